// Which of a device's two I/O directions may start requests: its reads (the loader) and its
// write-backs (the writer). "mixed": both at any time. "phased": they take turns, in bursts
// of one direction, for drives that lose bandwidth when reads and writes are mixed (the
// probe's mix curve says which). A turn lasts while its direction has requests to start,
// or until `burst` bytes were started and the other direction waits; the next turn starts
// when the last request of the turn has finished. The slots absorb the difference: reads
// fill free slots during a read turn, write-backs empty them during a write turn. With
// HostTurns (several processes' devices on one drive), a turn's requests also wait for the
// drive's turn across the host's processes, held while the turn has requests in flight or
// to start, so that the drive sees one direction of one process at a time.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "pipeline/host_turns.h"

namespace smartinf::pipeline {

class IoPhases {
 public:
  enum Dir { kRead = 0, kWrite = 1 };

  // `turns` counts the hand-overs from one direction to the other; `host`: the drive's
  // turns across the host's processes (null: this process's alone).
  IoPhases(bool phased, uint64_t burst, std::atomic<uint64_t>& turns, HostTurns* host = nullptr)
      : phased_(phased), burst_(burst), turns_(turns), host_(host) {}

  // Blocks until `d` may start a request of `bytes`, and counts it in flight. Only for a
  // direction with no request of its own in flight (else try_begin, and finish those
  // first): the other direction's turn waits for them.
  void begin(Dir d, uint64_t bytes) {
    if (!phased_) return;
    std::unique_lock lock(mu_);
    for (;;) {
      changed_.wait(lock, [&] { return may_start(d) && !taking_; });
      if (holds_host()) break;
      taking_ = true;  // the other direction's thread waits for this take, never takes too
      lock.unlock();
      host_->take();
      lock.lock();
      taking_ = false, held_ = true, taken_by_ = owner_;
      changed_.notify_all();
      if (may_start(d)) break;
      give_back_if_done();
    }
    start(d, bytes);
  }

  // begin() if `d` may start now, else false (having asked for the turn, as begin() does).
  bool try_begin(Dir d, uint64_t bytes) {
    if (!phased_) return true;
    std::lock_guard lock(mu_);
    if (!may_start(d) || taking_ || !holds_host()) return false;
    start(d, bytes);
    return true;
  }

  // One request of `d` finished (or failed).
  void end(Dir d) {
    if (!phased_) return;
    std::lock_guard lock(mu_);
    --in_flight_[d];
    give_back_if_done();
    changed_.notify_all();
  }

  // `d` has no request to start now: a waiting other direction takes the turn (after this
  // one's requests in flight); one that comes later takes it at once.
  void idle(Dir d) {
    if (!phased_) return;
    std::lock_guard lock(mu_);
    idle_[d] = true;
    give_back_if_done();
    changed_.notify_all();
  }

 private:
  // Asked by `d`: the turn passes to it when the owner is idle or has spent its burst; `d`
  // starts once the owner's last request has finished.
  bool may_start(Dir d) {
    const Dir other = Dir(1 - d);
    if (owner_ == other && (idle_[other] || started_[other] >= burst_)) hand_over(d);
    return owner_ == d && in_flight_[other] == 0;
  }

  // Whether this process holds the drive's turn (or needs none), taking it where it is free.
  bool holds_host() {
    if (!host_ || held_) return true;
    if (!host_->try_take()) return false;
    held_ = true, taken_by_ = owner_;
    return true;
  }

  // The drive's turn goes back once nothing is in flight and this process's turn is over:
  // its direction idle, or the turn handed to the other direction (which takes it again).
  void give_back_if_done() {
    if (!held_ || in_flight_[kRead] || in_flight_[kWrite]) return;
    if (!idle_[owner_] && owner_ == taken_by_) return;
    host_->give_back();
    held_ = false;
  }

  void start(Dir d, uint64_t bytes) {
    idle_[d] = false;
    ++in_flight_[d];
    started_[d] += bytes;
  }

  void hand_over(Dir to) {
    ++turns_;
    owner_ = to;
    started_[to] = 0;
    changed_.notify_all();
  }

  const bool phased_;
  const uint64_t burst_;
  std::atomic<uint64_t>& turns_;
  HostTurns* const host_;
  std::mutex mu_;
  std::condition_variable changed_;
  Dir owner_ = kRead;
  unsigned in_flight_[2] = {0, 0};
  uint64_t started_[2] = {0, 0};
  bool idle_[2] = {false, false};
  bool held_ = false, taking_ = false;  // the drive's turn: held; being taken (outside mu_)
  Dir taken_by_ = kRead;                // the direction that owned the turn when it was taken
};

}  // namespace smartinf::pipeline
