// A Pipeline's placement and tiers: where each sub-group is (its device, resident or streamed,
// its twin), the loads placement weighs, sub-groups added and initialised, their chunks' jobs.
// Construction, membership and stats are pipeline.cc's; updates steps.cc's; commits commit.cc's.
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
      // A resident sub-group's first states reach storage at the first durable commit, not
      // now (13 B: 51 GB written before the first step, GPT-2 XL 18.7 GB); until then the
      // directory holds no step of it (a crash restarts from the model), and a failure that
      // must go back to a durable commit loses it (back_to_durable). A streamed one's
      // states live on storage: written now.
      if (p.resident != device::kOwnStates) {
        store.begin_rewrite();  // (one copy: the directory says so)
        for (Job& job : jobs) job.write_back = false;
        p.made();
        u.ring->make_resident(jobs, options_.compute_threads ? options_.compute_threads
                                                             : device::default_compute_threads());
      } else {
        submit_and_wait(unit, jobs);
      }
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

}  // namespace smartinf::pipeline
