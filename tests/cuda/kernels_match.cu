// The GPU update kernels (device/cuda_update.cu) against the same kernel functions run on
// the host, bit for bit: every rule, every (gradient, param) dtype pair, an fp32 and a split
// master, hyper-parameters that take each branch (L2 and decoupled decay, lerp's two
// formulas, AMSGrad, SGD's momentum / Nesterov / first step, maximize, loss scales); fp32
// moments, and int8 and int4 moments for the rules that have them (the chunk's codes,
// scales and masters compared byte for byte, its last block and tile partial).
// Built and run by tests/test_cuda_kernels.py where nvcc and a GPU are found. Prints one
// line per case that differs and a summary; exits 1 if any does.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device/cuda_update.h"
#include "kernels/quantized.h"
#include "kernels/rules.h"
#include "kernels/split_master.h"
#include "store/layout.h"

using namespace smartinf;
using kernels::DType;

namespace {

void check(cudaError_t e) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(e));
    std::exit(2);
  }
}

struct Case {
  std::string name;
  kernels::Rule rule;
  kernels::Hyper hyper;
  uint64_t t;
};

std::vector<Case> cases() {
  using kernels::Rule;
  std::vector<Case> c;
  kernels::Hyper h;
  h.lr = 1e-3;
  h.grad_scale = 1.0 / 1024;
  for (Rule r : {Rule::adam, Rule::adamw, Rule::adam_amsgrad, Rule::adamw_amsgrad}) {
    for (double beta1 : {0.9, 0.3}) {  // lerp: weight 0.1 < 0.5, then 0.7
      kernels::Hyper a = h;
      a.beta1 = beta1;
      a.weight_decay = 0.1;
      c.push_back({std::string(kernels::rule_row(r).name) + " beta1 " + std::to_string(beta1), r, a, 7});
    }
    kernels::Hyper first = h;
    c.push_back({std::string(kernels::rule_row(r).name) + " t=1", r, first, 1});
  }
  kernels::Hyper maximize = h;
  maximize.grad_scale = -1.0;
  c.push_back({"adamw maximize", Rule::adamw, maximize, 3});
  for (bool nesterov : {false, true}) {
    for (uint64_t t : {1, 4}) {
      kernels::Hyper s = h;
      s.lr = 0.1;
      s.momentum = 0.9;
      s.dampening = nesterov ? 0.0 : 0.1;
      s.nesterov = nesterov;
      s.weight_decay = 1e-4;
      c.push_back({"sgd momentum nesterov=" + std::to_string(nesterov) + " t=" + std::to_string(t),
                   Rule::sgd, s, t});
    }
  }
  kernels::Hyper plain = h;
  plain.lr = 0.1;
  c.push_back({"sgd plain", Rule::sgd, plain, 2});
  kernels::Hyper ada = h;
  ada.lr = 0.01;
  ada.lr_decay = 0.01;
  ada.eps = 1e-10;
  ada.weight_decay = 1e-3;
  c.push_back({"adagrad", Rule::adagrad, ada, 3});
  kernels::Hyper lion = h;
  lion.lr = 1e-4;
  lion.beta2 = 0.99;
  lion.weight_decay = 0.1;
  c.push_back({"lion", Rule::lion, lion, 5});
  return c;
}

template <class T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  check(cudaMalloc(&d, host.size() * sizeof(T) + 1));
  check(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> host(n);
  check(cudaMemcpy(host.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// Random inputs: states of the signs each rule keeps (second moments, AdaGrad's sum and
// AMSGrad's maximum are >= 0), values across many binades, some exact zeros.
struct Inputs {
  std::vector<std::vector<float>> arrays;
  std::vector<float> grad32;
  std::vector<uint16_t> grad16;  // the gradient as bf16 or f16 bits
  std::vector<uint16_t> params;  // bf16 params sent in (split master)
  std::vector<uint16_t> low;
};

float wide(std::mt19937& rng) {
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 4);
  return std::ldexp(mantissa(rng), exponent(rng));
}

Inputs make_inputs(const Case& c, DType grad, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Inputs in;
  const unsigned arrays = kernels::rule_row(c.rule).arrays;
  in.arrays.assign(arrays, std::vector<float>(n));
  for (unsigned a = 0; a < arrays; ++a) {
    const bool nonnegative = (a == 2) || (a == 3) || (c.rule == kernels::Rule::adagrad && a == 1);
    for (size_t i = 0; i < n; ++i) {
      float x = i % 97 == 0 ? 0.0f : wide(rng);
      in.arrays[a][i] = nonnegative ? std::fabs(x) * std::fabs(x) : x;
    }
  }
  if (arrays == 4)  // AMSGrad: the maximum so far is at least some of the time the larger
    for (size_t i = 0; i < n; i += 2) in.arrays[3][i] = in.arrays[2][i] * 2.0f;
  in.grad32.resize(n);
  in.grad16.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const float g = i % 89 == 0 ? 0.0f : wide(rng) * 512.0f;
    if (grad == DType::bf16) in.grad16[i] = kernels::from_float<kernels::bf16>(g).bits;
    if (grad == DType::f16) in.grad16[i] = kernels::from_float<kernels::f16>(g / 64).bits;
    in.grad32[i] = g;
  }
  in.params.resize(n);
  in.low.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const kernels::bf16 p = kernels::from_float<kernels::bf16>(in.arrays[0][i]);
    in.params[i] = p.bits;
    in.low[i] = kernels::master_low(in.arrays[0][i], p);
  }
  return in;
}

const char* dtype_name(DType t) { return t == DType::f32 ? "f32" : t == DType::f16 ? "f16" : "bf16"; }

template <class T>
size_t differing(const std::vector<T>& a, const std::vector<T>& b) {
  size_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return d;
}

// The GPU's update of states `packed` (in `layout`) with the case's gradient: the states and
// the params out (a split master's sent in first), as the host holds them after.
struct GpuResult {
  std::vector<char> states, out;
};
GpuResult update_on_gpu(const kernels::Step& step, const store::StateLayout& layout,
                        const std::vector<char>& packed, const Inputs& in, DType grad, DType param,
                        bool split, bool adopt, size_t n) {
  const size_t psize = kernels::dtype_size(param);
  char* dstates = to_device(packed);
  void* dgrad = grad == DType::f32 ? static_cast<void*>(to_device(in.grad32))
                                   : static_cast<void*>(to_device(in.grad16));
  char* dout = nullptr;
  check(cudaMalloc(&dout, n * psize));
  if (split) check(cudaMemcpy(dout, in.params.data(), n * 2, cudaMemcpyHostToDevice));
  device::cuda::update(step, layout, dstates, n, grad, param, dgrad, dout, adopt, nullptr);
  check(cudaDeviceSynchronize());
  GpuResult r{to_host(dstates, packed.size()), to_host(dout, n * psize)};
  cudaFree(dstates);
  cudaFree(dgrad);
  cudaFree(dout);
  return r;
}

// One case on the host and on the GPU; the number of values whose bits differ.
size_t run_case(const Case& c, DType grad, DType param, bool split, bool adopt, size_t n) {
  const Inputs in = make_inputs(c, grad, n, 1234u + unsigned(c.rule) * 7 + unsigned(grad));
  const kernels::Step step = kernels::make_step(c.rule, c.hyper, c.t);
  const unsigned arrays = kernels::rule_row(c.rule).arrays;
  const size_t psize = kernels::dtype_size(param);
  const void* grad_host = grad == DType::f32 ? static_cast<const void*>(in.grad32.data())
                                             : static_cast<const void*>(in.grad16.data());
  // Host: the kernel functions as the cpu device calls them.
  std::vector<std::vector<float>> host = in.arrays;
  std::vector<char> host_out(n * psize);
  std::vector<uint16_t> host_low = in.low;
  if (split) std::memcpy(host_out.data(), in.params.data(), n * 2);
  kernels::dispatch(grad, param, [&](auto g, auto p) {
    using G = decltype(g);
    using P = decltype(p);
    float* a[kernels::kMaxStateArrays] = {};
    for (unsigned k = 0; k < arrays; ++k) a[k] = host[k].data();
    const G* gp = static_cast<const G*>(grad_host);
    P* op = reinterpret_cast<P*>(host_out.data());
    if (!split) return kernels::run_rule(step, n, a, gp, op);
    if constexpr (std::is_same_v<P, kernels::bf16>) {
      std::vector<float> master(n);
      kernels::rebuild_masters(n, op, host_low.data(), adopt, master.data());
      a[0] = master.data();
      kernels::run_rule(step, n, a, gp, op);
      kernels::split_masters(n, master.data(), op, host_low.data());
    }
  });
  // GPU: the states in the layout the devices hold them in (store/layout.h).
  store::StateLayout layout;
  layout.arrays = arrays;
  layout.master = split ? store::Master::split : store::Master::fp32;
  std::vector<char> packed(layout.bytes(n));
  for (unsigned k = split ? 1 : 0; k < arrays; ++k)
    std::memcpy(layout.array(packed.data(), n, k), in.arrays[k].data(), n * 4);
  if (split) std::memcpy(layout.split_at(packed.data(), n).low, in.low.data(), n * 2);
  const GpuResult gpu = update_on_gpu(step, layout, packed, in, grad, param, split, adopt, n);
  packed = gpu.states;
  size_t diff = 0;
  for (unsigned k = split ? 1 : 0; k < arrays; ++k) {
    const float* got = layout.array(packed.data(), n, k);
    diff += differing(std::vector<float>(got, got + n), host[k]);
  }
  diff += differing(gpu.out, host_out);
  if (split) {
    const uint16_t* low = layout.split_at(packed.data(), n).low;
    diff += differing(std::vector<uint16_t>(low, low + n), host_low);
  }
  return diff;
}

// One case on int8 or int4 moments (`moments`), on the host and on the GPU; the number of
// bytes of the chunk's states and of the params out that differ.
size_t run_quantized_case(const Case& c, store::Moments moments, DType grad, DType param, bool split,
                          bool adopt, size_t n) {
  const Inputs in = make_inputs(c, grad, n, 4321u + unsigned(c.rule) * 7 + unsigned(grad));
  const kernels::Step step = kernels::make_step(c.rule, c.hyper, c.t);
  store::StateLayout layout;
  layout.arrays = kernels::rule_row(c.rule).arrays;
  layout.moments = moments;
  layout.master = split ? store::Master::split : store::Master::fp32;
  std::vector<char> packed(layout.bytes(n));
  const float* from[3] = {in.arrays[0].data(), in.arrays[1].data(),
                          layout.arrays > 2 ? in.arrays[2].data() : nullptr};
  const float fill[3] = {};
  store::with_quantized(moments, [&](auto m) {
    kernels::import_quantized(layout.quantized_at<m.value>(packed.data(), n), n, layout.arrays - 1, from, fill);
  });
  if (split) std::memcpy(layout.split_at(packed.data(), n).low, in.low.data(), n * 2);
  const size_t psize = kernels::dtype_size(param);
  std::vector<char> host = packed, host_out(n * psize);
  if (split) std::memcpy(host_out.data(), in.params.data(), n * 2);
  const void* grad_host = grad == DType::f32 ? static_cast<const void*>(in.grad32.data())
                                             : static_cast<const void*>(in.grad16.data());
  kernels::dispatch(grad, param, [&](auto g, auto p) {
    using G = decltype(g);
    using P = decltype(p);
    const G* gp = static_cast<const G*>(grad_host);
    P* op = reinterpret_cast<P*>(host_out.data());
    const auto run = [&](const auto& states) {
      if (!split) return kernels::run_rule_quantized(step, n, states, gp, kernels::Fp32Masters<P>{states.param, op});
      if constexpr (std::is_same_v<P, kernels::bf16>) {
        uint16_t* low = layout.split_at(host.data(), n).low;
        if (adopt) return kernels::run_rule_quantized(step, n, states, gp, kernels::SplitMasters<true>{op, low});
        kernels::run_rule_quantized(step, n, states, gp, kernels::SplitMasters<false>{op, low});
      }
    };
    store::with_quantized(moments, [&](auto m) { run(layout.quantized_at<m.value>(host.data(), n)); });
  });
  const GpuResult gpu = update_on_gpu(step, layout, packed, in, grad, param, split, adopt, n);
  return differing(gpu.states, host) + differing(gpu.out, host_out);
}

}  // namespace

int main() {
  const size_t n = (size_t(1) << 20) + 3;
  size_t cases_run = 0, failed = 0;
  for (const Case& c : cases()) {
    for (DType grad : {DType::f32, DType::bf16, DType::f16}) {
      for (DType param : {DType::f32, DType::bf16, DType::f16}) {
        const size_t d = run_case(c, grad, param, false, false, n);
        ++cases_run;
        if (d) {
          ++failed;
          std::printf("DIFFERS %s grad %s param %s: %zu values\n", c.name.c_str(), dtype_name(grad),
                      dtype_name(param), d);
        }
      }
      for (bool adopt : {false, true}) {
        const size_t d = run_case(c, grad, DType::bf16, true, adopt, n);
        ++cases_run;
        if (d) {
          ++failed;
          std::printf("DIFFERS %s split adopt=%d grad %s: %zu values\n", c.name.c_str(), adopt,
                      dtype_name(grad), d);
        }
      }
    }
  }
  for (unsigned f = 1; f < store::kMomentsCount; ++f) {  // every quantized format
    const auto moments = static_cast<store::Moments>(f);
    const char* format = store::kMomentsNames[f];
    for (const Case& c : cases()) {
      if (!kernels::row_allows(kernels::rule_row(c.rule), moments)) continue;
      for (DType grad : {DType::f32, DType::bf16, DType::f16}) {
        for (DType param : {DType::f32, DType::bf16, DType::f16}) {
          const size_t d = run_quantized_case(c, moments, grad, param, false, false, n);
          ++cases_run;
          if (d) {
            ++failed;
            std::printf("DIFFERS %s %s grad %s param %s: %zu bytes\n", format, c.name.c_str(),
                        dtype_name(grad), dtype_name(param), d);
          }
        }
        for (bool adopt : {false, true}) {
          const size_t d = run_quantized_case(c, moments, grad, DType::bf16, true, adopt, n);
          ++cases_run;
          if (d) {
            ++failed;
            std::printf("DIFFERS %s %s split adopt=%d grad %s: %zu bytes\n", format, c.name.c_str(), adopt,
                        dtype_name(grad), d);
          }
        }
      }
    }
  }
  std::printf("%zu cases of %zu params, %zu differ\n", cases_run, n, failed);
  return failed ? 1 : 0;
}
