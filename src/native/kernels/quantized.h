// The update on quantized moments, written once for every format (kernels/quant8.h's
// Int8Format, kernels/quant4.h's Int4Format) and every rule whose row allows them
// (kernels/rules.h), for the CPU device and HLS. A piece at a time: the format decodes the
// moments into fp32, the rule's own element (adam.h, lion.h) updates param and moments in
// fp32 as on fp32 states, the format codes the new moments (finding their scales). Each
// loop is plain and vectorises; a format is its decode, its encode and its piece.
#pragma once
#include <cstddef>

#include "kernels/adam.h"
#include "kernels/lion.h"
#include "kernels/numeric.h"
#include "kernels/quant4.h"
#include "kernels/quant8.h"

namespace smartinf::kernels {

template <class States> struct FormatOf;
template <> struct FormatOf<Int8States> { using type = Int8Format; };
template <> struct FormatOf<Int4States> { using type = Int4Format; };

// A rule's element on quantized moments: its moment count, its step's scalars, and one
// element updated in place (the second moment left as the format keeps it: v or its root).
template <bool Decoupled, bool SmallWeight>
struct AdamElement {
  static constexpr unsigned kMoments = 2;
  const AdamStep& k;
  template <bool KeepsRoot>
  __attribute__((always_inline)) float apply(float g, float p, float& m, float& v) const {
    const AdamResult r = adam_element<Decoupled, SmallWeight>(g, p, m, v, k);
    m = r.m;
    v = KeepsRoot ? r.root : r.v;
    return r.p;
  }
};

struct LionElement {
  static constexpr unsigned kMoments = 1;
  const LionStep& k;
  template <bool KeepsRoot>
  __attribute__((always_inline)) float apply(float g, float p, float& m, float&) const {
    const LionResult r = lion_element(g, p, m, k);
    m = r.m;
    return r.p;
  }
};

// n params of quantized states `s` (s.param: their fp32 masters), from their start.
template <class Format, class Element, class G, class P>
inline void update_quantized(std::size_t n, const typename Format::States& s, const G* grad, P* out,
                             const Element& e) {
  constexpr std::size_t kPiece = Format::kPiece;
  constexpr bool two = Element::kMoments > 1;
  float m[kPiece], v[two ? kPiece : 1];
  for (std::size_t lo = 0; lo < n; lo += kPiece) {
    const std::size_t len = n - lo < kPiece ? n - lo : kPiece;
    Format::decode(s, 0, lo, len, m);
    if (two) Format::decode(s, 1, lo, len, v);
    // The arrays do not overlap: say so, or GCC versions the loop with a runtime check.
    float* __restrict param = s.param + lo;
    float* __restrict mr = m;
    float* __restrict vr = v;
    const G* __restrict gr = grad + lo;
    P* __restrict o = out + lo;
    for (std::size_t j = 0; j < len; ++j) {
      const float p = e.template apply<Format::kKeepsRoot>(to_float(gr[j]) * e.k.grad_scale, param[j],
                                                            mr[j], vr[two ? j : 0]);
      param[j] = p;
      o[j] = from_float<P>(p);
    }
    Format::encode(s, 0, lo, len, m);
    if (two) Format::encode(s, 1, lo, len, v);
  }
}

template <class States, class G, class P>
inline void adam_quantized(std::size_t n, const States& s, const G* grad, P* out, const AdamStep& k) {
  with_adam_choices(k, [&](auto decoupled, auto small) {
    update_quantized<typename FormatOf<States>::type>(
        n, s, grad, out, AdamElement<decltype(decoupled)::value, decltype(small)::value>{k});
  });
}

template <class States, class G, class P>
inline void lion_quantized(std::size_t n, const States& s, const G* grad, P* out, const LionStep& k) {
  update_quantized<typename FormatOf<States>::type>(n, s, grad, out, LionElement{k});
}

}  // namespace smartinf::kernels
