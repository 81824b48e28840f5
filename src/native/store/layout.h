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
};

// One chunk's extent: 4 KiB aligned, for O_DIRECT.
inline uint64_t extent_bytes(uint64_t numel, const StateLayout& layout) {
  return align_up(layout.bytes(numel));
}

}  // namespace smartinf::store
