#include "device/compute_pool.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <new>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace smartinf::device {

ComputePool::ComputePool(unsigned threads, std::vector<int> cores) : threads_(std::max(1u, threads)) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cores) CPU_SET(c, &set);
  for (unsigned i = 1; i < threads_; ++i)
    workers_.emplace_back([this, pin = !cores.empty(), set] {
      pthread_setname_np(pthread_self(), "smartinf-pool");
      if (pin) pthread_setaffinity_np(pthread_self(), sizeof set, &set);
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

namespace {

constexpr uint64_t kGrainBits = 32;
constexpr uint64_t kGrainMask = (uint64_t(1) << kGrainBits) - 1;
// How long a worker looks for the next run before it sleeps (a few chunks' gaps).
constexpr auto kSpin = std::chrono::microseconds(200);

}  // namespace

void ComputePool::take_grains(uint32_t generation, const Work& w) {
  uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    if ((c >> kGrainBits) != generation || (c & kGrainMask) >= w.grains) return;
    if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
    const uint64_t lo = (c & kGrainMask) * w.grain;
    std::exception_ptr error;
    try {
      (*w.fn)(lo, std::min(w.n, lo + w.grain));
    } catch (...) {
      error = std::current_exception();
    }
    done_grain(error);
    c = claim_.load(std::memory_order_acquire);
  }
}

void ComputePool::done_grain(std::exception_ptr error) {
  if (error) {
    std::lock_guard lock(mu_);
    if (!error_) error_ = error;
  }
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    std::lock_guard lock(mu_);  // the caller checks pending_ under it before it sleeps
    done_.notify_all();
  }
}

void ComputePool::work() {
  uint32_t seen = 0;
  for (;;) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while ((claim_.load(std::memory_order_acquire) >> kGrainBits) == seen &&
           std::chrono::steady_clock::now() < until)
      _mm_pause();
    Work w;
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || (claim_.load() >> kGrainBits) != seen; });
      if (stop_) return;
      seen = static_cast<uint32_t>(claim_.load() >> kGrainBits);
      w = work_;
    }
    take_grains(seen, w);
  }
}

void ComputePool::run(uint64_t n, uint64_t grain, const std::function<void(uint64_t, uint64_t)>& fn) {
  if (n == 0) return;
  const uint64_t grains = (n + grain - 1) / grain;
  if (threads_ == 1 || grains == 1) return fn(0, n);
  if (grains > kGrainMask) throw std::invalid_argument("a pool run of more than 2^32 grains");
  std::lock_guard turn(turn_);
  uint32_t generation;
  {
    std::lock_guard lock(mu_);
    work_ = Work{&fn, n, grain, grains};
    error_ = nullptr;
    pending_.store(grains, std::memory_order_relaxed);
    generation = static_cast<uint32_t>((claim_.load() >> kGrainBits) + 1);
    claim_.store(uint64_t(generation) << kGrainBits, std::memory_order_release);
  }
  wake_.notify_all();
  take_grains(generation, work_);
  while (pending_.load(std::memory_order_acquire) != 0) {  // the last grains, on other threads
    std::unique_lock lock(mu_);
    done_.wait_for(lock, std::chrono::microseconds(50),
                   [&] { return pending_.load(std::memory_order_acquire) == 0; });
  }
  std::lock_guard lock(mu_);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

// From 8 cores on, two are left: one to the training loop (its forward runs while the last
// step's updates do), one to the ring's threads and the background lane. A pool part on a
// shared core holds the whole chunk up (H100 host, GPT-2 XL: 14 threads 1.15 s per
// iteration, 15 threads 1.27 s, with the step finishing during the next forward).
// Several ranks of one host (local_ranks: what the launcher says) share its cores: each
// takes its share, unless the launcher bound it to cores of its own already (its affinity
// narrower than the host: --bind_cores_to_rank).
unsigned default_compute_threads() {
  const std::vector<int> mine = rank_cores();
  const unsigned cores = mine.empty() ? usable_cores() : static_cast<unsigned>(mine.size());
  return cores >= 8 ? cores - 2 : cores;
}

namespace {

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtol(v, nullptr, 10) : fallback;
}

// The ranks of this host, as launchers give them: torchrun's LOCAL_WORLD_SIZE, the deepspeed
// launcher's LOCAL_SIZE, Open MPI's (smartinf.defaults.local_ranks reads the same, in order).
long local_ranks() {
  for (const char* name : {"LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"})
    if (const long n = env_long(name, 0); n > 0) return n;
  return 1;
}

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

// The allowed cores in NUMA-node order (node 0's first), each once.
std::vector<int> numa_ordered(const cpu_set_t& allowed) {
  std::vector<int> order;
  for (int node = 0; node < 1024; ++node) {
    const std::string list = read_line("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
    if (list.empty()) break;
    for (int c : parse_cpu_list(list, "node cpulist"))
      if (c < CPU_SETSIZE && CPU_ISSET(c, &allowed) && std::find(order.begin(), order.end(), c) == order.end())
        order.push_back(c);
  }
  for (int c = 0; c < CPU_SETSIZE; ++c)  // no NUMA information: in number order
    if (CPU_ISSET(c, &allowed) && std::find(order.begin(), order.end(), c) == order.end()) order.push_back(c);
  return order;
}

}  // namespace

std::vector<int> parse_cpu_list(const std::string& list, const std::string& what) {
  std::vector<int> cores;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    int lo = -1, hi = -1;
    char dash = 0, extra = 0;
    const int got = std::sscanf(item.c_str(), "%d%c%d%c", &lo, &dash, &hi, &extra);
    if (got == 1) hi = lo;
    if (!((got == 1 || (got == 3 && dash == '-')) && 0 <= lo && lo <= hi && hi < CPU_SETSIZE))
      throw std::invalid_argument(what + " must list cores as '0-7,16' (each below " +
                                  std::to_string(CPU_SETSIZE) + "), got '" + list + "'");
    for (int c = lo; c <= hi; ++c) cores.push_back(c);
  }
  if (cores.empty()) throw std::invalid_argument(what + " lists no core: '" + list + "'");
  return cores;
}

std::vector<int> rank_cores() {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return {};
  if (const char* given = std::getenv("SMARTINF_CORES"); given && *given) {
    std::vector<int> cores;
    for (int c : parse_cpu_list(given, "SMARTINF_CORES"))
      if (CPU_ISSET(c, &allowed)) cores.push_back(c);
    if (cores.empty())
      throw std::invalid_argument(std::string("SMARTINF_CORES=") + given +
                                  " names none of the cores this process may run on");
    return cores;
  }
  const long local = local_ranks(), rank = env_long("LOCAL_RANK", 0);
  const unsigned usable = static_cast<unsigned>(CPU_COUNT(&allowed));
  if (local <= 1 || rank < 0 || rank >= local || usable < std::thread::hardware_concurrency()) return {};
  const std::vector<int> order = numa_ordered(allowed);
  const size_t share = std::max<size_t>(1, order.size() / static_cast<size_t>(local));
  const size_t lo = std::min(order.size() - 1, static_cast<size_t>(rank) * share);
  return {order.begin() + static_cast<long>(lo),
          order.begin() + static_cast<long>(std::min(order.size(), lo + share))};
}

void zero_in_parallel(ComputePool& pool, void* p, size_t bytes) {
  constexpr size_t kPiece = size_t{2} << 20;
  const size_t pieces = (bytes + kPiece - 1) / kPiece;
  pool.run(pieces, 1, [&](uint64_t lo, uint64_t hi) {
    char* at = static_cast<char*>(p) + lo * kPiece;
    std::memset(at, 0, std::min(hi * kPiece, bytes) - lo * kPiece);
  });
}

ZeroedMemory::ZeroedMemory(ComputePool& pool, size_t bytes) : bytes_(bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  data_ = p;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  constexpr size_t kPiece = size_t{2} << 20;
  pool.run((bytes + kPiece - 1) / kPiece, 1, [&](uint64_t lo, uint64_t hi) {
    char* at = static_cast<char*>(data_);
    for (size_t b = lo * kPiece, end = std::min(hi * kPiece, bytes); b < end; b += page)
      *reinterpret_cast<volatile char*>(at + b) = 0;
  });
}

ZeroedMemory::~ZeroedMemory() {
  if (data_) munmap(data_, bytes_);
}

ZeroedMemory::ZeroedMemory(ZeroedMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

ZeroedMemory& ZeroedMemory::operator=(ZeroedMemory&& other) noexcept {
  if (this != &other) {
    if (data_) munmap(data_, bytes_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

unsigned usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return std::max(1u, std::thread::hardware_concurrency());
  return std::max(1, CPU_COUNT(&set));
}

}  // namespace smartinf::device
