// Adamax (Kingma & Ba 2015, section 7.1), as torch.optim.Adamax's single-tensor path:
// exp_avg by lerp, the infinity norm exp_inf = max(beta2 * exp_inf, |g| + eps) (NaN kept,
// as torch.maximum keeps it), the param by addcdiv with -lr / (1 - beta1^t); L2 weight
// decay added to the gradient. Written once for the CPU device, the GPU and HLS.
#pragma once
#include <cmath>
#include <cstddef>

#include "kernels/adam.h"
#include "kernels/numeric.h"

namespace smartinf::kernels {

// Per-step scalars, computed on the host in double and rounded to float as torch does.
struct AdamaxStep {
  float one_minus_beta1;  // lerp weight for exp_avg
  float beta2;
  float eps;
  float weight_decay;
  float neg_clr;          // -lr / (1 - beta1^t)
  float grad_scale;       // 1 / loss scale
};

inline AdamaxStep adamax_step(double lr, double beta1, double beta2, double eps, double weight_decay,
                              unsigned long step, double grad_scale) {
  AdamaxStep s;
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.neg_clr = static_cast<float>(-(lr / (1.0 - std::pow(beta1, double(step)))));
  s.grad_scale = static_cast<float>(grad_scale);
  return s;
}

template <bool SmallWeight, class G, class P>
SMARTINF_HD inline void adamax_range(std::size_t n, float* __restrict param, float* __restrict exp_avg,
                                     float* __restrict exp_inf, const G* __restrict grad, P* __restrict out,
                                     const AdamaxStep& s) {
  for (std::size_t i = 0; i < n; ++i) {
    const float p = param[i];
    const float g = to_float(grad[i]) * s.grad_scale + s.weight_decay * p;
    const float m = lerp<SmallWeight>(exp_avg[i], g, s.one_minus_beta1);
    const float decayed = exp_inf[i] * s.beta2, bound = std::fabs(g) + s.eps;
    const float u = (decayed != decayed || decayed > bound) ? decayed : bound;
    const float updated = p + s.neg_clr * (m / u);
    param[i] = updated;
    exp_avg[i] = m;
    exp_inf[i] = u;
    out[i] = from_float<P>(updated);
  }
}

template <class G, class P>
SMARTINF_HD inline void adamax(std::size_t n, float* param, float* exp_avg, float* exp_inf, const G* grad,
                               P* out, const AdamaxStep& s) {
  if (std::fabs(s.one_minus_beta1) < 0.5f)
    adamax_range<true>(n, param, exp_avg, exp_inf, grad, out, s);
  else
    adamax_range<false>(n, param, exp_avg, exp_inf, grad, out, s);
}

}  // namespace smartinf::kernels
