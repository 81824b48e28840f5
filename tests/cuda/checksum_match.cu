// The GPU's params checksum (device/cuda_checksum.cu) against the host's
// (store::params_checksum) for chunks of every shape: whole pieces, a last piece short
// enough for XXH3's other paths or not, params starting off an 8-byte boundary.
#include <cstdio>
#include <random>
#include <vector>

#include "device/cuda_checksum.h"
#include "store/checksum.h"

int main() {
  using smartinf::store::kParamsPiece;
  std::mt19937_64 rng(7);
  const std::size_t most = 4 * kParamsPiece + 3;
  std::vector<uint16_t> host(most + 3);
  for (auto& h : host) h = static_cast<uint16_t>(rng());
  uint16_t* gpu = nullptr;
  smartinf::device::cuda::PieceSums sums;
  cudaStream_t stream;
  if (cudaMalloc(&gpu, host.size() * 2) != cudaSuccess || cudaStreamCreate(&stream) != cudaSuccess) {
    std::printf("no GPU memory\n");
    return 2;
  }
  smartinf::device::cuda::allocate_piece_sums(sums, most);  // (page-locked: what the devices use)
  cudaMemcpy(gpu, host.data(), host.size() * 2, cudaMemcpyHostToDevice);
  const std::size_t sizes[] = {1, 7, 120, 121, 1000, kParamsPiece - 1, kParamsPiece, kParamsPiece + 1,
                               kParamsPiece + 120, kParamsPiece + 121, 3 * kParamsPiece + 5, most};
  int cases = 0, differ = 0;
  for (std::size_t n : sizes)
    for (std::size_t offset : {0, 1, 2, 3}) {
      ++cases;
      const uint64_t want = smartinf::store::params_checksum(host.data() + offset, n);
      const uint64_t got = smartinf::device::cuda::params_checksum(gpu + offset, n, sums, stream);
      if (got != want) {
        ++differ;
        std::printf("n %zu offset %zu: GPU %016llx, host %016llx\n", n, offset,
                    (unsigned long long)got, (unsigned long long)want);
      }
    }
  smartinf::device::cuda::free_piece_sums(sums);
  std::printf("%d cases, %d differ\n", cases, differ);
  return differ != 0;
}
