#include "pipeline/ring.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <thread>
#include <stdexcept>
#include <utility>

#include "error.h"
#include "kernels/numeric.h"
#include "pipeline/timer.h"
#include "store/checksum.h"

namespace smartinf::pipeline {

Ring::Ring(device::Device& device, store::StateStore& store, const RingOptions& options,
           std::vector<std::string>& notes)
    : device_(device),
      store_(store),
      computing_(device.slot_count()),
      writing_(device.slot_count()),
      host_turns_(options.io_schedule == "phased" && HostTurns::across_host()
                      ? std::make_unique<HostTurns>(store.dir(), counters_.io_turn_waits)
                      : nullptr),
      phases_(options.io_schedule == "phased", options.io_burst, counters_.io_turns, host_turns_.get()) {
  io::Options io_options;
  io_options.queue_depth = options.queue_depth;
  io_options.piece_bytes = options.piece_bytes;
  if (device.registrable())
    for (size_t i = 0; i < device.slot_count(); ++i)
      io_options.fixed_buffers.push_back(iovec{device.slot(i).states, device.slot_states_bytes()});
  reader_ = io::make_engine(options.io, io_options, notes);
  io_options.low_priority = true;  // write-back yields to the loads on the critical path
  writer_ = io::make_engine(reader_->name(), io_options, notes);
  engine_name_ = reader_->name();
  host_link_ = options.host_link;
  verify_ = options.verify;
  checksums_ = device.host_visible_states();
  split_ = store.layout().split();
  host_memory_ = device.host_memory();
  if (options.storage_bps > 0) storage_limit_ = std::make_unique<RateLimiter>(options.storage_bps);
  for (size_t i = 0; i < device.slot_count(); ++i) free_slots_.push(i);
  // Resident states outside host memory are written from host copies: fixed, made now
  // (a host twin is one of the whole resident memory).
  if (device.resident_bytes() && !device.host_visible_resident() && !device.host_twin())
    for (size_t i = 0; i < kPersistInFlight; ++i) {
      void* mem = std::aligned_alloc(store::kAlign, store::align_up(device.slot_states_bytes()));
      if (!mem) throw std::bad_alloc();
      bounce_.emplace_back(mem);
    }
  // Named for top -H / perf: one thread per stage.
  loader_ = std::thread([this] { pthread_setname_np(pthread_self(), "smartinf-load"); load_loop(); });
  for (unsigned i = 0; i < std::max(1u, device.compute_lanes()); ++i)
    computers_.emplace_back([this] { pthread_setname_np(pthread_self(), "smartinf-comp"); compute_loop(); });
  writer_thread_ = std::thread([this] { pthread_setname_np(pthread_self(), "smartinf-write"); write_loop(); });
  if (device.resident_bytes()) {  // the background lane writes resident memory only
    io_options.fixed_buffers.clear();

    persister_ = io::make_engine(reader_->name(), io_options, notes);
    persister_thread_ = std::thread([this] { pthread_setname_np(pthread_self(), "smartinf-persist"); persist_loop(); });
  }
}

Ring::~Ring() {
  jobs_.close();
  loader_.join();
  computing_.close();
  for (std::thread& t : computers_) t.join();
  writing_.close();
  writer_thread_.join();
  persisting_.close();
  if (persister_thread_.joinable()) persister_thread_.join();
}

void Ring::push(Job job) {
  {
    std::lock_guard lock(mu_);
    ++in_flight_;
  }
  jobs_.push(std::move(job));
}

void Ring::drain() {
  std::unique_lock lock(mu_);
  idle_.wait(lock, [&] { return in_flight_ == 0; });
  if (write_error_) {
    std::exception_ptr e = write_error_;
    write_error_ = nullptr;
    std::rethrow_exception(e);
  }
}

std::vector<ForeignChunk> Ring::take_foreign() {
  std::lock_guard lock(mu_);
  return std::exchange(foreign_, {});
}

void Ring::check_params(Job& job, size_t slot, uint64_t sent) {
  const uint64_t emitted = device_.params_sum(slot, store_.layout().params_sum_offset(job.src.numel));
  if (sent == emitted) return;
  // states stored before the pieces were hashed apart: their sum is of the whole chunk
  if (device_.params_checksum(slot, job.output, job.src.numel, true) == emitted) return;
  job.kernel.adopt = true;
  foreign(job);
}

void Ring::params_sum_from_twin(const Job& job, size_t slot) {
  const uint64_t at = store_.layout().params_sum_offset(job.src.numel);
  device_.bind_states(slot, job.copy_from);
  const uint64_t sum = device_.params_sum(slot, at);
  device_.bind_states(slot, job.resident);
  device_.set_params_sum(slot, at, sum);
}

void Ring::foreign(const Job& job) {
  ++counters_.foreign_chunks;
  std::lock_guard lock(mu_);
  foreign_.push_back({job.subgroup, job.chunk});
}

void Ring::finished() {
  std::lock_guard lock(mu_);
  if (--in_flight_ == 0) idle_.notify_all();
}

Ring::Deadline Ring::reserve_host(bool to_device, uint64_t bytes) {
  if (!host_link_) return std::nullopt;
  return (to_device ? host_link_->to_device : host_link_->to_host).reserve(bytes);
}

Ring::Deadline Ring::reserve_storage(uint64_t bytes) {
  if (!storage_limit_) return std::nullopt;
  return storage_limit_->reserve(bytes);
}

void Ring::check_sum(const Job& job, size_t slot) const {
  const uint64_t expected = *job.src.sum;
  if (!checksums_ || expected == 0) return;
  const uint64_t actual = store::extent_checksum(device_.slot(slot).states, job.src.bytes);
  if (actual != expected)
    throw SystemError(EBADMSG,
                      "checksum mismatch in sub-group " + std::to_string(job.subgroup) +
                          ", chunk " + std::to_string(job.chunk) + " (bytes " +
                          std::to_string(job.src.offset) + "+" + std::to_string(job.src.bytes) +
                          ", written at step " + std::to_string(job.written_at) +
                          "): bit rot or a foreign write; restore the directory from a checkpoint",
                      store_.file_path());
}

io::Op Ring::state_io(bool write, const store::Extent& e, size_t slot, bool resident) const {
  // only slots are registered
  return storage_op(write, e, device_.slot(slot).states, resident ? -1 : static_cast<int>(slot));
}

io::Op Ring::storage_op(bool write, const store::Extent& e, void* buf, int buf_index) const {
  io::Op op;
  op.write = write;
  op.fd = store_.fd();
  op.path = &store_.file_path();
  op.buf = buf;
  op.len = e.bytes;
  op.offset = e.offset;
  op.buf_index = buf_index;
  return op;
}

void Ring::persist(Job job) {
  if (!persister_) throw std::logic_error("persist job for a device without resident memory");
  if (char* twin = device_.host_twin())  // the resident copy is free once this returns
    device_.resident_to_host(job.resident, twin + job.resident, job.dst.bytes);
  persisting_.push(std::move(job));
}

// The background lane: several chunks' writes in flight, as the writer keeps them. Its
// writes ignore the I/O schedule's turns: while a background commit is pending the
// pipeline streams nothing (a streamed sub-group's update waits for the commit to land).
void Ring::persist_loop() {
  size_t next_bounce = 0;
  struct Write {
    Job job;
    io::Ticket ticket;
    Deadline storage;
  };
  std::deque<Write> writing;  // oldest first
  std::chrono::steady_clock::time_point busy_since;  // the first of the writes in flight
  for (;;) {
    std::optional<Job> job;
    if (writing.size() < kPersistInFlight) job = writing.empty() ? persisting_.pop() : persisting_.try_pop();
    if (job) {
      Write w{std::move(*job), 0, std::nullopt};
      try {
        void* states;
        if (char* twin = device_.host_twin()) {
          states = twin + w.job.resident;  // copied there by persist()
        } else if (bounce_.empty()) {
          states = const_cast<void*>(device_.resident_at(w.job.resident));
        } else {  // FIFO: this buffer's last write, kPersistInFlight back, is done
          states = bounce_[next_bounce].get();
          next_bounce = (next_bounce + 1) % bounce_.size();
          device_.resident_to_host(w.job.resident, states, w.job.dst.bytes);
        }
        *w.job.dst.sum = checksums_ ? store::extent_checksum(states, w.job.dst.bytes) : 0;
        w.storage = reserve_storage(w.job.dst.bytes);
        const io::Op op = storage_op(true, w.job.dst, states, -1);
        if (writing.empty()) busy_since = std::chrono::steady_clock::now();
        w.ticket = persister_->submit({&op, 1});
        writing.push_back(std::move(w));
      } catch (...) {
        w.job.completion->chunk_done(std::current_exception());
      }
      continue;
    }
    if (writing.empty()) return;  // closed and drained
    Write& w = writing.front();
    std::exception_ptr error;
    try {
      persister_->wait_for(w.ticket);
      counters_.storage_write += w.job.dst.bytes;
      finish_storage(w.storage);
    } catch (...) {
      error = std::current_exception();
    }
    w.job.completion->chunk_done(error);
    writing.pop_front();
    if (writing.empty())
      counters_.persist_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - busy_since).count();
  }
}

void Ring::settle(io::Engine& engine, io::Ticket ticket, IoPhases::Dir d) {
  try {
    engine.wait_for(ticket);
  } catch (...) {
    phases_.end(d);
    throw;
  }
  phases_.end(d);
}

void Ring::release(Job& job, size_t slot, std::exception_ptr error) {
  job.completion->chunk_done(error);
  free_slots_.push(slot);
  finished();
}

void Ring::load_loop() {
  std::deque<Loading> loading;  // oldest first
  std::optional<Loaded> next;   // taken, but waiting for the read turn (phased I/O)
  for (;;) {
    // Start a load in every free slot there is a job for; block only with none under way.
    for (;;) {
      if (!next) {
        std::optional<size_t> slot = free_slots_.try_pop();
        if (!slot) {
          phases_.idle(IoPhases::kRead);
          if (!loading.empty()) break;
          slot = free_slots_.pop();
        }
        std::optional<Job> job = jobs_.try_pop();
        if (!job) {
          phases_.idle(IoPhases::kRead);
          if (!loading.empty() || !(job = jobs_.pop())) {
            free_slots_.push(*slot);
            if (loading.empty()) return;  // closed and drained
            break;
          }
        }
        next = Loaded{std::move(*job), *slot};
      }
      if (reads_storage(next->job)) {
        const uint64_t bytes = next->job.src.bytes;
        if (loading.empty())
          phases_.begin(IoPhases::kRead, bytes);
        else if (!phases_.try_begin(IoPhases::kRead, bytes))
          break;  // the write-backs' turn: finish the reads under way first
      }
      Loading l{std::move(*next), 0, std::nullopt, false, 0};
      next.reset();
      if (start_load(l.item.job, l.item.slot, l)) loading.push_back(std::move(l));
    }
    if (loading.empty()) continue;
    finish_load(loading.front());
    loading.pop_front();
  }
}

// An init job's states made in the slot, bound already: arrays from the host cross the
// host link; filled ones are made on the device.
void Ring::init_chunk(const Job& job, size_t slot) {
  uint64_t bytes = 0;
  for (const float* a : job.imported) bytes += a ? job.dst.numel * 4 : 0;
  Timer t(counters_.busy_ns[bytes ? kHostToDevice : kCompute]);
  const Deadline link = reserve_host(true, bytes);
  device_.init_states(slot, job.imported, job.fill, job.dst.numel);
  counters_.host_to_device += bytes;
  finish_host(link);
}

// The host's import of a chunk (a split master's low halves and params sums, the moments
// coded) is the work, one thread's per chunk: on the ring's load stage alone, 13 B's states
// took 62 s to make; each slot's thread takes the next chunk as it comes free.
void Ring::make_resident(std::vector<Job>& jobs, unsigned threads) {
  // The slots free now (the load stage, idle, holds one while it waits for a job): none,
  // and the load stage makes them, one after another.
  const size_t lanes = std::min<size_t>(threads, jobs.size());
  std::vector<size_t> slots;
  while (slots.size() < lanes)
    if (const std::optional<size_t> slot = free_slots_.try_pop()) slots.push_back(*slot);
    else break;
  if (slots.empty()) {
    for (Job& job : jobs) push(job);
    if (!jobs.empty()) jobs.front().completion->wait();
    return;
  }
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> errors(slots.size());
  const auto lane = [&](size_t l) {
    try {
      for (size_t c; (c = next.fetch_add(1)) < jobs.size();) {
        const Job& job = jobs[c];
        device_.bind_states(slots[l], job.resident);
        init_chunk(job, slots[l]);
      }
    } catch (...) {
      errors[l] = std::current_exception();
      next = jobs.size();
    }
    try {
      device_.bind_states(slots[l], device::kOwnStates);
    } catch (...) {
    }
  };
  std::vector<std::thread> others;
  for (size_t l = 1; l < slots.size(); ++l) others.emplace_back(lane, l);
  lane(0);
  for (std::thread& t : others) t.join();
  for (size_t slot : slots) free_slots_.push(slot);
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

bool Ring::update_hashes_params(const Job& job) const {
  return device_.hashes_params() && job.kind == JobKind::update;
}

bool Ring::reads_storage(const Job& job) {
  if (job.kind == JobKind::init) return false;
  return job.resident == device::kOwnStates || job.kind == JobKind::verify;
}

bool Ring::start_load(Job& job, size_t slot, Loading& l) {
  const bool resident = job.resident != device::kOwnStates;
  try {
    device_.bind_states(slot, job.resident);
    if (job.kind == JobKind::init) {
      init_chunk(job, slot);
      if (job.write_back)
        writing_.push(Loaded{std::move(job), slot});
      else  // resident, reaching storage at the first durable commit
        release(job, slot, nullptr);
      return false;
    }
    if (job.copy_from != device::kOwnStates) {
      ++counters_.twin_copies;
      if (job.kind == JobKind::update) {
        // Copied by the kernel as it reads them (a GPU with states in host memory reads the
        // twin's over PCIe: no host copy; a host memcpy of 36 GB took 8.4 s at 13 B). A split
        // master's params checksum is read before that (finish_load): it comes now.
        job.kernel.copy_from = job.copy_from;
        if (split_) params_sum_from_twin(job, slot);
      } else {  // now, before anything reads the states
        Timer t(counters_.busy_ns[kLoad]);
        device_.copy_states(slot, job.copy_from, job.src.bytes);
      }
    }
    // Resident states are in device memory already; verify is their load. The read's
    // turn was taken (IoPhases::begin) by the caller.
    if (reads_storage(job)) {
      Timer t(counters_.busy_ns[kLoad]);
      l.storage = reserve_storage(job.src.bytes);
      const io::Op op = state_io(false, job.src, slot, resident);
      l.read = reader_->submit({&op, 1});
    }
    // Caller's buffers the device reaches are worked on where they are: nothing to copy
    // in or out (the bytes count as crossing the link only for the cpu device's host).
    const bool dense = job.kind == JobKind::update && !job.kernel.compressed;
    const bool grad_there = dense && device_.reaches(job.input);
    const bool out_there = job.output && device_.reaches(job.output);
    device_.bind_caller(slot, grad_there ? job.input : nullptr, out_there ? job.output : nullptr,
                        job.ready);
    l.send_params = split_ && job.output && (job.kind == JobKind::update || job.kind == JobKind::read);
    if (l.send_params && out_there && !host_memory_ && job.kind == JobKind::read)
      throw std::invalid_argument("a split master's states are read out through host memory: "
                                  "pass its params in host memory, not in " + device_.describe() + "'s");
    if (l.send_params) {  // a split master's upper halves: the caller's bf16 params
      Timer h(counters_.busy_ns[kHostToDevice]);
      const uint64_t bytes = job.src.numel * 2;
      const bool crosses = !out_there || host_memory_;
      const Deadline link = reserve_host(true, crosses ? bytes : 0);
      // A device that hashes them in its update is asked to once the stored sum is in.
      if (!update_hashes_params(job)) l.sent = device_.params_checksum(slot, job.output, job.src.numel);
      if (!out_there) device_.copy_in_params(slot, job.output, bytes);
      if (crosses) counters_.host_to_device += bytes;
      finish_host(link);
    }
    if (job.kind == JobKind::update) {  // the gradient crosses the host link meanwhile
      Timer h(counters_.busy_ns[kHostToDevice]);
      const device::Kernel& k = job.kernel;
      const size_t size = kernels::dtype_size(k.grad);
      const uint64_t bytes = k.compressed ? k.nnz * (4 + size) : job.src.numel * size;
      const bool crosses = !grad_there || host_memory_;
      const Deadline link = reserve_host(true, crosses ? bytes : 0);
      if (k.compressed)
        device_.copy_in_compressed(slot, static_cast<const int32_t*>(job.input), job.values,
                                   k.nnz, size);
      else if (!grad_there)
        device_.copy_in(slot, job.input, bytes);
      if (crosses) counters_.host_to_device += bytes;
      finish_host(link);
    }
    return true;
  } catch (...) {
    // A read already submitted must finish before the slot is given back; the read turn
    // the caller took for it ends either way.
    if (reads_storage(job)) {
      if (l.read) {
        try {
          reader_->wait_for(l.read);
        } catch (...) {
        }
      }
      phases_.end(IoPhases::kRead);
    }
    release(job, slot, std::current_exception());
    return false;
  }
}

void Ring::finish_load(Loading& l) {
  Job& job = l.item.job;
  const size_t slot = l.item.slot;
  try {
    if (l.read) {
      Timer t(counters_.busy_ns[kLoad]);
      settle(*reader_, std::exchange(l.read, 0), IoPhases::kRead);
      counters_.storage_read += job.src.bytes;
    }
    finish_storage(l.storage);
    if (l.send_params) {
      const uint64_t stored = device_.params_sum(slot, store_.layout().params_sum_offset(job.src.numel));
      bool ours = false;
      if (update_hashes_params(job)) {
        std::lock_guard lock(mu_);
        const auto it = emitted_.find(chunk_key(job));
        ours = it != emitted_.end() && it->second == stored;
      }
      if (ours) {
        l.item.hashes_sent = true;
        l.item.stored = stored;
      } else {
        if (update_hashes_params(job)) {  // not hashed above: now, before the update
          Timer h(counters_.busy_ns[kHostToDevice]);
          l.sent = device_.params_checksum(slot, job.output, job.src.numel);
        }
        check_params(job, slot, l.sent);
      }
    }
    if (job.kind == JobKind::verify) {
      check_sum(job, slot);
      if (job.resident != device::kOwnStates) device_.resident_loaded(slot, job.src.bytes);
    }
  } catch (...) {
    release(job, slot, std::current_exception());
    return;
  }
  if (job.kind == JobKind::verify)
    release(job, slot, nullptr);
  else
    computing_.push(std::move(l.item));
}

void Ring::compute_loop() {
  while (std::optional<Loaded> item = computing_.pop()) {
    Job& job = item->job;
    const size_t numel = job.src.numel;
    const bool resident = job.resident != device::kOwnStates;
    try {
      // Checked here, not in the loader: the next read is already under way meanwhile.
      // (Resident states were checked when loaded and have been in memory since.)
      if (verify_ && !resident) check_sum(job, item->slot);
      if (job.kind == JobKind::read) {
        Timer t(counters_.busy_ns[kDeviceToHost]);
        uint64_t bytes = 0;
        for (float* a : job.exported) bytes += a ? numel * 4 : 0;
        const Deadline link = reserve_host(false, bytes);
        device_.export_states(item->slot, job.exported, numel, job.kernel.adopt);
        counters_.device_to_host += bytes;
        if (resident) counters_.memory_read += job.src.bytes;
        finish_host(link);
      } else {
        {
          Timer t(counters_.busy_ns[kCompute]);
          job.kernel.sent_sum = item->hashes_sent ? &item->sent : nullptr;
          device_.compute(item->slot, job.kernel, numel);
          if (resident && device_.resident_over_link()) {
            counters_.host_to_device += job.src.bytes;
            counters_.device_to_host += job.src.bytes;
          } else if (resident) {
            counters_.memory_read += job.src.bytes;
            counters_.memory_write += job.src.bytes;
          }
        }
        Timer t(counters_.busy_ns[kDeviceToHost]);
        const size_t bytes = numel * kernels::dtype_size(job.kernel.param);
        const bool out_there = device_.reaches(job.output);  // written in place by compute
        const bool crosses = !out_there || host_memory_;
        const Deadline link = reserve_host(false, crosses ? bytes : 0);
        if (!out_there) device_.copy_out(item->slot, job.output, bytes);
        if (crosses) counters_.device_to_host += bytes;
        finish_host(link);
        if (split_ && !device_.hashes_params())  // stored with the states: the params that must come back
          device_.set_params_sum(item->slot, store_.layout().params_sum_offset(numel),
                                 device_.params_checksum(item->slot, job.output, numel));
        if (item->hashes_sent && item->sent != item->stored) foreign(job);
        if (split_ && device_.hashes_params()) {
          const uint64_t sum = device_.params_sum(item->slot, store_.layout().params_sum_offset(numel));
          std::lock_guard lock(mu_);
          emitted_[chunk_key(job)] = sum;
        }
      }
    } catch (...) {  // e.g. a device without its kernel: nothing is written back
      release(job, item->slot, std::current_exception());
      continue;
    }
    ++counters_.chunks;
    if (job.kind == JobKind::read || !job.write_back) {
      release(job, item->slot, nullptr);
    } else {
      job.completion->chunk_done();  // OUT: the caller may reuse its buffers now
      writing_.push(std::move(*item));
    }
  }
}

void Ring::write_loop() {
  std::deque<Writing> writing;  // oldest first
  std::optional<Loaded> next;   // waiting for the write turn (phased I/O)
  for (;;) {
    if (!next) {
      next = writing_.try_pop();
      if (!next) {
        phases_.idle(IoPhases::kWrite);
        if (writing.empty() && !(next = writing_.pop())) return;  // closed and drained
      }
    }
    if (next && store_.logs() && next->job.kind == JobKind::update && !next->job.spare) {
      if (std::exception_ptr error = take_spare(*next, writing)) {
        Writing failed{std::move(*next), 0, std::nullopt};
        next.reset();
        finish_write(failed, error);
        continue;
      }
    }
    if (next) {
      const uint64_t bytes = next->job.dst.bytes;
      bool turn = true;
      if (writing.empty())
        phases_.begin(IoPhases::kWrite, bytes);
      else
        turn = phases_.try_begin(IoPhases::kWrite, bytes);
      if (turn) {
        Writing w{std::move(*next), 0, std::nullopt};
        next.reset();
        Job& job = w.item.job;
        std::exception_ptr error;
        try {
          Timer t(counters_.busy_ns[kWriteback]);
          *job.dst.sum = checksums_ ? store::extent_checksum(device_.slot(w.item.slot).states, job.dst.bytes) : 0;
          w.storage = reserve_storage(job.dst.bytes);
          const io::Op op = state_io(true, job.dst, w.item.slot, job.resident != device::kOwnStates);
          w.write = writer_->submit({&op, 1});
        } catch (...) {
          error = std::current_exception();
          phases_.end(IoPhases::kWrite);
        }
        if (error)
          finish_write(w, error);
        else
          writing.push_back(std::move(w));
        continue;  // more writes while there are slots to write
      }
      // The reads' turn: finish the writes under way first.
    }
    if (writing.empty()) continue;
    finish_write(writing.front(), nullptr);
    writing.pop_front();
  }
}

// A free extent for a log's new version (StateStore::take_spare). Where none is, the writes
// under way finish (journaled) and are made durable, which frees the extents their chunks
// left: unless one of the step's writes failed, when the step before must stay whole (the
// step is forgotten, not finished) and this one is not written: its error.
std::exception_ptr Ring::take_spare(Loaded& item, std::deque<Writing>& writing) {
  try {
    uint64_t at;
    while ((at = store_.take_spare()) == store::kNoExtent) {
      if (!writing.empty()) {
        finish_write(writing.front(), nullptr);
        writing.pop_front();
        continue;
      }
      {
        std::lock_guard lock(mu_);
        if (write_error_)
          throw std::runtime_error("not written: a write of the step failed before, and the "
                                   "step before must stay whole");
      }
      store_.sync_spares();
    }
    item.job.dst.offset = at;
    item.job.spare = true;
    return nullptr;
  } catch (...) {
    return std::current_exception();
  }
}

void Ring::finish_write(Writing& w, std::exception_ptr error) {
  Job& job = w.item.job;
  try {
    if (w.write) {
      Timer t(counters_.busy_ns[kWriteback]);
      settle(*writer_, std::exchange(w.write, 0), IoPhases::kWrite);
      counters_.storage_write += job.dst.bytes;
      if (job.spare && !error)  // where its chunk is now (the extent it left: free once synced)
        store_.written(store_.local(job.subgroup), job.chunk, job.dst.offset, *job.dst.sum);
    }
    finish_storage(w.storage);
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  if (job.kind == JobKind::init) job.completion->chunk_done(error);
  free_slots_.push(w.item.slot);
  {
    std::lock_guard lock(mu_);
    if (error && !write_error_) write_error_ = error;
  }
  finished();
}

}  // namespace smartinf::pipeline
