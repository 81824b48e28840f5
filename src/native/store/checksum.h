// Extent checksums: XXH3-64 (xxHash, header-only), SIMD on the baseline ISA; ~20 GB/s a
// core, so a 12 MiB extent costs well under a millisecond next to its storage I/O.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

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

namespace smartinf::store {

// A digest of `bytes` at `data` (smartinf.edits, the params a model holds on the host): the
// XXH3 of each `piece` bytes, into out[(bytes + piece - 1) / piece], computed by `threads`
// threads (the memory's bandwidth, not one core's, bounds it).
inline void piece_checksums(const void* data, size_t bytes, size_t piece, uint64_t* out,
                            unsigned threads) {
  const size_t pieces = (bytes + piece - 1) / piece;
  const auto run = [&](size_t from, size_t to) {
    for (size_t i = from; i < to; ++i)
      out[i] = extent_checksum(static_cast<const char*>(data) + i * piece,
                               std::min(piece, bytes - i * piece));
  };
  threads = static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(threads, pieces)));
  std::vector<std::thread> workers;
  for (unsigned t = 1; t < threads; ++t)
    workers.emplace_back(run, pieces * t / threads, pieces * (t + 1) / threads);
  run(0, pieces / threads);
  for (std::thread& w : workers) w.join();
}

// The same pieces' checksums of `src` while copying it to `dst`: each piece hashed where it
// was just written, in cache, so the digest costs the copy little more.
inline void copy_piece_checksums(void* dst, const void* src, size_t bytes, size_t piece,
                                 uint64_t* out) {
  for (size_t i = 0, at = 0; at < bytes; ++i, at += piece) {
    const size_t n = std::min(piece, bytes - at);
    std::memcpy(static_cast<char*>(dst) + at, static_cast<const char*>(src) + at, n);
    out[i] = extent_checksum(static_cast<char*>(dst) + at, n);
  }
}

}  // namespace smartinf::store
