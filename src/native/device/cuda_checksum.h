// A split master's params checksum of bf16 params in a GPU's memory (cuda_checksum.cu).
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace smartinf::device::cuda {

// store::params_checksum of the n bf16 params at `params` (GPU memory), hashed on the GPU on
// `stream` into `sums` (GPU memory for store::params_pieces(n) values); waits for it.
uint64_t params_checksum(const void* params, std::size_t n, uint64_t* sums, cudaStream_t stream);

}  // namespace smartinf::device::cuda
