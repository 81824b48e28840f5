// Element types of gradients and params, and exact fp16/bf16 <-> fp32 conversions.
// Branch-free bit formulas (fp16: those of the FP16 library used by PyTorch's c10) so loops
// vectorise on a baseline ISA and HLS synthesises them. fp16 rounds to nearest-even, as
// torch's `.to(torch.float16)`. bf16 rounds to nearest with ties away from zero: the rule a
// split master can be rebuilt from (kernels/split_master.h; nearest-even cannot be at exact
// ties), used for every bf16 param so that a split master and an fp32 one give the same
// bits. It differs from torch's `.to(torch.bfloat16)` only at exact ties (low 16 bits
// 0x8000, one value in 65536), by one bf16 ulp; smartinf.rounding.to_bf16 is it in torch.
#pragma once
#include <cstdint>
#include <cstring>

// The element-wise kernels are host and device functions where CUDA compiles them (the GPU
// device runs the same source); elsewhere the mark is empty.
#if defined(__CUDACC__)
#define SMARTINF_HD __host__ __device__
#else
#define SMARTINF_HD
#endif

namespace smartinf::kernels {

enum class DType : uint8_t { f32 = 0, f16 = 1, bf16 = 2 };

SMARTINF_HD inline unsigned dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

SMARTINF_HD inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
SMARTINF_HD inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Unsigned a < b through a signed compare: baseline SSE2 has only signed 32-bit compares,
// so this form lets the conversions below vectorise.
SMARTINF_HD inline bool below(uint32_t a, uint32_t b) {
  return static_cast<int32_t>(a ^ 0x80000000u) < static_cast<int32_t>(b ^ 0x80000000u);
}

// a < b ? x : y without a branch, for the vectoriser.
SMARTINF_HD inline uint32_t select_below(uint32_t a, uint32_t b, uint32_t x, uint32_t y) {
  const uint32_t mask = 0u - static_cast<uint32_t>(below(a, b));
  return (x & mask) | (y & ~mask);
}

SMARTINF_HD inline float to_float(float x) { return x; }

SMARTINF_HD inline float to_float(bf16 x) { return float_of(static_cast<uint32_t>(x.bits) << 16); }

SMARTINF_HD inline float to_float(f16 x) {
  const uint32_t w = static_cast<uint32_t>(x.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude =
      select_below(two_w, 1u << 27, bits_of(denormalized), bits_of(normalized));
  return float_of(sign | magnitude);
}

template <class T> SMARTINF_HD T from_float(float x);

template <> SMARTINF_HD inline float from_float<float>(float x) { return x; }

template <> SMARTINF_HD inline bf16 from_float<bf16>(float x) {
  const uint32_t u = bits_of(x);
  if (x != x) return bf16{0x7FC0};  // NaN stays a quiet NaN
  return bf16{static_cast<uint16_t>((u + 0x8000u) >> 16)};
}

template <> SMARTINF_HD inline f16 from_float<f16>(float x) {
  float base = (__builtin_fabsf(x) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bits_of(x);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = select_below(bias, 0x71000000u, 0x71000000u, bias);
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits_of(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  return f16{static_cast<uint16_t>((sign >> 16) | select_below(0xFF000000u, shl1_w, 0x7E00u, nonsign))};
}

// Calls fn(G{}, P{}) for the runtime (grad, param) dtype pair: values of the element
// types as tags, so fn is a generic lambda that takes them as `auto`.
template <class Fn>
inline void dispatch(DType grad, DType param, Fn&& fn) {
  auto with_param = [&](auto g) {
    using G = decltype(g);
    switch (param) {
      case DType::f32: fn(G{}, float{}); break;
      case DType::f16: fn(G{}, f16{}); break;
      case DType::bf16: fn(G{}, bf16{}); break;
    }
  };
  switch (grad) {
    case DType::f32: with_param(float{}); break;
    case DType::f16: with_param(f16{}); break;
    case DType::bf16: with_param(bf16{}); break;
  }
}

}  // namespace smartinf::kernels
