#include "device/cuda_update.h"

#include <stdexcept>
#include <string>

#include "kernels/split_master.h"

namespace smartinf::device::cuda {

namespace {

using kernels::kMaxStateArrays;

struct Arrays {
  float* at[kMaxStateArrays];
};

constexpr unsigned kThreads = 256;

// Each param's arrays, one past another: the kernel functions take a range, here of one.
__device__ inline void arrays_of(const Arrays& a, std::size_t i, float** mine) {
  for (unsigned k = 0; k < kMaxStateArrays; ++k) mine[k] = a.at[k] ? a.at[k] + i : nullptr;
}

template <class G, class P>
__global__ void update_kernel(kernels::Step step, std::size_t n, Arrays a, const G* grad, P* out) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    float* mine[kMaxStateArrays];
    arrays_of(a, i, mine);
    kernels::run_rule(step, 1, mine, grad + i, out + i);
  }
}

// As the cpu device's run_update on a split master: the master rebuilt from the param sent
// in and its low half, updated, split again.
template <class G>
__global__ void update_split_kernel(kernels::Step step, std::size_t n, Arrays a, uint16_t* low,
                                    const G* grad, kernels::bf16* out, bool adopt) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    float* mine[kMaxStateArrays];
    arrays_of(a, i, mine);
    float master;
    kernels::rebuild_masters(1, out + i, low + i, adopt, &master);
    mine[0] = &master;
    kernels::run_rule(step, 1, mine, grad + i, out + i);
    kernels::split_masters(1, &master, out + i, low + i);
  }
}

unsigned blocks_for(std::size_t n) {
  const std::size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 * 32 ? (b ? b : 1) : 65535 * 32);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA update: ") + what + ": " + cudaGetErrorString(e));
}

Arrays arrays_from(float* const* arrays, unsigned count) {
  Arrays a{};
  for (unsigned k = 0; k < count && k < kMaxStateArrays; ++k) a.at[k] = arrays[k];
  return a;
}

}  // namespace

void update(const kernels::Step& step, kernels::DType grad_dtype, kernels::DType param_dtype,
            std::size_t n, float* const* arrays, const void* grad, void* out, cudaStream_t stream) {
  const Arrays a = arrays_from(arrays, kernels::rule_row(step.rule).arrays);
  kernels::dispatch(grad_dtype, param_dtype, [&](auto g, auto p) {
    using G = decltype(g);
    using P = decltype(p);
    update_kernel<G, P><<<blocks_for(n), kThreads, 0, stream>>>(
        step, n, a, static_cast<const G*>(grad), static_cast<P*>(out));
  });
  check(cudaGetLastError(), "launch");
}

void update_split(const kernels::Step& step, kernels::DType grad_dtype, std::size_t n,
                  float* const* arrays, uint16_t* low, const void* grad, kernels::bf16* out,
                  bool adopt, cudaStream_t stream) {
  const Arrays a = arrays_from(arrays, kernels::rule_row(step.rule).arrays);
  kernels::dispatch(grad_dtype, kernels::DType::bf16, [&](auto g, auto) {
    using G = decltype(g);
    update_split_kernel<G><<<blocks_for(n), kThreads, 0, stream>>>(
        step, n, a, low, static_cast<const G*>(grad), out, adopt);
  });
  check(cudaGetLastError(), "launch");
}

}  // namespace smartinf::device::cuda
