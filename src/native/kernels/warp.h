// What the formats' GPU pieces (kernels/quant8.h's Int8Rows, quant4.h's Int4Tiles; run by
// device/cuda_update.cu's quantized_kernel) share: warp reductions, packed 4-bit codes, and a
// host map made readable on the GPU. CUDA only.
#pragma once
#include <cstddef>
#include <cstdint>

namespace smartinf::kernels {

// A host constexpr map, where the GPU reads it (a host constexpr array is not addressable in
// device code): the same float values, copied at compile time into a __constant__ one.
template <std::size_t N>
struct Map {
  float at[N];
};

template <std::size_t N>
constexpr Map<N> map_of(const float (&values)[N]) {
  Map<N> m{};
  for (std::size_t i = 0; i < N; ++i) m.at[i] = values[i];
  return m;
}

// The largest of N values across a warp, in every lane: integers, the bits of non-negative
// floats, so the result is exact whatever the order.
template <unsigned N>
__device__ inline void warp_max(int32_t (&v)[N]) {
  for (unsigned o = 16; o > 0; o >>= 1)
    for (unsigned k = 0; k < N; ++k) {
      const int32_t w = __shfl_xor_sync(0xffffffffu, v[k], o);
      v[k] = w > v[k] ? w : v[k];
    }
}

// Two neighbouring params' 4-bit codes in one byte (the even one's in the low nibble),
// written by the even lane; a lane without a param gives 0.
__device__ inline void store_nibbles(uint8_t* byte, uint32_t code, bool here) {
  const uint32_t high = __shfl_down_sync(0xffffffffu, code, 1);
  if (here && threadIdx.x % 2 == 0) *byte = static_cast<uint8_t>(code | (high << 4));
}

__device__ inline uint32_t nibble(const uint8_t* codes, std::size_t i) {
  return i % 2 ? codes[i / 2] >> 4 : codes[i / 2] & 15u;
}

}  // namespace smartinf::kernels
