// The update kernels of device/cuda_update.cu timed alone on one GPU: AdamW, bf16 gradients
// and params, fp32 masters, fp32 / int8 / int4 moments, four chunks of 16 Mi params (the GPU
// device's chunk) one after another on one stream, the best of six steps after two; params/s.
// Built with the flags of the library's CUDA device, against this checkout's kernels or
// another's (A/B in one lease, as bench/measured/h100-cuda-quantized-kernels.txt):
//   nvcc -std=c++17 -O2 -arch=native -fmad=false -Xcompiler=-ffp-contract=off -Isrc/native \
//     bench/gpu_kernel_rates.cu src/native/device/cuda_update.cu -o /tmp/rates && /tmp/rates
// (probe.measure_gpu gives the same through the pipeline, without the A/B.)
#include <cstdio>
#include <vector>
#include <cuda_runtime.h>
#include "device/cuda_update.h"
using namespace smartinf;
int main() {
  const size_t n = size_t(1) << 24, chunks = 4;
  std::vector<uint16_t> g(n);
  for (size_t i = 0; i < n; ++i) g[i] = kernels::from_float<kernels::bf16>(1e-3f * (float(i % 251) - 125.5f) / 125.5f).bits;
  void *dg, *dout; cudaMalloc(&dg, n * 2); cudaMalloc(&dout, n * 2);
  cudaMemcpy(dg, g.data(), n * 2, cudaMemcpyHostToDevice);
  for (unsigned f = 0; f < store::kMomentsCount; ++f) {
    const auto mo = static_cast<store::Moments>(f);
    store::StateLayout layout; layout.arrays = 3; layout.moments = mo;
    std::vector<void*> st(chunks);
    for (auto& p : st) { cudaMalloc(&p, layout.bytes(n)); cudaMemset(p, 0, layout.bytes(n)); }
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    float best = 1e9;
    for (int t = 1; t <= 8; ++t) {
      const kernels::Step step = kernels::make_step(kernels::Rule::adamw, kernels::Hyper{1e-3, 0.01}, t);
      cudaEventRecord(a);
      for (size_t c = 0; c < chunks; ++c) device::cuda::update(step, layout, st[c], n, kernels::DType::bf16, kernels::DType::bf16, dg, dout, false, nullptr);
      cudaEventRecord(b); cudaEventSynchronize(b);
      float ms; cudaEventElapsedTime(&ms, a, b);
      if (t > 2 && ms < best) best = ms;
    }
    std::printf("%s %.1f G params/s\n", store::kMomentsNames[f], n * chunks / (best * 1e-3) / 1e9);
    for (auto p : st) cudaFree(p);
  }
  std::printf("err: %s\n", cudaGetErrorString(cudaGetLastError()));
}
