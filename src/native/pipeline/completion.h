// Completion of one request (all of its chunks): what a Python future waits on.
#pragma once
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

#include "pipeline/activity.h"

namespace smartinf::pipeline {

class Completion {
 public:
  explicit Completion(size_t chunks) : remaining_(chunks) {}

  // An update's: in flight from now until its last chunk is done, and its callers' waits,
  // counted in `activity` (before any chunk is submitted).
  void track(std::shared_ptr<Activity> activity) {
    activity_ = std::move(activity);
    activity_->began();
  }

  void chunk_done(std::exception_ptr error = nullptr) {
    std::lock_guard lock(mu_);
    if (error && !error_) error_ = error;
    if (--remaining_ == 0) {
      if (activity_) activity_->ended();
      cv_.notify_all();
    }
  }

  bool done() const {
    std::lock_guard lock(mu_);
    return remaining_ == 0;
  }

  // Blocks until every chunk is done; rethrows the first chunk's error.
  void wait() const {
    std::unique_lock lock(mu_);
    const bool counted = remaining_ != 0 && activity_;
    if (counted) activity_->wait_began();
    cv_.wait(lock, [&] { return remaining_ == 0; });
    if (counted) activity_->wait_ended();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  size_t remaining_;
  std::exception_ptr error_;
  std::shared_ptr<Activity> activity_;
};

}  // namespace smartinf::pipeline
