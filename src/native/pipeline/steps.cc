// A Pipeline's step of one sub-group: an update (speculative, retractable, retracted), the
// states read and written between steps, and waiting for the step's updates. Placement is
// placement.cc's; the step's end (commit) commit.cc's.
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

bool Pipeline::retractable(size_t sg) const {
  std::lock_guard lock(mu_);
  const Placement& p = placed(sg);
  return !updated_[sg] && (p.resident == device::kOwnStates ? !p.dirty : twin_fits(p));
}

bool Pipeline::parts_taken(const Unit& u) {
  return !u.store->logs() && u.device->takes_parts(u.layout);  // (a log hashes one flat gradient)
}

bool Pipeline::takes_parts(size_t sg) const {
  std::lock_guard lock(mu_);
  return parts_taken(devices_[placed(sg).unit]);
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
  restore(sg, before);
  speculative_.erase(it);
  ++retracted_updates_;
}

void Pipeline::restore(size_t sg, Placement before) {
  const bool held = pending_ && std::any_of(pending_->subgroups.begin(), pending_->subgroups.end(),
                                            [&](const auto& e) { return e.first == sg; });
  before.unwritten = placement_[sg].unwritten;  // (a commit since may have written it)
  if (!held) {  // a commit that held it landed since: as land() would have left it
    before.released();
    before.landed(devices_[before.unit].store->record(before.local).steps);
  }
  placement_[sg] = before;
  updated_[sg] = false;
  undo_.erase(sg);
}

// A streamed sub-group's update reads its committed extents and writes the others unless
// it was updated since the last durable commit (then in place); a resident one's writes
// `elsewhere` (its twin) or over its memory, which the committed copy still holds unless
// it was updated since.
Pipeline::Undo Pipeline::undo_of(const Placement& before, bool elsewhere) const {
  if (elsewhere || (before.resident == device::kOwnStates && !before.dirty)) return Undo::restore;
  return before.dirty ? Undo::keep : Undo::reload;
}

std::vector<size_t> Pipeline::undo_updates(std::map<size_t, std::pair<Placement, Undo>> undo,
                                           bool failed) {
  kept_.clear();
  // The devices' work failed (an I/O error): an update made in place may be half written,
  // and which one is not known: back to the durable commit, as the only states whole.
  if (failed && std::any_of(undo.begin(), undo.end(),
                            [](const auto& u) { return u.second.second == Undo::keep; })) {
    back_to_durable();
    return kept_;
  }
  try {
    for (auto& [sg, u] : undo) {
      if (u.second == Undo::keep) {
        kept_.push_back(sg);
        continue;
      }
      restore(sg, u.first);
      if (u.second != Undo::reload) continue;
      std::vector<Job> jobs = chunk_jobs(placement_[sg], JobKind::verify);  // the committed copy
      submit_and_wait(placement_[sg].unit, jobs);
    }
  } catch (const std::exception& e) {
    abandon();
    throw std::runtime_error(std::string("undoing a failed step failed (") + e.what() +
                             "): the pipeline is closed; reopen the directories, which are at "
                             "step " + std::to_string(durable_step_));
  }
  return kept_;
}

namespace {

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
  if (!step_in_progress()) kept_.clear();  // a new step: the last failed one's kept are its own
  if (g.parts) {
    const Unit& u = devices_[p.unit];
    const uint64_t numel = u.store->record(p.local).numel;
    const device::CallerParts& parts = *g.parts;
    if (g.compressed || log_only || !parts_taken(u))
      throw std::invalid_argument("sub-group " + std::to_string(sg) + "'s update cannot take its "
                                  "gradient and params in parts (see takes_parts()): gather "
                                  "them into one buffer each");
    if (parts.start.size() != parts.grad.size() + 1 || parts.grad.size() != parts.out.size() ||
        parts.start.front() != 0 || parts.start.back() != numel ||
        !std::is_sorted(parts.start.begin(), parts.start.end()))
      throw std::invalid_argument("sub-group " + std::to_string(sg) + "'s parts do not cover its " +
                                  std::to_string(numel) + " params in order");
  }
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
  const bool elsewhere = p.pinned || (speculative && resident);
  if (elsewhere) {
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
  undo_[sg] = {before, undo_of(before, elsewhere)};
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
    job.ready = g.ready;
    job.write_back = write_back;
    if (compressed) {
      job.input = g.index + first[c];
      job.values = static_cast<const char*>(g.data) + first[c] * gsize;
      job.kernel.nnz = first[c + 1] - first[c];
      job.kernel.base = c * options_.chunk;
    } else if (g.parts) {  // (the device finds its parts: nothing to bind, nothing to copy)
      job.input = nullptr;
      job.output = nullptr;
      job.parts = g.parts;
      job.kernel.parts = g.parts.get();
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
  const Placement before = p;
  mark_written(sg, steps, false);  // init jobs write the shadow extents too
  undo_[sg] = {before, undo_of(before, false)};
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
  undo_.clear();
  std::fill(updated_.begin(), updated_.end(), false);
  if (error) std::rethrow_exception(error);
}

bool Pipeline::step_in_progress() const {
  return !completions_.empty() || std::find(updated_.begin(), updated_.end(), true) != updated_.end();
}

}  // namespace smartinf::pipeline
