// Paces transfers to a bandwidth: models a shared host link (PCIe switch, root port) or a
// computational storage device's internal SSD when emulated devices share one machine.
// A transfer reserves the next interval of the budget when it starts (so transfers are
// served in the order they start, with no gaps while one is waiting), and when it has
// run faster than its interval, sleeps until the interval ends.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

namespace smartinf::pipeline {

class RateLimiter {
 public:
  using Clock = std::chrono::steady_clock;

  explicit RateLimiter(double bytes_per_second) : ns_per_byte_(1e9 / bytes_per_second) {}

  // Call when a transfer of `bytes` starts; returns when it may end.
  Clock::time_point reserve(uint64_t bytes) {
    std::lock_guard lock(mu_);
    const Clock::time_point begin = std::max(Clock::now(), next_free_);
    next_free_ = begin + std::chrono::nanoseconds(static_cast<int64_t>(bytes * ns_per_byte_));
    return next_free_;
  }

  // Call when the transfer is done; returns the nanoseconds slept.
  static uint64_t finish(Clock::time_point end) {
    const Clock::time_point now = Clock::now();
    if (end <= now) return 0;
    std::this_thread::sleep_until(end);
    return std::chrono::duration_cast<std::chrono::nanoseconds>(end - now).count();
  }

  double bytes_per_second() const { return 1e9 / ns_per_byte_; }

 private:
  const double ns_per_byte_;
  std::mutex mu_;
  Clock::time_point next_free_{};
};

// The host link all of a pipeline's devices share, one budget per direction (PCIe is full
// duplex: a link of B GB/s moves B GB/s each way at once).
struct HostLink {
  explicit HostLink(double bytes_per_second) : to_device(bytes_per_second), to_host(bytes_per_second) {}
  RateLimiter to_device, to_host;
};

}  // namespace smartinf::pipeline
