// SGD with momentum, dampening, Nesterov and L2 weight decay, element-wise, written once
// for the CPU device and the HLS kernels. Operation order follows torch.optim.SGD's
// single-tensor path: d = g + wd*p; buf = buf*momentum + (1-dampening)*d (buf = d on the
// first step); d = nesterov ? d + momentum*buf : buf; p = p - lr*d.
#pragma once
#include <cstddef>

#include "kernels/numeric.h"

namespace smartinf::kernels {

struct SgdStep {
  float neg_lr;
  float momentum;
  float one_minus_dampening;
  float weight_decay;
  float grad_scale;  // 1 / loss scale
  bool use_momentum;
  bool nesterov;
  bool first;        // no momentum buffer yet: it starts as the gradient
};

inline SgdStep sgd_step(double lr, double momentum, double dampening, double weight_decay,
                        bool nesterov, unsigned long step, double grad_scale) {
  SgdStep s;
  s.neg_lr = static_cast<float>(-lr);
  s.momentum = static_cast<float>(momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - dampening);
  s.weight_decay = static_cast<float>(weight_decay);
  s.grad_scale = static_cast<float>(grad_scale);
  s.use_momentum = momentum != 0.0;
  s.nesterov = nesterov;
  s.first = step == 1;
  return s;
}

template <bool Momentum, bool Nesterov, bool First, class G, class P>
SMARTINF_HD inline void sgd_range(std::size_t n, float* __restrict param, float* __restrict buf,
                                  const G* __restrict grad, P* __restrict out, const SgdStep& s) {
  for (std::size_t i = 0; i < n; ++i) {
    float p = param[i];
    float d = to_float(grad[i]) * s.grad_scale + s.weight_decay * p;
    if (Momentum) {
      const float b = First ? d : buf[i] * s.momentum + s.one_minus_dampening * d;
      buf[i] = b;
      d = Nesterov ? d + s.momentum * b : b;
    }
    p = p + s.neg_lr * d;
    param[i] = p;
    out[i] = from_float<P>(p);
  }
}

// `buf` is the momentum buffer (stored, but untouched when momentum is 0).
template <class G, class P>
SMARTINF_HD inline void sgd(std::size_t n, float* param, float* buf, const G* grad, P* out,
                            const SgdStep& s) {
  if (!s.use_momentum)
    sgd_range<false, false, false>(n, param, buf, grad, out, s);
  else if (s.first)
    s.nesterov ? sgd_range<true, true, true>(n, param, buf, grad, out, s)
               : sgd_range<true, false, true>(n, param, buf, grad, out, s);
  else
    s.nesterov ? sgd_range<true, true, false>(n, param, buf, grad, out, s)
               : sgd_range<true, false, false>(n, param, buf, grad, out, s);
}

}  // namespace smartinf::kernels
