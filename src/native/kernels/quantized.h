// The update on quantized moments, written once for every format (kernels/quant8.h's
// Int8Format, kernels/quant4.h's Int4Format) and every rule whose row allows them
// (kernels/rules.h), for the CPU device and HLS (the GPU's kernel runs the same elements,
// device/cuda_update.cu). A piece at a time the format decodes the moments into fp32; row
// by row the rule's own element (adam.h, lion.h) updates param and moments in fp32 as on
// fp32 states, the row's maxima are found in that loop, and the format codes the row. Each
// loop is plain and vectorises; a format is its decode, its row (maxima) and its piece
// (coding), a rule its element, the masters a policy (Fp32Masters, SplitMasters).
#pragma once
#include <cstddef>
#include <utility>

#include "kernels/adam.h"
#include "kernels/lion.h"
#include "kernels/numeric.h"
#include "kernels/quant4.h"
#include "kernels/quant8.h"

namespace smartinf::kernels {

// A states type's format: each format's header declares its format_of.
template <class States>
using FormatOf = decltype(format_of(std::declval<States>()));

// A rule's element on quantized moments: its moment count, its step's scalars (a copy: the
// GPU's kernels take it as an argument), and one element updated in place (the second
// moment left as the format keeps it: v or its root). The CPU's update below and the GPU's
// (device/cuda_update.cu) run these.
template <bool Decoupled, bool SmallWeight>
struct AdamElement {
  static constexpr unsigned kMoments = 2;
  AdamStep k;
  template <bool KeepsRoot>
  __attribute__((always_inline)) SMARTINF_HD float apply(float g, float p, float& m, float& v) const {
    const AdamResult r = adam_element<Decoupled, SmallWeight>(g, p, m, v, k);
    m = r.m;
    v = KeepsRoot ? r.root : r.v;
    return r.p;
  }
};

// f(AdamElement<...>{k}) with Adam's two compile-time choices for step k (with_adam_choices):
// the one place an Adam step becomes its element.
template <class F>
inline void with_adam_element(const AdamStep& k, F&& f) {
  with_adam_choices(k, [&](auto decoupled, auto small) {
    f(AdamElement<decltype(decoupled)::value, decltype(small)::value>{k});
  });
}

struct LionElement {
  static constexpr unsigned kMoments = 1;
  LionStep k;
  template <bool KeepsRoot>
  __attribute__((always_inline)) SMARTINF_HD float apply(float g, float p, float& m, float&) const {
    const LionResult r = lion_element(g, p, m, k);
    m = r.m;
    return r.p;
  }
};

// The states' fp32 masters (s.param) as a kernel's masters, and the params emitted from
// them; kernels/split_master.h's SplitMasters are the other kind: from(lo) the masters of
// params lo.., get(i) one to update, put(i, m) it updated (and its param emitted).
template <class P>
struct Fp32Masters {
  float* __restrict master;
  P* __restrict out;
  Fp32Masters from(std::size_t lo) const { return {master + lo, out + lo}; }
  __attribute__((always_inline)) float get(std::size_t i) const { return master[i]; }
  __attribute__((always_inline)) void put(std::size_t i, float m) const {
    master[i] = m;
    out[i] = from_float<P>(m);
  }
};

// n params of quantized states `s` with masters `masters`, from their start: a piece's
// moments decoded, then row by row the rule's element on each param, the row's maxima
// found in the same loop (no pass of their own), and the format's coding of the row (and
// of the piece, for scales a whole piece shares).
template <class Format, class Element, class G, class Masters>
inline void update_quantized(std::size_t n, const typename Format::States& s, const G* grad,
                             const Masters& masters, const Element& e) {
  constexpr std::size_t kPiece = Format::kPiece, kRow = Format::kRow;
  constexpr bool two = Element::kMoments > 1;
  float m[kPiece], v[two ? kPiece : 1];
  for (std::size_t lo = 0; lo < n; lo += kPiece) {
    const std::size_t len = n - lo < kPiece ? n - lo : kPiece;
    Format::decode(s, 0, lo, len, m);
    if (two) Format::decode(s, 1, lo, len, v);
    typename Format::Piece piece;
    for (std::size_t at = 0; at < len; at += kRow) {
      const std::size_t rl = len - at < kRow ? len - at : kRow;
      // The arrays do not overlap: say so, or GCC versions the loop with a runtime check.
      const Masters ms = masters.from(lo + at);
      float* __restrict mr = m + at;
      float* __restrict vr = v + (two ? at : 0);
      const G* __restrict gr = grad + lo + at;
      typename Format::Row row = piece.row();
      for (std::size_t j = 0; j < rl; ++j) {
        float& mj = mr[j];
        float& vj = vr[two ? j : 0];
        ms.put(j, e.template apply<Format::kKeepsRoot>(to_float(gr[j]) * e.k.grad_scale, ms.get(j), mj, vj));
        row.template add<two>(j, mj, vj);
      }
      piece.close_row(s, Element::kMoments, lo, at, rl, row, m, v);
    }
    piece.close(s, Element::kMoments, lo, len, v);
  }
}

// Each rule's entry, for the HLS tops (compiled per rule, hls_kernels/update.h); the devices
// take the rule's element from kernels/rules.h's with_quantized_element.
template <class States, class G, class Masters>
inline void adam_quantized(std::size_t n, const States& s, const G* grad, const Masters& masters,
                           const AdamStep& k) {
  with_adam_element(k, [&](const auto& element) {
    update_quantized<FormatOf<States>>(n, s, grad, masters, element);
  });
}

template <class States, class G, class Masters>
inline void lion_quantized(std::size_t n, const States& s, const G* grad, const Masters& masters,
                           const LionStep& k) {
  update_quantized<FormatOf<States>>(n, s, grad, masters, LionElement{k});
}

}  // namespace smartinf::kernels
