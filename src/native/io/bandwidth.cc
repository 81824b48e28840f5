#include "io/bandwidth.h"

#include "kernels/quant8.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "error.h"
#include "kernels/adam.h"

namespace smartinf::io {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Free {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

double time_io(const std::string& path, uint64_t bytes, bool write, const std::string& engine,
               uint64_t block, unsigned depth) {
  if (block == 0 || block % 4096 || depth == 0)
    throw std::invalid_argument("block must be a positive multiple of 4096 and depth positive");
  const int flags = O_RDWR | O_CLOEXEC | (write ? O_CREAT | O_TRUNC : 0);
  int fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
  if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), flags, 0644);
  check_errno(fd, "cannot open", path);
  std::unique_ptr<void, Free> mem(std::aligned_alloc(4096, block * depth));
  if (!mem) {
    ::close(fd);
    throw std::bad_alloc();
  }
  std::memset(mem.get(), 0x5a, block * depth);
  Options options;
  options.queue_depth = depth;
  options.piece_bytes = block;
  options.fixed_buffers.push_back(iovec{mem.get(), block * depth});
  std::vector<std::string> notes;
  std::unique_ptr<Engine> e;
  try {
    e = make_engine(engine, options, notes);
  } catch (...) {
    ::close(fd);
    throw;
  }
  const auto start = Clock::now();
  try {
    // One op per buffer-full; the engine keeps `depth` blocks in flight.
    for (uint64_t done = 0; done < bytes; done += block * depth) {
      Op op;
      op.write = write;
      op.fd = fd;
      op.path = &path;
      op.buf = mem.get();
      op.len = std::min<uint64_t>(block * depth, bytes - done);
      op.offset = done;
      op.buf_index = 0;
      e->submit({&op, 1});
      e->wait();
    }
    if (write) check_errno(::fdatasync(fd), "fdatasync", path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  const double seconds = since(start);
  ::close(fd);
  return seconds;
}

namespace {

// As the cpu device runs the kernels: for the baseline ISA and AVX2, picked at load time.
// flatten: every kernel it calls is inlined, so each clone has its own code.
__attribute__((target_clones("avx2", "default"), flatten))
void run_adam(uint64_t numel, kernels::DType grad, kernels::DType param, bool int8_states,
              const kernels::Int8Adam& q, float* p, float* m, float* v, const uint32_t* g,
              uint32_t* out, const kernels::AdamStep& s) {
  kernels::dispatch(grad, param, [&](auto gt, auto pt) {
    using G = decltype(gt);
    using P = decltype(pt);
    if (int8_states)
      kernels::adam8(numel, q, reinterpret_cast<const G*>(g), reinterpret_cast<P*>(out), s);
    else
      kernels::adam(numel, p, m, v, reinterpret_cast<const G*>(g), reinterpret_cast<P*>(out), s);
  });
}

}  // namespace

double time_adam_kernel(uint64_t numel, kernels::DType grad, kernels::DType param,
                        bool int8_states) {
  std::vector<float> p(numel, 0.5f), m(numel, 0.0f), v(numel, 0.0f);
  std::vector<uint32_t> g(numel, 0), out(numel, 0);  // room for any dtype
  std::vector<uint32_t> packed(int8_states ? kernels::int8_adam_bytes(numel) / 4 + 1 : 0);
  const kernels::Int8Adam q = kernels::int8_adam_layout(packed.data(), numel);
  if (int8_states) {
    const float* from[3] = {p.data(), nullptr, nullptr};
    const float fill[3] = {0.0f, 0.0f, 0.0f};
    kernels::import_int8_adam(q, numel, from, fill);
  }
  const kernels::AdamStep s = kernels::adam_step(1e-3, 0.9, 0.999, 1e-8, 0.01, true, 1, 1.0);
  const auto start = Clock::now();
  run_adam(numel, grad, param, int8_states, q, p.data(), m.data(), v.data(), g.data(), out.data(), s);
  return since(start);
}

}  // namespace smartinf::io
