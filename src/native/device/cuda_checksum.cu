// A split master's params checksum (store/checksum.h) of bf16 params in a GPU's memory:
// XXH3 of each piece by one warp (store/xxh3_lanes.h). Its 32 threads are XXH3's eight lanes
// times four groups of stripes: within a block of 16 stripes a lane's accumulator only adds,
// so each group sums its four stripes' terms, the warp adds the groups' sums by shuffles and
// every thread of a lane scrambles the same accumulator at the block's end. (Eight threads a
// piece, each walking its 32 KiB alone, filled 3 % of an H200: 0.18 TB/s.)
#include "device/cuda_checksum.h"

#include <stdexcept>
#include <string>

#include "device/registry.h"
#include "store/checksum.h"
#include "store/xxh3_lanes.h"

namespace smartinf::device::cuda {

namespace {

namespace xxh3 = store::xxh3;
constexpr unsigned kThreads = 256;  // whole warps: a warp a piece, all of its threads shuffle
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

constexpr unsigned kGroups = 32 / xxh3::kLanes;  // threads of a lane in a piece's warp
constexpr unsigned kPerGroup = xxh3::kStripesPerBlock / kGroups;  // stripes a thread takes a block
static_assert(xxh3::kStripesPerBlock % kGroups == 0);

// A block's (or the last partial block's first `stripes`) stripe terms for this thread's lane,
// summed over the warp's groups: own[k] is this thread's 8 bytes of stripe k * kGroups + group.
__device__ uint64_t block_terms(const uint64_t (&own)[kPerGroup], const uint64_t (&key)[kPerGroup],
                                unsigned group, std::size_t stripes) {
  uint64_t sum = 0;
#pragma unroll
  for (unsigned k = 0; k < kPerGroup; ++k) {
    const uint64_t other = __shfl_xor_sync(0xFFFFFFFFu, own[k], 1);  // the neighbour lane's bytes
    const uint64_t mixed = own[k] ^ key[k];
    if (k * kGroups + group < stripes) sum += other + (mixed & 0xFFFFFFFFu) * (mixed >> 32);
  }
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, xxh3::kLanes);  // (threads of one lane: lanes apart)
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2 * xxh3::kLanes);
  return sum;
}

// This thread's 8 bytes of each of its stripes in the block at `block` (those before `stripes`).
__device__ void load_stripes(uint64_t (&own)[kPerGroup], const uint8_t* block, unsigned lane,
                             unsigned group, std::size_t stripes, bool aligned) {
#pragma unroll
  for (unsigned k = 0; k < kPerGroup; ++k) {
    const std::size_t s = k * kGroups + group;
    const uint8_t* at = block + s * xxh3::kStripe + 8 * lane;
    own[k] = s >= stripes ? 0 : aligned ? __ldg(reinterpret_cast<const unsigned long long*>(at))
                                        : xxh3::read64(at);
  }
}

__global__ void piece_sums_kernel(const uint8_t* params, std::size_t n, std::size_t pieces,
                                  uint64_t* sums) {
  const std::size_t p = (blockIdx.x * std::size_t(kThreads) + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x % xxh3::kLanes, group = (threadIdx.x % 32) / xxh3::kLanes;
  const std::size_t len = piece_bytes(p, n, pieces);
  if (len <= xxh3::kLongAbove) return;  // (the warp's p; a shorter last piece: the host's)
  const uint8_t* input = params + p * store::kParamsPiece * 2;
  const bool aligned = reinterpret_cast<std::uintptr_t>(input) % 8 == 0;
  uint64_t key[kPerGroup];
#pragma unroll
  for (unsigned k = 0; k < kPerGroup; ++k) key[k] = xxh3::secret64((k * kGroups + group) * 8 + 8 * lane);
  const uint64_t scrambling = xxh3::scramble_key(lane);
  uint64_t acc = xxh3::initial_accumulator(lane);
  const std::size_t blocks = (len - 1) / xxh3::kBlock;
  uint64_t own[kPerGroup], next[kPerGroup] = {};
  if (blocks) load_stripes(own, input, lane, group, xxh3::kStripesPerBlock, aligned);
  for (std::size_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks)  // the next block's loads in flight while this one's terms are summed
      load_stripes(next, input + (b + 1) * xxh3::kBlock, lane, group, xxh3::kStripesPerBlock, aligned);
    acc = xxh3::scramble(acc + block_terms(own, key, group, xxh3::kStripesPerBlock), scrambling);
#pragma unroll
    for (unsigned k = 0; k < kPerGroup; ++k) own[k] = next[k];
  }
  const std::size_t stripes = ((len - 1) - blocks * xxh3::kBlock) / xxh3::kStripe;  // < 16
  load_stripes(own, input + blocks * xxh3::kBlock, lane, group, stripes, false);
  acc += block_terms(own, key, group, stripes);
  const uint64_t last = xxh3::read64(input + len - xxh3::kStripe + 8 * lane);
  const uint64_t mixed = last ^ xxh3::last_key(lane);
  acc += __shfl_xor_sync(0xFFFFFFFFu, last, 1) + (mixed & 0xFFFFFFFFu) * (mixed >> 32);
  uint64_t all[xxh3::kLanes];
  const unsigned first = (threadIdx.x % 32) & ~(xxh3::kLanes - 1);
  for (unsigned j = 0; j < xxh3::kLanes; ++j) all[j] = __shfl_sync(0xFFFFFFFFu, acc, first + j);
  if (threadIdx.x % 32 == 0) sums[p] = xxh3::merge(all, len);
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
  const std::size_t threads = pieces * 32;  // a warp a piece
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

namespace smartinf::device {

uint64_t gpu_params_checksum(const void* params, std::size_t numel) {
  cuda::PieceSums sums;
  cuda::allocate_piece_sums(sums, numel);
  try {
    const uint64_t sum = cuda::params_checksum(params, numel, sums, nullptr);
    cuda::free_piece_sums(sums);
    return sum;
  } catch (...) {
    cuda::free_piece_sums(sums);
    throw;
  }
}

}  // namespace smartinf::device
