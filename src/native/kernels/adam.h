// Adam / AdamW element-wise update, written once for the CPU device and the HLS kernels.
// Operation order follows torch.optim.Adam's single-tensor path so fp32 results agree
// to rounding: lerp for exp_avg, addcmul for exp_avg_sq, addcdiv for the param.
#pragma once
#include <cmath>
#include <cstddef>
#include <type_traits>

#include "kernels/numeric.h"

namespace smartinf::kernels {

// Per-step scalars, computed on the host in double and rounded to float as torch does.
struct AdamStep {
  float one_minus_beta1;  // lerp weight for exp_avg
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;     // Adam: L2 added to the gradient
  float decay;            // AdamW: 1 - lr * weight_decay applied to the param
  float neg_step_size;    // -lr / (1 - beta1^t)
  float bias2_sqrt;       // sqrt(1 - beta2^t)
  float grad_scale;       // 1 / loss scale
  bool decoupled;         // AdamW
};

inline AdamStep adam_step(double lr, double beta1, double beta2, double eps,
                          double weight_decay, bool decoupled, unsigned long step,
                          double grad_scale) {
  AdamStep s;
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(decoupled ? 0.0 : weight_decay);
  s.decay = static_cast<float>(decoupled ? 1.0 - lr * weight_decay : 1.0);
  s.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, double(step)))));
  s.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, double(step))));
  s.grad_scale = static_cast<float>(grad_scale);
  s.decoupled = decoupled;
  return s;
}

// torch.lerp's two formulas; torch picks one by |weight| < 0.5. The weight is fixed for a
// step, so the choice is a template argument: a branch inside the loop stops GCC from
// vectorising it.
template <bool SmallWeight>
SMARTINF_HD inline float lerp(float self, float end, float weight) {
  return SmallWeight ? self + weight * (end - self) : end - (end - self) * (1.0f - weight);
}

// One element: from the (unscaled) gradient g, the param p and the old moments, the
// updated param, the new moments, and sqrt(v) (the root the step divides by before bias
// correction). Shared by the fp32 and the int8 state kernels. Always inlined: a call left
// in the loop (GCC's inliner gives up in a unit with many kernels) stops vectorisation.
struct AdamResult {
  float p, m, v, root, v_max;
};

// AMSGrad (torch's amsgrad=True) divides by the root of the largest exp_avg_sq so far,
// v_max, kept as a fourth state.
template <bool Decoupled, bool SmallWeight, bool Amsgrad = false>
__attribute__((always_inline)) SMARTINF_HD inline AdamResult adam_element(float g, float p, float m_old, float v_old,
                                                                          const AdamStep& s, float v_max_old = 0.0f) {
  const float gd = Decoupled ? g : g + s.weight_decay * p;
  const float pd = Decoupled ? p * s.decay : p;
  const float m = lerp<SmallWeight>(m_old, gd, s.one_minus_beta1);
  const float v = v_old * s.beta2 + s.one_minus_beta2 * gd * gd;
  const float v_max = Amsgrad ? (v_max_old > v ? v_max_old : v) : v;
  const float root = std::sqrt(v_max);
  const float denom = root / s.bias2_sqrt + s.eps;
  return {pd + s.neg_step_size * (m / denom), m, v, root, v_max};
}

template <bool Decoupled, bool SmallWeight, bool Amsgrad, class G, class P>
SMARTINF_HD inline void adam_range(std::size_t n, float* __restrict param, float* __restrict exp_avg,
                                   float* __restrict exp_avg_sq, float* __restrict max_exp_avg_sq,
                                   const G* __restrict grad, P* __restrict out, const AdamStep& s) {
  for (std::size_t i = 0; i < n; ++i) {
    const AdamResult r = adam_element<Decoupled, SmallWeight, Amsgrad>(
        to_float(grad[i]) * s.grad_scale, param[i], exp_avg[i], exp_avg_sq[i], s,
        Amsgrad ? max_exp_avg_sq[i] : 0.0f);
    param[i] = r.p;
    exp_avg[i] = r.m;
    exp_avg_sq[i] = r.v;
    if (Amsgrad) max_exp_avg_sq[i] = r.v_max;
    out[i] = from_float<P>(r.p);
  }
}

// `max_exp_avg_sq`: AMSGrad's fourth array, or null (plain Adam).
template <bool Amsgrad, class G, class P>
SMARTINF_HD inline void adam_variant(std::size_t n, float* param, float* exp_avg, float* exp_avg_sq,
                                     float* max_exp_avg_sq, const G* grad, P* out, const AdamStep& s) {
  const bool small = std::fabs(s.one_minus_beta1) < 0.5f;
  if (s.decoupled && small)
    adam_range<true, true, Amsgrad>(n, param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, out, s);
  else if (s.decoupled)
    adam_range<true, false, Amsgrad>(n, param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, out, s);
  else if (small)
    adam_range<false, true, Amsgrad>(n, param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, out, s);
  else
    adam_range<false, false, Amsgrad>(n, param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, out, s);
}

// Calls f with Adam's two compile-time choices for the step (decoupled weight decay, lerp's
// formula) as std::bool_constant arguments: the dispatch of the quantized kernels and the
// CUDA launches (host code; adam_variant is this for the fp32 kernel, on either side).
template <class F>
inline void with_adam_choices(const AdamStep& s, F&& f) {
  const bool small = std::fabs(s.one_minus_beta1) < 0.5f;
  if (s.decoupled && small)
    f(std::true_type{}, std::true_type{});
  else if (s.decoupled)
    f(std::true_type{}, std::false_type{});
  else if (small)
    f(std::false_type{}, std::true_type{});
  else
    f(std::false_type{}, std::false_type{});
}

template <class G, class P>
SMARTINF_HD inline void adam(std::size_t n, float* param, float* exp_avg, float* exp_avg_sq,
                             const G* grad, P* out, const AdamStep& s) {
  adam_variant<false>(n, param, exp_avg, exp_avg_sq, nullptr, grad, out, s);
}

template <class G, class P>
SMARTINF_HD inline void adam_amsgrad(std::size_t n, float* param, float* exp_avg, float* exp_avg_sq,
                                     float* max_exp_avg_sq, const G* grad, P* out, const AdamStep& s) {
  adam_variant<true>(n, param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, out, s);
}

}  // namespace smartinf::kernels
