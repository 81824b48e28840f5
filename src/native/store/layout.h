// How one chunk's states sit in an extent (and in a device slot): `arrays` fp32 arrays
// of the chunk's params one after another (param first, then the optimizer's), or, with
// int8 states (Adam), the fp32 params and the 8-bit moments of kernels/quant8.h.
#pragma once
#include <cstdint>

#include "kernels/quant8.h"

namespace smartinf::store {

inline constexpr uint64_t kAlign = 4096;

inline uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct StateLayout {
  unsigned arrays = 3;  // fp32 arrays per param when not int8 (fixed by the optimizer)
  bool int8 = false;
  uint64_t bytes(uint64_t numel) const {
    return int8 ? kernels::int8_adam_bytes(numel) : numel * arrays * 4;
  }
  const char* dtype() const { return int8 ? "int8" : "fp32"; }
  // Byte offset of fp32 array `a` (0: the param) of a chunk of `numel` params.
  uint64_t array_offset(uint64_t numel, unsigned a) const { return uint64_t(a) * numel * 4; }
  // fp32 array `a` of a chunk's states held at `states` (fp32 layout only).
  float* array(void* states, uint64_t numel, unsigned a) const {
    return reinterpret_cast<float*>(static_cast<char*>(states) + array_offset(numel, a));
  }
};

// One chunk's extent: 4 KiB aligned, for O_DIRECT.
inline uint64_t extent_bytes(uint64_t numel, const StateLayout& layout) {
  return align_up(layout.bytes(numel));
}

// A sub-group's chunks in states.bin: full chunks first, each a pair of extents (copy A,
// then B), then the tail's pair.
struct ChunkLayout {
  uint64_t chunk = 0;  // params per chunk
  StateLayout layout;
  uint64_t chunks(uint64_t numel) const { return (numel + chunk - 1) / chunk; }
  uint64_t numel_of(uint64_t numel, uint64_t c) const {
    return c * chunk + chunk <= numel ? chunk : numel - c * chunk;
  }
  // Offset of chunk c's pair from the sub-group's first byte; copy B follows copy A.
  uint64_t pair_offset(uint64_t c) const { return 2 * c * extent_bytes(chunk, layout); }
  uint64_t bytes(uint64_t numel) const {  // the whole sub-group, both copies
    const uint64_t last = chunks(numel) - 1;
    return pair_offset(last) + 2 * extent_bytes(numel_of(numel, last), layout);
  }
};

}  // namespace smartinf::store
