// Paces transfers to a bandwidth: models a shared host link (PCIe switch, root port) or a
// computational storage device's internal SSD when emulated devices share one machine.
// Transfers reserve consecutive intervals of the budget in arrival order; a transfer that
// ran faster than its interval sleeps until the interval ends.
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

  // Call after moving `bytes` that started at `started`; returns the nanoseconds slept.
  uint64_t pace(uint64_t bytes, Clock::time_point started) {
    Clock::time_point end;
    {
      std::lock_guard lock(mu_);
      const Clock::time_point begin = std::max(started, next_free_);
      end = begin + std::chrono::nanoseconds(static_cast<int64_t>(bytes * ns_per_byte_));
      next_free_ = end;
    }
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
