#include "pipeline/pipeline.h"

#include "device/compute_pool.h"
#include "device/cpu_device.h"
#include "device/registry.h"
#include "error.h"
#include "store/checksum.h"

#include <algorithm>
#include <cstdio>
#include <random>
#include <stdexcept>

namespace smartinf::pipeline {
namespace {

constexpr uint64_t kMaxChunk = uint64_t(1) << 28;  // 3 GiB of states in one slot
constexpr size_t kMaxSlots = 256;
constexpr uint64_t kMaxCommitEvery = uint64_t(1) << 20;
constexpr size_t kDefaultSlots = 4;
constexpr size_t kMaxAutoSlots = 64;

// Slots per device when none were given: 4, and where a cpu device's storage runs phased,
// enough more to hold a whole turn of reads: a turn also ends when the free slots run out,
// and turns shorter than the probe's best burst lose what phasing gains (the H100's NVMe,
// half read, half written: 1.82 GB/s in 64 MiB turns, 2.31 in 256 MiB ones; 4 slots of int8
// + split chunks hold 16 MiB).
// A device's phased turn in bytes: its own (the probe's best), else the ring's default.
uint64_t io_burst(const DeviceSpec& d, const RingOptions& ring) {
  return d.io_burst ? d.io_burst : ring.io_burst;
}

size_t auto_slots(const PipelineOptions& o, uint64_t chunk_bytes) {
  size_t slots = kDefaultSlots;
  for (const DeviceSpec& d : o.devices) {
    if (!device::device_kind(d.kind).phased_io || d.io_schedule != "phased") continue;
    const uint64_t turn = (io_burst(d, o.ring) + chunk_bytes - 1) / chunk_bytes;
    slots = std::max<size_t>(slots, std::min<uint64_t>(kMaxAutoSlots, kDefaultSlots + turn));
  }
  return slots;
}

// The first pair of each chunk (and nnz at the end) in a compressed gradient; checks
// that positions ascend strictly inside the sub-group before anything is queued.
std::vector<uint64_t> split_pairs(const int32_t* index, uint64_t nnz, uint64_t numel,
                                  uint64_t chunk) {
  std::vector<uint64_t> first(1, 0);
  int64_t previous = -1;
  for (uint64_t j = 0; j < nnz; ++j) {
    const int64_t i = index[j];
    const bool outside = i < 0 || static_cast<uint64_t>(i) >= numel;
    if (outside || i <= previous)
      throw std::invalid_argument(
          "compressed gradient index " + std::to_string(i) + " at position " +
          std::to_string(j) + (outside ? " is outside the sub-group of " +
                                             std::to_string(numel) + " params"
                                       : " does not ascend strictly"));
    while (static_cast<uint64_t>(i) >= first.size() * chunk) first.push_back(j);
    previous = i;
  }
  while (first.size() <= (numel + chunk - 1) / chunk) first.push_back(nnz);
  return first;
}

}  // namespace

Pipeline::Pipeline(const PipelineOptions& options)
    : options_(options), rule_(kernels::rule_row(options.optimizer).rule) {
  if (options.devices.empty()) throw std::invalid_argument("a pipeline needs at least one device");
  if (options.chunk == 0 || options.chunk > kMaxChunk)
    throw std::invalid_argument("chunk must be between 1 and " + std::to_string(kMaxChunk) +
                                " params, got " + std::to_string(options.chunk));
  if (!(options.host_link_bps >= 0))
    throw std::invalid_argument("the host link bandwidth must be positive (or 0: no cap)");
  if (options.slots > kMaxSlots)
    throw std::invalid_argument("slots must be between 1 and " + std::to_string(kMaxSlots) +
                                " (0: auto), got " + std::to_string(options.slots));
  store::Moments moments;
  if (!store::moments_named(options.state_dtype.c_str(), &moments)) {
    std::string names;
    for (unsigned i = 0; i < store::kMomentsCount; ++i)
      names += std::string(i == 0 ? "'" : i + 1 < store::kMomentsCount ? ", '" : " or '") +
               store::kMomentsNames[i] + "'";
    throw std::invalid_argument("state_dtype must be " + names + ", got '" + options.state_dtype + "'");
  }
  if (options.master != "fp32" && options.master != "split")
    throw std::invalid_argument("master must be 'fp32' or 'split', got '" + options.master + "'");
  if (options.commit_every == 0 || options.commit_every > kMaxCommitEvery)
    throw std::invalid_argument("commit_every must be between 1 and " +
                                std::to_string(kMaxCommitEvery) + ", got " +
                                std::to_string(options.commit_every));
  const store::StateLayout layout{
      state_arrays(), moments,
      options.master == "split" ? store::Master::split : store::Master::fp32};
  layout_ = layout;
  if (!kernels::row_allows(kernels::rule_row(rule_), layout.moments))
    throw std::invalid_argument(options.state_dtype + " states are for " +
                                kernels::rule_names_allowing(layout.moments) + "; " +
                                options.optimizer + " keeps fp32 states");
  if (options.if_exists != "resume" && options.if_exists != "overwrite" && options.if_exists != "error")
    throw std::invalid_argument("if_exists must be 'resume', 'overwrite' or 'error', got '" +
                                options.if_exists + "'");
  store::StoreConfig config{options.chunk, options.optimizer, layout};
  config.if_exists = options.if_exists;
  if (options.copies != 1 && options.copies != 2)
    throw std::invalid_argument("copies must be 1 or 2, got " + std::to_string(options.copies));
  config.copies = options.copies;
  if (options.log) refuse_log_options(options);
  config.log = options.log;
  if (!options_.slots)
    options_.slots = auto_slots(options, store::extent_bytes(options.chunk, layout));
  config.spares = 2 * options_.slots;  // a log's free extents: every slot's write, twice
  const device::SlotGeometry geometry{options_.slots, options.chunk, layout};
  // One pool for every cpu device's kernel: they take turns, each with all threads.
  const device::CpuOptions cpu{options.memory_budget, std::make_shared<device::ComputePool>(
      options.compute_threads ? options.compute_threads : device::default_compute_threads())};
  // The small sub-groups' device (made last): fp32 moments, two slots, all resident where
  // the pipeline keeps states in host memory (a memory budget, or a device's budget in host
  // memory: a GPU's with memory "host"), with room for their twins where durable commits are
  // written in the background.
  const store::StateLayout small_layout{layout.arrays, store::Moments::fp32, layout.master};
  const auto small_cpu = [&] {
    device::CpuOptions o = cpu;
    o.resident_bytes = 0;
    const bool host_states = options.memory_budget ||
        std::any_of(devices_.begin(), devices_.end(), [](const Unit& u) {
          return u.device->host_visible_resident() && u.device->resident_bytes();
        });
    if (host_states)
      for (uint64_t n : options.small_numels)
        o.resident_bytes += store::ChunkLayout{options.chunk, small_layout}.copy_bytes(n) *
                            (options.background_commit ? 2 : 1);
    return o;
  };
  if (!options.small_dir.empty()) {
    if (layout.moments == store::Moments::fp32)
      throw std::invalid_argument("small_dir keeps small tensors' moments in fp32 beside int8/int4 "
                                  "states; with fp32 states every moment is fp32 already");
    DeviceSpec small;
    small.dir = options.small_dir;
    options_.devices.push_back(small);
  }
  const bool any_cpu = std::any_of(options.devices.begin(), options.devices.end(), [](const DeviceSpec& d) {
    return device::device_kind(d.kind).host_budget;
  });
  if (options.memory_budget && !any_cpu)
    throw std::invalid_argument("memory_budget is host memory for cpu devices, and this pipeline "
                                "has none: a CUDA device takes a GPU memory budget of its own "
                                "(CudaDevice(path, memory_budget=...)); xrt devices keep no "
                                "resident states");
  for (const DeviceSpec& spec : options_.devices) {
    const bool small = !options.small_dir.empty() && &spec == &options_.devices.back();
    const device::DeviceKind& kind = device::device_kind(spec.kind);
    if (const std::string why = device::refuses(kind, layout); !why.empty())
      throw std::invalid_argument(why);
    if (spec.io_schedule != "mixed" && spec.io_schedule != "phased")
      throw std::invalid_argument("io_schedule must be 'mixed' or 'phased', got '" +
                                  spec.io_schedule + "' for " + spec.dir);
    if (!(spec.storage_bps >= 0) || (spec.storage_bps > 0 && !kind.storage_cap))
      throw std::invalid_argument("a storage bandwidth cap is for emulated (cpu) devices, and "
                                  "must be positive; got " + std::to_string(spec.storage_bps) +
                                  " for " + spec.dir);
    Unit unit;
    unit.twins = spec.twins;
    unit.small = small;
    unit.layout = small ? small_layout : layout;
    unit.device = small ? device::make_cpu_device(spec.dir, {2, options.chunk, small_layout}, small_cpu())
                        : device::make_device(kind, spec.dir, geometry, cpu, spec.options);
    if (options.chunk % unit.device->param_multiple() != 0)
      throw std::invalid_argument(unit.device->describe() + " needs chunks of a multiple of " +
                                  std::to_string(unit.device->param_multiple()) +
                                  " params, got " + std::to_string(options.chunk));
    store::StoreConfig device_config = config;
    device_config.layout = unit.layout;
    device_config.direct = unit.device->direct_io();
    if (!device_config.direct)
      notes_.push_back(unit.device->describe() + ": slot memory is not page aligned (XRT "
                       "emulation?): buffered I/O on " + spec.dir);
    unit.store = std::make_unique<store::StateStore>(spec.dir, device_config, notes_);
    devices_.push_back(std::move(unit));
  }
  check_membership();
  // A crash between two devices' commits leaves some one commit ahead; their previous
  // copies are intact, so roll them back to the step every device has.
  uint64_t lo = UINT64_MAX, hi = 0;
  for (const Unit& u : devices_) {
    lo = std::min(lo, u.store->step());
    hi = std::max(hi, u.store->step());
  }
  if (options.log) {
    settle_logs(lo, hi);
  } else if (hi != lo && options.copies == 1) {
    throw std::invalid_argument(
        "device directories of one copy (copies=1) are at steps " + std::to_string(lo) + " and " +
        std::to_string(hi) + ": a crash between their durable commits left them apart, and one "
        "copy holds no earlier step to bring them together. Restore a checkpoint, or open them "
        "with if_exists=\"overwrite\" to start afresh");
  }
  for (const Unit& u : devices_)
    if (!options.log && u.store->step() != lo && u.store->previous_step() != lo)
      throw std::invalid_argument("device directories are at steps " + std::to_string(lo) +
                                  " and " + std::to_string(u.store->step()) +
                                  " (one commit after step " +
                                  std::to_string(u.store->previous_step()) +
                                  "): they do not belong to one pipeline");
  for (Unit& u : devices_) {
    if (!options.log && u.store->step() == hi && hi != lo) {
      u.store->rollback_last_step();
      notes_.push_back(u.store->dir() + " was committed one step ahead of the others " +
                       "(interrupted commit): rolled back to step " + std::to_string(lo));
    }
  }
  step_ = durable_step_ = lo;
  RingOptions ring = options.ring;
  ring.verify = options.verify;
  if (options.host_link_bps > 0) ring.host_link = std::make_shared<HostLink>(options.host_link_bps);
  for (size_t i = 0; i < devices_.size(); ++i) {
    ring.storage_bps = options_.devices[i].storage_bps;
    ring.io_schedule = options_.devices[i].io_schedule;
    ring.io_burst = io_burst(options_.devices[i], options.ring);
    Unit& u = devices_[i];
    u.ring = std::make_unique<Ring>(*u.device, *u.store, ring, notes_);
  }
  if (!logged_undecided_)
    for (Unit& u : devices_)
      if (u.store->pending()) finish_logged_step(u);
  if (options.log) step_ = durable_step_ = devices_.front().store->step();
}

void Pipeline::seal_logs() {
  std::lock_guard lock(mu_);
  require_open();
  for (Unit& u : devices_)
    if (u.store->logs() && !u.store->log_sealed()) u.store->seal_log();
}

bool Pipeline::logged_step_pending() const {
  std::lock_guard lock(mu_);
  return logged_undecided_ && std::all_of(devices_.begin(), devices_.end(), [](const Unit& u) {
    return u.store->pending();
  });
}

void Pipeline::finish_logged_step() {
  std::lock_guard lock(mu_);
  require_open();
  if (!logged_undecided_) return;
  for (Unit& u : devices_)
    if (!u.store->pending())
      throw std::invalid_argument(u.store->dir() + " holds no log of step " +
                                  std::to_string(step_ + 1) + " to finish: drop_logged_step()");
  for (Unit& u : devices_) finish_logged_step(u);
  logged_undecided_ = false;
  step_ = durable_step_ = devices_.front().store->step();
}

void Pipeline::drop_logged_step() {
  std::lock_guard lock(mu_);
  require_open();
  for (Unit& u : devices_)
    if (u.store->pending()) u.store->drop_log();
  logged_undecided_ = false;
}

// Directories with a log at reopen: each device's log of the step after its own is sealed
// before any device's update runs, so where every device behind has its log, all finish
// that step (a crash between two devices' commits leaves some one step ahead); where one
// lacks it, no extent was written over anywhere, and those sealed forget it.
void Pipeline::settle_logs(uint64_t lo, uint64_t hi) {
  const bool logged = std::all_of(devices_.begin(), devices_.end(), [&](const Unit& u) {
    return u.store->step() != lo || u.store->pending();
  });
  if (options_.defer_logged_step && hi == lo &&
      std::any_of(devices_.begin(), devices_.end(), [](const Unit& u) { return u.store->pending(); })) {
    logged_undecided_ = true;  // the caller decides, with the other processes'
    return;
  }
  if (hi > lo + 1 || (hi == lo + 1 && !logged))
    throw std::invalid_argument(
        "device directories with a log (copies='log') are at steps " + std::to_string(lo) +
        " and " + std::to_string(hi) + ", and those at step " + std::to_string(lo) + " hold no " +
        "log of step " + std::to_string(lo + 1) + " to finish: they do not belong to one "
        "pipeline. Pass the directories the pipeline was made with, or restore a checkpoint");
  if (logged) return;
  for (Unit& u : devices_)
    if (u.store->pending()) {
      u.store->drop_log();
      notes_.push_back(u.store->dir() + ": its log of step " + std::to_string(lo + 1) + " was "
                       "sealed, another device's was not, so no update of that step had run: "
                       "forgotten, the directory is at step " + std::to_string(lo));
    }
}

void Pipeline::refuse_log_options(const PipelineOptions& o) const {
  const auto no = [](const std::string& what) {
    throw std::invalid_argument("copies='log' (one copy, each step's gradients logged) " + what);
  };
  if (o.copies != 1) no("keeps one copy: copies must be 1 with it");
  if (o.commit_every != 1) no("makes every step durable: commit_every must be 1");
  if (o.master != "fp32") no("is for an fp32 master: with a split one, two copies (copies=2) take no "
                             "more disk (docs/memory-tiers.md)");
  if (o.memory_budget) no("streams every sub-group from storage: no memory_budget");
  for (const DeviceSpec& d : o.devices)
    if (d.kind != "cpu") no("runs on cpu devices so far, not " + d.kind + " (" + d.dir + ")");
}

// The update's own path: each chunk left at the step before is read from its committed
// extent, updated by the device's kernel with the logged gradient and hyper-parameters (the
// same bits as the update that was interrupted), and written to a free extent; then the
// step is committed.
void Pipeline::finish_logged_step(Unit& u) {
  store::StateStore& store = *u.store;
  uint64_t chunks = 0;
  for (const store::Replay& r : store.replay()) {
    if (r.chunks.empty()) continue;
    const store::SubgroupRecord& rec = store.record(r.local);
    const auto dtype = static_cast<kernels::DType>(r.gradient.dtype);
    const size_t gsize = kernels::dtype_size(dtype);
    std::vector<char> grad(rec.numel * gsize);
    std::vector<float> out(rec.numel);
    store.read_logged(r.gradient, grad.data());
    auto done = std::make_shared<Completion>(r.chunks.size());
    for (uint64_t c : r.chunks) {
      Job job;
      job.kind = JobKind::update;
      job.completion = done;
      job.src = store.extent(r.local, c, rec.copy);
      job.dst = store.extent(r.local, c, rec.copy ^ 1u);
      job.subgroup = rec.id;
      job.chunk = c;
      job.written_at = rec.last;
      job.kernel.step = kernels::make_step(rule_, r.gradient.hyper, r.gradient.steps);
      job.kernel.grad = dtype;
      job.kernel.param = kernels::DType::f32;
      job.input = grad.data() + c * options_.chunk * gsize;
      job.output = out.data() + c * options_.chunk;
      u.ring->push(job);
    }
    done->wait();
    u.ring->drain();
    chunks += r.chunks.size();
  }
  store.publish_logged_step();
  notes_.push_back(store.dir() + ": its run stopped in step " + std::to_string(store.step()) +
                   ", whose gradients were logged: that step was finished (" +
                   std::to_string(chunks) + " chunks updated again from the log)");
}

uint64_t Pipeline::previous_step() const {
  const uint64_t previous = devices_.front().store->previous_step();
  for (const Unit& u : devices_)
    if (u.store->previous_step() != previous) return durable_step_;  // not one step for all
  return previous;
}

void Pipeline::roll_back_to(uint64_t step) {
  std::lock_guard lock(mu_);
  if (step == durable_step_) return;
  if (step_ != durable_step_ || subgroup_count() != 0 || step != previous_step() || step > durable_step_)
    throw std::invalid_argument(
        "cannot go back to step " + std::to_string(step) + ": these directories are at step " +
        std::to_string(durable_step_) + " and hold step " + std::to_string(previous_step()) +
        " besides (a rollback goes back one durable commit, before any sub-group is added)");
  for (Unit& u : devices_)
    if (u.store->step() != step) u.store->rollback_last_step();
  notes_.push_back("rolled back from step " + std::to_string(durable_step_) + " to step " +
                   std::to_string(step) + ", where the other ranks' directories are");
  step_ = durable_step_ = step;
}

// Every directory records its place in the device list it was made with; reopening with
// another list would put sub-groups on other devices, so it is refused before any I/O.
void Pipeline::check_membership() {
  const size_t n = devices_.size();
  const Unit* known = nullptr;
  for (const Unit& u : devices_)
    if (u.store->membership().count) known = known ? known : &u;
  const auto where = [](const Unit& u) {
    const store::Membership& m = u.store->membership();
    return u.store->dir() + " is device " + std::to_string(m.index) + " (from 0) of a pipeline of " +
           std::to_string(m.count);
  };
  const std::string fix = "; pass the directories the pipeline was made with, all of them, in "
                          "the same order";
  // A creation killed between two directories' first manifests leaves members that hold
  // nothing and directories without membership: the set is finished, nothing is lost.
  const bool members_empty = std::all_of(devices_.begin(), devices_.end(), [](const Unit& u) {
    return !u.store->membership().count ||
           (u.store->subgroup_count() == 0 && u.store->step() == 0);
  });
  std::string id;
  if (known) {
    id = known->store->membership().pipeline;
  } else {
    std::random_device random;
    const uint64_t bits = (uint64_t(random()) << 32) ^ random();
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(bits));
    id = text;
  }
  const Unit& last = devices_.back();
  if (last.small && known && !last.store->membership().count && known->store->membership().count == n - 1)
    throw std::invalid_argument(
        known->store->dir() + " was made by a smartinf whose " + layout_.dtype() + " states "
        "quantised small tensors' moments too; this one keeps those in fp32 (in " +
        last.store->dir() + "): resume the run with the version that made it, or start "
        "afresh (if_exists='overwrite')");
  for (size_t i = 0; i < n; ++i) {
    const Unit& u = devices_[i];
    const store::Membership& m = u.store->membership();
    if (!m.count) {
      const bool empty = u.store->subgroup_count() == 0 && u.store->step() == 0;

      if (known && empty && !members_empty)
        throw std::invalid_argument(u.store->dir() + " holds no states, but " + where(*known) +
                                    " (a directory is missing or was replaced)" + fix);
      continue;  // new, or made by a version that did not record membership
    }
    if (m.pipeline != id)
      throw std::invalid_argument(u.store->dir() + " and " + known->store->dir() +
                                  " belong to different pipelines" + fix);
    if (m.count != n || m.index != i)
      throw std::invalid_argument(where(u) + ", but was passed as device " + std::to_string(i) +
                                  " of " + std::to_string(n) + fix);
  }
  for (size_t i = 0; i < n; ++i)
    if (!devices_[i].store->membership().count)
      devices_[i].store->set_membership({id, static_cast<uint32_t>(i), static_cast<uint32_t>(n)});
}

Pipeline::~Pipeline() {
  try {
    close();
  } catch (...) {
  }
}

void Pipeline::require_open() const {
  if (devices_.empty()) throw std::invalid_argument("the pipeline is closed");
}

const Placement& Pipeline::placed(size_t sg) const {
  require_open();
  if (sg >= placement_.size())
    throw std::out_of_range("unknown sub-group " + std::to_string(sg) + " (the pipeline has " +
                            std::to_string(placement_.size()) + ")");
  return placement_[sg];
}

uint64_t Pipeline::numel(size_t sg) const {
  const Placement& p = placed(sg);
  return devices_[p.unit].store->record(p.local).numel;
}

size_t Pipeline::device_of(size_t sg) const { return placed(sg).unit; }

uint64_t Pipeline::current_steps(const Placement& p) const {
  return p.dirty ? p.steps : devices_[p.unit].store->record(p.local).steps;
}

uint64_t Pipeline::resident_size(const Placement& p) const {
  const Unit& u = devices_[p.unit];
  return store::ChunkLayout{options_.chunk, u.layout}.copy_bytes(u.store->record(p.local).numel);
}

bool Pipeline::twin_fits(const Placement& p) const {
  const Unit& u = devices_[p.unit];
  return p.resident != device::kOwnStates &&
         (p.twin != device::kOwnStates || u.resident_used + resident_size(p) <= u.device->resident_bytes());
}

bool Pipeline::fits_resident(const Unit& u, uint64_t used, uint64_t bytes) {
  return used + (u.twins ? 2 * bytes : bytes) <= u.device->resident_bytes();
}

std::vector<Pipeline::Load> Pipeline::loads() const {
  std::vector<Load> out;
  for (const Unit& u : devices_) out.push_back({u.resident_used, u.balanced_numel});
  return out;
}

bool Pipeline::settle_load(size_t unit, uint64_t numel, uint64_t bytes,
                           std::vector<Load>& loads) const {
  const Unit& u = devices_[unit];
  const bool resident = fits_resident(u, loads[unit].resident_used, bytes);
  if (resident) loads[unit].resident_used += u.twins ? 2 * bytes : bytes;
  if (!resident || !u.device->placed_first()) loads[unit].balanced_numel += numel;
  return resident;
}

std::vector<uint64_t> Pipeline::planned_bytes(const std::vector<uint64_t>& numels,
                                              const std::vector<bool>& small,
                                              uint32_t gradient_bytes) const {
  std::lock_guard lock(mu_);
  require_open();
  std::vector<Load> planned = loads();
  std::vector<uint64_t> grow(devices_.size(), 0);
  for (size_t k = 0; k < numels.size(); ++k) {
    const auto id = static_cast<int64_t>(placement_.size() + k);
    const bool is_small = k < small.size() && small[k];
    const size_t unit =
        place(id, store::ChunkLayout{options_.chunk, layout_}.copy_bytes(numels[k]), is_small, planned);
    const store::ChunkLayout chunks{options_.chunk, devices_[unit].layout, options_.copies, options_.log};
    if (!settle_load(unit, numels[k], chunks.copy_bytes(numels[k]), planned))
      refuse_streamed_one_copy(id, numels[k], unit);
    const store::StateStore& store = *devices_[unit].store;
    if (store.holds(id)) continue;  // reopened
    if (options_.log)  // its logged gradient, and with the device's first the spares
      grow[unit] += numels[k] * gradient_bytes + (grow[unit] ? 0 : store.unallocated_spare_bytes());
    grow[unit] += chunks.bytes(numels[k]);
  }
  return grow;
}

bool Pipeline::give_twin(Placement& p) {
  if (p.twin != device::kOwnStates || !twin_fits(p)) return p.twin != device::kOwnStates;
  Unit& u = devices_[p.unit];
  p.twin = u.resident_used;
  u.resident_used += resident_size(p);
  return true;
}

uint64_t Pipeline::subgroup_steps(size_t sg) const {
  const Placement& p = placed(sg);
  return current_steps(p);
}

void Pipeline::submit_and_wait(size_t unit, std::vector<Job>& jobs) {
  for (Job& job : jobs) devices_[unit].ring->push(job);
  if (!jobs.empty()) jobs.front().completion->wait();
}

// Where sub-group `id` (`bytes` of states) goes: the device whose directory holds it
// (reopened: membership fixed the device list); else the first device placed first
// (a GPU: its resident update is ~100x the host's, so its budget fills first) whose
// resident memory holds it; else balanced by params (the device with the fewest so far
// outside such budgets) over the other devices, or over all when every one is placed
// first. Deterministic, so a reopened pipeline places new sub-groups as the first run did.
size_t Pipeline::place(int64_t id, uint64_t bytes, bool small, const std::vector<Load>& loads) const {
  for (size_t u = 0; u < devices_.size(); ++u)
    if (devices_[u].store->holds(id)) return u;
  const size_t last = devices_.size() - 1;
  if (devices_[last].small) {  // the small unit holds the small sub-groups, and only those
    if (small) return last;
  }
  const size_t count = devices_[last].small ? last : devices_.size();
  for (size_t u = 0; u < count; ++u) {
    const Unit& d = devices_[u];
    if (d.device->placed_first() && fits_resident(d, loads[u].resident_used, bytes)) return u;
  }
  const bool others = std::any_of(devices_.begin(), devices_.begin() + count,
                                  [](const Unit& d) { return !d.device->placed_first(); });
  size_t unit = count;
  for (size_t u = 0; u < count; ++u) {
    if (others && devices_[u].device->placed_first()) continue;
    if (unit == count || loads[u].balanced_numel < loads[unit].balanced_numel) unit = u;
  }
  return unit;
}

size_t Pipeline::add_subgroup(uint64_t numel, const float* init, uint64_t fingerprint,
                              bool& resumed, bool small) {
  std::lock_guard lock(mu_);
  require_open();
  if (logged_undecided_)
    throw std::logic_error("a logged step is undecided: finish_logged_step() or "
                           "drop_logged_step() before adding sub-groups");
  if (numel == 0) throw std::invalid_argument("a sub-group needs at least one parameter");
  const auto id = static_cast<int64_t>(placement_.size());
  const size_t unit = place(id, store::ChunkLayout{options_.chunk, layout_}.copy_bytes(numel), small, loads());
  const uint64_t bytes = store::ChunkLayout{options_.chunk, devices_[unit].layout}.copy_bytes(numel);
  const size_t multiple = devices_[unit].device->param_multiple();
  if (numel % multiple != 0)
    throw std::invalid_argument("a sub-group of " + std::to_string(numel) + " params on " +
                                devices_[unit].device->describe() + ": it needs a multiple of " +
                                std::to_string(multiple) + " (pad the sub-group)");
  store::StateStore& store = *devices_[unit].store;
  Unit& u = devices_[unit];
  // Resident if its states (and its twin, where the device keeps twins) fit in what is
  // left of the budget: decided here, once.
  std::vector<Load> after = loads();
  const bool resident = settle_load(unit, numel, bytes, after);
  if (!resident) refuse_streamed_one_copy(id, numel, unit);
  bool created = false;
  Placement p;
  p.unit = unit;
  p.local = store.attach(id, numel, fingerprint, created);
  if (resident) {
    p.resident = u.resident_used;
    if (u.twins) p.twin = u.resident_used + bytes;
  }
  try {
    if (created) {
      const float* arrays[device::kMaxStateArrays] = {init};
      std::vector<Job> jobs = init_jobs(p, store.record(p.local).copy, arrays);
      // One copy: a resident sub-group's first states reach storage at the first durable
      // commit, not now (13 B: 51 GB written before the first step); until then the
      // directory says it holds no step.
      const bool later = options_.copies == 1 && p.resident != device::kOwnStates;
      if (later) {
        store.begin_rewrite();
        for (Job& job : jobs) job.write_back = false;
        p.updated(0, true);
      }
      submit_and_wait(unit, jobs);
    } else {  // states from disk: checked against their checksums before any use
      std::vector<Job> jobs = chunk_jobs(p, JobKind::verify);
      const bool known = std::any_of(jobs.begin(), jobs.end(), [](const Job& j) { return *j.src.sum; });
      if (known || p.resident != device::kOwnStates) submit_and_wait(unit, jobs);
    }
  } catch (...) {
    try {
      u.ring->drain();  // chunks still in flight after the first failed one
    } catch (...) {
    }
    if (created) store.detach_last();
    throw;
  }
  u.resident_used = after[unit].resident_used;
  u.balanced_numel = after[unit].balanced_numel;
  resumed = !created;
  u.numel += numel;
  placement_.push_back(p);
  updated_.push_back(false);
  return static_cast<size_t>(id);
}

void Pipeline::refuse_streamed_one_copy(int64_t id, uint64_t numel, size_t unit) const {
  if (options_.copies != 1 || options_.log) return;
  const Unit& u = devices_[unit];
  throw std::invalid_argument(
      "sub-group " + std::to_string(id) + " (" + std::to_string(numel) + " params) does not fit "
      "what is left of " + u.device->describe() + "'s resident memory (" +
      std::to_string(u.device->resident_bytes() - u.resident_used) + " of " +
      std::to_string(u.device->resident_bytes()) + " bytes): with copies=1 every sub-group "
      "must be resident (a streamed one would be written over its committed states every "
      "step). Give a larger memory_budget, or copies=2");
}

std::vector<Job> Pipeline::chunk_jobs(const Placement& p, JobKind kind) const {
  const store::StateStore& store = *devices_[p.unit].store;
  const store::SubgroupRecord& r = store.record(p.local);
  const uint64_t chunks = store.chunks(p.local);
  auto done = std::make_shared<Completion>(chunks);
  const uint64_t current = p.dirty ? r.copy ^ 1u : r.copy;
  std::vector<Job> jobs;
  for (uint64_t c = 0; c < chunks; ++c) {
    Job job;
    job.kind = kind;
    job.completion = done;
    job.src = store.extent(p.local, c, current);
    job.dst = store.extent(p.local, c, r.copy ^ 1u);
    if (p.resident != device::kOwnStates)  // chunks one after another, each extent aligned
      job.resident = p.resident + c * store::extent_bytes(options_.chunk, devices_[p.unit].layout);
    job.subgroup = r.id;
    job.chunk = c;
    job.written_at = r.last;
    jobs.push_back(job);
  }
  return jobs;
}

std::vector<Job> Pipeline::init_jobs(const Placement& p, uint32_t copy,
                                     const float* const* arrays) const {
  const store::StateStore& store = *devices_[p.unit].store;
  std::vector<Job> jobs = chunk_jobs(p, JobKind::init);
  for (Job& job : jobs) {
    job.dst = store.extent(p.local, job.chunk, copy);
    for (unsigned a = 0; a < state_arrays(); ++a) {
      job.imported[a] = arrays[a] ? arrays[a] + job.chunk * options_.chunk : nullptr;
      job.fill[a] = a == 0 ? 0.0f : options_.initial_state;
    }
  }
  return jobs;
}

void Pipeline::mark_written(size_t sg, uint64_t steps, bool stays_resident) {
  if (updated_[sg])
    throw std::invalid_argument("sub-group " + std::to_string(sg) +
                                " was already updated in this step; commit the step first");
  updated_[sg] = true;
  placement_[sg].updated(steps, stays_resident);
}

bool Pipeline::retractable(size_t sg) const {
  std::lock_guard lock(mu_);
  const Placement& p = placed(sg);
  return !updated_[sg] && (p.resident == device::kOwnStates ? !p.dirty : twin_fits(p));
}

void Pipeline::retract(size_t sg) {
  std::lock_guard lock(mu_);
  placed(sg);
  auto it = speculative_.find(sg);
  if (it == speculative_.end())
    throw std::invalid_argument("sub-group " + std::to_string(sg) + " has no speculative update "
                                "in the step in progress to retract");
  Placement before = it->second.first;
  it->second.second->wait();
  devices_[before.unit].ring->drain();  // its write-back, which a new update would race
  completions_.erase(std::find(completions_.begin(), completions_.end(), it->second.second));
  const bool held = pending_ && std::any_of(pending_->subgroups.begin(), pending_->subgroups.end(),
                                            [&](const auto& e) { return e.first == sg; });
  if (!held) {  // a commit that held it landed since: as land() would have left it
    before.released();
    before.landed(devices_[before.unit].store->record(before.local).steps);
  }
  placement_[sg] = before;
  updated_[sg] = false;
  speculative_.erase(it);
  ++retracted_updates_;
}

namespace {

bool same_hyper(const kernels::Hyper& a, const kernels::Hyper& b) {
  return a.lr == b.lr && a.weight_decay == b.weight_decay && a.beta1 == b.beta1 &&
         a.beta2 == b.beta2 && a.eps == b.eps && a.momentum == b.momentum &&
         a.dampening == b.dampening && a.nesterov == b.nesterov && a.lr_decay == b.lr_decay &&
         a.grad_scale == b.grad_scale;
}

}  // namespace

std::shared_ptr<Completion> Pipeline::update(size_t sg, const Gradient& g, void* out,
                                             kernels::DType out_dtype, const UpdateHyper& h,
                                             bool speculative, bool log_only) {
  std::lock_guard lock(mu_);
  const Placement& p = placed(sg);
  store::StateStore& logs = *devices_[p.unit].store;
  if (log_only && !logs.logs())
    throw std::invalid_argument("log_only is for directories made with copies='log'");
  if (logs.logs()) {
    const store::SubgroupRecord& r = logs.record(p.local);
    const std::string what = "copies='log': sub-group " + std::to_string(sg);
    if (speculative)
      throw std::invalid_argument(what + ": no update runs before the step's gradients are all "
                                  "logged, so none is speculative (overlap=False)");
    if (g.compressed)
      throw std::invalid_argument(what + ": the log takes dense gradients, not compressed ones");
    if (log_only) {
      if (logs.log_sealed())
        throw std::invalid_argument(what + "'s gradient comes after the step's first update: "
                                    "log every gradient of a step before its first update");
      logs.log_gradient(p.local, g.dtype, current_steps(p) + 1, h, g.data);
      auto done = std::make_shared<Completion>(1);
      done->chunk_done();
      return done;
    }
    if (!logs.log_sealed())  // the step's first update: its input complete, on every device
      for (Unit& u : devices_) u.store->seal_log();
    const store::LoggedGradient* e = logs.logged(r.id);
    const uint64_t bytes = r.numel * kernels::dtype_size(g.dtype);
    if (!e || e->dtype != static_cast<uint32_t>(g.dtype) || e->steps != current_steps(p) + 1 ||
        !same_hyper(e->hyper, h) || store::extent_checksum(g.data, bytes) != e->hash)
      throw std::invalid_argument(
          what + (e ? "'s update differs from its logged gradient or hyper-parameters"
                    : " has no logged gradient in this step") +
          ": a crash would finish the step from the log, not as updated. Log each sub-group's "
          "gradient (log_only) before the step's first update, and update it with the same");
  }
  const bool resident = p.resident != device::kOwnStates;
  if (speculative && resident) give_twin(placement_[sg]);  // the update goes to it
  if (speculative && (updated_[sg] || (resident ? p.twin == device::kOwnStates : p.dirty)))
    throw std::invalid_argument(
        "sub-group " + std::to_string(sg) + "'s update cannot be speculative: " +
        (updated_[sg] ? std::string("it was already updated in this step")
         : resident ? std::string("its resident states have no twin to update instead")
                    : std::string("its states were updated in place since the last durable "
                                  "commit (commit_every > 1)")) + " (see retractable())");

  Unit& unit = devices_[p.unit];
  const store::StateStore& store = *unit.store;
  const store::SubgroupRecord& r = store.record(p.local);
  const uint64_t steps = current_steps(p);
  const bool compressed = g.compressed;
  if (layout_.split() && out_dtype != kernels::DType::bf16)
    throw std::invalid_argument("master='split' keeps the low halves of the fp32 masters of "
                                "bfloat16 params; sub-group " + std::to_string(sg) +
                                "'s params are not bfloat16: use master='fp32'");
  if (compressed && g.dtype == kernels::DType::f32)
    throw std::invalid_argument("compressed gradient values must be fp16 or bf16");
  const std::vector<uint64_t> first =
      compressed ? split_pairs(g.index, g.nnz, r.numel, options_.chunk) : std::vector<uint64_t>{};
  // A pending commit holds a streamed sub-group's extents (the update waits for the commit
  // to land), and a resident one's copy while it writes it, when it has no twin to update
  // instead (the update waits for that write).
  if (p.resident == device::kOwnStates)
    land();
  else if (p.pinned && p.twin == device::kOwnStates)
    wait_written(sg);
  const Placement before = p;  // after land(), which changes it
  std::vector<Job> jobs = chunk_jobs(p, JobKind::update);  // reads the copy current now
  // Its copy is being written, or must survive a retract: the update goes to the twin, then
  // they swap.
  if (p.pinned || (speculative && resident)) {
    Placement& q = placement_[sg];
    for (Job& job : jobs) {
      job.copy_from = job.resident;
      job.resident = job.resident - q.resident + q.twin;
    }
    q.swap_twin();
  }
  // Resident states reach storage only at a durable commit (make_durable).
  const bool write_back = p.resident == device::kOwnStates;
  mark_written(sg, steps + 1, !write_back);
  device::Kernel kernel;
  kernel.step = kernels::make_step(rule_, h, steps + 1);
  kernel.grad = g.dtype;
  kernel.param = out_dtype;
  kernel.compressed = compressed;
  auto done = jobs.front().completion;
  completions_.push_back(done);
  if (speculative) {
    speculative_[sg] = {before, done};
    ++speculative_updates_;
  }
  last_hyper_ = {{"lr", h.lr}, {"weight_decay", h.weight_decay}};
  if (kernels::rule_row(rule_).betas)
    last_hyper_.insert({{"beta1", h.beta1}, {"beta2", h.beta2}, {"eps", h.eps}});
  const size_t gsize = kernels::dtype_size(g.dtype), osize = kernels::dtype_size(out_dtype);
  done->track(updates_);
  for (Job& job : jobs) {
    const uint64_t c = job.chunk;
    job.output = static_cast<char*>(out) + c * options_.chunk * osize;
    job.kernel = kernel;
    job.write_back = write_back;
    if (compressed) {
      job.input = g.index + first[c];
      job.values = static_cast<const char*>(g.data) + first[c] * gsize;
      job.kernel.nnz = first[c + 1] - first[c];
      job.kernel.base = c * options_.chunk;
    } else {
      job.input = static_cast<const char*>(g.data) + c * options_.chunk * gsize;
    }
    unit.ring->push(job);
  }
  return done;
}

void Pipeline::write_states(size_t sg, const float* const* arrays, uint64_t steps) {
  std::lock_guard lock(mu_);
  const Placement& p = placed(sg);
  land();
  mark_written(sg, steps, false);  // init jobs write the shadow extents too
  devices_[p.unit].store->begin_rewrite();  // one copy: the shadow extents are the committed ones
  const uint32_t shadow = devices_[p.unit].store->record(p.local).copy ^ 1u;
  std::vector<Job> jobs = init_jobs(p, shadow, arrays);
  completions_.push_back(jobs.front().completion);
  submit_and_wait(p.unit, jobs);
}

void Pipeline::read_states(size_t sg, float* const* arrays, const void* params) {
  std::lock_guard lock(mu_);
  placed(sg);
  land();
  Placement p = placement_[sg];
  if (layout_.split() && arrays[0] && !params)
    throw std::invalid_argument("with master='split' the masters are rebuilt from the bf16 "
                                "params: pass sub-group " + std::to_string(sg) + "'s params");
  if (updated_[sg]) {  // written in the step in progress: step()'s states are the committed copy
    if (devices_[p.unit].store->logs())
      throw std::invalid_argument(
          "sub-group " + std::to_string(sg) + " was updated in the step in progress, whose "
          "chunks are written where free extents are (copies='log'), the committed ones "
          "among them once their chunks moved: its states at step " + std::to_string(step_) +
          " are no longer held; read them before the update, or after commit()");
    if (p.was_dirty)
      throw std::invalid_argument(
          "sub-group " + std::to_string(sg) + " was updated in the step in progress after "
          "steps not yet durable (commit_every > 1), which updated its states in place: its "
          "states at step " + std::to_string(step_) + " are no longer held; read them before "
          "the update, or after commit()");
    p.dirty = false;
    p.resident = device::kOwnStates;
  }
  std::vector<Job> jobs = chunk_jobs(p, JobKind::read);
  for (Job& job : jobs) {
    for (unsigned a = 0; a < state_arrays(); ++a)
      job.exported[a] = arrays[a] ? arrays[a] + job.chunk * options_.chunk : nullptr;
    if (layout_.split() && arrays[0])
      job.output = const_cast<char*>(static_cast<const char*>(params) + job.chunk * options_.chunk * 2);
  }
  submit_and_wait(p.unit, jobs);
}

void Pipeline::wait_step() {
  std::exception_ptr error;
  for (Unit& u : devices_) {
    try {
      u.ring->drain();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  for (auto& done : completions_) {
    try {
      done->wait();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  completions_.clear();
  speculative_.clear();
  std::fill(updated_.begin(), updated_.end(), false);
  if (error) std::rethrow_exception(error);
}

bool Pipeline::step_in_progress() const {
  return !completions_.empty() || std::find(updated_.begin(), updated_.end(), true) != updated_.end();
}

namespace {

void add_counters(std::map<std::string, double>& s, const Counters& c) {
  s["host_to_device"] += c.host_to_device;
  s["device_to_host"] += c.device_to_host;
  s["storage_read"] += c.storage_read;
  s["storage_write"] += c.storage_write;
  s["chunks"] += c.chunks;
  s["memory_read"] += c.memory_read;
  s["memory_write"] += c.memory_write;
  s["foreign_chunks"] += c.foreign_chunks;
  s["io_turns"] += c.io_turns;
  s["io_turn_waits"] += c.io_turn_waits;
  for (size_t i = 0; i < kStages; ++i)
    s[std::string("busy_") + kStageNames[i]] += c.busy_ns[i] * 1e-9;
  s["wait_host_link"] += c.host_link_wait_ns * 1e-9;
  s["wait_storage"] += c.storage_wait_ns * 1e-9;
  s["busy_persist"] += c.persist_ns * 1e-9;
  s["twin_copies"] += c.twin_copies;
}

}  // namespace

std::map<std::string, double> Pipeline::stats() const {
  std::lock_guard lock(mu_);
  std::map<std::string, double> s;
  add_counters(s, Counters{});  // every key present, even with no device
  for (const Unit& u : devices_) add_counters(s, u.ring->counters());
  s["step"] = static_cast<double>(step_);
  s["slots"] = static_cast<double>(options_.slots);  // per device
  s["durable_step"] = static_cast<double>(durable_step_);
  s["background_commits"] = static_cast<double>(background_commits_);
  s["commit_pending"] = pending_ ? 1.0 : 0.0;
  s["wait_commit"] = commit_wait_ns_ * 1e-9;
  s["speculative_updates"] = static_cast<double>(speculative_updates_);
  s["retracted_updates"] = static_cast<double>(retracted_updates_);
  // Seconds with an update in flight, seconds a caller waited for one, and the rest: the
  // update time hidden behind the caller's work (overlap: backward, the next forward).
  const double running = updates_->running_s(), waited = updates_->waited_s();
  s["update_s"] = running;
  s["update_wait_s"] = waited;
  s["update_hidden_s"] = running - waited;
  return s;
}

std::vector<std::map<std::string, double>> Pipeline::device_stats() const {
  std::lock_guard lock(mu_);
  std::vector<std::map<std::string, double>> all;
  for (const Unit& u : devices_) {
    std::map<std::string, double> s;
    add_counters(s, u.ring->counters());
    s["numel"] = static_cast<double>(u.numel);
    s["resident_bytes"] = static_cast<double>(u.resident_used);
    s["memory_budget"] = static_cast<double>(u.device->resident_bytes());
    all.push_back(std::move(s));
  }
  return all;
}

std::vector<ForeignChunk> Pipeline::take_foreign() {
  std::lock_guard lock(mu_);
  std::vector<ForeignChunk> all;
  for (Unit& u : devices_)
    for (const ForeignChunk& f : u.ring->take_foreign()) all.push_back(f);
  return all;
}

std::string Pipeline::engine() const {
  return devices_.empty() ? std::string("closed") : devices_.front().ring->engine_name();
}

}  // namespace smartinf::pipeline
