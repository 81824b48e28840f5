// 8-bit block-wise optimizer states (after Dettmers et al., "8-bit Optimizers via
// Block-wise Quantization", ICLR 2022), written once for the CPU device and HLS: the code,
// and the format kernels/quantized.h's update runs the rules whose row allows int8 on. Where the
// codes and scales sit is store/layout.h's (Int8States).
//
// Each block of 256 values (store::kQuantBlock) is divided by its absolute maximum (kept as
// fp32) and coded on a non-linear, logarithmic 8-bit map, so small states keep their relative
// precision, as with the paper's dynamic map. Instead of its base-10 "dynamic tree" table
// (decoded by lookup, encoded by a binary search), the code is a small float: exponent
// bits and 3 mantissa bits, rounded to nearest-even. It is computed with integer and
// float operations only, so it vectorises on the baseline ISA, maps onto FPGA logic
// without a table, and is reproduced exactly by the numpy reference in the tests.
//
// A rule's int8 moments, in the order of its state arrays: the first is a momentum (Adam's
// and Lion's exp_avg), signed; a second is a second moment (Adam's exp_avg_sq), kept as its
// root, unsigned:
//   exp_avg:             sign + 4 exponent bits + 3 mantissa bits: 2^-17 .. 1 of the block max
//   sqrt(exp_avg_sq):    5 exponent bits + 3 mantissa bits:      2^-33 .. 1 of the block max
// The second moment is kept as its square root (what the update divides by): half the
// dynamic range to cover, and a relative error of at most 1/16 in the denominator from
// 2^-30 of the block max up (below, subnormal codes: at most 2^-33 of the max). A
// positive one never rounds to 0 (that would turn m / (sqrt(v) + eps) into m / eps).
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

// The int8 layout's names, owned by store/layout.h.
using store::Int8States;
using store::kQuantBlock;
using store::quant_blocks;

// Branch-free (selects by masks) so GCC vectorises the loops that call these.
SMARTINF_HD inline uint32_t select(bool take_a, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(take_a);
  return (a & mask) | (b & ~mask);
}

// Magnitude a in [0, 1] -> code: ((exponent + Bias) << 3) + mantissa, or below 2^(1-Bias)
// the subnormal multiples of 2^(-Bias-2). Round to nearest-even; a mantissa rounding up
// to 8 carries into the exponent, which is the right code.
template <int Bias>
SMARTINF_HD inline uint32_t encode_magnitude(float a) {
  constexpr float kSubScale = float(uint64_t(1) << (Bias + 2));  // one subnormal step -> 1
  const uint32_t b = bits_of(a);
  const bool subnormal = a < 1.0f / float(uint64_t(1) << (Bias - 1));
  // Below the smallest normal a * 2^(Bias+2) < 8, so adding 2^23 rounds it to an integer,
  // nearest-even, which the sum's low mantissa bits then are. Both paths are computed, in
  // unsigned integers (no float -> int conversion: nothing overflows where one is unused).
  const uint32_t sub = bits_of(a * kSubScale + 8388608.0f) - 0x4b000000u;
  // ((exponent + Bias - 127) << 3) + the rounded 3 mantissa bits, one add: a carry of the
  // rounding goes into the exponent.
  const uint32_t normal = ((b + 0x7ffffu + ((b >> 20) & 1u)) >> 20) - ((127u - Bias) << 3);
  return select(subnormal, sub, normal);
}

// Code -> the float bits of its magnitude: (code << 20) is exponent | mantissa in place.
template <int Bias>
SMARTINF_HD inline uint32_t decode_magnitude_bits(uint32_t code) {
  const float sub = static_cast<float>(static_cast<int32_t>(code & 7u)) * (1.0f / float(uint64_t(1) << (Bias + 2)));
  return select(code < 8u, bits_of(sub), (code << 20) + ((127u - Bias) << 23));
}

template <int Bias>
SMARTINF_HD inline float decode_magnitude(uint32_t code) {
  return float_of(decode_magnitude_bits<Bias>(code));
}

inline constexpr int kSignedBias = 15;    // exp_avg: 4 exponent bits
inline constexpr int kUnsignedBias = 31;  // sqrt(exp_avg_sq): 5 exponent bits

// `inv_scale` is 1 / (block maximum), rounded to float: one division per block instead of
// one per value. |x| * inv_scale may then exceed 1 by an ulp, which codes as 1.
SMARTINF_HD inline uint8_t encode_signed(float x, float inv_scale) {
  const uint32_t sign = (bits_of(x) >> 24) & 0x80u;
  return static_cast<uint8_t>(sign | encode_magnitude<kSignedBias>(std::fabs(x) * inv_scale));
}

SMARTINF_HD inline float decode_signed(uint8_t c, float scale) {
  const float a = decode_magnitude<kSignedBias>(c & 0x7fu) * scale;
  return float_of(bits_of(a) | (uint32_t(c & 0x80u) << 24));
}

SMARTINF_HD inline uint8_t encode_unsigned(float x, float inv_scale) {
  const uint32_t c = encode_magnitude<kUnsignedBias>(x * inv_scale);
  return static_cast<uint8_t>(c + static_cast<uint32_t>((c == 0) & (x > 0.0f)));
}

SMARTINF_HD inline float decode_unsigned(uint8_t c, float scale) {
  return decode_magnitude<kUnsignedBias>(c) * scale;
}

// Largest magnitude, as the bits of a non-negative float: their bit patterns order like
// their values, and an integer max reduction vectorises where a float one needs -ffast-math.
SMARTINF_HD inline int32_t magnitude_bits(float x) { return static_cast<int32_t>(bits_of(x) & 0x7fffffffu); }

// Codes `n` <= kQuantBlock values of a signed moment (or of a non-negative root,
// sqrt(exp_avg_sq): Signed false) against their block maximum.
template <bool Signed>
inline void encode_block(std::size_t n, const float* x, float max, uint8_t* q) {
  if (max > 0.0f) {
    const float inv = 1.0f / max;
    for (std::size_t i = 0; i < n; ++i) q[i] = Signed ? encode_signed(x[i], inv) : encode_unsigned(x[i], inv);
  } else {
    std::memset(q, 0, n);
  }
}

// One block of moment k (0: signed, 1: root): its maximum becomes the scale, then the codes.
inline void quantize_block(unsigned k, std::size_t n, const float* x, uint8_t* q, float* scale) {
  int32_t bits = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const int32_t a = magnitude_bits(x[i]);
    bits = a > bits ? a : bits;
  }
  *scale = float_of(static_cast<uint32_t>(bits));
  if (k == 0)
    encode_block<true>(n, x, *scale, q);
  else
    encode_block<false>(n, x, *scale, q);
}

// The int8 format for kernels/quantized.h's one update: moment k of params [lo, lo + len)
// (lo a whole number of blocks in) decoded to the fp32 values the rule reads; a row (a
// block) of the values it leaves (a second moment: its root, AdamResult::root) tracked for
// its maxima in the update's loop, then coded.
struct Int8Format {
  using States = Int8States;
  static constexpr std::size_t kPiece = 8 * kQuantBlock;  // params decoded at once
  static constexpr std::size_t kRow = kQuantBlock;        // params sharing their scales
  static constexpr bool kKeepsRoot = true;

  static void decode(const States& s, unsigned k, std::size_t lo, std::size_t len, float* __restrict x) {
    for (std::size_t at = 0; at < len; at += kQuantBlock) {
      const std::size_t bl = len - at < kQuantBlock ? len - at : kQuantBlock;
      const float scale = s.scale[k][(lo + at) / kQuantBlock];
      const uint8_t* __restrict q = s.code[k] + lo + at;
      float* __restrict y = x + at;
      if (k == 0) {
        for (std::size_t j = 0; j < bl; ++j) y[j] = decode_signed(q[j], scale);
      } else {
        for (std::size_t j = 0; j < bl; ++j) {
          const float w = decode_unsigned(q[j], scale);
          y[j] = w * w;
        }
      }
    }
  }

  // A row's largest magnitudes (float bits) of each moment.
  struct Row {
    int32_t m = 0, v = 0;
    template <bool Two>
    __attribute__((always_inline)) void add(std::size_t, float mj, float vj) {
      const int32_t a = magnitude_bits(mj), b = magnitude_bits(vj);
      m = a > m ? a : m;
      if (Two) v = b > v ? b : v;
    }
  };

  struct Piece {
    Row row() const { return {}; }
    // The row of `len` new values at m + at, v + at (params lo + at ..) coded: the maxima
    // are its scales.
    void close_row(const States& s, unsigned moments, std::size_t lo, std::size_t at, std::size_t len,
                   const Row& r, const float* m, const float* v) const {
      const std::size_t b = (lo + at) / kQuantBlock;
      s.scale[0][b] = float_of(static_cast<uint32_t>(r.m));
      encode_block<true>(len, m + at, s.scale[0][b], s.code[0] + lo + at);
      if (moments < 2) return;
      s.scale[1][b] = float_of(static_cast<uint32_t>(r.v));
      encode_block<false>(len, v + at, s.scale[1][b], s.code[1] + lo + at);
    }
    void close(const States&, unsigned, std::size_t, std::size_t, const float*) const {}
  };
};
Int8Format format_of(const Int8States&);  // kernels/quantized.h's FormatOf

// A rule's fp32 arrays (param, then its `moments` states; a null one is `fill`) -> int8
// states (the fp32 param skipped when the states hold none: a split master). A second moment (exp_avg_sq) is coded as its root.
inline void import_quantized(const Int8States& s, std::size_t n, unsigned moments,
                             const float* const* from, const float* fill) {
  float x[kQuantBlock];
  for (std::size_t b = 0; b * kQuantBlock < n; ++b) {
    const std::size_t lo = b * kQuantBlock, len = n - lo < kQuantBlock ? n - lo : kQuantBlock;
    for (std::size_t j = 0; j < len && s.param; ++j) s.param[lo + j] = from[0] ? from[0][lo + j] : fill[0];
    for (unsigned k = 0; k < moments; ++k) {
      for (std::size_t j = 0; j < len; ++j) {
        const float v = from[k + 1] ? from[k + 1][lo + j] : fill[k + 1];
        x[j] = k == 0 ? v : std::sqrt(v);
      }
      quantize_block(k, len, x, s.code[k] + lo, s.scale[k] + b);
    }
  }
}

// int8 states -> fp32 arrays (a second moment as the square of the decoded root); a null
// array, and the param when the states hold none (a split master), is skipped.
inline void export_quantized(const Int8States& s, std::size_t n, unsigned moments, float* const* to) {
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t b = i / kQuantBlock;
    if (to[0] && s.param) to[0][i] = s.param[i];
    if (moments > 0 && to[1]) to[1][i] = decode_signed(s.code[0][i], s.scale[0][b]);
    if (moments > 1 && to[2]) {
      const float r = decode_unsigned(s.code[1][i], s.scale[1][b]);
      to[2][i] = r * r;
    }
  }
}

#if defined(__CUDACC__)
// The GPU's piece of int8 (device/cuda_update.cu's quantized_kernel runs it, the scheme
// there): rows of kQuantBlock params, each with its own scales: a row's codes are written
// once its maxima are known.
struct Int8Rows {
  using States = Int8States;
  // Four warps a block, a row each (rows share nothing, so any count gives the same bits):
  // on the H100 114.5 G params/s, against 107.0 with eight, 106.0 with sixteen, 99.1 with
  // thirty-two (bench/measured/h100-cuda-quantized-kernels.txt).
  static constexpr unsigned kWarps = 4, kRow = kQuantBlock, kPieceRows = kWarps, kEach = kRow / 32;
  static constexpr bool kKeepsRoot = true;
  static constexpr std::size_t kLaterBytes = 0;  // nothing is coded after its row
  struct Shared {};

  struct Piece {
    const States s;
    const std::size_t lo, len;
    const bool full;  // all its rows: no param outside it
    __device__ bool has(std::size_t i) const { return full || i < lo + len; }
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
      if (!has(at)) return;
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
        if (!has(i)) continue;
        s.code[0][i] = m_max > 0.0f ? kernels::encode_signed(m[e], m_inv) : 0;
        if (Two) s.code[1][i] = w_max > 0.0f ? kernels::encode_unsigned(v[e], w_inv) : 0;
      }
    }
    template <bool Two>
    __device__ void close(Shared&, const float*) {}
  };
  __device__ static Piece piece(const States& s, std::size_t lo, std::size_t len, bool full) {
    return {s, lo, len, full};
  }
};
Int8Rows gpu_format_of(const Int8States&);  // device/cuda_update.cu's
#endif

}  // namespace smartinf::kernels
