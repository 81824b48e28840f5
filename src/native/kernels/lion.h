// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), element-wise,
// written once for the CPU device and the HLS kernels: one moment, the update is a sign.
//   c = beta1 * m + (1 - beta1) * g;  p = p * (1 - lr * wd) - lr * sign(c);
//   m = beta2 * m + (1 - beta2) * g
#pragma once
#include <cstddef>

#include "kernels/numeric.h"

namespace smartinf::kernels {

struct LionStep {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_lr;
  float decay;       // 1 - lr * weight_decay (decoupled, as AdamW)
  float grad_scale;  // 1 / loss scale
};

inline LionStep lion_step(double lr, double beta1, double beta2, double weight_decay,
                          double grad_scale) {
  LionStep s;
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.neg_lr = static_cast<float>(-lr);
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.grad_scale = static_cast<float>(grad_scale);
  return s;
}

// One element: from the scaled gradient g, the param p and the old momentum m, the new
// param and momentum. Shared by the fp32 and the int8 state kernels; always inlined so the
// loops that call it vectorise.
struct LionResult {
  float p, m;
};

__attribute__((always_inline)) SMARTINF_HD inline LionResult lion_element(float g, float p, float m,
                                                                          const LionStep& s) {
  const float c = m * s.beta1 + g * s.one_minus_beta1;
  const float sign = static_cast<float>((c > 0.0f) - (c < 0.0f));  // sign(0) = 0
  return {p * s.decay + s.neg_lr * sign, m * s.beta2 + g * s.one_minus_beta2};
}

template <class G, class P>
SMARTINF_HD inline void lion(std::size_t n, float* __restrict param, float* __restrict exp_avg,
                             const G* __restrict grad, P* __restrict out, const LionStep& s) {
  for (std::size_t i = 0; i < n; ++i) {
    const LionResult r = lion_element(to_float(grad[i]) * s.grad_scale, param[i], exp_avg[i], s);
    exp_avg[i] = r.m;
    param[i] = r.p;
    out[i] = from_float<P>(r.p);
  }
}

}  // namespace smartinf::kernels
