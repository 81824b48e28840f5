// The GPU digest of params for edits between steps (smartinf/step/edits.py): per key (a
// sub-group), over the 2-byte units of its parts one after another, the plain sum of the units
// and their sum weighted by a bijective 32-bit hash of each unit's position in the key, both
// modulo 2^64. Sums modulo 2^64 do not depend on the order of their additions, so the blocks
// add into the keys' totals atomically, and the digest of parts equals that of their
// concatenation however they are cut: one launch reads each byte once, where copying the
// parts together first (torch.cat, then a matmul) read them three times and launched ~150
// torch ops a sub-group.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "device/registry.h"

namespace smartinf::device {

namespace {

constexpr unsigned kThreads = 256;
constexpr uint64_t kChunkUnits = uint64_t(kThreads) * 128;  // units a block sums (64 KiB)

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("GPU digest: ") + what + ": " + cudaGetErrorString(e));
}

// A bijection of 32-bit positions (an odd multiply and xor-shifts, each invertible): two units'
// weights differ, so changing any two units (|delta| < 2^16 each) always changes a sum.
__device__ __forceinline__ uint32_t weight(uint32_t position) {
  uint32_t x = position * 0x9E3779B1u;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  return x;
}

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
  for (unsigned d = 16; d; d /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, d);
  return v;
}

// Block b sums chunk b - first[p] of part p (first[p] <= b < first[p + 1], found by bisection).
__global__ void unit_sums_kernel(const DigestPart* parts, std::size_t count, uint64_t* sums) {
  std::size_t lo = 0, hi = count;  // the last part whose first chunk is at or before this block
  while (hi - lo > 1) {
    const std::size_t mid = (lo + hi) / 2;
    if (parts[mid].first_chunk <= blockIdx.x) lo = mid; else hi = mid;
  }
  const DigestPart part = parts[lo];
  const uint64_t begin = (blockIdx.x - part.first_chunk) * kChunkUnits;
  const uint64_t end = begin + kChunkUnits < part.units ? begin + kChunkUnits : part.units;
  const uint16_t* units = reinterpret_cast<const uint16_t*>(part.address);
  uint64_t plain = 0, mixed = 0;
  for (uint64_t i = begin + threadIdx.x; i < end; i += kThreads) {  // (coalesced: a warp's 64 B)
    const uint32_t u = units[i];
    plain += u;
    mixed += uint64_t(u) * weight(uint32_t(part.offset + i));
  }
  __shared__ uint64_t partial[2][kThreads / 32];
  plain = warp_sum(plain);
  mixed = warp_sum(mixed);
  if (threadIdx.x % 32 == 0) {
    partial[0][threadIdx.x / 32] = plain;
    partial[1][threadIdx.x / 32] = mixed;
  }
  __syncthreads();
  if (threadIdx.x < 2) {
    uint64_t total = 0;
    for (unsigned w = 0; w < kThreads / 32; ++w) total += partial[threadIdx.x][w];
    atomicAdd(reinterpret_cast<unsigned long long*>(sums + 2 * part.key + threadIdx.x),
              static_cast<unsigned long long>(total));
  }
}

}  // namespace

uint64_t digest_chunk_units() { return kChunkUnits; }

void queue_gpu_unit_sums(const DigestPart* parts, std::size_t count, std::size_t chunks,
                         uint64_t* sums, int gpu, void* stream) {
  if (!count || !chunks) return;
  if (chunks > 0x7FFFFFFFu)
    throw std::out_of_range("a GPU digest of " + std::to_string(chunks) + " chunks: at most 2^31 - 1");
  int was = 0;
  check(cudaGetDevice(&was), "the current GPU");
  check(cudaSetDevice(gpu), "selecting the params' GPU");
  unit_sums_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      parts, count, sums);
  const cudaError_t launched = cudaGetLastError();
  cudaSetDevice(was);
  check(launched, "launching the digest");
}

}  // namespace smartinf::device
