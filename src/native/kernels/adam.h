// Adam / AdamW element-wise update, written once for the CPU device and the HLS kernels.
// Operation order follows torch.optim.Adam's single-tensor path so fp32 results agree
// to rounding: lerp for exp_avg, addcmul for exp_avg_sq, addcdiv for the param.
#pragma once
#include <cmath>
#include <cstddef>

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
inline float lerp(float self, float end, float weight) {
  return SmallWeight ? self + weight * (end - self) : end - (end - self) * (1.0f - weight);
}

// One element: the updated param from the (unscaled) gradient g, the param p and the old
// moments; the new moments go to m and v, and sqrt(v) (the root the step divides by
// before bias correction) to root. Shared by the fp32 and the int8 state kernels.
template <bool Decoupled, bool SmallWeight>
inline float adam_element(float g, float p, float m_old, float v_old, const AdamStep& s,
                          float& m, float& v, float& root) {
  if (Decoupled)
    p = p * s.decay;
  else
    g = g + s.weight_decay * p;
  m = lerp<SmallWeight>(m_old, g, s.one_minus_beta1);
  v = v_old * s.beta2 + s.one_minus_beta2 * g * g;
  root = std::sqrt(v);
  const float denom = root / s.bias2_sqrt + s.eps;
  return p + s.neg_step_size * (m / denom);
}

template <bool Decoupled, bool SmallWeight, class G, class P>
inline void adam_range(std::size_t n, float* __restrict param, float* __restrict exp_avg,
                       float* __restrict exp_avg_sq, const G* __restrict grad,
                       P* __restrict out, const AdamStep& s) {
  for (std::size_t i = 0; i < n; ++i) {
    float m, v, root;
    const float p = adam_element<Decoupled, SmallWeight>(to_float(grad[i]) * s.grad_scale,
                                                         param[i], exp_avg[i], exp_avg_sq[i],
                                                         s, m, v, root);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    out[i] = from_float<P>(p);
  }
}

template <class G, class P>
inline void adam(std::size_t n, float* param, float* exp_avg, float* exp_avg_sq,
                 const G* grad, P* out, const AdamStep& s) {
  const bool small = std::fabs(s.one_minus_beta1) < 0.5f;
  if (s.decoupled && small)
    adam_range<true, true>(n, param, exp_avg, exp_avg_sq, grad, out, s);
  else if (s.decoupled)
    adam_range<true, false>(n, param, exp_avg, exp_avg_sq, grad, out, s);
  else if (small)
    adam_range<false, true>(n, param, exp_avg, exp_avg_sq, grad, out, s);
  else
    adam_range<false, false>(n, param, exp_avg, exp_avg_sq, grad, out, s);
}

}  // namespace smartinf::kernels
