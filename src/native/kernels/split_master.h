// A split fp32 master for bf16 params (store/layout.h, master "split"): bf16 is the upper
// half of an fp32, so the device stores only each master's low 16 bits and is sent the bf16
// param (the upper half, rounded) with the gradient. With bf16 rounded to nearest, ties away
// from zero (kernels/numeric.h), master - (param << 16) lies in [-2^15, 2^15): the low half
// is that difference, an int16, and param << 16 plus it is the master again, bit for bit
// (after Transformer Engine's FusedAdam(store_param_remainders=True)). A NaN master comes
// back as a NaN. Written once for the CPU device and HLS.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/numeric.h"

namespace smartinf::kernels {

SMARTINF_HD inline float rebuild_master(bf16 param, uint16_t low) {
  return float_of((static_cast<uint32_t>(param.bits) << 16) +
                  static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(low))));
}

// The low half of `master` given the bf16 param emitted for it (from_float<bf16>(master)).
SMARTINF_HD inline uint16_t master_low(float master, bf16 param) {
  return static_cast<uint16_t>(bits_of(master) - (static_cast<uint32_t>(param.bits) << 16));
}

// n masters from the params sent in and the stored low halves; `adopt`: the params are not
// all the ones emitted with these low halves (weights loaded or edited), so each param its
// low half does not round back to is taken as its master (an edited one that it does is
// within half an ulp of the edit: the master keeps those low bits, as an fp32 master keeps
// itself where an edit equals its rounding; edits.merge); the others' masters stay exact
// (a param emitted always rounds back from its master, so `adopt` costs those nothing).
SMARTINF_HD inline void rebuild_masters(std::size_t n, const bf16* param, const uint16_t* low, bool adopt,
                                        float* master) {
  if (adopt) {
    for (std::size_t i = 0; i < n; ++i) {
      const float m = rebuild_master(param[i], low[i]);
      master[i] = from_float<bf16>(m).bits == param[i].bits ? m : to_float(param[i]);
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) master[i] = rebuild_master(param[i], low[i]);
  }
}

// The low halves of n updated masters, whose bf16 params the kernel emitted.
SMARTINF_HD inline void split_masters(std::size_t n, const float* master, const bf16* param, uint16_t* low) {
  for (std::size_t i = 0; i < n; ++i) low[i] = master_low(master[i], param[i]);
}

// Split masters as a kernel's masters (kernels/quantized.h's Masters): each rebuilt as the
// update reads it and split as it writes it, in the update's own loop, where rebuilding
// into an fp32 buffer and splitting it after took two more passes over the piece
// (rebuild_masters' and split_masters' bits: the same operations on each element).
template <bool Adopt>
struct SplitMasters {
  bf16* __restrict param;  // sent in, then emitted
  uint16_t* __restrict low;
  SplitMasters from(std::size_t lo) const { return {param + lo, low + lo}; }
  __attribute__((always_inline)) float get(std::size_t i) const {
    const float m = rebuild_master(param[i], low[i]);
    return !Adopt || from_float<bf16>(m).bits == param[i].bits ? m : to_float(param[i]);
  }
  __attribute__((always_inline)) void put(std::size_t i, float master) const {
    const bf16 p = from_float<bf16>(master);
    param[i].bits = p.bits;  // a member's copy: GCC does not vectorise a struct's
    low[i] = master_low(master, p);
  }
};

}  // namespace smartinf::kernels
