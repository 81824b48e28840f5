// A blocking FIFO between pipeline stages; a capacity gives back-pressure.
#pragma once
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>

namespace smartinf::pipeline {

template <class T>
class Queue {
 public:
  explicit Queue(size_t capacity = SIZE_MAX) : capacity_(capacity) {}

  void push(T item) {
    std::unique_lock lock(mu_);
    not_full_.wait(lock, [&] { return items_.size() < capacity_; });
    items_.push_back(std::move(item));
    not_empty_.notify_one();
  }

  // Blocks for the next item; empty once closed and drained.
  std::optional<T> pop() {
    std::unique_lock lock(mu_);
    not_empty_.wait(lock, [&] { return closed_ || !items_.empty(); });
    return take();
  }

  // The next item if there is one now, without blocking.
  std::optional<T> try_pop() {
    std::lock_guard lock(mu_);
    return take();
  }

  void close() {
    std::lock_guard lock(mu_);
    closed_ = true;
    not_empty_.notify_all();
  }

 private:
  std::optional<T> take() {  // under mu_
    if (items_.empty()) return std::nullopt;
    T item = std::move(items_.front());
    items_.pop_front();
    not_full_.notify_one();
    return item;
  }

  size_t capacity_;
  std::mutex mu_;
  std::condition_variable not_empty_, not_full_;
  std::deque<T> items_;
  bool closed_ = false;
};

}  // namespace smartinf::pipeline
