// A split master's params checksum of bf16 params in a GPU's memory (cuda_checksum.cu).
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "store/xxh3_lanes.h"

namespace smartinf::device::cuda {

// One checksum's pieces on their way to the host. Both host buffers are page-locked
// (allocate_piece_sums): a copy to pageable memory returns only once the stream has reached
// it, and meanwhile blocks the other threads' CUDA calls (the training loop's among them).
struct PieceSums {
  uint64_t* gpu = nullptr;   // store::params_pieces(n) sums, GPU memory
  uint64_t* host = nullptr;  // their copy (page-locked)
  uint8_t* tail = nullptr;   // a last piece too short for the GPU's XXH3 (page-locked, kLongAbove)
  std::size_t capacity = 0;  // pieces each holds
};

// The buffers of a checksum of up to `n` params; free_piece_sums releases them (also those
// of one half made).
void allocate_piece_sums(PieceSums& sums, std::size_t n);
void free_piece_sums(PieceSums& sums);

// Queues on `stream` the hash of the pieces of the n bf16 params at `params` (GPU memory)
// and their copy to the host (`sums.gpu` holds store::params_pieces(n) values).
void queue_piece_sums(const void* params, std::size_t n, PieceSums& sums, cudaStream_t stream);

// store::params_checksum of those params, once the stream has done what was queued.
uint64_t join_piece_sums(PieceSums& sums, std::size_t n);

// Both, waiting for the stream.
uint64_t params_checksum(const void* params, std::size_t n, PieceSums& sums, cudaStream_t stream);

}  // namespace smartinf::device::cuda
