// A split master's params checksum of bf16 params in a GPU's memory (cuda_checksum.cu).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "store/xxh3_lanes.h"

namespace smartinf::device::cuda {

// One checksum's pieces on their way to the host.
struct PieceSums {
  uint64_t* gpu = nullptr;                      // store::params_pieces(n) sums, GPU memory
  std::vector<uint64_t> host;                   // their copy
  uint8_t tail[store::xxh3::kLongAbove] = {};  // a last piece too short for the GPU's XXH3
};

// Queues on `stream` the hash of the pieces of the n bf16 params at `params` (GPU memory)
// and their copy to the host (`sums.gpu` holds store::params_pieces(n) values).
void queue_piece_sums(const void* params, std::size_t n, PieceSums& sums, cudaStream_t stream);

// store::params_checksum of those params, once the stream has done what was queued.
uint64_t join_piece_sums(PieceSums& sums, std::size_t n);

// Both, waiting for the stream.
uint64_t params_checksum(const void* params, std::size_t n, PieceSums& sums, cudaStream_t stream);

}  // namespace smartinf::device::cuda
