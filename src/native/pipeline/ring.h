// The transfer handler: a ring of K fixed device slots and three stage threads.
//   loader:   take a free slot (blocks when all K are busy), read the chunk's states from
//             storage, copy the gradient in (host -> device) while the read is in flight
//   computer: run the kernel, copy params out (device -> host); the request's chunk is done
//             (a GPU runs Device::compute_lanes() computers, each chunk on its slot's stream)
//   writer:   write the states back to storage (the other shadow copy), free the slot
// Different chunks are in different stages at once; memory is K slots whatever the model.
// Beside the ring, on a device with resident memory, a background lane (thread
// smartinf-persist, its own engine) writes resident chunks' states to storage for a durable commit while later steps run: it needs
// no slot, and drain() does not wait for it (each write's completion says when it is done).
// The loader keeps the reads of every free slot in flight and the writer the writes of
// every slot it holds, so the storage queue does not drain between chunks: small chunks
// (int8/int4 states) keep the device as busy as large ones. With the phased I/O schedule
// the two take turns (io_phases.h).
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "device/device.h"
#include "io/engine.h"
#include "pipeline/completion.h"
#include "pipeline/io_phases.h"
#include "pipeline/queue.h"
#include "pipeline/rate_limiter.h"
#include "store/state_store.h"

namespace smartinf::pipeline {

// update: load, compute, params out, write back. init: states in from the host, written.
// read: states loaded and out to the host. verify: loaded and checked against checksums
// (into resident memory for a resident chunk: its load). persist: resident states written
// (the background lane). A resident chunk is never read from storage except by verify.
enum class JobKind { update, init, read, verify, persist };

struct Job {
  JobKind kind = JobKind::update;
  std::shared_ptr<Completion> completion;
  store::Extent src{};  // states read from (update, read)
  store::Extent dst{};  // states written to (update, init)
  // update: the dense gradient, or the compressed pairs' indices (then `values`)
  const void* input = nullptr;
  const void* values = nullptr;
  // update: updated params (with a split master also the bf16 params sent in); read with a
  // split master: the bf16 params the masters are rebuilt from (null: masters not read)
  void* output = nullptr;
  const void* ready = nullptr;  // update: Gradient::ready, which input and output wait for
  // init: the state arrays from the host; a null one is filled with `fill`
  const float* imported[device::kMaxStateArrays] = {};
  float fill[device::kMaxStateArrays] = {};
  float* exported[device::kMaxStateArrays] = {};  // read: the state arrays to the host
  device::Kernel kernel{};
  std::shared_ptr<const device::CallerParts> parts;  // kernel.parts, held while the job runs
  // Where the states are held: a byte of the device's resident memory, or streamed
  // through the slot (kOwnStates).
  uint64_t resident = device::kOwnStates;
  bool write_back = true;  // update, init: write the new states to `dst` (else they stay resident)
  // update of a resident chunk: its current states are at this byte of resident memory,
  // copied to `resident` before the kernel (a background commit is writing them); else
  // kOwnStates.
  uint64_t copy_from = device::kOwnStates;
  int64_t subgroup = -1;  // for error messages
  uint64_t chunk = 0;
  uint64_t written_at = 0;  // pipeline step that wrote `src`
  // An update's new version in a directory with a log: written to a free extent the writer
  // takes from the store (StateStore::take_spare), journaled once written.
  bool spare = false;
};

enum Stage { kLoad, kHostToDevice, kCompute, kDeviceToHost, kWriteback, kStages };
inline constexpr std::array<const char*, kStages> kStageNames = {
    "load", "host_to_device", "compute", "device_to_host", "writeback"};

struct Counters {
  std::atomic<uint64_t> host_to_device{0}, device_to_host{0}, storage_read{0},
      storage_write{0}, chunks{0};
  // Resident states read and written in device memory by the kernel (and by reads out).
  std::atomic<uint64_t> memory_read{0}, memory_write{0};
  std::array<std::atomic<uint64_t>, kStages> busy_ns{};
  // Time spent waiting for a bandwidth budget (host link, emulated internal storage).
  std::atomic<uint64_t> host_link_wait_ns{0}, storage_wait_ns{0};
  // Split master: chunks whose params came back other than emitted (taken as the masters).
  std::atomic<uint64_t> foreign_chunks{0};
  // Phased I/O: turns handed from reads to write-backs or back; the drive's turn waited
  // for while another process of the host held it (HostTurns).
  std::atomic<uint64_t> io_turns{0}, io_turn_waits{0};
  // The background lane: time with writes in flight; resident chunks copied to their twin
  // (a background commit held the first copy, or the update was speculative).
  std::atomic<uint64_t> persist_ns{0}, twin_copies{0};
};

// A chunk whose bf16 params were not the ones the device emitted with its split master.
struct ForeignChunk {
  int64_t subgroup;
  uint64_t chunk;
};

struct RingOptions {
  std::string io = "auto";
  unsigned queue_depth = 32;
  uint64_t piece_bytes = 1 << 20;
  std::shared_ptr<HostLink> host_link;  // shared by the pipeline's rings; null: no cap
  double storage_bps = 0;               // cap on this device's storage traffic; 0: none
  bool verify = false;                  // check every loaded extent against its checksum
  // "mixed": reads and write-backs in flight together; "phased": they take turns in bursts
  // of up to `io_burst` bytes (IoPhases). Neither changes a bit of the results.
  std::string io_schedule = "mixed";
  uint64_t io_burst = 256ull << 20;
};

class Ring {
 public:
  Ring(device::Device& device, store::StateStore& store, const RingOptions& options,
       std::vector<std::string>& notes);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Queues a job without blocking (a job is a few pointers; the K slots bound the memory
  // in flight), so one slow device never holds up the caller's work for the others.
  void push(Job job);
  // Waits for every pushed job, write-backs included; rethrows (once) the first
  // write-back error, which means the step must not be committed.
  void drain();
  // Queues a persist job (a resident chunk's states written to `dst`) on the background
  // lane; its completion is done when the write is, with the write's error if any. On a
  // device with a host twin the states are copied there first, before this returns.
  void persist(Job job);
  // Init jobs of a resident sub-group whose states reach storage at the first durable
  // commit (write_back false), run now on up to `threads` of the ring's free slots at once
  // (each a thread of its own, taking chunks as it comes free; none free: pushed); returns
  // when all are made, rethrowing the first error.
  void make_resident(std::vector<Job>& jobs, unsigned threads);

  const Counters& counters() const { return counters_; }
  // The chunks found foreign since the last call (in any job kind that sends params in).
  std::vector<ForeignChunk> take_foreign();
  const char* engine_name() const { return engine_name_; }

 private:
  struct Loaded {
    Job job;
    size_t slot;
    // Split master on a device that hashes_params(): the params sent in are hashed by the
    // update (Kernel::sent_sum), compared with `stored` (the sum of those emitted) after it.
    bool hashes_sent = false;
    uint64_t stored = 0, sent = 0;
  };
  using Deadline = std::optional<RateLimiter::Clock::time_point>;
  struct Loading {  // a load under way: its read (0: none) and what it sent in
    Loaded item;
    io::Ticket read;
    Deadline storage;
    bool send_params;
    uint64_t sent;  // their checksum, hashed here (not by the update)
  };
  struct Writing {  // a write-back under way
    Loaded item;
    io::Ticket write;
    Deadline storage;
  };
  std::exception_ptr take_spare(Loaded& item, std::deque<Writing>& writing);
  void load_loop();
  // Starts a job's load in `slot`; false when it is done with (init: handed to the
  // writer; or failed), true when it is under way.
  bool start_load(Job& job, size_t slot, Loading& loading);
  void init_chunk(const Job& job, size_t slot);
  static bool reads_storage(const Job& job);  // loads its states from storage
  // A split master's sent params hashed by the device's update (Kernel::sent_sum), not here.
  bool update_hashes_params(const Job& job) const;
  void finish_load(Loading& loading);
  void compute_loop();
  void write_loop();
  void finish_write(Writing& writing, std::exception_ptr error);
  // The chunk is done (failed with `error` when given) and its slot free again.
  void release(Job& job, size_t slot, std::exception_ptr error);
  // Waits for a batch of requests; its direction's turn ends either way.
  void settle(io::Engine& engine, io::Ticket ticket, IoPhases::Dir d);
  void finished();
  void persist_loop();
  io::Op state_io(bool write, const store::Extent& e, size_t slot, bool resident) const;
  io::Op storage_op(bool write, const store::Extent& e, void* buf, int buf_index) const;
  void check_sum(const Job& job, size_t slot) const;
  // Split master: the checksum of the params sent in (`sent`) against the one stored with the
  // states; foreign params become the masters (`job.kernel.adopt`).
  void check_params(Job& job, size_t slot, uint64_t sent);
  // A twin's first update: the split master's params checksum from the copy it starts from
  void params_sum_from_twin(const Job& job, size_t slot);
  void foreign(const Job& job);  // records a chunk sent params other than it emitted
  // Bandwidth caps: reserve when a transfer starts, finish (sleep out the rest) when done.
  Deadline reserve_host(bool to_device, uint64_t bytes);
  Deadline reserve_storage(uint64_t bytes);
  void finish_host(const Deadline& d) { finish(d, counters_.host_link_wait_ns); }
  void finish_storage(const Deadline& d) { finish(d, counters_.storage_wait_ns); }
  static void finish(const Deadline& d, std::atomic<uint64_t>& waited) {
    if (d) waited += RateLimiter::finish(*d);
  }

  device::Device& device_;
  store::StateStore& store_;
  std::unique_ptr<io::Engine> reader_, writer_, persister_;
  static constexpr size_t kPersistInFlight = 8;  // the background lane's writes in flight
  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };
  // Host copies the background lane writes from (devices whose resident states are not
  // host-visible: host_visible_resident), one per write in flight.
  std::vector<std::unique_ptr<void, FreeDeleter>> bounce_;
  const char* engine_name_ = "";
  std::shared_ptr<HostLink> host_link_;
  std::unique_ptr<RateLimiter> storage_limit_;
  bool verify_ = false, checksums_ = true, split_ = false, host_memory_ = false;
  Queue<Job> jobs_;
  Queue<size_t> free_slots_;
  Queue<Loaded> computing_, writing_;
  Queue<Job> persisting_;
  Counters counters_;
  std::unique_ptr<HostTurns> host_turns_;  // phased: the drive's turns across the host
  IoPhases phases_;

  std::mutex mu_;
  std::condition_variable idle_;
  size_t in_flight_ = 0;
  std::exception_ptr write_error_;
  std::vector<ForeignChunk> foreign_;
  // Split master: the params sum this ring's updates last stored, by (sub-group, chunk).
  // A chunk loaded with it holds a sum of the pieces the update hashes (not one of a
  // directory written before: store::whole_params_checksum), so the update may hash what
  // it is sent instead of this stage thread, serially, before it.
  std::unordered_map<uint64_t, uint64_t> emitted_;
  static uint64_t chunk_key(const Job& job) { return uint64_t(job.subgroup) << 32 | job.chunk; }
  std::thread loader_, writer_thread_, persister_thread_;
  std::vector<std::thread> computers_;  // Device::compute_lanes() of them
};

}  // namespace smartinf::pipeline
