#include "device/compute_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <utility>

namespace smartinf::device {

ComputePool::ComputePool(unsigned threads) : threads_(std::max(1u, threads)) {
  for (unsigned i = 1; i < threads_; ++i)
    workers_.emplace_back([this] {
      pthread_setname_np(pthread_self(), "smartinf-pool");
      work();
    });
}

ComputePool::~ComputePool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

bool ComputePool::take_part(std::unique_lock<std::mutex>& lock) {
  if (!fn_ || next_ >= n_) return false;
  const uint64_t lo = next_, hi = std::min(n_, lo + part_);
  next_ = hi;
  ++running_;
  const auto* fn = fn_;
  lock.unlock();
  std::exception_ptr error;
  try {
    (*fn)(lo, hi);
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  if (error && !error_) error_ = error;
  if (--running_ == 0 && next_ >= n_) done_.notify_all();
  return true;
}

void ComputePool::work() {
  std::unique_lock lock(mu_);
  uint64_t seen = 0;
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || (generation_ != seen && fn_ && next_ < n_); });
    if (stop_) return;
    seen = generation_;
    while (take_part(lock)) {
    }
  }
}

void ComputePool::run(uint64_t n, uint64_t grain, const std::function<void(uint64_t, uint64_t)>& fn) {
  if (n == 0) return;
  // Parts of about n / threads, in whole grains: every thread gets one, none is tiny.
  const uint64_t grains = (n + grain - 1) / grain;
  const uint64_t part = (grains + threads_ - 1) / threads_ * grain;
  if (threads_ == 1 || part >= n) return fn(0, n);
  std::lock_guard turn(turn_);
  std::unique_lock lock(mu_);
  fn_ = &fn;
  n_ = n;
  part_ = part;
  next_ = 0;
  error_ = nullptr;
  ++generation_;
  wake_.notify_all();
  while (take_part(lock)) {
  }
  done_.wait(lock, [&] { return running_ == 0; });
  fn_ = nullptr;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

// From 8 cores on, two are left: one to the training loop (its forward runs while the last
// step's updates do), one to the ring's threads and the background lane. A pool part on a
// shared core holds the whole chunk up (H100 host, GPT-2 XL: 14 threads 1.15 s per
// iteration, 15 threads 1.27 s, with the step finishing during the next forward).
// Several ranks of one host (torchrun's and DeepSpeed's launchers say how many in
// LOCAL_WORLD_SIZE) share its cores: each takes its share, unless the launcher bound it to
// cores of its own already (its affinity narrower than the host: --bind_cores_to_rank).
unsigned default_compute_threads() {
  unsigned cores = usable_cores();
  const char* ranks = std::getenv("LOCAL_WORLD_SIZE");
  const long local = ranks ? std::strtol(ranks, nullptr, 10) : 1;
  if (local > 1 && cores >= std::thread::hardware_concurrency())
    cores = std::max(1u, cores / static_cast<unsigned>(local));
  return cores >= 8 ? cores - 2 : cores;
}

unsigned usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return std::max(1u, std::thread::hardware_concurrency());
  return std::max(1, CPU_COUNT(&set));
}

}  // namespace smartinf::device
