// Extent checksums: XXH3-64 (xxHash, header-only), SIMD on the baseline ISA; ~20 GB/s a
// core, so a 12 MiB extent costs well under a millisecond next to its storage I/O.
#pragma once
#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace smartinf::store {

// Never 0: a stored 0 means "not known" (older manifests, devices the host cannot read).
inline uint64_t extent_checksum(const void* data, size_t bytes) {
  const uint64_t h = XXH3_64bits(data, bytes);
  return h ? h : 1;
}

}  // namespace smartinf::store

namespace smartinf::store {

// The checksum of a chunk's bf16 params (a split master's, store/layout.h): what the device
// emitted with the states, compared with what comes back. Streamed, so params made piece by
// piece (at init) hash as one array would.
class ParamsChecksum {
 public:
  ParamsChecksum() { XXH3_64bits_reset(&state_); }
  void add(const void* data, size_t bytes) { XXH3_64bits_update(&state_, data, bytes); }
  uint64_t value() const {
    const uint64_t h = XXH3_64bits_digest(&state_);
    return h ? h : 1;
  }

 private:
  XXH3_state_t state_;
};

inline uint64_t params_checksum(const void* bf16_params, size_t numel) {
  return extent_checksum(bf16_params, numel * 2);
}

}  // namespace smartinf::store
