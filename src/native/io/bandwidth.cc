#include "io/bandwidth.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
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

namespace {

// An O_DIRECT file (buffered where the file system has no O_DIRECT), closed by its owner.
struct File {
  File(const std::string& path, bool create) : path(path) {
    const int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_TRUNC : 0);
    fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
    if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), flags, 0644);
    check_errno(fd, "cannot open", path);
  }
  ~File() { ::close(fd); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  const std::string& path;
  int fd;
};

// One direction of sequential I/O over [offset, end) of a file through its own engine, in
// batches of `depth` blocks, two batches submitted so the queue never drains between them.
class Stream {
 public:
  Stream(const File& file, bool write, const std::string& engine, uint64_t block, unsigned depth)
      : file_(file), write_(write), batch_(block * depth),
        mem_(std::aligned_alloc(4096, 2 * block * depth)) {
    if (!mem_) throw std::bad_alloc();
    std::memset(mem_.get(), 0x5a, 2 * batch_);
    Options options;
    options.queue_depth = depth;  // the second batch waits in the engine for room
    options.piece_bytes = block;
    options.fixed_buffers.push_back(iovec{mem_.get(), 2 * batch_});
    std::vector<std::string> notes;
    engine_ = make_engine(engine, options, notes);
  }

  void range(uint64_t offset, uint64_t end) {
    offset_ = offset;
    end_ = end;
  }
  // Submits the next batch (after the one that last used its buffer); false once the range
  // is done and nothing is in flight.
  bool advance() {
    if (inflight_[next_]) engine_->wait_for(std::exchange(inflight_[next_], 0));
    if (offset_ >= end_) {
      next_ ^= 1;
      if (!inflight_[next_]) return false;
      engine_->wait_for(std::exchange(inflight_[next_], 0));
      return false;
    }
    Op op;
    op.write = write_;
    op.fd = file_.fd;
    op.path = &file_.path;
    op.buf = static_cast<char*>(mem_.get()) + next_ * batch_;
    op.len = std::min(batch_, end_ - offset_);
    op.offset = offset_;
    op.buf_index = 0;
    inflight_[next_] = engine_->submit({&op, 1});
    offset_ += op.len;
    next_ ^= 1;
    return true;
  }
  void drain() {
    while (advance()) {
    }
  }

 private:
  const File& file_;
  bool write_;
  uint64_t batch_;
  std::unique_ptr<void, Free> mem_;
  std::unique_ptr<Engine> engine_;
  uint64_t offset_ = 0, end_ = 0;
  Ticket inflight_[2] = {0, 0};
  int next_ = 0;
};

void check_geometry(uint64_t block, unsigned depth) {
  if (block == 0 || block % 4096 || depth == 0)
    throw std::invalid_argument("block must be a positive multiple of 4096 and depth positive");
}

}  // namespace

double time_io(const std::string& path, uint64_t bytes, bool write, const std::string& engine,
               uint64_t block, unsigned depth) {
  check_geometry(block, depth);
  File file(path, write);
  Stream stream(file, write, engine, block, depth);
  const auto start = Clock::now();
  stream.range(0, bytes);
  stream.drain();
  if (write) check_errno(::fdatasync(file.fd), "fdatasync", path);
  return since(start);
}

double time_mixed_io(const std::string& path, uint64_t bytes, const std::string& engine,
                     uint64_t block, unsigned depth, uint64_t burst) {
  check_geometry(block, depth);
  if (burst % block) throw std::invalid_argument("burst must be a multiple of block");
  const uint64_t half = bytes / 2 / block * block;
  File file(path, false);
  Stream reads(file, false, engine, block, depth), writes(file, true, engine, block, depth);
  const auto start = Clock::now();
  if (burst == 0) {  // both directions at once, batch for batch
    reads.range(0, half);
    writes.range(half, 2 * half);
    for (bool more = true; more;) {
      const bool r = reads.advance();
      const bool w = writes.advance();
      more = r || w;
    }
  } else {  // bursts of one direction
    for (uint64_t at = 0; at < half; at += burst) {
      reads.range(at, std::min(half, at + burst));
      reads.drain();
      writes.range(half + at, half + std::min(half, at + burst));
      writes.drain();
    }
  }
  check_errno(::fdatasync(file.fd), "fdatasync", path);
  return since(start);
}

namespace {

// One slot of a cpu device (the code and the ISA the pipeline runs) holding `numel` params'
// states from p = 0.5, m = v = 0, and their gradients, for AdamW updates on `threads`.
class KernelBench {
 public:
  KernelBench(uint64_t numel, kernels::DType grad, kernels::DType param,
              const store::StateLayout& layout, unsigned threads)
      : numel_(numel),
        cpu_(device::make_cpu_device("probe", device::SlotGeometry{1, numel, layout},
                                     device::CpuOptions{0, std::make_shared<device::ComputePool>(threads)})) {
    const float* none[device::kMaxStateArrays] = {};
    const float fill[device::kMaxStateArrays] = {0.5f, 0.0f, 0.0f};
    cpu_->init_states(0, none, fill, numel);
    // Gradients of both signs over three orders of magnitude: zeros would leave the moments
    // 0, and quantized moments of 0 skip their coding (a block's maximum of 0), which real
    // ones do not.
    kernels::dispatch(grad, param, [&](auto g, auto) {
      using G = decltype(g);
      auto* to = static_cast<G*>(cpu_->slot(0).grad);
      for (uint64_t i = 0; i < numel; ++i)
        to[i] = kernels::from_float<G>(1e-3f * (float(i % 251) - 125.5f) / 125.5f);
    });
    kernel_.step = kernels::make_step(kernels::Rule::adamw, kernels::Hyper{1e-3, 0.01}, 1);
    kernel_.grad = grad;
    kernel_.param = param;
  }

  // Seconds for one update.
  double update() {
    const auto start = Clock::now();
    cpu_->compute(0, kernel_, numel_);
    return since(start);
  }

 private:
  uint64_t numel_;
  std::unique_ptr<device::Device> cpu_;
  device::Kernel kernel_;
};

}  // namespace

// A first update to warm up (threads woken, pages touched), then the best of `repeats` more.
double time_adam_kernel(uint64_t numel, kernels::DType grad, kernels::DType param,
                        const store::StateLayout& layout, unsigned threads, unsigned repeats) {
  KernelBench bench(numel, grad, param, layout, threads);
  bench.update();
  double best = std::numeric_limits<double>::infinity();
  for (unsigned r = 0; r < std::max(repeats, 1u); ++r) best = std::min(best, bench.update());
  return best;
}

double time_write_beside_update(const std::string& path, uint64_t bytes, const std::string& engine,
                                uint64_t block, unsigned depth, uint64_t numel, kernels::DType grad,
                                kernels::DType param, const store::StateLayout& layout,
                                unsigned threads) {
  KernelBench bench(numel, grad, param, layout, threads);
  bench.update();  // warm, before the write starts
  std::exception_ptr failed;
  double seconds = 0;
  {
    std::jthread loop([&](std::stop_token stop) {
      try {
        while (!stop.stop_requested()) bench.update();
      } catch (...) {
        failed = std::current_exception();
      }
    });
    seconds = time_io(path, bytes, true, engine, block, depth);
  }  // the loop asked to stop and joined, the write's error or not
  if (failed) std::rethrow_exception(failed);
  return seconds;
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
