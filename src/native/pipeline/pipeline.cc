// A Pipeline: its devices opened (slots, tiers, the memory budgets), membership of a
// directory run, and its counters. Placement and tiers are placement.cc's, a sub-group's
// update steps.cc's, the step's end (commits, logs, rollback) commit.cc's.
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
  if (parked_)
    throw std::invalid_argument("the pipeline's states are parked in host memory (park(), "
                                "DeepSpeed's offload_states): unpark() (reload_states) first");
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
