#include "device/cuda_update.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/split_master.h"

namespace smartinf::device::cuda {

namespace {

using kernels::kMaxStateArrays;

constexpr unsigned kThreads = 256;

// Where a param's fp32 master is: in the states, or (split: `fp32` null) rebuilt from the
// bf16 param sent in and its low half, split again after the update.
struct Master {
  float* fp32;
  uint16_t* low;
  bool adopt;

  template <class P>
  __device__ float load(std::size_t i, const P* out) const {
    if constexpr (std::is_same_v<P, kernels::bf16>) {
      if (!fp32) {
        float m;
        kernels::rebuild_masters(1, out + i, low + i, adopt, &m);
        return m;
      }
    }
    return fp32[i];
  }

  // The updated master, after the param emitted for it is in out[i].
  template <class P>
  __device__ void keep(std::size_t i, float m, P* out) const {
    if constexpr (std::is_same_v<P, kernels::bf16>) {
      if (!fp32) return kernels::split_masters(1, &m, out + i, low + i);
    }
    fp32[i] = m;
  }

  template <class P>
  __device__ void store(std::size_t i, float m, P* out) const {
    out[i] = kernels::from_float<P>(m);
    keep(i, m, out);
  }
};

// A rule's fp32 moment arrays (index 0, the master, is Master's), as one kernel argument.
struct Arrays {
  float* at[kMaxStateArrays];
};

// fp32 moments: one thread per param (the kernels' range functions over one param).
template <class G, class P>
__global__ void fp32_kernel(kernels::Step step, std::size_t n, const Master ms, const Arrays a,
                            const G* grad, P* out) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    float master = ms.load(i, out);
    float* mine[kMaxStateArrays] = {&master};
    for (unsigned k = 1; k < kMaxStateArrays; ++k) mine[k] = a.at[k] ? a.at[k] + i : nullptr;
    kernels::run_rule(step, 1, mine, grad + i, out + i);
    ms.keep(i, master, out);
  }
}

// Quantized moments, written once for every rule whose row allows them (the element of
// kernels/quantized.h: AdamElement, LionElement) and every format (its GPU piece, in its own
// header: kernels/quant8.h's Int8Rows, quant4.h's Int4Tiles, named by kernels::gpu_format_of),
// as the CPU's kernels::update_quantized is: a thread block of Format::kWarps warps takes
// a piece of Format::kPieceRows rows of Format::kRow params, each warp a row at a time,
// lane l the row's params l, l + 32, ...; a row's maxima are reduced within its warp
// (shuffles, no barrier), its codes written; scales a whole piece shares (int4's second
// moment) after one barrier at its end.

// One piece of quantized states per thread block (the scheme above): each row's params
// decoded, updated by the rule's element, the new params stored, the row closed. `Full`: the
// piece has all its rows (every block but a chunk's last), so no param needs a bounds check
// (on the H100 these checks and their branches were a large share of int4's instructions).
template <bool Full, class Format, class Element, class G, class P>
__device__ void quantized_piece(std::size_t lo, std::size_t len, const typename Format::States& s, const Master& ms,
                                const G* grad, P* out, const Element& el, typename Format::Shared& shared,
                                float* later) {
  constexpr unsigned kWarps = Format::kWarps, kEach = Format::kEach, kRows = Format::kPieceRows / kWarps;
  constexpr bool two = Element::kMoments > 1;
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  typename Format::Piece piece = Format::piece(s, lo, len, Full);
  for (unsigned q = 0; q < kRows; ++q) {
    const unsigned r = q * kWarps + warp;
    // Every load of the row before any store: the stores might alias them for the compiler,
    // which then issues each element's loads only after the previous element's stores.
    float m[kEach], v[kEach], g[kEach], p[kEach];
    const std::size_t row = lo + std::size_t(r) * Format::kRow;
#pragma unroll
    for (unsigned e = 0; e < kEach; ++e) {
      const std::size_t i = row + e * 32 + lane;
      const bool here = piece.has(i);
      m[e] = piece.first(i, r, e, here);
      v[e] = two ? piece.second(i, r, e, here) : 0.0f;
      g[e] = here ? kernels::to_float(grad[i]) * el.k.grad_scale : 0.0f;
      p[e] = here ? ms.load(i, out) : 0.0f;
    }
#pragma unroll
    for (unsigned e = 0; e < kEach; ++e) {
      const std::size_t i = row + e * 32 + lane;
      if (piece.has(i)) ms.store(i, el.template apply<Format::kKeepsRoot>(g[e], p[e], m[e], v[e]), out);
    }
    piece.template close_row<two>(r, m, v, later);
  }
  piece.template close<two>(shared, later);
}

template <class Format, class Element, class G, class P>
__global__ void __launch_bounds__(Format::kWarps * 32) quantized_kernel(std::size_t n, const typename Format::States s,
                                                                const Master ms, const G* grad, P* out,
                                                                const Element el) {
  constexpr std::size_t kPieceLen = std::size_t(Format::kRow) * Format::kPieceRows;
  __shared__ typename Format::Shared shared;
  extern __shared__ float later[];  // Format::kLaterBytes: values coded at the piece's end
  const std::size_t lo = blockIdx.x * kPieceLen, len = n - lo < kPieceLen ? n - lo : kPieceLen;
  if (len == kPieceLen)
    quantized_piece<true, Format>(lo, len, s, ms, grad, out, el, shared, later);
  else
    quantized_piece<false, Format>(lo, len, s, ms, grad, out, el, shared, later);
}

unsigned blocks_for(std::size_t n, std::size_t per_block) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

unsigned grid_for(std::size_t n) {
  const std::size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 * 32 ? (b ? b : 1) : 65535 * 32);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA update: ") + what + ": " + cudaGetErrorString(e));
}

// The step's rule on quantized states: its element (kernels::with_quantized_element).
template <class Format, class G, class P>
void launch_quantized(const kernels::Step& step, const typename Format::States& s, std::size_t n,
                      const Master& ms, const G* grad, P* out, cudaStream_t stream) {
  const unsigned blocks = blocks_for(n, std::size_t(Format::kRow) * Format::kPieceRows);
  const auto run = [&](auto kernel, const auto& element) {
    // Above 48 KiB of shared memory a block asks for it; once per kernel.
    static const cudaError_t allowed = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Format::kLaterBytes));
    check(allowed, "shared memory for the quantized kernel");
    kernel<<<blocks, Format::kWarps * 32, Format::kLaterBytes, stream>>>(n, s, ms, grad, out, element);
  };
  kernels::with_quantized_element(step, [&](const auto& element) {
    run(quantized_kernel<Format, std::decay_t<decltype(element)>, G, P>, element);
  });
}

template <class G, class P>
void launch(const kernels::Step& step, const store::StateLayout& layout, void* states,
            std::size_t n, const Master& ms, const G* grad, P* out, cudaStream_t stream) {
  // quantized: the rules with_quantized_element has, others refused
  if (store::with_quantized(layout.moments, [&](auto m) {
        const auto s = layout.quantized_at<m.value>(states, n);
        launch_quantized<decltype(kernels::gpu_format_of(s))>(step, s, n, ms, grad, out, stream);
      }))
    return;
  Arrays arrays{};
  for (unsigned a = 1; a < layout.arrays; ++a) arrays.at[a] = layout.array(states, n, a);
  fp32_kernel<G, P><<<grid_for(n), kThreads, 0, stream>>>(step, n, ms, arrays, grad, out);
}

}  // namespace

void update(const kernels::Step& step, const store::StateLayout& layout, void* states,
            std::size_t n, kernels::DType grad_dtype, kernels::DType param_dtype, const void* grad,
            void* out, bool adopt, cudaStream_t stream) {
  const kernels::RuleRow& row = kernels::rule_row(step.rule);
  if (!kernels::row_allows(row, layout.moments))  // the pipeline refuses these first
    throw std::logic_error(std::string("no ") + layout.dtype() + " kernel for " + row.name);
  if (layout.split() && param_dtype != kernels::DType::bf16)
    throw std::logic_error("a split master needs bfloat16 params");
  const Master ms{layout.fp32_master(states),
                  layout.split() ? layout.split_at(states, n).low : nullptr, adopt};
  kernels::dispatch(grad_dtype, param_dtype, [&](auto g, auto p) {
    using G = decltype(g);
    using P = decltype(p);
    launch(step, layout, states, n, ms, static_cast<const G*>(grad), static_cast<P*>(out), stream);
  });
  check(cudaGetLastError(), "launch");
}

}  // namespace smartinf::device::cuda
