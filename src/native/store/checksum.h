// Extent checksums: XXH3-64 (xxHash, header-only), SIMD on the baseline ISA; ~20 GB/s a
// core, so a 12 MiB extent costs well under a millisecond next to its storage I/O.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace smartinf::store {

// Never 0: a stored 0 means "not known" (older manifests, devices the host cannot read).
inline uint64_t extent_checksum(const void* data, size_t bytes) {
  const uint64_t h = XXH3_64bits(data, bytes);
  return h ? h : 1;
}

// The checksum of a chunk's bf16 params (a split master's, stored with its states): the
// XXH3 of the XXH3s of its pieces of kParamsPiece params, so the threads that emit the
// pieces hash each while it is in their cache (ComputePool parts are whole pieces) and one
// small hash joins them. Never 0.
inline constexpr size_t kParamsPiece = size_t(1) << 14;

inline uint64_t params_piece_sum(const void* bf16_params, size_t numel) {
  return XXH3_64bits(bf16_params, numel * 2);
}

inline uint64_t join_params_sums(const uint64_t* piece_sums, size_t pieces) {
  const uint64_t h = XXH3_64bits(piece_sums, pieces * sizeof(uint64_t));
  return h ? h : 1;
}

inline size_t params_pieces(size_t numel) { return (numel + kParamsPiece - 1) / kParamsPiece; }

// The same, in one thread: the pieces' sums streamed into the join (XXH3 streamed over the
// same bytes is XXH3 of them), so no buffer is allocated on the ring's threads.
inline uint64_t params_checksum(const void* bf16_params, size_t numel) {
  XXH3_state_t join;
  XXH3_64bits_reset(&join);
  const char* p = static_cast<const char*>(bf16_params);
  for (size_t i = 0; i < params_pieces(numel); ++i) {
    const uint64_t sum = params_piece_sum(p + i * kParamsPiece * 2, std::min(kParamsPiece, numel - i * kParamsPiece));
    XXH3_64bits_update(&join, &sum, sizeof sum);
  }
  const uint64_t h = XXH3_64bits_digest(&join);
  return h ? h : 1;
}

// The checksum directories written before the pieces stored (XXH3 of the whole chunk's
// bytes): a reopened chunk's stored sum is compared with it where the new one differs.
inline uint64_t whole_params_checksum(const void* bf16_params, size_t numel) {
  return extent_checksum(bf16_params, numel * 2);
}

}  // namespace smartinf::store
