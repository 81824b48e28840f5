// SmartComp decompression: a chunk's dense fp32 gradient from the top-k (index, value)
// pairs that fall in it. Written once for the CPU device and the HLS kernels.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/numeric.h"

namespace smartinf::kernels {

// `index` holds sub-group positions in [base, base + n), ascending (the caller splits
// them per chunk); every other gradient element is zero.
template <class V>
inline void decompress(std::size_t n, float* __restrict grad, const int32_t* __restrict index,
                       const V* __restrict values, std::size_t nnz, uint64_t base) {
  for (std::size_t i = 0; i < n; ++i) grad[i] = 0.0f;
  for (std::size_t j = 0; j < nnz; ++j) grad[static_cast<uint64_t>(index[j]) - base] = to_float(values[j]);
}

}  // namespace smartinf::kernels
