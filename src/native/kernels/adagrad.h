// AdaGrad with learning-rate decay and L2 weight decay, element-wise, written once for
// the CPU device and the HLS kernels. Operation order follows torch.optim.Adagrad's
// single-tensor path: g += wd*p; sum += g*g; p -= clr * g / (sqrt(sum) + eps), with
// clr = lr / (1 + (t-1) * lr_decay).
#pragma once
#include <cmath>
#include <cstddef>

#include "kernels/numeric.h"

namespace smartinf::kernels {

struct AdagradStep {
  float neg_clr;
  float eps;
  float weight_decay;
  float grad_scale;  // 1 / loss scale
};

inline AdagradStep adagrad_step(double lr, double lr_decay, double eps, double weight_decay,
                                unsigned long step, double grad_scale) {
  AdagradStep s;
  s.neg_clr = static_cast<float>(-(lr / (1.0 + double(step - 1) * lr_decay)));
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.grad_scale = static_cast<float>(grad_scale);
  return s;
}

template <class G, class P>
SMARTINF_HD inline void adagrad(std::size_t n, float* __restrict param, float* __restrict sum,
                                const G* __restrict grad, P* __restrict out, const AdagradStep& s) {
  for (std::size_t i = 0; i < n; ++i) {
    float p = param[i];
    const float g = to_float(grad[i]) * s.grad_scale + s.weight_decay * p;
    const float acc = sum[i] + g * g;
    p = p + s.neg_clr * (g / (std::sqrt(acc) + s.eps));
    sum[i] = acc;
    param[i] = p;
    out[i] = from_float<P>(p);
  }
}

}  // namespace smartinf::kernels
