// A split master's params checksum (store/checksum.h) of bf16 params in a GPU's memory:
// XXH3 of each piece by eight threads, one lane of XXH3's eight each (store/xxh3_lanes.h),
// gathered across the group by warp shuffles and merged by its first thread.
#include "device/cuda_checksum.h"

#include <stdexcept>
#include <string>

#include "store/checksum.h"
#include "store/xxh3_lanes.h"

namespace smartinf::device::cuda {

namespace {

namespace xxh3 = store::xxh3;
constexpr unsigned kThreads = 256;  // whole warps, so every lane of a group shuffles
static_assert(kThreads % 32 == 0 && 32 % xxh3::kLanes == 0);

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA device: ") + what + ": " + cudaGetErrorString(e));
}

// The length in bytes of piece p of n params (0 past the last).
__device__ std::size_t piece_bytes(std::size_t p, std::size_t n, std::size_t pieces) {
  if (p >= pieces) return 0;
  const std::size_t rest = n - p * store::kParamsPiece;
  return 2 * (rest < store::kParamsPiece ? rest : store::kParamsPiece);
}

__global__ void piece_sums_kernel(const uint8_t* params, std::size_t n, std::size_t pieces,
                                  uint64_t* sums) {
  const std::size_t t = blockIdx.x * std::size_t(kThreads) + threadIdx.x;
  const std::size_t p = t / xxh3::kLanes;
  const unsigned lane = t % xxh3::kLanes;
  const std::size_t len = piece_bytes(p, n, pieces);
  const bool long_input = len > xxh3::kLongAbove;  // (a shorter last piece: the host's)
  const uint64_t acc =
      long_input ? xxh3::lane_accumulator(params + p * store::kParamsPiece * 2, len, lane) : 0;
  uint64_t all[xxh3::kLanes];
  const unsigned first = (threadIdx.x % 32) & ~(xxh3::kLanes - 1);
  for (unsigned j = 0; j < xxh3::kLanes; ++j) all[j] = __shfl_sync(0xFFFFFFFFu, acc, first + j);
  if (long_input && lane == 0) sums[p] = xxh3::merge(all, len);
}

}  // namespace

void allocate_piece_sums(PieceSums& sums, std::size_t n) {
  sums.capacity = store::params_pieces(n);
  check(cudaMalloc(&sums.gpu, sums.capacity * sizeof(uint64_t)), "allocating a checksum's pieces on the GPU");
  check(cudaHostAlloc(&sums.host, sums.capacity * sizeof(uint64_t) + xxh3::kLongAbove, cudaHostAllocPortable),
        "page-locking a checksum's pieces");
  sums.tail = reinterpret_cast<uint8_t*>(sums.host + sums.capacity);
}

void free_piece_sums(PieceSums& sums) {  // (cudaFree and cudaFreeHost of nullptr: no-ops)
  cudaFree(sums.gpu);
  cudaFreeHost(sums.host);
  sums = PieceSums{};
}

void queue_piece_sums(const void* params, std::size_t n, PieceSums& sums, cudaStream_t stream) {
  const std::size_t pieces = store::params_pieces(n);
  if (pieces > sums.capacity)
    throw std::out_of_range("a params checksum of " + std::to_string(n) + " params: its buffers hold " +
                            std::to_string(sums.capacity) + " pieces");
  if (!pieces) return;
  const std::size_t threads = pieces * xxh3::kLanes;
  piece_sums_kernel<<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(params), n, pieces, sums.gpu);
  check(cudaGetLastError(), "launching the params checksum");
  check(cudaMemcpyAsync(sums.host, sums.gpu, pieces * sizeof(uint64_t), cudaMemcpyDeviceToHost,
                        stream), "the params checksum's pieces to the host");
  const std::size_t last = n - (pieces - 1) * store::kParamsPiece;
  if (2 * last <= xxh3::kLongAbove)
    check(cudaMemcpyAsync(sums.tail, static_cast<const uint8_t*>(params) + (pieces - 1) * store::kParamsPiece * 2,
                          2 * last, cudaMemcpyDeviceToHost, stream), "a short last piece to the host");
}

uint64_t join_piece_sums(PieceSums& sums, std::size_t n) {
  const std::size_t pieces = store::params_pieces(n);
  if (pieces) {
    const std::size_t last = n - (pieces - 1) * store::kParamsPiece;
    if (2 * last <= xxh3::kLongAbove) sums.host[pieces - 1] = store::params_piece_sum(sums.tail, last);
  }
  return store::join_params_sums(sums.host, pieces);
}

uint64_t params_checksum(const void* params, std::size_t n, PieceSums& sums, cudaStream_t stream) {
  queue_piece_sums(params, n, sums, stream);
  check(cudaStreamSynchronize(stream), "the params checksum");
  return join_piece_sums(sums, n);
}

}  // namespace smartinf::device::cuda
