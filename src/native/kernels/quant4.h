// 4-bit optimizer states (after Li et al., "Memory Efficient Optimizers with 4-bit States",
// NeurIPS 2023; their code is github.com/thu-ml/low-bit-optimizers, `lpmm`), written once for
// the CPU device and HLS: the two codes, and the format kernels/quantized.h's update runs the
// rules whose row allows int4 on. Where the codes and scales sit is store/layout.h's (Int4States).
//
// A rule's int4 moments, in the order of its state arrays (the first moment as lpmm's default
// configuration, lpmm/configs/default.yml "B128/DE"; the second moment's scales as its
// "Rank-1", its map our own, see below):
//   first (Adam's and Lion's exp_avg, signed): blocks of 128 params (kQuant4Block), each
//     divided by its extreme value (the block's fp32 scale, see below) and rounded to the
//     nearest value of lpmm's 4-bit signed dynamic-exponent map (functional.
//     create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4), its float32 values
//     bit for bit):
//       -0.8875 -0.6625 -0.4375 -0.2125 -0.0775 -0.0325 -0.0055 0
//        0.0055  0.0325  0.0775  0.2125  0.4375  0.6625  0.8875 1
//     (code i is the i-th value; 0 is exact). The map holds +1 but not -1, so the scale is
//     the block's largest magnitude WITH ITS SIGN (the positive one on a tie): lpmm divides
//     by the absolute maximum, and a block whose extreme is negative then decodes it as
//     -0.8875 of it; with a signed scale the extreme always decodes exactly, and decoded
//     states code back to the same bits (a state_dict round trip is exact). The decode is
//     the same product, map value x scale. Largest gap 0.225, so the error is at most
//     0.1125 of the block's largest magnitude.
//   second (Adam's exp_avg_sq, v itself, not its root as int8 keeps it): rank-1 normalisation
//     (functional.quant_scaling, scale_type "rank1": the scale of element (r, c) is
//     min(max of row r, max of column c)) and the map of the powers of two without zero:
//     code i is 2^(i - 15), 2^-15 .. 1. Adam divides by sqrt(v), so what must be bounded is
//     v's RELATIVE error, wherever in its scale's range v lies: from 2^-15 of the scale up,
//     a decoded v is within 2/3 .. 4/3 of v (its root within 0.82 .. 1.16), below it is
//     rounded up to 2^-15 of the scale. lpmm's default, "power-1" (the linear map
//     (i + 1) / 16), bounds the absolute error instead: a v below 1/32 of its scale decodes
//     as 1/16 of it, up to thousands of times too large, and in the first iterations, where
//     v holds the squares of a few gradients spread over orders of magnitude, that shrank
//     the steps of most params (demo GPT, step 3: 1.6 % off fp32 states' loss; GPT-2 XL,
//     iteration 4: 15 %; with this map 0.26 % over the demo's first 10 steps and 0.6 % at
//     GPT-2 XL's iteration 4, README "int4"). Like lpmm's, this map has no
//     zero, so m / (sqrt(v) + eps) cannot blow up where a tiny v would have rounded to zero
//     (the failure the paper calls the zero-point problem).
// Rounding is lpmm's "real-nearest" (quantization_kernel.cu, quantize_bsearch): the code is
// the number of midpoints (float32 (map[i] + map[i+1]) * 0.5) strictly below x, so a tie goes
// to the smaller value and x beyond the ends clamps to them. Here that count is 15 compares
// and adds, branch-free, so GCC vectorises it and tests/quant4_reference.py reproduces it
// exactly. x is the value divided by its scale (correctly rounded: |x| <= 1 always), as lpmm
// divides; a zero scale (all its values 0) codes every value as x = 0.
//
// Where this differs from lpmm: lpmm normalises a 2-D param by its own matrix's row and
// column maxima (and 1-D ones by blocks of 128; tensors of <= 4096 elements stay fp32). A
// device sees only flat chunks, so here a tile is 128 x 128 consecutive params of the chunk
// viewed row by row (the last tile of a chunk may have fewer rows and a shorter last row),
// whatever the param's own shape; every param is quantized; blocks and tiles restart at every
// chunk. A tile's row r is also the first moment's block: the tile's 128 rows are its 128
// blocks. The update is lpmm's order (optim/adamw.py, _single_tensor_adamw4bit): decode the
// old moments, the fp32
// update with the new moments in fp32 (adam_element, lion_element), then the new moments'
// maxima become the scales and the new moments are coded.
//
// Bytes per param of moments (store/layout.h): codes 0.5 each; first moment 4 B per 128
// params (1/32); second moment 2 x 128 fp32 maxima per 16384 params (1/16). Adam: 2 x 0.5 +
// 1/32 + 1/16 = 1.09375 B/param (int8: 2.03, fp32: 8); Lion: 0.53125 B/param.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/numeric.h"
#if defined(__CUDACC__)
#include "kernels/warp.h"
#endif
#include "store/layout.h"

namespace smartinf::kernels {

// The int4 layout's names, owned by store/layout.h.
using store::Int4States;
using store::kQuant4Block;
using store::kQuant4Tile;

namespace q4 {

// lpmm's 4-bit signed dynamic-exponent map (float32, as torch builds it), ascending.
inline constexpr float kDynamic[16] = {
    -0x1.c66666p-1f, -0x1.533334p-1f, -0x1.cp-2f,      -0x1.b33332p-3f,
    -0x1.3d70a4p-4f, -0x1.0a3d72p-5f, -0x1.6872b0p-8f, 0.0f,
    0x1.6872b0p-8f,  0x1.0a3d72p-5f,  0x1.3d70a4p-4f,  0x1.b33332p-3f,
    0x1.cp-2f,       0x1.533334p-1f,  0x1.c66666p-1f,  1.0f};
inline constexpr float kDynamicMid[15] = {
#define SMARTINF_Q4_MID(i) (kDynamic[i] + kDynamic[i + 1]) * 0.5f
    SMARTINF_Q4_MID(0),  SMARTINF_Q4_MID(1),  SMARTINF_Q4_MID(2),  SMARTINF_Q4_MID(3),
    SMARTINF_Q4_MID(4),  SMARTINF_Q4_MID(5),  SMARTINF_Q4_MID(6),  SMARTINF_Q4_MID(7),
    SMARTINF_Q4_MID(8),  SMARTINF_Q4_MID(9),  SMARTINF_Q4_MID(10), SMARTINF_Q4_MID(11),
    SMARTINF_Q4_MID(12), SMARTINF_Q4_MID(13), SMARTINF_Q4_MID(14)};
#undef SMARTINF_Q4_MID
// The powers of two 2^-15 .. 1 (code i is 2^(i - 15)); midpoints 1.5 x 2^(i - 15), exact.
inline constexpr float kPow2Mid[15] = {
    0x1.8p-15f, 0x1.8p-14f, 0x1.8p-13f, 0x1.8p-12f, 0x1.8p-11f, 0x1.8p-10f, 0x1.8p-9f, 0x1.8p-8f,
    0x1.8p-7f,  0x1.8p-6f,  0x1.8p-5f,  0x1.8p-4f,  0x1.8p-3f,  0x1.8p-2f,  0x1.8p-1f};

// The nearest map value's code: how many midpoints lie strictly below x (ties go down).
__attribute__((always_inline)) SMARTINF_HD inline uint32_t nearest(float x, const float* mid) {
  uint32_t c = 0;
#pragma GCC unroll 15
  for (int i = 0; i < 15; ++i) c += static_cast<uint32_t>(x > mid[i]);
  return c;
}

// nearest(x, kPow2Mid) from x's bits (equal for every float; csim_test checks): the exponent,
// plus one above the midpoint 1.5 x 2^e (mantissa > 0x400000; a tie goes down), clamped to
// 0 .. 15; negatives and NaN count no midpoint, as there.
__attribute__((always_inline)) SMARTINF_HD inline uint32_t nearest_pow2(float x) {
  const uint32_t b = bits_of(x);
  const int32_t c = static_cast<int32_t>(b >> 23) - 112 + static_cast<int32_t>((b & 0x7fffffu) > 0x400000u);
  const int32_t clamped = c < 0 ? 0 : (c > 15 ? 15 : c);
  return b > 0x7f800000u ? 0u : static_cast<uint32_t>(clamped);
}

// nearest(x, kDynamicMid) on |x| (equal for every float; csim_test checks): the map is
// symmetric but for +1 (kDynamicMid[i] = -kDynamicMid[13 - i]), so the count is 7 plus the
// positive midpoints below x, or 7 less those at or below |x| (|x| >= m is |x| > m less one
// ulp: add the sign bit to |x|'s bits); NaN counts none. The positive midpoints
// kDynamicMid[7 ..] are written as float bits (non-negative floats order like their bits),
// literals where an array would not be addressable in GPU code.
__attribute__((always_inline)) SMARTINF_HD inline uint32_t nearest_dynamic(float x) {
  const uint32_t b = bits_of(x), negative = b >> 31, a = b & 0x7fffffffu, t = a + negative;
  const uint32_t below = static_cast<uint32_t>(t > 0x3b343958u) + static_cast<uint32_t>(t > 0x3c9ba5e4u) +
                         static_cast<uint32_t>(t > 0x3d6147aeu) + static_cast<uint32_t>(t > 0x3e147ae1u) +
                         static_cast<uint32_t>(t > 0x3ea66666u) + static_cast<uint32_t>(t > 0x3f0ccccdu) +
                         static_cast<uint32_t>(t > 0x3f466666u);
  const uint32_t top = static_cast<uint32_t>(t > 0x3f71999au) & (negative ^ 1u);
  const uint32_t c = negative ? 7u - below : 7u + below + top;
  return a > 0x7f800000u ? 0u : c;
}

// 2^(code - 15), built from its exponent bits (exact, branch-free).
__attribute__((always_inline)) SMARTINF_HD inline float pow2_value(uint32_t code) {
  return float_of((code + 112u) << 23);
}

// Largest magnitude as the bits of a non-negative float (they order like the values; an
// integer max reduction vectorises where a float one needs -ffast-math).
__attribute__((always_inline)) SMARTINF_HD inline int32_t magnitude(float x) {
  return static_cast<int32_t>(bits_of(x) & 0x7fffffffu);
}

// A first-moment block's extreme, found on the way: the largest magnitude among values with
// the sign bit clear and among those with it set (as float bits, integer maxima).
struct Extreme {
  int32_t pos = 0, neg = 0;
  __attribute__((always_inline)) SMARTINF_HD void add(float x) {
    const int32_t b = static_cast<int32_t>(bits_of(x));
    const int32_t a = b & 0x7fffffff, negative = b >> 31;  // all ones for a set sign bit
    const int32_t p = a & ~negative, q = a & negative;
    pos = p > pos ? p : pos;
    neg = q > neg ? q : neg;
  }
  // The scale: the largest magnitude with its sign, the positive one on a tie.
  SMARTINF_HD float scale() const {
    return neg > pos ? -float_of(static_cast<uint32_t>(neg)) : float_of(static_cast<uint32_t>(pos));
  }
};

__attribute__((always_inline)) SMARTINF_HD inline float min(float a, float b) { return a < b ? a : b; }

// A divisor for values whose scale is `s`: s itself, or 1 where s is 0 (its values are 0).
// Selected by masks: written as `s != 0 ? s : 1`, GCC moves the division into the branches
// (x / 1 = x), and a conditional division stops the loop from vectorising.
__attribute__((always_inline)) SMARTINF_HD inline float divisor(float s) {
  const uint32_t take = 0u - static_cast<uint32_t>(s != 0.0f);
  return float_of((bits_of(s) & take) | (bits_of(1.0f) & ~take));
}

// The map values of both codes of each byte (low nibble first): decoding reads two values
// with one load, which vectorises as a gather where 16 selects a value did not (3x slower).
struct DynamicPair {
  float v[2];
};
struct DynamicPairs {
  DynamicPair of[256];
};
constexpr DynamicPairs dynamic_pairs() {
  DynamicPairs t{};
  for (unsigned b = 0; b < 256; ++b) t.of[b] = {{kDynamic[b & 15u], kDynamic[b >> 4]}};
  return t;
}
inline constexpr DynamicPairs kDynamicPairs = dynamic_pairs();

// `len` values of the first moment from codes at q (value j's code in q[j / 2], the low
// nibble for even j), with the block's scale.
// With AVX2 or AVX-512, sixteen codes at a time as GCC's generic vectors: the lookup is a
// two-table shuffle (vpermi2ps; two vpermps and a blend), where GCC lowers the table loads
// below to scalar ones (about 1.15x the whole int4 update, bench/test_kernels.py). The
// same products, so the same bits. Not for CUDA's or HLS's parsers, nor for a CPU whose
// shuffles would be emulated (the `default` clone of device/cpu_update_impl.h's entries).
#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(__SYNTHESIS__)
typedef float F8v __attribute__((vector_size(32)));
typedef int32_t I8v __attribute__((vector_size(32)));

inline std::size_t decode_first_shuffled(std::size_t len, const uint8_t* __restrict q, float scale,
                                         float* __restrict x) {
  if (!__builtin_cpu_supports("avx2")) return 0;
  const F8v low = {kDynamic[0], kDynamic[1], kDynamic[2], kDynamic[3],
                   kDynamic[4], kDynamic[5], kDynamic[6], kDynamic[7]};
  const F8v high = {kDynamic[8], kDynamic[9], kDynamic[10], kDynamic[11],
                    kDynamic[12], kDynamic[13], kDynamic[14], kDynamic[15]};
  std::size_t j = 0;
  for (; j + 16 <= len; j += 16) {
    I8v even, odd;  // codes 2k and 2k + 1
    for (int k = 0; k < 8; ++k) {
      even[k] = q[j / 2 + k] & 15;
      odd[k] = q[j / 2 + k] >> 4;
    }
    const F8v v0 = __builtin_shuffle(low, high, __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11)) * scale;
    const F8v v1 = __builtin_shuffle(low, high, __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15)) * scale;
    std::memcpy(x + j, &v0, sizeof v0);
    std::memcpy(x + j + 8, &v1, sizeof v1);
  }
  return j;
}
#else
inline std::size_t decode_first_shuffled(std::size_t, const uint8_t*, float, float*) { return 0; }
#endif

inline void decode_first(std::size_t len, const uint8_t* __restrict q, float scale,
                         float* __restrict x) {
  const std::size_t done = decode_first_shuffled(len, q, scale, x);  // even
  q += done / 2;
  x += done;
  len -= done;
  for (std::size_t j = 0; j < len / 2; ++j) std::memcpy(x + 2 * j, &kDynamicPairs.of[q[j]], sizeof(DynamicPair));
  if (len & 1) x[len - 1] = kDynamic[q[len / 2] & 15u];
  for (std::size_t j = 0; j < len; ++j) x[j] *= scale;
}

// `len` values of a tile's row of the second moment: the row's maximum `rmax`, the tile's
// column maxima `cmax`.
inline void decode_second(std::size_t len, const uint8_t* __restrict q, float rmax,
                          const float* __restrict cmax, float* __restrict x) {
  for (std::size_t j = 0; j < len / 2; ++j) {
    const uint32_t b = q[j];
    x[2 * j] = pow2_value(b & 15u) * min(rmax, cmax[2 * j]);
    x[2 * j + 1] = pow2_value(b >> 4) * min(rmax, cmax[2 * j + 1]);
  }
  if (len & 1) x[len - 1] = pow2_value(q[len / 2] & 15u) * min(rmax, cmax[len - 1]);
}

// The codes of `len` first-moment values whose block extreme is `scale`; for odd len the
// last byte's high nibble is 0.
inline void encode_first(std::size_t len, const float* __restrict x, float scale,
                         uint8_t* __restrict q) {
  const float d = divisor(scale);
  for (std::size_t j = 0; j < len / 2; ++j)
    q[j] = static_cast<uint8_t>(nearest_dynamic(x[2 * j] / d) | (nearest_dynamic(x[2 * j + 1] / d) << 4));
  if (len & 1) q[len / 2] = static_cast<uint8_t>(nearest_dynamic(x[len - 1] / d));
}

// The codes of a tile's row of second-moment values (rank-1 scales).
inline void encode_second(std::size_t len, const float* __restrict x, float rmax,
                          const float* __restrict cmax, uint8_t* __restrict q) {
  for (std::size_t j = 0; j < len / 2; ++j)
    q[j] = static_cast<uint8_t>(
        nearest_pow2(x[2 * j] / divisor(min(rmax, cmax[2 * j]))) |
        (nearest_pow2(x[2 * j + 1] / divisor(min(rmax, cmax[2 * j + 1]))) << 4));
  if (len & 1)
    q[len / 2] = static_cast<uint8_t>(nearest_pow2(x[len - 1] / divisor(min(rmax, cmax[len - 1]))));
}

// The rows of a tile of `len` params.
SMARTINF_HD inline std::size_t tile_rows(std::size_t len) { return (len + kQuant4Block - 1) / kQuant4Block; }
SMARTINF_HD inline std::size_t row_len(std::size_t len, std::size_t r) {
  const std::size_t left = len - r * kQuant4Block;
  return left < kQuant4Block ? left : kQuant4Block;
}

// Codes a tile's second moment (`len` values, v >= 0) with its rank-1 scales: 128 row maxima
// then 128 column maxima at `scales` (rows and columns the tile lacks: 0).
inline void quantize_second_tile(std::size_t len, const float* x, uint8_t* q, float* scales) {
  int32_t rbits[kQuant4Block] = {}, cbits[kQuant4Block] = {};
  for (std::size_t r = 0; r < tile_rows(len); ++r) {
    const std::size_t at = r * kQuant4Block, rl = row_len(len, r);
    int32_t m = 0;
    for (std::size_t j = 0; j < rl; ++j) {
      const int32_t a = magnitude(x[at + j]);
      m = a > m ? a : m;
      cbits[j] = a > cbits[j] ? a : cbits[j];
    }
    rbits[r] = m;
  }
  for (std::size_t i = 0; i < kQuant4Block; ++i) {
    scales[i] = float_of(static_cast<uint32_t>(rbits[i]));
    scales[kQuant4Block + i] = float_of(static_cast<uint32_t>(cbits[i]));
  }
  for (std::size_t r = 0; r < tile_rows(len); ++r)
    encode_second(row_len(len, r), x + r * kQuant4Block, scales[r], scales + kQuant4Block,
                  q + r * kQuant4Block / 2);
}

// Codes a block of the first moment; its extreme (signed) becomes *scale.
inline void quantize_first_block(std::size_t len, const float* x, uint8_t* q, float* scale) {
  Extreme e;
  for (std::size_t j = 0; j < len; ++j) e.add(x[j]);
  *scale = e.scale();
  encode_first(len, x, *scale, q);
}

}  // namespace q4

// The int4 format for kernels/quantized.h's one update, a tile at a time (the second
// moment's scales need the whole tile's new values before any is coded; a first-moment
// block is a tile's row): moment k of params [lo, lo + len) (lo a whole number of tiles in)
// decoded to the fp32 values the rule reads; the values it leaves tracked for their
// maxima in the update's loop, each row's first moment coded after the row, the second
// moment after the tile.
struct Int4Format {
  using States = Int4States;
  static constexpr std::size_t kPiece = kQuant4Tile;
  static constexpr std::size_t kRow = kQuant4Block;
  static constexpr bool kKeepsRoot = false;

  static void decode(const States& s, unsigned k, std::size_t lo, std::size_t len, float* x) {
    constexpr std::size_t B = kQuant4Block;
    const float* rmax = k == 1 ? s.scale[1] + lo / kQuant4Tile * 2 * B : nullptr;
    for (std::size_t r = 0; r < q4::tile_rows(len); ++r) {
      const std::size_t at = r * B, rl = q4::row_len(len, r);
      if (k == 0)
        q4::decode_first(rl, s.code[0] + (lo + at) / 2, s.scale[0][(lo + at) / B], x + at);
      else
        q4::decode_second(rl, s.code[1] + (lo + at) / 2, rmax[r], rmax + B, x + at);
    }
  }

  // A row's first-moment extreme, its second moment's maximum, and the tile's column maxima
  // (float bits).
  struct Row {
    q4::Extreme m;
    int32_t v = 0;
    int32_t* __restrict columns;
    template <bool Two>
    __attribute__((always_inline)) void add(std::size_t j, float mj, float vj) {
      m.add(mj);
      if (!Two) return;
      const int32_t a = q4::magnitude(vj);
      v = a > v ? a : v;
      columns[j] = a > columns[j] ? a : columns[j];
    }
  };

  struct Piece {
    int32_t rows[kQuant4Block] = {}, columns[kQuant4Block] = {};  // rows and columns it lacks: 0
    Row row() { return {{}, 0, columns}; }
    // The row's first moment coded (its extreme the block's scale); its second moment's
    // maximum kept for the tile.
    void close_row(const States& s, unsigned, std::size_t lo, std::size_t at, std::size_t len, const Row& r,
                   const float* m, const float*) {
      const float scale = s.scale[0][(lo + at) / kQuant4Block] = r.m.scale();
      q4::encode_first(len, m + at, scale, s.code[0] + (lo + at) / 2);
      rows[at / kQuant4Block] = r.v;
    }
    // The tile's second moment coded with its rank-1 scales: 128 row maxima, 128 column maxima.
    void close(const States& s, unsigned moments, std::size_t lo, std::size_t len, const float* v) const {
      if (moments < 2) return;
      float* scales = s.scale[1] + lo / kQuant4Tile * 2 * kQuant4Block;
      for (std::size_t i = 0; i < kQuant4Block; ++i) {
        scales[i] = float_of(static_cast<uint32_t>(rows[i]));
        scales[kQuant4Block + i] = float_of(static_cast<uint32_t>(columns[i]));
      }
      for (std::size_t r = 0; r < q4::tile_rows(len); ++r)
        q4::encode_second(q4::row_len(len, r), v + r * kQuant4Block, scales[r], scales + kQuant4Block,
                          s.code[1] + (lo + r * kQuant4Block) / 2);
    }
  };
};

Int4Format format_of(const Int4States&);  // kernels/quantized.h's FormatOf

// A rule's fp32 arrays (param, then its `moments` states; a null one is `fill`) -> int4
// states (the fp32 param skipped when the states hold none: a split master). The second
// moment is Adam's exp_avg_sq itself.
inline void import_quantized(const Int4States& s, std::size_t n, unsigned moments,
                             const float* const* from, const float* fill) {
  constexpr std::size_t B = kQuant4Block;
  float x[kQuant4Tile];
  for (std::size_t t = 0; t * kQuant4Tile < n; ++t) {
    const std::size_t lo = t * kQuant4Tile;
    const std::size_t len = n - lo < kQuant4Tile ? n - lo : kQuant4Tile;
    for (std::size_t j = 0; j < len && s.param; ++j) s.param[lo + j] = from[0] ? from[0][lo + j] : fill[0];
    for (unsigned k = 0; k < moments; ++k) {
      for (std::size_t j = 0; j < len; ++j) x[j] = from[k + 1] ? from[k + 1][lo + j] : fill[k + 1];
      if (k == 0) {
        for (std::size_t r = 0; r < q4::tile_rows(len); ++r)
          q4::quantize_first_block(q4::row_len(len, r), x + r * B, s.code[0] + (lo + r * B) / 2,
                                   s.scale[0] + lo / B + r);
      } else {
        q4::quantize_second_tile(len, x, s.code[1] + lo / 2, s.scale[1] + t * 2 * B);
      }
    }
  }
}

// int4 states -> fp32 arrays (the second moment as exp_avg_sq); a null array, and the param
// when the states hold none (a split master), is skipped.
inline void export_quantized(const Int4States& s, std::size_t n, unsigned moments, float* const* to) {
  constexpr std::size_t B = kQuant4Block;
  for (std::size_t lo = 0; lo < n; lo += B) {
    const std::size_t len = n - lo < B ? n - lo : B;
    const std::size_t t = lo / kQuant4Tile, r = lo % kQuant4Tile / B;
    if (to[0] && s.param)
      for (std::size_t j = 0; j < len; ++j) to[0][lo + j] = s.param[lo + j];
    if (moments > 0 && to[1]) q4::decode_first(len, s.code[0] + lo / 2, s.scale[0][lo / B], to[1] + lo);
    if (moments > 1 && to[2]) {
      const float* rmax = s.scale[1] + t * 2 * B;
      q4::decode_second(len, s.code[1] + lo / 2, rmax[r], rmax + B, to[2] + lo);
    }
  }
}

#if defined(__CUDACC__)
namespace q4 {
static __constant__ Map<16> kDynamicOnGpu = map_of(kDynamic);
}  // namespace q4

// The GPU's piece of int4 (device/cuda_update.cu's quantized_kernel runs it, the scheme
// there): a piece is a tile of kQuant4Block rows; a row is a first-moment
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
    const bool full;     // all its rows: no param outside it
    float* const rmax;   // the tile's row maxima, then its column maxima (null: one moment)
    float map;           // the map's value at this lane (& 15): lanes read the map by shuffles
    float c_old[kEach];  // the old column maxima of this lane's columns
    int32_t columns[kEach] = {};

    __device__ Piece(const States& st, std::size_t l, std::size_t n, bool f)
        : s(st), lo(l), len(n), full(f), rmax(st.scale[1] ? st.scale[1] + l / kQuant4Tile * 2 * kRow : nullptr),
          map(q4::kDynamicOnGpu.at[threadIdx.x % 16]) {
      for (unsigned e = 0; e < kEach; ++e) c_old[e] = rmax ? rmax[kRow + e * 32 + threadIdx.x % 32] : 0.0f;
    }
    __device__ bool has(std::size_t i) const { return full || i < lo + len; }
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
      if (!has(at)) {  // a row the tile lacks: its maximum 0
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
        const bool here = has(i);
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
          const bool here = has(i);
          const float d = here ? kernels::q4::divisor(kernels::q4::min(rmax[r], c_max[e])) : 1.0f;
          store_nibbles(s.code[1] + i / 2, here ? kernels::q4::nearest_pow2(later[r * kRow + e * 32 + lane] / d) : 0u, here);
        }
      }
    }
  };
  __device__ static Piece piece(const States& s, std::size_t lo, std::size_t len, bool full) {
    return {s, lo, len, full};
  }
};
Int4Tiles gpu_format_of(const Int4States&);  // device/cuda_update.cu's
#endif

}  // namespace smartinf::kernels
