#include "io/bandwidth.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "device/compute_pool.h"
#include "device/cpu_device.h"
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

// On one slot of a cpu device (the code and the ISA the pipeline runs), states p = 0.5,
// m = v = 0 and a zero gradient, as the probe has always timed it.
double time_adam_kernel(uint64_t numel, kernels::DType grad, kernels::DType param,
                        const store::StateLayout& layout, unsigned threads) {
  const device::SlotGeometry geometry{1, numel, layout};
  const device::CpuOptions options{0, std::make_shared<device::ComputePool>(threads)};
  const std::unique_ptr<device::Device> cpu = device::make_cpu_device("probe", geometry, options);
  const float* none[device::kMaxStateArrays] = {};
  const float fill[device::kMaxStateArrays] = {0.5f, 0.0f, 0.0f};
  cpu->init_states(0, none, fill, numel);  // the slot's gradient memory starts zeroed
  device::Kernel kernel;
  kernel.step = kernels::make_step(kernels::Rule::adamw, kernels::Hyper{1e-3, 0.01}, 1);
  kernel.grad = grad;
  kernel.param = param;
  const auto start = Clock::now();
  cpu->compute(0, kernel, numel);
  return since(start);
}

// STREAM's triad a[i] = b[i] + q * c[i] over three arrays of `bytes` / 3, split over the
// same pool of threads the update runs on; the first touch is outside the timing.
double time_triad(uint64_t bytes, unsigned threads) {
  const uint64_t n = bytes / 12;
  device::ComputePool pool(threads);
  std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);
  const auto triad = [&](uint64_t lo, uint64_t hi) {
    for (uint64_t i = lo; i < hi; ++i) a[i] = b[i] + 3.0f * c[i];
  };
  pool.run(n, 1 << 14, triad);  // warm: pages mapped, threads awake
  const auto start = Clock::now();
  pool.run(n, 1 << 14, triad);
  return since(start);
}

}  // namespace smartinf::io
