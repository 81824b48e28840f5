// Completion of one request (all of its chunks): what a Python future waits on.
#pragma once
#include <condition_variable>
#include <exception>
#include <mutex>

namespace smartinf::pipeline {

class Completion {
 public:
  explicit Completion(size_t chunks) : remaining_(chunks) {}

  void chunk_done(std::exception_ptr error = nullptr) {
    std::lock_guard lock(mu_);
    if (error && !error_) error_ = error;
    if (--remaining_ == 0) cv_.notify_all();
  }

  bool done() const {
    std::lock_guard lock(mu_);
    return remaining_ == 0;
  }

  // Blocks until every chunk is done; rethrows the first chunk's error.
  void wait() const {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return remaining_ == 0; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  size_t remaining_;
  std::exception_ptr error_;
};

}  // namespace smartinf::pipeline
