// Wall time during which updates were in flight, and the part of it during which a caller
// waited for one: the rest is the update time hidden behind the caller's own work (issue
// 25's "time hidden"). Intervals, not sums: two updates in flight at once, or two callers
// waiting at once, count once; a waiter's wake-up after the last update ended counts not.
#pragma once
#include <chrono>
#include <cstdint>
#include <mutex>
#include <utility>

namespace smartinf::pipeline {

class Activity {
 public:
  using Clock = std::chrono::steady_clock;

  void began() { change(running_, +1); }
  void ended() { change(running_, -1); }
  void wait_began() { change(waiting_, +1); }
  void wait_ended() { change(waiting_, -1); }

  // Seconds with an update in flight, and of those, seconds a caller waited (up to now).
  double running_s() const { return now_s().first; }
  double waited_s() const { return now_s().second; }

 private:
  void change(int& count, int by) {
    std::lock_guard lock(mu_);
    accrue(Clock::now());
    count += by;
  }
  // Adds the time since the last change to what was accruing then.
  void accrue(Clock::time_point now) const {
    const auto ns = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(now - since_).count());
    if (running_ > 0) run_ns_ += ns;
    if (running_ > 0 && waiting_ > 0) wait_ns_ += ns;
    since_ = now;
  }
  std::pair<double, double> now_s() const {
    std::lock_guard lock(mu_);
    accrue(Clock::now());
    return {1e-9 * static_cast<double>(run_ns_), 1e-9 * static_cast<double>(wait_ns_)};
  }

  mutable std::mutex mu_;
  int running_ = 0, waiting_ = 0;
  mutable Clock::time_point since_ = Clock::now();
  mutable uint64_t run_ns_ = 0, wait_ns_ = 0;
};

}  // namespace smartinf::pipeline
