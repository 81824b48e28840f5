// Adds the nanoseconds a scope took to a counter (a stage's busy time, a caller's wait).
#pragma once
#include <chrono>

namespace smartinf::pipeline {

template <class Sink>  // uint64_t, or std::atomic<uint64_t> where threads share it
class Timer {
 public:
  explicit Timer(Sink& sink) : sink_(sink), start_(std::chrono::steady_clock::now()) {}
  ~Timer() {
    sink_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                 std::chrono::steady_clock::now() - start_)
                 .count();
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

 private:
  Sink& sink_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace smartinf::pipeline
