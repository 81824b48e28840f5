// C simulation of the HLS top functions (plain g++: `#pragma HLS` is ignored): each must
// equal the C++ reference (src/native/kernels/ on whole arrays, as the cpu device runs
// it) bit for bit on states and params, for lengths that are and are not multiples of a
// beat, zero-length included, and leave the bytes after each array untouched.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "update.h"

using smartinf::hls::Beat;
namespace k = smartinf::kernels;

#define DECLARE_ADAM(NAME) \
  extern "C" void NAME(Beat*, Beat*, Beat*, const Beat*, Beat*, int, k::AdamStep);
#define DECLARE_TOPK(NAME)                                                                 \
  extern "C" void NAME(Beat*, Beat*, Beat*, const Beat*, const Beat*, int, unsigned long long, \
                       Beat*, int, k::AdamStep);
DECLARE_ADAM(smartinf_adam_f32_f16)
DECLARE_ADAM(smartinf_adam_f32_bf16)
DECLARE_ADAM(smartinf_adam_f16_f16)
DECLARE_ADAM(smartinf_adam_bf16_bf16)
DECLARE_ADAM(smartinf_adam_f32_f32)
DECLARE_TOPK(smartinf_adam_topk_f16_f16)
DECLARE_TOPK(smartinf_adam_topk_bf16_bf16)
extern "C" void smartinf_sgd_f32_f16(Beat*, Beat*, const Beat*, Beat*, int, k::SgdStep);
extern "C" void smartinf_adagrad_f32_f16(Beat*, Beat*, const Beat*, Beat*, int, k::AdagradStep);
extern "C" void smartinf_lion_f32_f16(Beat*, Beat*, const Beat*, Beat*, int, k::LionStep);
extern "C" void smartinf_lion_bf16_bf16(Beat*, Beat*, const Beat*, Beat*, int, k::LionStep);
extern "C" void smartinf_amsgrad_f32_f16(Beat*, Beat*, Beat*, Beat*, const Beat*, Beat*, int,
                                         k::AdamStep);
extern "C" void smartinf_adam8_f32_f16(Beat*, Beat*, Beat*, Beat*, Beat*, const Beat*, Beat*, int,
                                       k::AdamStep);
extern "C" void smartinf_lion8_f32_f16(Beat*, Beat*, Beat*, const Beat*, Beat*, int, k::LionStep);
extern "C" void smartinf_adam4_f32_f16(Beat*, Beat*, Beat*, Beat*, Beat*, const Beat*, Beat*, int,
                                       k::AdamStep);
extern "C" void smartinf_lion4_f32_f16(Beat*, Beat*, Beat*, const Beat*, Beat*, int, k::LionStep);
namespace store = smartinf::store;

static std::mt19937 rng(7);
static int failures = 0, checks = 0;
constexpr unsigned char CANARY = 0xA5;

// An array of n T in whole beats, plus one more beat; everything past n is canary bytes.
template <class T>
struct Device {
  std::vector<Beat> beats;
  std::size_t n;
  explicit Device(const std::vector<T>& host) : beats(host.size() * sizeof(T) / 64 + 2), n(host.size()) {
    std::memset(beats.data(), CANARY, beats.size() * sizeof(Beat));
    if (n) std::memcpy(beats.data(), host.data(), n * sizeof(T));
  }
  Beat* data() { return beats.data(); }
  bool equals(const std::vector<T>& host) const {
    if (n && std::memcmp(beats.data(), host.data(), n * sizeof(T)) != 0) return false;
    const auto* tail = reinterpret_cast<const unsigned char*>(beats.data()) + n * sizeof(T);
    const std::size_t rest = beats.size() * sizeof(Beat) - n * sizeof(T);
    for (std::size_t i = 0; i < rest; ++i)
      if (tail[i] != CANARY) return false;
    return true;
  }
};

static void check(bool ok, const char* what, int n) {
  ++checks;
  if (!ok) {
    ++failures;
    std::printf("FAIL %s n=%d\n", what, n);
  }
}

static float value(std::size_t i) {
  static const float special[] = {0.0f, -0.0f, 1e-40f, -3e-39f, 70000.0f, -1e-8f, 1e30f};
  if (i % 97 == 5) return special[(i / 97) % 7];
  return std::normal_distribution<float>(0.0f, 1.0f)(rng);
}

template <class T>
static std::vector<T> random(std::size_t n, float scale = 1.0f) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = k::from_float<T>(value(i) * scale);
  return v;
}

static std::vector<float> positive(std::size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = std::uniform_real_distribution<float>(0.0f, 0.01f)(rng);
  return v;
}

template <class G, class P>
static void adam_case(void (*kernel)(Beat*, Beat*, Beat*, const Beat*, Beat*, int, k::AdamStep),
                      const char* name, int n, const k::AdamStep& s) {
  auto p = random<float>(n), m = random<float>(n, 0.1f), v = positive(n);
  auto g = random<G>(n);
  std::vector<P> out(n);
  Device<float> dp(p), dm(m), dv(v);
  Device<G> dg(g);
  Device<P> dout(out);
  k::adam(n, p.data(), m.data(), v.data(), g.data(), out.data(), s);
  kernel(dp.data(), dm.data(), dv.data(), dg.data(), dout.data(), n, s);
  check(dp.equals(p) && dm.equals(m) && dv.equals(v), name, n);
  check(dout.equals(out), name, n);
  check(dg.equals(g), name, n);  // the gradient is read only
}

template <class V, class P>
static void topk_case(void (*kernel)(Beat*, Beat*, Beat*, const Beat*, const Beat*, int,
                                     unsigned long long, Beat*, int, k::AdamStep),
                      const char* name, int n, const k::AdamStep& s) {
  const unsigned long long base = 3u << 20;  // the chunk's first sub-group position
  std::vector<int32_t> index;
  for (int i = 0; i < n; ++i)
    if (std::uniform_real_distribution<float>(0, 1)(rng) < 0.1f) index.push_back(static_cast<int32_t>(base + i));
  auto values = random<V>(index.size());
  auto p = random<float>(n), m = random<float>(n, 0.1f), v = positive(n);
  std::vector<P> out(n);
  std::vector<float> dense(n);
  Device<float> dp(p), dm(m), dv(v);
  Device<int32_t> di(index);
  Device<V> dval(values);
  Device<P> dout(out);
  k::decompress(n, dense.data(), index.data(), values.data(), index.size(), base);
  k::adam(n, p.data(), m.data(), v.data(), dense.data(), out.data(), s);
  kernel(dp.data(), dm.data(), dv.data(), di.data(), dval.data(), static_cast<int>(index.size()),
         base, dout.data(), n, s);
  check(dp.equals(p) && dm.equals(m) && dv.equals(v) && dout.equals(out), name, n);
}

template <class G, class P>
static void lion_case(void (*kernel)(Beat*, Beat*, const Beat*, Beat*, int, k::LionStep),
                      const char* name, int n) {
  const auto s = k::lion_step(1e-4, 0.9, 0.99, 0.1, 0.5);
  auto p = random<float>(n), m = random<float>(n, 0.1f);
  auto g = random<G>(n);
  std::vector<P> out(n);
  Device<float> dp(p), dm(m);
  Device<G> dg(g);
  Device<P> dout(out);
  k::lion(n, p.data(), m.data(), g.data(), out.data(), s);
  kernel(dp.data(), dm.data(), dg.data(), dout.data(), n, s);
  check(dp.equals(p) && dm.equals(m) && dout.equals(out), name, n);
}

static void amsgrad_case(int n, const k::AdamStep& s) {
  auto p = random<float>(n), m = random<float>(n, 0.1f), v = positive(n), vmax = positive(n);
  auto g = random<float>(n);
  std::vector<k::f16> out(n);
  Device<float> dp(p), dm(m), dv(v), dvmax(vmax), dg(g);
  Device<k::f16> dout(out);
  k::adam_amsgrad(n, p.data(), m.data(), v.data(), vmax.data(), g.data(), out.data(), s);
  smartinf_amsgrad_f32_f16(dp.data(), dm.data(), dv.data(), dvmax.data(), dg.data(), dout.data(), n, s);
  check(dp.equals(p) && dm.equals(m) && dv.equals(v) && dvmax.equals(vmax) && dout.equals(out),
        "amsgrad_f32_f16", n);
}

static void two_state_cases(int n) {
  for (int first = 0; first < 2; ++first)
    for (int nesterov = 0; nesterov < 2; ++nesterov) {
      const auto s = k::sgd_step(0.05, 0.9, nesterov ? 0.0 : 0.1, 0.01, nesterov, first ? 1 : 4, 0.25);
      auto p = random<float>(n), buf = random<float>(n, 0.1f);
      auto g = random<float>(n);
      std::vector<k::f16> out(n);
      Device<float> dp(p), db(buf), dg(g);
      Device<k::f16> dout(out);
      k::sgd(n, p.data(), buf.data(), g.data(), out.data(), s);
      smartinf_sgd_f32_f16(dp.data(), db.data(), dg.data(), dout.data(), n, s);
      check(dp.equals(p) && db.equals(buf) && dout.equals(out), "sgd_f32_f16", n);
    }
  const auto s = k::adagrad_step(0.1, 0.01, 1e-10, 0.01, 3, 0.5);
  auto p = random<float>(n), sum = positive(n);
  auto g = random<float>(n);
  std::vector<k::f16> out(n);
  Device<float> dp(p), ds(sum), dg(g);
  Device<k::f16> dout(out);
  k::adagrad(n, p.data(), sum.data(), g.data(), out.data(), s);
  smartinf_adagrad_f32_f16(dp.data(), ds.data(), dg.data(), dout.data(), n, s);
  check(dp.equals(p) && ds.equals(sum) && dout.equals(out), "adagrad_f32_f16", n);
  lion_case<float, k::f16>(smartinf_lion_f32_f16, "lion_f32_f16", n);
  lion_case<k::bf16, k::bf16>(smartinf_lion_bf16_bf16, "lion_bf16_bf16", n);
}

// int8 states: the kernel on the cpu device's layout (one buffer, whole chunk, as
// store/layout.h places it) against the HLS top on separate arrays, from the same coded states.
struct Int8Case {
  int n;
  unsigned moments;
  std::vector<uint32_t> buf;
  store::Int8States ref;
  Int8Case(int n_, unsigned m, const std::vector<float>* states)
      : n(n_), moments(m), buf(store::int8_bytes(n_, m) / 4 + 1) {
    ref = store::int8_states(buf.data(), n, moments);
    const float* from[3] = {states[0].data(), states[1].data(), m > 1 ? states[2].data() : nullptr};
    const float fill[3] = {0.0f, 0.0f, 0.0f};
    k::import_quantized(ref, n, moments, from, fill);
  }
  std::vector<float> param() const { return {ref.param, ref.param + n}; }
  std::vector<uint8_t> codes(unsigned k) const { return {ref.code[k], ref.code[k] + n}; }
  std::vector<float> scales(unsigned k) const {
    return {ref.scale[k], ref.scale[k] + store::quant_blocks(n)};
  }
};

// int4 states: as int8, on store/layout.h's int4 layout (an fp32 master in front).
struct Int4Case {
  int n;
  unsigned moments;
  std::vector<uint32_t> buf;
  store::Int4States ref;
  Int4Case(int n_, unsigned m, const std::vector<float>* states)
      : n(n_), moments(m), buf((4 * std::size_t(n_) + store::int4_moment_bytes(n_, m)) / 4 + 1) {
    ref = store::int4_moments_at(buf.data() + n, reinterpret_cast<float*>(buf.data()), n, moments);
    const float* from[3] = {states[0].data(), states[1].data(), m > 1 ? states[2].data() : nullptr};
    const float fill[3] = {0.0f, 0.0f, 0.0f};
    k::import_quantized(ref, n, moments, from, fill);
  }
  std::vector<float> param() const { return {ref.param, ref.param + n}; }
  std::vector<uint8_t> codes(unsigned k) const { return {ref.code[k], ref.code[k] + (n + 1) / 2}; }
  std::vector<float> scales(unsigned k) const {
    const std::size_t count = k == 0 ? store::quant4_blocks(n) : store::quant4_tiles(n) * 2 * store::kQuant4Block;
    return {ref.scale[k], ref.scale[k] + count};
  }
};

// A quantized top against kernels/quantized.h's update on the host: Case is Int8Case or
// Int4Case (the states and the reference's), `top` the top function (Adam: two moments).
template <class Case, class Top>
static void adam_quantized_case(int n, const k::AdamStep& s, Top top, const char* name) {
  const std::vector<float> states[3] = {random<float>(n), random<float>(n, 0.1f), positive(n)};
  auto g = random<float>(n);
  Case c(n, 2, states);
  Device<float> dp(c.param()), dms(c.scales(0)), dvs(c.scales(1));
  Device<uint8_t> dmq(c.codes(0)), dvq(c.codes(1));
  Device<float> dg(g);
  std::vector<k::f16> out(n);
  Device<k::f16> dout(out);
  k::adam_quantized(n, c.ref, g.data(), k::Fp32Masters<k::f16>{c.ref.param, out.data()}, s);
  top(dp.data(), dmq.data(), dvq.data(), dms.data(), dvs.data(), dg.data(), dout.data(), n, s);
  check(dp.equals(c.param()) && dmq.equals(c.codes(0)) && dvq.equals(c.codes(1)) &&
            dms.equals(c.scales(0)) && dvs.equals(c.scales(1)) && dout.equals(out),
        name, n);
}

template <class Case, class Top>
static void lion_quantized_case(int n, Top top, const char* name) {
  const auto s = k::lion_step(1e-4, 0.9, 0.99, 0.1, 0.5);
  const std::vector<float> states[2] = {random<float>(n), random<float>(n, 0.1f)};
  auto g = random<float>(n);
  Case c(n, 1, states);
  Device<float> dp(c.param()), dms(c.scales(0));
  Device<uint8_t> dmq(c.codes(0));
  Device<float> dg(g);
  std::vector<k::f16> out(n);
  Device<k::f16> dout(out);
  k::lion_quantized(n, c.ref, g.data(), k::Fp32Masters<k::f16>{c.ref.param, out.data()}, s);
  top(dp.data(), dmq.data(), dms.data(), dg.data(), dout.data(), n, s);
  check(dp.equals(c.param()) && dmq.equals(c.codes(0)) && dms.equals(c.scales(0)) &&
            dout.equals(out),
        name, n);
}

// quant4.h's second-moment map: the exponent-built values are 2^(i - 15) and its midpoint
// table is the float32 midpoints of neighbouring values, as the count of midpoints needs.
static void pow2_map_case() {
  namespace q4 = k::q4;
  bool ok = true;
  for (uint32_t i = 0; i < 16; ++i) ok = ok && q4::pow2_value(i) == std::ldexp(1.0f, int(i) - 15);
  for (uint32_t i = 0; i < 15; ++i)
    ok = ok && q4::kPow2Mid[i] == (q4::pow2_value(i) + q4::pow2_value(i + 1)) * 0.5f;
  check(ok, "quant4 power-of-two map", 16);
}

// quant4.h's codes from a float's bits (nearest_pow2, nearest_dynamic) equal the count of
// midpoints below it (nearest): for every float within 2^16 ulps of each midpoint of either
// sign and of 0, 1 and infinity, and every 4099th float of all 2^32 (the whole range was
// checked once: bench/test_kernels.py's note).
static void nearest_from_bits_case() {
  namespace q4 = k::q4;
  uint64_t bad = 0, seen = 0;
  auto one = [&](uint32_t b) {
    const float x = k::float_of(b);
    bad += q4::nearest_pow2(x) != q4::nearest(x, q4::kPow2Mid);
    bad += q4::nearest_dynamic(x) != q4::nearest(x, q4::kDynamicMid);
    ++seen;
  };
  auto around = [&](float m) {
    for (uint32_t sign : {0u, 0x80000000u})
      for (int32_t d = -(1 << 16); d <= (1 << 16); ++d)
        one(((k::bits_of(m) & 0x7fffffffu) + static_cast<uint32_t>(d)) ^ sign);
  };
  for (float m : q4::kPow2Mid) around(m);
  for (float m : q4::kDynamicMid) around(m);
  for (float m : {0.0f, 1.0f, INFINITY}) around(m);
  for (uint64_t b = 0; b < (uint64_t(1) << 32); b += 4099) one(static_cast<uint32_t>(b));
  check(bad == 0, "quant4 codes from bits", static_cast<int>(seen >> 20));
}

int main() {
  // 4095..4097 and 9000: int8 tiles of 4096 (whole and partial beats of scales).
  const int lengths[] = {0, 1, 15, 16, 17, 31, 33, 1023, 1024, 1025, 2500, 4095, 4096, 4097, 9000};
  for (int n : lengths) {
    for (int variant = 0; variant < 3; ++variant) {
      // AdamW, Adam (L2), and a beta1 that takes torch.lerp's other formula.
      const bool decoupled = variant != 1;
      const double beta1 = variant == 2 ? 0.3 : 0.9;
      const auto s = k::adam_step(1e-3, beta1, 0.999, 1e-8, 0.01, decoupled, 3, 0.5);
      adam_case<float, k::f16>(smartinf_adam_f32_f16, "adam_f32_f16", n, s);
      adam_case<float, k::bf16>(smartinf_adam_f32_bf16, "adam_f32_bf16", n, s);
      adam_case<k::f16, k::f16>(smartinf_adam_f16_f16, "adam_f16_f16", n, s);
      adam_case<k::bf16, k::bf16>(smartinf_adam_bf16_bf16, "adam_bf16_bf16", n, s);
      adam_case<float, float>(smartinf_adam_f32_f32, "adam_f32_f32", n, s);
      topk_case<k::f16, k::f16>(smartinf_adam_topk_f16_f16, "adam_topk_f16_f16", n, s);
      topk_case<k::bf16, k::bf16>(smartinf_adam_topk_bf16_bf16, "adam_topk_bf16_bf16", n, s);
      adam_quantized_case<Int8Case>(n, s, smartinf_adam8_f32_f16, "adam8_f32_f16");
      amsgrad_case(n, s);
    }
    two_state_cases(n);
    lion_quantized_case<Int8Case>(n, smartinf_lion8_f32_f16, "lion8_f32_f16");
  }
  pow2_map_case();
  nearest_from_bits_case();
  // int4 tiles of 16384 params (128 x 128): partial rows, partial tiles, several tiles.
  const int lengths4[] = {0, 1, 15, 16, 127, 128, 129, 1025, 16383, 16384, 16385, 40001};
  for (int n : lengths4) {
    for (int variant = 0; variant < 3; ++variant) {
      const bool decoupled = variant != 1;
      const double beta1 = variant == 2 ? 0.3 : 0.9;
      adam_quantized_case<Int4Case>(n, k::adam_step(1e-3, beta1, 0.999, 1e-8, 0.01, decoupled, 3, 0.5),
                                    smartinf_adam4_f32_f16, "adam4_f32_f16");
    }
    lion_quantized_case<Int4Case>(n, smartinf_lion4_f32_f16, "lion4_f32_f16");
  }
  std::printf("csim: %d checks, %d failures (%zu + %zu lengths, 16 top functions)\n", checks,
              failures, sizeof(lengths) / sizeof(lengths[0]), sizeof(lengths4) / sizeof(lengths4[0]));
  return failures ? 1 : 0;
}
