// The update kernels' tile loop: burst-read a tile of each fp32 state array and of the
// gradient (or decompress the top-k pairs that fall in it), run the element-wise math of
// src/native/kernels/ on the on-chip tile, burst-write states and params back.
#pragma once
#include <cstddef>
#include <cstdint>

#include "beats.h"
#include "kernels/decompress.h"
#include "kernels/rules.h"
#include "store/layout.h"

namespace smartinf::hls {

// The math of rule R on a tile: its NS fp32 arrays (the param first), its kernel and scalars
// (kernels/rules.h RuleKernel).
template <kernels::Rule R>
struct RuleMath {
  static constexpr int NS = static_cast<int>(kernels::kRules[static_cast<int>(R)].arrays);
  typename kernels::RuleKernel<R>::Scalars s;
  template <class G, class P>
  void operator()(int n, float (*st)[TILE], const G* g, P* out) const {
    kernels::RuleKernel<R>::run(static_cast<std::size_t>(n), st, g, out, s);
  }
};

// Where a tile's gradient comes from: a dense G array, or top-k (int32 index, V value)
// pairs with ascending sub-group positions, this chunk starting at position `base`.
template <class G>
struct DenseGrad {
  using Elem = G;
  const Beat* grad;
  void tile(std::size_t start, int count, G* g) { load(grad, start, count, g); }
};

template <class V>
struct TopkGrad {
  using Elem = float;
  const Beat* index;
  const Beat* values;
  int nnz;
  uint64_t base;
  int next = 0;  // the first pair not yet used (pairs come in ascending order)
  int32_t idx[TILE] = {};
  V val[TILE] = {};
  void tile(std::size_t start, int count, float* g) {
    const uint64_t end = base + start + static_cast<uint64_t>(count);
    int m = 0;
  gather_pairs:
    for (; next < nnz; ++next, ++m) {
#pragma HLS PIPELINE II = 1
      const int32_t i = element<int32_t>(index, static_cast<std::size_t>(next));
      if (static_cast<uint64_t>(i) >= end) break;
      idx[m] = i;
      val[m] = element<V>(values, static_cast<std::size_t>(next));
    }
    kernels::decompress(static_cast<std::size_t>(count), g, idx, val, static_cast<std::size_t>(m),
                        base + start);
  }
};

// One chunk of n params: states[0..NS) are the fp32 state arrays (param first).
template <class Math, class Grad, class P>
inline void update_chunk(Beat* const* states, Grad& grad, Beat* out, int n, const Math& math) {
  float st[Math::NS][TILE];
  typename Grad::Elem g[TILE];
  P o[TILE];
tiles:
  for (int start = 0; start < n; start += TILE) {
    const int count = n - start < TILE ? n - start : TILE;
    for (int a = 0; a < Math::NS; ++a) load(states[a], start, count, st[a]);
    grad.tile(start, count, g);
    math(count, st, g, o);
    for (int a = 0; a < Math::NS; ++a) store(states[a], start, count, st[a]);
    store(out, start, count, o);
  }
}

// The math of one optimizer on quantized states (an int8 or an int4 tile, kernels/quantized.h's
// one update): M coded moments.
struct AdamQuantMath {
  static constexpr int M = 2;  // exp_avg, and exp_avg_sq (int8: its root)
  kernels::AdamStep s;
  template <class States, class G, class P>
  void operator()(int n, const States& st, const G* g, P* out) const {
    kernels::adam_quantized(static_cast<std::size_t>(n), st, g, kernels::Fp32Masters<P>{st.param, out}, s);
  }
};

struct LionQuantMath {
  static constexpr int M = 1;  // exp_avg
  kernels::LionStep s;
  template <class States, class G, class P>
  void operator()(int n, const States& st, const G* g, P* out) const {
    kernels::lion_quantized(static_cast<std::size_t>(n), st, g, kernels::Fp32Masters<P>{st.param, out}, s);
  }
};

// A quantized format's tile in on-chip buffers: `states` (the view kernels/quantized.h
// updates), and the load and store of the tile's codes and scales at param `start`.
// int8 (store/layout.h, coded as kernels/quant8.h says): tiles of 4096 params, whole
// blocks of 256 and a whole number of beats of block scales (16 floats = one beat); M code
// arrays and M per-block scale arrays.
template <int M>
struct Int8Tile {
  static constexpr int kSize = 4096;
  static constexpr int kBlocks = kSize / static_cast<int>(store::kQuantBlock);
  float sc[M][kBlocks];
  uint8_t q[M][kSize];
  store::Int8States states(float* p) {
    store::Int8States st{p, {}, {}};
    for (int k = 0; k < M; ++k) {
      st.code[k] = q[k];
      st.scale[k] = sc[k];
    }
    return st;
  }
  template <bool kStore>
  void move(Beat* const* codes, Beat* const* scales, int start, int count) {
    const int blocks = static_cast<int>(store::quant_blocks(static_cast<std::size_t>(count)));
    const std::size_t first_block = static_cast<std::size_t>(start) / store::kQuantBlock;
    for (int k = 0; k < M; ++k) {
      transfer<kStore>(codes[k], start, count, q[k]);
      transfer<kStore>(scales[k], first_block, blocks, sc[k]);
    }
  }
};

// int4 (coded as kernels/quant4.h says): tiles of one rank-1 tile of 128 x 128 (the second
// moment's scales need the whole tile's new values before any is coded), i.e. 128
// first-moment blocks, 8192 code bytes and 256 tile scales: whole beats of each. M packed
// code arrays (two codes a byte), the first moment's per-block scales and (M = 2) the second
// moment's per-tile row and column maxima.
template <int M>
struct Int4Tile {
  static constexpr int kSize = static_cast<int>(store::kQuant4Tile);
  static constexpr int kBlock = static_cast<int>(store::kQuant4Block);
  float block_scale[kSize / kBlock], tile_scale[2 * kBlock];
  uint8_t q[M][kSize / 2];
  store::Int4States states(float* p) {
    store::Int4States st{p, {}, {block_scale, M > 1 ? tile_scale : nullptr}};
    for (int k = 0; k < M; ++k) st.code[k] = q[k];
    return st;
  }
  template <bool kStore>
  void move(Beat* const* codes, Beat* const* scales, int start, int count) {
    const int blocks = static_cast<int>(store::quant4_blocks(static_cast<std::size_t>(count)));
    for (int k = 0; k < M; ++k)
      transfer<kStore>(codes[k], static_cast<std::size_t>(start) / 2, (count + 1) / 2, q[k]);
    transfer<kStore>(scales[0], static_cast<std::size_t>(start) / store::kQuant4Block, blocks, block_scale);
    if (M > 1)
      transfer<kStore>(scales[1], static_cast<std::size_t>(start) / store::kQuant4Tile * 2 * kBlock,
                       2 * kBlock, tile_scale);
  }
};

// One chunk of n params with quantized states (Tile: Int8Tile or Int4Tile of Math::M
// moments): fp32 params, the tile's codes and scales, a dense G gradient.
template <template <int> class Tile, class Math, class G, class P>
inline void update_chunk_quantized(Beat* param, Beat* const* codes, Beat* const* scales,
                                   const Beat* grad, Beat* out, int n, const Math& math) {
  constexpr int kSize = Tile<Math::M>::kSize;
  float p[kSize];
  G g[kSize];
  P o[kSize];
  Tile<Math::M> tile;
  const auto st = tile.states(p);
quantized_tiles:
  for (int start = 0; start < n; start += kSize) {
    const int count = n - start < kSize ? n - start : kSize;
    load(param, start, count, p);
    tile.template move<false>(codes, scales, start, count);
    load(grad, start, count, g);
    math(count, st, g, o);
    store(param, start, count, p);
    tile.template move<true>(codes, scales, start, count);
    store(out, start, count, o);
  }
}

}  // namespace smartinf::hls
