// The body of cpu_update.h's entries, for moments format M: included by their units only.
// Each entry is compiled for the portable baseline, for AVX2 and for AVX-512 (x86-64-v4) and
// picked when the library loads (GCC function multi-versioning; `flatten` inlines every
// kernel into each clone). The same IEEE operations (no FMA contraction), so all give the
// same bits; AVX2 halves the time of the quantized kernels, AVX-512's wider registers take
// another third off (bench/test_kernels.py).
#pragma once
#include <algorithm>
#include <stdexcept>
#include <type_traits>

#include "device/cpu_update.h"
#include "kernels/rules.h"
#include "kernels/split_master.h"
#include "store/checksum.h"

namespace smartinf::device {

// The rule's kernel on params [lo, lo + n) of a chunk of `numel` whose states are at
// `states`, in moments format M: fp32 masters at `master` (lo's) and the params emitted to
// `out`, or (quantized moments) `masters` (kernels::Fp32Masters or SplitMasters, lo's).
template <store::Moments M, class G, class Masters>
void run_quantized(const Kernel& k, const store::StateLayout& layout, void* states, size_t numel,
                   size_t lo, size_t n, const G* grad, const Masters& masters) {
  kernels::run_rule_quantized(k.step, n, layout.quantized_at<M>(states, numel).from(lo), grad, masters);
}

template <store::Moments M, class G, class P>
void run_moments(const Kernel& k, const store::StateLayout& layout, void* states, size_t numel,
                 size_t lo, size_t n, float* master, const G* grad, P* out) {
  if constexpr (M != store::Moments::fp32) {
    run_quantized<M>(k, layout, states, numel, lo, n, grad, kernels::Fp32Masters<P>{master, out});
  } else {
    float* arrays[kMaxStateArrays] = {master};  // the master, then the rule's states
    for (unsigned a = 1; a < layout.arrays; ++a) arrays[a] = layout.array(states, numel, a) + lo;
    kernels::run_rule(k.step, n, arrays, grad, out);
  }
}

// A split master's piece of `len` params at lo: rebuilt, updated and split in the kernel's
// loop (quantized moments), or through an fp32 buffer (fp32 moments: their kernels take
// arrays).
template <store::Moments M, class G>
void run_split(const Kernel& k, const store::StateLayout& layout, void* states, size_t numel,
               size_t lo, size_t len, const G* grad, kernels::bf16* params, uint16_t* low) {
  const bool adopt = k.adopt || k.sent_sums;
  if constexpr (M != store::Moments::fp32) {
    if (adopt)
      return run_quantized<M>(k, layout, states, numel, lo, len, grad, kernels::SplitMasters<true>{params, low});
    return run_quantized<M>(k, layout, states, numel, lo, len, grad, kernels::SplitMasters<false>{params, low});
  } else {
    float master[kSplitPiece];
    kernels::rebuild_masters(len, params, low, adopt, master);
    run_moments<M>(k, layout, states, numel, lo, len, master, grad, params);
    kernels::split_masters(len, master, params, low);
  }
}

template <store::Moments M>
inline void run_update_as(const Slot& s, const Kernel& k, DType grad, size_t n,
                          const store::StateLayout& layout, size_t numel, size_t lo) {
  kernels::dispatch(grad, k.param, [&](auto g, auto p) {
    using P = decltype(p);
    const auto* gp = static_cast<const decltype(g)*>(s.grad);
    auto* op = static_cast<P*>(s.out);
    if (!layout.split())
      return run_moments<M>(k, layout, s.states, numel, lo, n, layout.fp32_master(s.states) + lo, gp, op);
    if constexpr (std::is_same_v<P, kernels::bf16>) {
      uint16_t* low = layout.split_at(s.states, numel).low + lo;
      for (size_t at = 0; at < n; at += kSplitPiece) {
        const size_t len = std::min(kSplitPiece, n - at);
        if (k.sent_sums) k.sent_sums[(lo + at) / kSplitPiece] = store::params_piece_sum(op + at, len);
        run_split<M>(k, layout, s.states, numel, lo + at, len, gp + at, op + at, low + at);
        if (k.params_sums) k.params_sums[(lo + at) / kSplitPiece] = store::params_piece_sum(op + at, len);
      }
    } else {
      throw std::logic_error("a split master needs bfloat16 params");
    }
  });
}

}  // namespace smartinf::device

// The ISAs each entry is compiled for: the unit (CMakeLists.txt) says whether AVX-512 is one
// (SMARTINF_CPU_ISA=avx2 leaves it out, to time an AVX2-only CPU on a newer one).
#if defined(SMARTINF_CPU_UPDATE_AVX512) && !SMARTINF_CPU_UPDATE_AVX512
#define SMARTINF_CPU_CLONES "avx2", "default"
#else
#define SMARTINF_CPU_CLONES "arch=x86-64-v4", "avx2", "default"
#endif

// One entry of cpu_update.h: `name` runs moments format `moments`.
#define SMARTINF_CPU_UPDATE(name, moments)                                                     \
  namespace smartinf::device {                                                                 \
  __attribute__((target_clones(SMARTINF_CPU_CLONES), flatten)) void name(                      \
      const Slot& s, const Kernel& k, DType grad, size_t n, const store::StateLayout& layout,  \
      size_t numel, size_t lo) {                                                               \
    run_update_as<moments>(s, k, grad, n, layout, numel, lo);                                  \
  }                                                                                            \
  }
