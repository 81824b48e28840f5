// The update rules, one row each. Everything that depends on which rule runs (its name in
// the manifest, its state arrays, whether quantized states apply, its kernel scalars, its CPU
// kernels on fp32 and quantized states, its HLS top function) is read from here: nothing else
// switches on a rule. Adding a rule: its element-wise kernel (kernels/<rule>.h), a row, its
// cases and RuleKernel below, its HLS top's line (hls_kernels/kernels.cpp, Makefile,
// smartssd.cfg), and its Python class (smartinf/update_rules.py, smartinf/optim/drop_in.py);
// quantized states for it: its element in kernels/quantized.h (one for every format),
// `quantized` in its row, its case in with_quantized_element, its HLS top.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/adagrad.h"
#include "kernels/adamax.h"
#include "kernels/adam.h"
#include "kernels/lion.h"
#include "kernels/quantized.h"
#include "kernels/sgd.h"
#include "store/layout.h"

namespace smartinf::kernels {

enum class Rule : uint8_t { adam, adamw, adam_amsgrad, adamw_amsgrad, sgd, adagrad, lion, adamax };

struct RuleRow {
  const char* name;  // in the manifest, and in smartinf/update_rules.py
  Rule rule;
  unsigned arrays;   // fp32 arrays per param on storage: the master, then the states
  bool quantized;    // its moments may be any quantized format (store/layout.h's list): a case in with_quantized_element
  bool betas;        // reads beta1/beta2 (recorded in the manifest with lr, weight_decay)
  const char* hls;   // hls_kernels/ top function, before _<grad>_<param> dtypes (int8: "8" added)
};

inline constexpr RuleRow kRules[] = {
    {"adam", Rule::adam, 3, true, true, "smartinf_adam"},
    {"adamw", Rule::adamw, 3, true, true, "smartinf_adam"},
    {"adam_amsgrad", Rule::adam_amsgrad, 4, false, true, "smartinf_amsgrad"},
    {"adamw_amsgrad", Rule::adamw_amsgrad, 4, false, true, "smartinf_amsgrad"},
    {"sgd", Rule::sgd, 2, false, false, "smartinf_sgd"},
    {"adagrad", Rule::adagrad, 2, false, false, "smartinf_adagrad"},
    {"lion", Rule::lion, 2, true, true, "smartinf_lion"},
    {"adamax", Rule::adamax, 3, false, true, "smartinf_adamax"},
};
inline constexpr unsigned kMaxStateArrays = 4;

constexpr bool quantized_rows_fit_the_layout() {
  for (const RuleRow& row : kRules)
    if (row.quantized && row.arrays - 1 > store::kMaxInt8Moments) return false;
  return true;
}
static_assert(quantized_rows_fit_the_layout(), "a quantized row keeps at most kMaxInt8Moments moments");

constexpr bool rows_in_enum_order() {
  for (std::size_t i = 0; i < sizeof kRules / sizeof kRules[0]; ++i)
    if (static_cast<std::size_t>(kRules[i].rule) != i) return false;
  return true;
}
static_assert(rows_in_enum_order(), "kRules lists the rules in the order of enum Rule");

inline const RuleRow& rule_row(Rule r) { return kRules[static_cast<std::size_t>(r)]; }

inline const RuleRow& rule_row(const std::string& name) {
  std::string known;
  for (const RuleRow& row : kRules) {
    if (name == row.name) return row;
    known += (known.empty() ? "" : ", ") + std::string(row.name);
  }
  throw std::invalid_argument("unknown optimizer '" + name + "' (expected one of " + known + ")");
}

// Whether a row allows moments of format `moments`.
inline bool row_allows(const RuleRow& row, store::Moments moments) {
  return moments == store::Moments::fp32 || row.quantized;
}

// The rules whose row allows those moments, for messages: "adam, adamw, lion".
inline std::string rule_names_allowing(store::Moments moments) {
  std::string names;
  for (const RuleRow& row : kRules)
    if (row_allows(row, moments)) names += (names.empty() ? "" : ", ") + std::string(row.name);
  return names;
}

// Hyper-parameters of one update (each rule reads its own); t comes from the sub-group.
struct Hyper {
  double lr = 1e-3, weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // Adam, Lion (betas); eps also AdaGrad
  double momentum = 0.0, dampening = 0.0;         // SGD
  bool nesterov = false;
  double lr_decay = 0.0;                          // AdaGrad
  double grad_scale = 1.0;  // 1 / loss scale (and clipping; negative: maximize)
};

// The kernel scalars of one update: the rule's own struct.
struct Step {
  Rule rule = Rule::adamw;
  AdamStep adam{};
  SgdStep sgd{};
  AdagradStep adagrad{};
  LionStep lion{};
  AdamaxStep adamax{};
};

inline Step make_step(Rule r, const Hyper& h, uint64_t t) {
  Step s;
  s.rule = r;
  switch (r) {
    case Rule::adam:
    case Rule::adamw:
    case Rule::adam_amsgrad:
    case Rule::adamw_amsgrad:
      s.adam = adam_step(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
                         r == Rule::adamw || r == Rule::adamw_amsgrad, t, h.grad_scale);
      break;
    case Rule::sgd:
      s.sgd = sgd_step(h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov, t, h.grad_scale);
      break;
    case Rule::adagrad:
      s.adagrad = adagrad_step(h.lr, h.lr_decay, h.eps, h.weight_decay, t, h.grad_scale);
      break;
    case Rule::lion:
      s.lion = lion_step(h.lr, h.beta1, h.beta2, h.weight_decay, h.grad_scale);
      break;
    case Rule::adamax:
      s.adamax = adamax_step(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, t, h.grad_scale);
      break;
  }
  return s;
}

// Calls f with the step's own scalars (a device passes them to its kernel as they are).
template <class F>
inline decltype(auto) with_scalars(const Step& s, F&& f) {
  switch (s.rule) {
    case Rule::sgd: return f(s.sgd);
    case Rule::adagrad: return f(s.adagrad);
    case Rule::lion: return f(s.lion);
    case Rule::adamax: return f(s.adamax);
    default: return f(s.adam);
  }
}

// Each rule's kernel on fp32 arrays, with its own scalars: `a` indexes to its arrays (the
// master, then its states: the CPU's pointers, or an HLS tile's rows), so the CPU device,
// the GPU's fp32 path (run_rule) and the HLS tops (hls_kernels/update.h RuleMath) run the
// one row.
template <Rule R> struct RuleKernel;
// RuleKernel<R>: the scalars' type and the call of rule R's kernel on `a`, `grad`, `out` and
// the scalars `s`, over `n` params.
#define SMARTINF_RULE_KERNEL(RULE, SCALARS, CALL)                                              \
  template <> struct RuleKernel<Rule::RULE> {                                                  \
    using Scalars = SCALARS;                                                                   \
    template <class A, class G, class P>                                                       \
    SMARTINF_HD static void run(std::size_t n, A a, const G* grad, P* out, const Scalars& s) { \
      CALL;                                                                                    \
    }                                                                                          \
  };
SMARTINF_RULE_KERNEL(adam, AdamStep, adam(n, a[0], a[1], a[2], grad, out, s))
SMARTINF_RULE_KERNEL(adam_amsgrad, AdamStep, adam_amsgrad(n, a[0], a[1], a[2], a[3], grad, out, s))
SMARTINF_RULE_KERNEL(sgd, SgdStep, sgd(n, a[0], a[1], grad, out, s))
SMARTINF_RULE_KERNEL(adagrad, AdagradStep, adagrad(n, a[0], a[1], grad, out, s))
SMARTINF_RULE_KERNEL(lion, LionStep, lion(n, a[0], a[1], grad, out, s))
SMARTINF_RULE_KERNEL(adamax, AdamaxStep, adamax(n, a[0], a[1], a[2], grad, out, s))
#undef SMARTINF_RULE_KERNEL
template <> struct RuleKernel<Rule::adamw> : RuleKernel<Rule::adam> {};
template <> struct RuleKernel<Rule::adamw_amsgrad> : RuleKernel<Rule::adam_amsgrad> {};

// The kernel of the step's rule over n params: `a` are its fp32 arrays (param first).
template <class G, class P>
SMARTINF_HD inline void run_rule(const Step& s, std::size_t n, float* const* a, const G* grad, P* out) {
  switch (s.rule) {
    case Rule::adam:
    case Rule::adamw:
      return RuleKernel<Rule::adam>::run(n, a, grad, out, s.adam);
    case Rule::adam_amsgrad:
    case Rule::adamw_amsgrad:
      return RuleKernel<Rule::adam_amsgrad>::run(n, a, grad, out, s.adam);
    case Rule::sgd:
      return RuleKernel<Rule::sgd>::run(n, a, grad, out, s.sgd);
    case Rule::adagrad:
      return RuleKernel<Rule::adagrad>::run(n, a, grad, out, s.adagrad);
    case Rule::lion:
      return RuleKernel<Rule::lion>::run(n, a, grad, out, s.lion);
    case Rule::adamax:
      return RuleKernel<Rule::adamax>::run(n, a, grad, out, s.adamax);
  }
}

// Calls f with the step's rule as its element on quantized moments (kernels/quantized.h:
// AdamElement with Adam's two compile-time choices, LionElement), for the CPU's update and
// the GPU's kernel alike; only rows with `quantized` have one (the pipeline refuses
// those states for the others), any other is refused here.
template <class F>
inline void with_quantized_element(const Step& s, F&& f) {
  switch (s.rule) {
    case Rule::adam:
    case Rule::adamw:
      return with_adam_element(s.adam, f);
    case Rule::lion:
      return f(LionElement{s.lion});
    default:
      throw std::logic_error(std::string("no quantized kernel for ") + rule_row(s.rule).name);
  }
}

// The CPU kernel of the step's rule on quantized states (store/layout.h's Int8States or
// Int4States) with masters `masters` (Fp32Masters over st.param, or SplitMasters).
template <class States, class G, class Masters>
inline void run_rule_quantized(const Step& s, std::size_t n, const States& st, const G* grad,
                               const Masters& masters) {
  with_quantized_element(s, [&](const auto& element) {
    update_quantized<FormatOf<States>>(n, st, grad, masters, element);
  });
}

}  // namespace smartinf::kernels
