#include "device/cuda_update.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/split_master.h"

namespace smartinf::device::cuda {

namespace {

using kernels::AdamResult;
using kernels::AdamStep;
using kernels::kMaxStateArrays;
using kernels::LionStep;
using store::Int4States;
using store::Int8States;
using store::kQuant4Block;
using store::kQuant4Tile;
using store::kQuantBlock;

// kernels/quant4.h's map, where the GPU reads it (a host constexpr array is not
// addressable in device code): the same float values, copied at compile time.
template <std::size_t N>
struct Map {
  float at[N];
};

template <std::size_t N>
constexpr Map<N> map_of(const float (&values)[N]) {
  Map<N> m{};
  for (std::size_t i = 0; i < N; ++i) m.at[i] = values[i];
  return m;
}

__constant__ Map<16> kDynamic = map_of(kernels::q4::kDynamic);

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

// The largest of N values across a warp, in every lane: integers, the bits of non-negative
// floats, so the result is exact whatever the order.
template <unsigned N>
__device__ void warp_max(int32_t (&v)[N]) {
  for (unsigned o = 16; o > 0; o >>= 1)
    for (unsigned k = 0; k < N; ++k) {
      const int32_t w = __shfl_xor_sync(0xffffffffu, v[k], o);
      v[k] = w > v[k] ? w : v[k];
    }
}

// Two neighbouring params' 4-bit codes in one byte (the even one's in the low nibble),
// written by the even lane; a lane without a param gives 0.
__device__ void store_nibbles(uint8_t* byte, uint32_t code, bool here) {
  const uint32_t high = __shfl_down_sync(0xffffffffu, code, 1);
  if (here && threadIdx.x % 2 == 0) *byte = static_cast<uint8_t>(code | (high << 4));
}

__device__ uint32_t nibble(const uint8_t* codes, std::size_t i) {
  return i % 2 ? codes[i / 2] >> 4 : codes[i / 2] & 15u;
}

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
// kernels/quantized.h: AdamElement, LionElement) and both formats (Int8Rows, Int4Tiles
// below), as the CPU's kernels::update_quantized is: a thread block of Format::kWarps warps takes
// a piece of Format::kPieceRows rows of Format::kRow params, each warp a row at a time,
// lane l the row's params l, l + 32, ...; a row's maxima are reduced within its warp
// (shuffles, no barrier), its codes written; scales a whole piece shares (int4's second
// moment) after one barrier at its end.

// int8 (kernels/quant8.h): rows of kQuantBlock params, each with its own scales: a row's
// codes are written once its maxima are known.
struct Int8Rows {
  using States = Int8States;
  static constexpr unsigned kWarps = 8, kRow = kQuantBlock, kPieceRows = kWarps, kEach = kRow / 32;
  static constexpr bool kKeepsRoot = true;
  static constexpr std::size_t kLaterBytes = 0;  // nothing is coded after its row
  struct Shared {};

  struct Piece {
    const States s;
    const std::size_t lo, len;
    __device__ float first(std::size_t i, unsigned, unsigned, bool here) const {
      return here ? kernels::decode_signed(s.code[0][i], s.scale[0][i / kRow]) : 0.0f;
    }
    __device__ float second(std::size_t i, unsigned, unsigned, bool here) const {
      const float w = here ? kernels::decode_unsigned(s.code[1][i], s.scale[1][i / kRow]) : 0.0f;
      return w * w;
    }
    // Row r's new moments (a second one: its root) coded with its maxima as scales.
    template <bool Two>
    __device__ void close_row(unsigned r, const float (&m)[kEach], const float (&v)[kEach], float*) {
      const std::size_t at = lo + std::size_t(r) * kRow;
      int32_t maxima[2] = {0, 0};
      for (unsigned e = 0; e < kEach; ++e) {
        const int32_t a = kernels::magnitude_bits(m[e]), b = kernels::magnitude_bits(v[e]);
        maxima[0] = a > maxima[0] ? a : maxima[0];
        maxima[1] = b > maxima[1] ? b : maxima[1];
      }
      warp_max(maxima);
      if (at >= lo + len) return;
      const float m_max = kernels::float_of(static_cast<uint32_t>(maxima[0]));
      const float w_max = kernels::float_of(static_cast<uint32_t>(maxima[1]));
      const unsigned lane = threadIdx.x % 32;
      if (lane == 0) {
        s.scale[0][at / kRow] = m_max;
        if (Two) s.scale[1][at / kRow] = w_max;
      }
      const float m_inv = 1.0f / m_max, w_inv = 1.0f / w_max;  // used where the maxima are > 0
      for (unsigned e = 0; e < kEach; ++e) {
        const std::size_t i = at + e * 32 + lane;
        if (i >= lo + len) continue;
        s.code[0][i] = m_max > 0.0f ? kernels::encode_signed(m[e], m_inv) : 0;
        if (Two) s.code[1][i] = w_max > 0.0f ? kernels::encode_unsigned(v[e], w_inv) : 0;
      }
    }
    template <bool Two>
    __device__ void close(Shared&, const float*) {}
  };
  __device__ static Piece piece(const States& s, std::size_t lo, std::size_t len) { return {s, lo, len}; }
};

// int4 (kernels/quant4.h): a piece is a tile of kQuant4Block rows; a row is a first-moment
// block, coded once its extreme is reduced; the second moment's rank-1 scales (the row
// maxima, and the column maxima across the tile) are known at the tile's end, so each
// lane keeps its new second moments until then. A lane's columns are the same in every
// row (l, l + 32, ...): it finds their maxima over its rows, the barrier joins the warps'.
struct Int4Tiles {
  using States = Int4States;
  // Sixteen warps a tile (eight rows each): on the H100, 1.4x eight warps' params/s, and
  // thirty-two's no faster (each warp's rows run one after another).
  static constexpr unsigned kWarps = 16, kRow = kQuant4Block, kPieceRows = kQuant4Block, kEach = kRow / 32;
  static constexpr bool kKeepsRoot = false;
  // The tile's new second moments, in shared memory until its end (64 KiB: in registers they
  // took 174 a thread, one block an SM).
  static constexpr std::size_t kLaterBytes = std::size_t(kQuant4Tile) * sizeof(float);
  struct Shared {
    int32_t columns[kWarps][kRow];
  };

  struct Piece {
    const States s;
    const std::size_t lo, len;
    float* const rmax;   // the tile's row maxima, then its column maxima (null: one moment)
    float map;           // kDynamic at this lane (& 15): lanes read the map by shuffles
    float c_old[kEach];  // the old column maxima of this lane's columns
    int32_t columns[kEach] = {};

    __device__ Piece(const States& st, std::size_t l, std::size_t n)
        : s(st), lo(l), len(n), rmax(st.scale[1] ? st.scale[1] + l / kQuant4Tile * 2 * kRow : nullptr),
          map(kDynamic.at[threadIdx.x % 16]) {
      for (unsigned e = 0; e < kEach; ++e) c_old[e] = rmax ? rmax[kRow + e * 32 + threadIdx.x % 32] : 0.0f;
    }
    // Every lane calls it (the map is read by a shuffle); 0 where it has no param.
    __device__ float first(std::size_t i, unsigned r, unsigned, bool here) const {
      const float value = __shfl_sync(0xffffffffu, map, here ? nibble(s.code[0], i) : 0u);
      return here ? value * s.scale[0][(lo + std::size_t(r) * kRow) / kRow] : 0.0f;
    }
    __device__ float second(std::size_t i, unsigned r, unsigned e, bool here) const {
      return here ? kernels::q4::pow2_value(nibble(s.code[1], i)) * kernels::q4::min(rmax[r], c_old[e]) : 0.0f;
    }
    template <bool Two>
    __device__ void close_row(unsigned r, const float (&m)[kEach], const float (&v)[kEach], float* later) {
      const std::size_t at = lo + std::size_t(r) * kRow;
      kernels::q4::Extreme x;
      int32_t v_bits = 0;
      for (unsigned e = 0; e < kEach; ++e) {
        x.add(m[e]);
        const int32_t a = kernels::q4::magnitude(v[e]);
        v_bits = a > v_bits ? a : v_bits;
        columns[e] = a > columns[e] ? a : columns[e];
        later[r * kRow + e * 32 + threadIdx.x % 32] = v[e];
      }
      int32_t maxima[3] = {x.pos, x.neg, v_bits};
      warp_max(maxima);
      x.pos = maxima[0], x.neg = maxima[1];
      const unsigned lane = threadIdx.x % 32;
      if (at >= lo + len) {  // a row the tile lacks: its maximum 0
        if (Two && lane == 0) rmax[r] = 0.0f;
        return;
      }
      const float scale = x.scale();
      if (lane == 0) {
        s.scale[0][at / kRow] = scale;
        if (Two) rmax[r] = kernels::float_of(static_cast<uint32_t>(maxima[2]));
      }
      const float d = kernels::q4::divisor(scale);
      for (unsigned e = 0; e < kEach; ++e) {
        const std::size_t i = at + e * 32 + lane;
        const bool here = i < lo + len;
        store_nibbles(s.code[0] + i / 2, here ? kernels::q4::nearest_dynamic(m[e] / d) : 0u, here);
      }
    }
    // The tile's second moment coded: the column maxima of every warp joined.
    template <bool Two>
    __device__ void close(Shared& shared, const float* later) {
      if (!Two) return;
      const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
      for (unsigned e = 0; e < kEach; ++e) shared.columns[warp][e * 32 + lane] = columns[e];
      __syncthreads();  // every warp's column maxima, and its rows' maxima in rmax
      float c_max[kEach];
      for (unsigned e = 0; e < kEach; ++e) {
        int32_t c = 0;
        for (unsigned w = 0; w < kWarps; ++w) c = shared.columns[w][e * 32 + lane] > c ? shared.columns[w][e * 32 + lane] : c;
        c_max[e] = kernels::float_of(static_cast<uint32_t>(c));
        if (warp == 0) rmax[kRow + e * 32 + lane] = c_max[e];
      }
#pragma unroll
      for (unsigned q = 0; q < kPieceRows / kWarps; ++q) {
        const unsigned r = q * kWarps + warp;
        const std::size_t at = lo + std::size_t(r) * kRow;
        for (unsigned e = 0; e < kEach; ++e) {
          const std::size_t i = at + e * 32 + lane;
          const bool here = i < lo + len;
          const float d = here ? kernels::q4::divisor(kernels::q4::min(rmax[r], c_max[e])) : 1.0f;
          store_nibbles(s.code[1] + i / 2, here ? kernels::q4::nearest_pow2(later[r * kRow + e * 32 + lane] / d) : 0u, here);
        }
      }
    }
  };
  __device__ static Piece piece(const States& s, std::size_t lo, std::size_t len) { return {s, lo, len}; }
};

// Each quantized format's GPU piece, by its states.
Int8Rows gpu_format_of(const Int8States&);
Int4Tiles gpu_format_of(const Int4States&);

// One piece of quantized states per thread block (the scheme above): each row's params
// decoded, updated by the rule's element, the new params stored, the row closed.
template <class Format, class Element, class G, class P>
__global__ void __launch_bounds__(Format::kWarps * 32) quantized_kernel(std::size_t n, const typename Format::States s,
                                                                const Master ms, const G* grad, P* out,
                                                                const Element el) {
  constexpr unsigned kWarps = Format::kWarps, kEach = Format::kEach, kRows = Format::kPieceRows / kWarps;
  constexpr bool two = Element::kMoments > 1;
  __shared__ typename Format::Shared shared;
  const std::size_t lo = blockIdx.x * std::size_t(Format::kRow) * Format::kPieceRows;
  const std::size_t len = n - lo < std::size_t(Format::kRow) * Format::kPieceRows ? n - lo
                                                                                  : std::size_t(Format::kRow) * Format::kPieceRows;
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  typename Format::Piece piece = Format::piece(s, lo, len);
  extern __shared__ float later[];  // Format::kLaterBytes: values coded at the piece's end
  for (unsigned q = 0; q < kRows; ++q) {
    const unsigned r = q * kWarps + warp;
    // Every load of the row before any store: the stores might alias them for the compiler,
    // which then issues each element's loads only after the previous element's stores.
    float m[kEach], v[kEach], g[kEach], p[kEach];
    const std::size_t row = lo + std::size_t(r) * Format::kRow;
#pragma unroll
    for (unsigned e = 0; e < kEach; ++e) {
      const std::size_t i = row + e * 32 + lane;
      const bool here = i < lo + len;
      m[e] = piece.first(i, r, e, here);
      v[e] = two ? piece.second(i, r, e, here) : 0.0f;
      g[e] = here ? kernels::to_float(grad[i]) * el.k.grad_scale : 0.0f;
      p[e] = here ? ms.load(i, out) : 0.0f;
    }
#pragma unroll
    for (unsigned e = 0; e < kEach; ++e) {
      const std::size_t i = row + e * 32 + lane;
      if (i < lo + len) ms.store(i, el.template apply<Format::kKeepsRoot>(g[e], p[e], m[e], v[e]), out);
    }
    piece.template close_row<two>(r, m, v, later);
  }
  piece.template close<two>(shared, later);
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
        launch_quantized<decltype(gpu_format_of(s))>(step, s, n, ms, grad, out, stream);
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
