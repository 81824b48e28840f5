// The host's update (device/cpu_update_impl.h's run_update_as, the body every ISA clone of
// device/cpu_update.h runs) compiled for ONE instruction set, the -march given, so that an
// AVX2-only or a baseline CPU's code can be timed, or counted, on any x86-64 machine: AdamW,
// bf16 gradients and params, one thread, fp32 / int8 / int4 moments with an fp32 or a split
// master, the best of STEPS - 2 updates after two; M params/s. With an argument (a format,
// then "split") it runs that one alone, for an instruction count under callgrind (which has
// no AVX-512): the difference between STEPS=4 and STEPS=2, over 2 x 2^N params.
//   g++ -std=c++20 -O3 -ffp-contract=off -fno-math-errno -march=x86-64-v3 -Isrc/native \
//     bench/cpu_kernel_rates.cc -o /tmp/rates-v3 && /tmp/rates-v3
//   (-march=x86-64-v4: the AVX-512 clone's code; x86-64: the baseline's; -DSTEPS=4, -DLOG2N=20)
// bench/measured/cpu-kernels-isa-instructions.txt has both measures; bench/test_kernels.py
// times the library's own entries (the clone this CPU picks) through the pipeline's pool.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device/cpu_update_impl.h"

#ifndef STEPS
#define STEPS 7
#endif
#ifndef LOG2N
#define LOG2N 24
#endif

using namespace smartinf;

// As cpu_update_impl.h's entries: every kernel inlined into it.
template <store::Moments M>
__attribute__((flatten)) void entry(const device::Slot& s, const device::Kernel& k, size_t n,
                                    const store::StateLayout& layout) {
  device::run_update_as<M>(s, k, kernels::DType::bf16, n, layout, n, 0);
}

template <store::Moments M>
double rate(bool split) {
  const size_t n = size_t(1) << LOG2N;
  store::StateLayout layout;
  layout.moments = M;
  layout.master = split ? store::Master::split : store::Master::fp32;
  const size_t bytes = (store::extent_bytes(n, layout) + 4095) / 4096 * 4096;
  void* states = std::aligned_alloc(4096, bytes);
  std::memset(states, 0, bytes);
  std::vector<uint16_t> grad(n), params(n, 0x3f00);  // bf16 0.5
  // both signs over three orders of magnitude, as io/bandwidth.cc's KernelBench
  for (size_t i = 0; i < n; ++i)
    grad[i] = kernels::from_float<kernels::bf16>(1e-3f * (float(i % 251) - 125.5f) / 125.5f).bits;
  device::Slot slot;
  slot.states = static_cast<float*>(states);
  slot.grad = grad.data();
  slot.out = params.data();
  device::Kernel k;
  k.grad = k.param = kernels::DType::bf16;
  double best = 1e30;
  for (int t = 1; t <= STEPS; ++t) {
    k.step = kernels::make_step(kernels::Rule::adamw, kernels::Hyper{1e-3, 0.01}, t);
    const auto start = std::chrono::steady_clock::now();
    entry<M>(slot, k, n, layout);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (t > 2 && s < best) best = s;
  }
  std::free(states);
  return n / best / 1e6;
}

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";
  const bool split = argc > 2 && std::string(argv[2]) == "split";
  if (!only.empty()) {  // one format, for callgrind
    if (only == "fp32") rate<store::Moments::fp32>(split);
    if (only == "int8") rate<store::Moments::int8>(split);
    if (only == "int4") rate<store::Moments::int4>(split);
    return 0;
  }
  const double fp32 = rate<store::Moments::fp32>(false);
  std::printf("fp32 %.0f", fp32);
  const auto row = [&](const char* name, double r) { std::printf("  %s %.0f (%.2fx)", name, r, r / fp32); };
  row("int8", rate<store::Moments::int8>(false));
  row("int8+split", rate<store::Moments::int8>(true));
  row("int4", rate<store::Moments::int4>(false));
  row("int4+split", rate<store::Moments::int4>(true));
  std::printf("  M params/s, one thread\n");
}
