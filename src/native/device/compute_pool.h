// The parallel update: a fixed pool of threads that runs one chunk's kernel in grains.
// The kernels are element-wise (int8 ones block-wise), so grains cut at block boundaries
// give the same bits as one thread. One chunk at a time: devices sharing a pool take
// turns, each with every thread (a memory-bound kernel gains nothing from more). Chunks
// come one after another (a 7 B step is 6,300 of 1 Mi params, 0.3 ms each on 14 threads):
// grains taken as threads come free keep them even, and a worker spins a little before it
// sleeps, so the next chunk finds it awake.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace smartinf::device {

// The cores this rank's update runs on: SMARTINF_CORES ("0-7,16"), else, where several ranks
// share an unbound host (LOCAL_WORLD_SIZE, LOCAL_SIZE or Open MPI's > 1, each rank's affinity the whole host), the
// LOCAL_RANK-th of that many equal slices of its cores in NUMA-node order (launchers number
// ranks by GPU, and GPUs by node: rank r's slice lies on the node of GPU r on hosts that
// number them so); else none (no pinning: a launcher that bound the rank did it already).
std::vector<int> rank_cores();

class ComputePool {
 public:
  // `threads` workers in all, the calling thread included (1: run() calls fn inline); the
  // workers run on `cores` (none: wherever the process may).
  explicit ComputePool(unsigned threads, std::vector<int> cores = rank_cores());
  ~ComputePool();
  ComputePool(const ComputePool&) = delete;
  ComputePool& operator=(const ComputePool&) = delete;

  unsigned threads() const { return threads_; }
  // Calls fn(lo, hi) over [0, n) cut into grains of `grain` elements (the last one the
  // rest), each taken by whichever thread is free (the caller's too), so threads that
  // finish early take more; returns when all are done and rethrows the first exception.
  void run(uint64_t n, uint64_t grain, const std::function<void(uint64_t, uint64_t)>& fn);

 private:
  // One run's work, read by a worker under mu_ when it sees a new generation.
  struct Work {
    const std::function<void(uint64_t, uint64_t)>* fn = nullptr;
    uint64_t n = 0, grain = 0, grains = 0;
  };
  void work();
  // Takes and runs grains of `w` while the run of `generation` has any left.
  void take_grains(uint32_t generation, const Work& w);
  void done_grain(std::exception_ptr error);

  const unsigned threads_;
  std::mutex turn_;  // one run() at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  Work work_;
  // The run's generation (upper 32 bits) and its next grain (lower 32): a grain is taken by
  // one compare-exchange, and a worker late for a run that ended takes none of the next.
  std::atomic<uint64_t> claim_{0};
  std::atomic<uint64_t> pending_{0};  // grains of the current run not yet done
  std::exception_ptr error_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// The threads this process may run on (its CPU affinity), at least 1.
unsigned usable_cores();

// Zeroes `bytes` at `p` on `pool`'s threads: a budget touched at creation takes its page
// faults, and the zeroing, in parallel (5 GB in 2.7 s on one core of the 2-core VM, 1.4 s
// on two; a GPU's 40 GB host budget at 13 B had been zeroed on one of the H200 host's 16).
void zero_in_parallel(ComputePool& pool, void* p, size_t bytes);

// `bytes` of zeroed host memory whose pages are faulted in on `pool`'s threads now (a cpu
// device's budget, held from creation): an anonymous mapping, which the kernel zero-fills
// as each page is first written, so one write a page holds it where a memset wrote every
// byte a second time (5 GB in 1.0 s against 1.4 s on the 2-core VM's two threads).
class ZeroedMemory {
 public:
  ZeroedMemory() = default;
  ZeroedMemory(ComputePool& pool, size_t bytes);  // throws std::bad_alloc
  ~ZeroedMemory();
  ZeroedMemory(ZeroedMemory&& other) noexcept;
  ZeroedMemory& operator=(ZeroedMemory&& other) noexcept;
  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// The update's threads when none are given: the usable cores, less one where there are
// many (8 or more): the pool's parts finish together, so a core also running the ring's
// stage threads, the background lane or the training loop holds every chunk up (on the
// H100 host, 16 cores: a step of 1.56 B params resident 0.59 s on 15 threads, 0.65 s on
// 16, and 0.65 against 0.76 s while a background commit writes).
unsigned default_compute_threads();

// "0-3,8" -> {0, 1, 2, 3, 8}; throws std::invalid_argument naming `what` on anything else.
std::vector<int> parse_cpu_list(const std::string& list, const std::string& what);

}  // namespace smartinf::device
