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

// kernels/quant4.h's maps, where the GPU reads them (a host constexpr array is not
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
__constant__ Map<15> kDynamicMid = map_of(kernels::q4::kDynamicMid);
__constant__ Map<15> kPow2Mid = map_of(kernels::q4::kPow2Mid);

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

// The largest of N values over each group of `Group` consecutive threads (the whole block,
// or one row of a tile), in every thread of the group: integers, the bits of non-negative
// floats, so the result is exact whatever the order. `shared` holds N values per warp; the
// first barrier lets a second call reuse it and orders every read the threads made before
// it ahead of writes after it.
template <unsigned Group, unsigned N>
__device__ void group_max(int32_t (&v)[N], int32_t* shared) {
  for (unsigned o = 16; o > 0; o >>= 1)
    for (unsigned k = 0; k < N; ++k) {
      const int32_t w = __shfl_xor_sync(0xffffffffu, v[k], o);
      v[k] = w > v[k] ? w : v[k];
    }
  __syncthreads();
  if (threadIdx.x % 32 == 0)
    for (unsigned k = 0; k < N; ++k) shared[threadIdx.x / 32 * N + k] = v[k];
  __syncthreads();
  const int32_t* mine = shared + threadIdx.x / Group * (Group / 32) * N;
  for (unsigned k = 0; k < N; ++k) {
    v[k] = mine[k];
    for (unsigned w = 1; w < Group / 32; ++w) v[k] = mine[w * N + k] > v[k] ? mine[w * N + k] : v[k];
  }
}

// Two neighbouring params' 4-bit codes in one byte (the even one's in the low nibble),
// written by the even thread; a thread without a param gives 0.
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

// Adam on int8 states (kernels::adam8_range): a block of kQuantBlock params per thread block.
template <bool Decoupled, bool Small, class G, class P>
__global__ void adam8_kernel(std::size_t n, const Int8States s, const Master ms, const G* grad,
                             P* out, const AdamStep k) {
  __shared__ int32_t shared[kQuantBlock / 32 * 2];
  const std::size_t b = blockIdx.x, i = b * kQuantBlock + threadIdx.x;
  const bool here = i < n;
  float m = 0.0f, root = 0.0f;
  if (here) {
    const float w_old = kernels::decode_unsigned(s.code[1][i], s.scale[1][b]);
    const AdamResult r = kernels::adam_element<Decoupled, Small>(
        kernels::to_float(grad[i]) * k.grad_scale, ms.load(i, out),
        kernels::decode_signed(s.code[0][i], s.scale[0][b]), w_old * w_old, k);
    ms.store(i, r.p, out);
    m = r.m;
    root = r.root;
  }
  int32_t maxima[2] = {kernels::magnitude_bits(m), kernels::magnitude_bits(root)};
  group_max<kQuantBlock>(maxima, shared);
  const float m_max = kernels::float_of(static_cast<uint32_t>(maxima[0]));
  const float w_max = kernels::float_of(static_cast<uint32_t>(maxima[1]));
  if (threadIdx.x == 0) s.scale[0][b] = m_max, s.scale[1][b] = w_max;
  if (!here) return;
  s.code[0][i] = m_max > 0.0f ? kernels::encode_signed(m, 1.0f / m_max) : 0;
  s.code[1][i] = w_max > 0.0f ? kernels::encode_unsigned(root, 1.0f / w_max) : 0;
}

// A first-moment block's signed extreme (kernels::q4::Extreme) across a row of kQuant4Block
// threads, and the largest of `also` (a second moment's row maximum: 0 where none).
__device__ float block_extreme(float m, bool here, int32_t& also, int32_t* shared) {
  kernels::q4::Extreme e;
  if (here) e.add(m);
  int32_t maxima[3] = {e.pos, e.neg, also};
  group_max<kQuant4Block>(maxima, shared);
  e.pos = maxima[0], e.neg = maxima[1], also = maxima[2];
  return e.scale();
}

__device__ uint32_t code_first(float m, float scale) {
  return kernels::q4::nearest(m / kernels::q4::divisor(scale), kDynamicMid.at);
}

// Adam on int4 states (kernels::adam4_range): a tile per thread block of kTileRowsAtOnce rows
// of threads, thread (g, j) column j of rows g, g + kTileRowsAtOnce, ...; a row is a
// first-moment block, coded once its extreme is reduced; the second moment is coded after
// the tile, when its column maxima (each thread's, then across its column's threads) are.
constexpr unsigned kTileRowsAtOnce = 8;

template <bool Decoupled, bool Small, class G, class P>
__global__ void __launch_bounds__(kQuant4Block * kTileRowsAtOnce) adam4_kernel(std::size_t n, const Int4States s, const Master ms, const G* grad,
                             P* out, const AdamStep k) {
  constexpr std::size_t B = kQuant4Block, kRowsEach = B / kTileRowsAtOnce;
  __shared__ int32_t shared[kTileRowsAtOnce * B / 32 * 3];
  __shared__ int32_t columns[kTileRowsAtOnce][B];
  const std::size_t t = blockIdx.x, lo = t * kQuant4Tile;
  const std::size_t j = threadIdx.x % B, g = threadIdx.x / B;
  const std::size_t len = n - lo < kQuant4Tile ? n - lo : kQuant4Tile;
  const std::size_t rows = kernels::q4::tile_rows(len);
  float* mscale = s.scale[0] + lo / B;
  float* rmax = s.scale[1] + t * 2 * B;
  float* cmax = rmax + B;
  uint8_t* mq = s.code[0] + lo / 2;
  uint8_t* vq = s.code[1] + lo / 2;
  const float c_old = cmax[j];
  float v_new[kRowsEach];  // this thread's new second moments, coded after the tile
  int32_t c_bits = 0;
  for (std::size_t e = 0; e < kRowsEach; ++e) {  // every thread: the barriers are the block's
    const std::size_t r = e * kTileRowsAtOnce + g, at = r * B + j;
    const bool row = r < rows, here = row && j < kernels::q4::row_len(len, r);
    float m = 0.0f, v = 0.0f;
    if (here) {
      const float m_old = kDynamic.at[nibble(mq, at)] * mscale[r];
      const float v_old = kernels::q4::pow2_value(nibble(vq, at)) * kernels::q4::min(rmax[r], c_old);
      const AdamResult res = kernels::adam_element<Decoupled, Small>(
          kernels::to_float(grad[lo + at]) * k.grad_scale, ms.load(lo + at, out), m_old, v_old, k);
      ms.store(lo + at, res.p, out);
      m = res.m;
      v = res.v;
    }
    v_new[e] = v;
    const int32_t v_bits = kernels::q4::magnitude(v);
    c_bits = v_bits > c_bits ? v_bits : c_bits;
    int32_t r_bits = v_bits;
    const float m_scale = block_extreme(m, here, r_bits, shared);
    if (row && j == 0) mscale[r] = m_scale, rmax[r] = kernels::float_of(static_cast<uint32_t>(r_bits));
    store_nibbles(mq + at / 2, here ? code_first(m, m_scale) : 0, here);
  }
  columns[g][j] = c_bits;
  __syncthreads();  // the column maxima of every row group, and the new row maxima
  for (std::size_t h = 0; h < kTileRowsAtOnce; ++h) c_bits = columns[h][j] > c_bits ? columns[h][j] : c_bits;
  const float c_max = kernels::float_of(static_cast<uint32_t>(c_bits));
  if (g == 0) {
    cmax[j] = c_max;
    if (j >= rows) rmax[j] = 0.0f;
  }
  for (std::size_t e = 0; e < kRowsEach; ++e) {
    const std::size_t r = e * kTileRowsAtOnce + g, at = r * B + j;
    const bool here = r < rows && j < kernels::q4::row_len(len, r);
    const float d = here ? kernels::q4::divisor(kernels::q4::min(rmax[r], c_max)) : 1.0f;
    store_nibbles(vq + at / 2, here ? kernels::q4::nearest(v_new[e] / d, kPow2Mid.at) : 0, here);
  }
}

// How Lion's one moment is coded in a block: int8 (kernels::lion8: the block's largest
// magnitude) or int4 (kernels::lion4: its signed extreme on the dynamic map). Every thread
// of the block calls scale_of and encode (their reductions and nibble pairs are collective).
struct Lion8Coding {
  static constexpr std::size_t kBlock = kQuantBlock;
  using States = Int8States;
  __device__ static float decode(const States& s, std::size_t i, std::size_t b) {
    return kernels::decode_signed(s.code[0][i], s.scale[0][b]);
  }
  __device__ static float scale_of(float m, bool, int32_t* shared) {
    int32_t maxima[1] = {kernels::magnitude_bits(m)};
    group_max<kBlock>(maxima, shared);
    return kernels::float_of(static_cast<uint32_t>(maxima[0]));
  }
  __device__ static void encode(const States& s, std::size_t i, float m, float scale, bool here) {
    if (here) s.code[0][i] = scale > 0.0f ? kernels::encode_signed(m, 1.0f / scale) : 0;
  }
};

struct Lion4Coding {
  static constexpr std::size_t kBlock = kQuant4Block;
  using States = Int4States;
  __device__ static float decode(const States& s, std::size_t i, std::size_t b) {
    return kDynamic.at[nibble(s.code[0], i)] * s.scale[0][b];
  }
  __device__ static float scale_of(float m, bool here, int32_t* shared) {
    int32_t unused = 0;
    return block_extreme(m, here, unused, shared);
  }
  __device__ static void encode(const States& s, std::size_t i, float m, float scale, bool here) {
    store_nibbles(s.code[0] + i / 2, here ? code_first(m, scale) : 0, here);
  }
};

// Lion on quantized states: a first-moment block of Coding::kBlock params per thread block.
template <class Coding, class G, class P>
__global__ void lion_quantized_kernel(std::size_t n, const typename Coding::States s,
                                      const Master ms, const G* grad, P* out, const LionStep k) {
  __shared__ int32_t shared[Coding::kBlock / 32 * 3];
  const std::size_t b = blockIdx.x, i = b * Coding::kBlock + threadIdx.x;
  const bool here = i < n;
  float m = 0.0f;
  if (here) {
    const kernels::LionResult r = kernels::lion_element(
        kernels::to_float(grad[i]) * k.grad_scale, ms.load(i, out), Coding::decode(s, i, b), k);
    ms.store(i, r.p, out);
    m = r.m;
  }
  const float scale = Coding::scale_of(m, here, shared);
  if (threadIdx.x == 0) s.scale[0][b] = scale;
  Coding::encode(s, i, m, scale, here);
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

template <class G, class P>
void launch(const kernels::Step& step, const store::StateLayout& layout, void* states,
            std::size_t n, const Master& ms, const G* grad, P* out, cudaStream_t stream) {
  const bool adam = step.rule == kernels::Rule::adam || step.rule == kernels::Rule::adamw;
  // Quantized moments: Adam's and Lion's kernels only (the rows marked int8/int4); any other
  // rule is refused here, not run as one of them.
  if (layout.moments != store::Moments::fp32 && !adam && step.rule != kernels::Rule::lion)
    throw std::logic_error(std::string("the CUDA device has no quantized kernel for rule ") +
                           kernels::rule_row(step.rule).name);
  switch (layout.moments) {
    case store::Moments::fp32: {
      Arrays arrays{};
      for (unsigned a = 1; a < layout.arrays; ++a) arrays.at[a] = layout.array(states, n, a);
      fp32_kernel<G, P><<<grid_for(n), kThreads, 0, stream>>>(step, n, ms, arrays, grad, out);
      return;
    }
    case store::Moments::int8: {
      const Int8States s = layout.int8_at(states, n);
      const unsigned blocks = blocks_for(n, kQuantBlock);
      if (adam)
        return kernels::with_adam_choices(step.adam, [&](auto decoupled, auto small) {
          adam8_kernel<decltype(decoupled)::value, decltype(small)::value, G, P>
              <<<blocks, kQuantBlock, 0, stream>>>(n, s, ms, grad, out, step.adam);
        });
      lion_quantized_kernel<Lion8Coding, G, P>
          <<<blocks, kQuantBlock, 0, stream>>>(n, s, ms, grad, out, step.lion);
      return;
    }
    case store::Moments::int4: {
      const Int4States s = layout.int4_at(states, n);
      if (adam)
        return kernels::with_adam_choices(step.adam, [&](auto decoupled, auto small) {
          adam4_kernel<decltype(decoupled)::value, decltype(small)::value, G, P>
              <<<blocks_for(n, kQuant4Tile), kQuant4Block * kTileRowsAtOnce, 0, stream>>>(
                  n, s, ms, grad, out, step.adam);
        });
      lion_quantized_kernel<Lion4Coding, G, P>
          <<<blocks_for(n, kQuant4Block), kQuant4Block, 0, stream>>>(n, s, ms, grad, out, step.lion);
      return;
    }
  }
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
