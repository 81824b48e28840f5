// Vitis HLS top functions of the SmartSSD update kernels (one chunk of params per run).
//
// Ports: the fp32 state arrays share the `states` AXI bundle (they stream from the
// SSD-filled DRAM region), the gradient or top-k pairs the `grads` bundle, the updated
// params the `params` bundle; all 512-bit with 64-beat bursts. Scalars (n, the step's
// hyper-parameters) are AXI-lite registers. Names say gradient and param dtypes:
// smartinf_adam_f32_f16 takes fp32 gradients and writes fp16 params.
#include "update.h"

using smartinf::hls::Beat;
namespace k = smartinf::kernels;
namespace h = smartinf::hls;
using Adam = h::RuleMath<k::Rule::adam>;  // (and AdamW: the step says which)
using Amsgrad = h::RuleMath<k::Rule::adam_amsgrad>;

#define SMARTINF_PORT(p, bundle) \
  _Pragma(SMARTINF_STR(HLS INTERFACE m_axi port = p bundle = bundle offset = slave max_read_burst_length = 64 max_write_burst_length = 64 num_read_outstanding = 16 num_write_outstanding = 16))
#define SMARTINF_STR(x) #x

// Adam / AdamW (step.decoupled), dense gradient.
#define SMARTINF_ADAM(NAME, G, P)                                                              \
  extern "C" void NAME(Beat* param, Beat* exp_avg, Beat* exp_avg_sq, const Beat* grad,         \
                       Beat* out, int n, k::AdamStep step) {                                   \
    SMARTINF_PORT(param, states)                                                               \
    SMARTINF_PORT(exp_avg, states)                                                             \
    SMARTINF_PORT(exp_avg_sq, states)                                                          \
    SMARTINF_PORT(grad, grads)                                                                 \
    SMARTINF_PORT(out, params)                                                                 \
    Beat* states[3] = {param, exp_avg, exp_avg_sq};                                            \
    h::DenseGrad<G> g{grad};                                                                   \
    h::update_chunk<Adam, h::DenseGrad<G>, P>(states, g, out, n, Adam{step});    \
  }

// Adam / AdamW fused with SmartComp decompression: nnz (int32 index, V value) pairs with
// ascending sub-group positions; this chunk starts at position `base`.
#define SMARTINF_ADAM_TOPK(NAME, V, P)                                                         \
  extern "C" void NAME(Beat* param, Beat* exp_avg, Beat* exp_avg_sq, const Beat* index,        \
                       const Beat* values, int nnz, unsigned long long base, Beat* out, int n, \
                       k::AdamStep step) {                                                     \
    SMARTINF_PORT(param, states)                                                               \
    SMARTINF_PORT(exp_avg, states)                                                             \
    SMARTINF_PORT(exp_avg_sq, states)                                                          \
    SMARTINF_PORT(index, grads)                                                                \
    SMARTINF_PORT(values, grads)                                                               \
    SMARTINF_PORT(out, params)                                                                 \
    Beat* states[3] = {param, exp_avg, exp_avg_sq};                                            \
    h::TopkGrad<V> g{index, values, nnz, base};                                                \
    h::update_chunk<Adam, h::TopkGrad<V>, P>(states, g, out, n, Adam{step});     \
  }

// Adam / AdamW with AMSGrad: the largest exp_avg_sq so far as a fourth state array.
#define SMARTINF_AMSGRAD(NAME, G, P)                                                           \
  extern "C" void NAME(Beat* param, Beat* exp_avg, Beat* exp_avg_sq, Beat* max_exp_avg_sq,     \
                       const Beat* grad, Beat* out, int n, k::AdamStep step) {                 \
    SMARTINF_PORT(param, states)                                                               \
    SMARTINF_PORT(exp_avg, states)                                                             \
    SMARTINF_PORT(exp_avg_sq, states)                                                          \
    SMARTINF_PORT(max_exp_avg_sq, states)                                                      \
    SMARTINF_PORT(grad, grads)                                                                 \
    SMARTINF_PORT(out, params)                                                                 \
    Beat* states[4] = {param, exp_avg, exp_avg_sq, max_exp_avg_sq};                            \
    h::DenseGrad<G> g{grad};                                                                   \
    h::update_chunk<Amsgrad, h::DenseGrad<G>, P>(states, g, out, n, Amsgrad{step});    \
  }

// SGD (momentum buffer), AdaGrad (squared-gradient sum), Lion (momentum): two state arrays.
#define SMARTINF_TWO_STATE(NAME, MATH, STEP, G, P)                                             \
  extern "C" void NAME(Beat* param, Beat* state, const Beat* grad, Beat* out, int n,           \
                       STEP step) {                                                            \
    SMARTINF_PORT(param, states)                                                               \
    SMARTINF_PORT(state, states)                                                               \
    SMARTINF_PORT(grad, grads)                                                                 \
    SMARTINF_PORT(out, params)                                                                 \
    Beat* states[2] = {param, state};                                                          \
    h::DenseGrad<G> g{grad};                                                                   \
    h::update_chunk<MATH, h::DenseGrad<G>, P>(states, g, out, n, MATH{step});                  \
  }

// Adam / AdamW on quantized states (store/layout.h): fp32 params, the BITS-bit codes of the
// two moments and their fp32 scales. int8 (kernels/quant8.h): exp_avg and sqrt(exp_avg_sq),
// scales per 256 params; int4 (kernels/quant4.h): exp_avg and exp_avg_sq, packed two a byte,
// exp_avg's scales per 128 params and exp_avg_sq's row and column maxima per 128 x 128 tile.
#define SMARTINF_ADAM_QUANT(NAME, BITS, G, P)                                                  \
  extern "C" void NAME(Beat* param, Beat* m_codes, Beat* v_codes, Beat* m_scales,               \
                       Beat* v_scales, const Beat* grad, Beat* out, int n, k::AdamStep step) {  \
    SMARTINF_PORT(param, states)                                                               \
    SMARTINF_PORT(m_codes, states)                                                             \
    SMARTINF_PORT(v_codes, states)                                                             \
    SMARTINF_PORT(m_scales, states)                                                            \
    SMARTINF_PORT(v_scales, states)                                                            \
    SMARTINF_PORT(grad, grads)                                                                 \
    SMARTINF_PORT(out, params)                                                                 \
    Beat* codes[2] = {m_codes, v_codes};                                                       \
    Beat* scales[2] = {m_scales, v_scales};                                                    \
    h::update_chunk_quantized<h::Int##BITS##Tile, h::AdamQuantMath, G, P>(                      \
        param, codes, scales, grad, out, n, h::AdamQuantMath{step});                            \
  }

// Lion on quantized states: fp32 params, the BITS-bit codes of exp_avg and their scales.
#define SMARTINF_LION_QUANT(NAME, BITS, G, P)                                                  \
  extern "C" void NAME(Beat* param, Beat* m_codes, Beat* m_scales, const Beat* grad, Beat* out, \
                       int n, k::LionStep step) {                                              \
    SMARTINF_PORT(param, states)                                                               \
    SMARTINF_PORT(m_codes, states)                                                             \
    SMARTINF_PORT(m_scales, states)                                                            \
    SMARTINF_PORT(grad, grads)                                                                 \
    SMARTINF_PORT(out, params)                                                                 \
    Beat* codes[1] = {m_codes};                                                                \
    Beat* scales[1] = {m_scales};                                                              \
    h::update_chunk_quantized<h::Int##BITS##Tile, h::LionQuantMath, G, P>(                      \
        param, codes, scales, grad, out, n, h::LionQuantMath{step});                            \
  }

SMARTINF_ADAM(smartinf_adam_f32_f16, float, k::f16)
SMARTINF_ADAM(smartinf_adam_f32_bf16, float, k::bf16)
SMARTINF_ADAM(smartinf_adam_f16_f16, k::f16, k::f16)
SMARTINF_ADAM(smartinf_adam_bf16_bf16, k::bf16, k::bf16)
SMARTINF_ADAM(smartinf_adam_f32_f32, float, float)
SMARTINF_ADAM_TOPK(smartinf_adam_topk_f16_f16, k::f16, k::f16)
SMARTINF_ADAM_TOPK(smartinf_adam_topk_bf16_bf16, k::bf16, k::bf16)
SMARTINF_TWO_STATE(smartinf_sgd_f32_f16, h::RuleMath<k::Rule::sgd>, k::SgdStep, float, k::f16)
SMARTINF_TWO_STATE(smartinf_adagrad_f32_f16, h::RuleMath<k::Rule::adagrad>, k::AdagradStep, float, k::f16)
SMARTINF_TWO_STATE(smartinf_lion_f32_f16, h::RuleMath<k::Rule::lion>, k::LionStep, float, k::f16)
SMARTINF_TWO_STATE(smartinf_lion_bf16_bf16, h::RuleMath<k::Rule::lion>, k::LionStep, k::bf16, k::bf16)
SMARTINF_AMSGRAD(smartinf_amsgrad_f32_f16, float, k::f16)
SMARTINF_ADAM_QUANT(smartinf_adam8_f32_f16, 8, float, k::f16)
SMARTINF_LION_QUANT(smartinf_lion8_f32_f16, 8, float, k::f16)
SMARTINF_ADAM_QUANT(smartinf_adam4_f32_f16, 4, float, k::f16)
SMARTINF_LION_QUANT(smartinf_lion4_f32_f16, 4, float, k::f16)
