// The end of a Pipeline's step: commit() (durable every commit_every-th time, its resident
// states written on the rings' background lanes and the stores committed when they are:
// make_durable, land), flush, settle, going back to the durable commit after a failure
// (back_to_durable, discard) and close; with a log, the step's logs sealed, finished,
// dropped and settled, and the rollback to a step. Construction and membership are
// pipeline.cc's, placement placement.cc's, updates steps.cc's.
#include <algorithm>

#include "fault.h"
#include "pipeline/pipeline.h"
#include "pipeline/timer.h"

namespace smartinf::pipeline {

bool Pipeline::rewritten() const {
  return std::any_of(devices_.begin(), devices_.end(), [](const Unit& u) {
    return u.store->rewriting();
  });
}

bool Pipeline::unwritten() const {
  return std::any_of(placement_.begin(), placement_.end(), [](const Placement& p) { return p.unwritten; });
}

// Updated since it was made, before any durable commit wrote it: nothing stored to go back to.
bool Pipeline::lost_unwritten() const {
  return std::any_of(placement_.begin(), placement_.end(),
                     [](const Placement& p) { return p.unwritten && p.steps > 0; });
}

void Pipeline::lose_one_copy(const std::string& why) {
  abandon();
  throw std::runtime_error(why + ": directories of one copy (copies=1) hold no step while "
                           "their states are written over in place, and no directory holds a "
                           "sub-group's states before the first durable commit that writes "
                           "them: those states are lost, and the pipeline is closed. Restore "
                           "a checkpoint, or reopen the directories with if_exists=\"overwrite\" "
                           "(or a run before its first durable commit with \"resume\") to "
                           "start afresh from the model");
}

void Pipeline::finish_on_reopen(const std::string& why) {
  abandon();
  throw std::runtime_error(why + ": its chunks were partly rewritten where the step before "
                           "was (copies='log'), so the pipeline cannot go back, and is closed. "
                           "Its gradients are logged: reopening the directories finishes the "
                           "step, then training goes on from it");
}

void Pipeline::back_to_durable() {
  try {
    land();  // a commit the caller was promised; if it fails it went back before it
  } catch (...) {
    if (devices_.empty()) throw;  // abandoned: nothing to go back to
  }
  if (rewritten() || lost_unwritten())
    lose_one_copy("going back to step " + std::to_string(durable_step_));
  for (Unit& u : devices_)
    if (u.store->logs() && u.store->reused())
      finish_on_reopen("step " + std::to_string(durable_step_ + 1) + " failed");
  for (Unit& u : devices_) u.store->forget_step();
  try {
    for (size_t sg = 0; sg < placement_.size(); ++sg) {
      Placement& p = placement_[sg];
      if (!p.dirty || p.unwritten) continue;  // (unwritten: as made, held in memory)
      p.forgotten();
      if (p.resident == device::kOwnStates) continue;
      std::vector<Job> jobs = chunk_jobs(p, JobKind::verify);  // the committed copy, again
      submit_and_wait(p.unit, jobs);
    }
  } catch (const std::exception& e) {
    abandon();
    throw std::runtime_error(std::string("reloading resident states after a failed step failed (") +
                             e.what() + "): the pipeline is closed; reopen the directories, "
                             "which are at step " + std::to_string(durable_step_));
  }
  step_ = durable_step_;
}

void Pipeline::commit() {
  std::lock_guard lock(mu_);
  require_open();
  for (size_t sg = 0; sg < placement_.size(); ++sg) {  // a log's step is what it logged
    const store::StateStore& s = *devices_[placement_[sg].unit].store;
    if (s.logs() && !updated_[sg] && s.logged(s.record(placement_[sg].local).id))
      throw std::invalid_argument(
          "copies='log': sub-group " + std::to_string(sg) + "'s gradient was logged in this "
          "step but it was not updated; a crash would finish the step with it. Update it, or "
          "discard() the step");
  }
  auto undo = undo_;  // (wait_step forgets it)
  try {
    wait_step();
  } catch (...) {
    if (logs_or_rewritten()) back_to_durable();
    else undo_updates(std::move(undo), true);  // the failed step alone
    throw;
  }
  kept_.clear();
  land_if_written();
  const uint64_t last = pending_ ? pending_->step : durable_step_;  // the interval's start
  // (a durable commit due while the last is still written: put off, where it may not wait)
  if (step_ + 1 - last < options_.commit_every || (pending_ && !options_.commit_waits)) {
    ++step_;  // in resident memory and the working copies until the next durable commit
    return;
  }
  make_durable(step_ + 1);
}

void Pipeline::flush() {
  std::lock_guard lock(mu_);
  require_open();
  if (step_in_progress())
    throw std::invalid_argument("a step is in progress: commit() or discard() it before flush()");
  land();
  if (step_ > durable_step_ || rewritten() || unwritten()) make_durable(step_);  // new states too
  land();
}

void Pipeline::settle() {
  std::lock_guard lock(mu_);
  require_open();
  land();
}

// The steps since the last durable commit become durable at `step`: streamed sub-groups'
// working copies are written already (the step's write-backs); resident ones are written by
// each ring's background lane, and every device's store commits once they are (land()). In
// the background, later steps update resident states meanwhile: a resident sub-group's
// first update after this copies it into its twin (given now from what is left of the
// budget) and works there; one without a twin waits for its own states' write, and a
// streamed one for the commit. On a device with a host twin (a GPU's budget copied to
// page-locked host memory here, and written from there) nothing waits.
void Pipeline::make_durable(uint64_t step) {
  land();  // one pending commit at a time, landed in order
  PendingCommit c;
  c.step = step;
  c.hyper = last_hyper_;
  // Those whose next update waits for their write (no twin to update instead) are written
  // first: queued after the others, they waited for most of the commit's bytes.
  std::vector<size_t> order, twinned_ones;
  for (size_t sg = 0; sg < placement_.size(); ++sg) {
    Placement& p = placement_[sg];
    if (!p.dirty) continue;
    c.subgroups.emplace_back(sg, p.steps);
    if (!p.behind) continue;
    Unit& u = devices_[p.unit];
    u.store->begin_rewrite();  // one copy: written over the committed states from here
    // A device with a host twin copies the states there as the jobs are queued: its
    // resident copy is free at once, and no twin of it is needed.
    const bool copied = u.device->host_twin() != nullptr;
    const bool twinned = copied || (options_.background_commit && give_twin(p));
    (twinned ? twinned_ones : order).push_back(sg);
  }
  order.insert(order.end(), twinned_ones.begin(), twinned_ones.end());
  for (size_t sg : order) {
    Placement& p = placement_[sg];
    Unit& u = devices_[p.unit];
    std::vector<Job> jobs = chunk_jobs(p, JobKind::persist);
    c.writes.push_back(jobs.front().completion);
    if (u.device->host_twin() == nullptr) p.persisting(jobs.front().completion);
    for (Job& job : jobs) u.ring->persist(job);
  }
  const bool background = options_.background_commit && !c.writes.empty();
  pending_ = std::move(c);
  step_ = step;
  if (background)
    ++background_commits_;
  else
    land();
}

// A resident sub-group without a twin is updated in place once its own states are on
// storage: the commit's other writes (other sub-groups', other devices') go on. A failed
// write is the commit's: land() reports it.
void Pipeline::wait_written(size_t sg) {
  Placement& p = placement_[sg];
  try {
    Timer waited(commit_wait_ns_);
    p.written->wait();
  } catch (...) {
    land();
    throw;
  }
  p.released();
}

void Pipeline::land_if_written() {
  if (!pending_) return;
  for (const auto& w : pending_->writes)
    if (!w->done()) return;
  land();
}

void Pipeline::land() {
  if (!pending_) return;
  PendingCommit c = std::move(*pending_);
  pending_.reset();
  try {
    std::exception_ptr error;
    {
      Timer waited(commit_wait_ns_);
      for (const auto& w : c.writes) {
        try {
          w->wait();
        } catch (...) {
          if (!error) error = std::current_exception();
        }
      }
    }
    for (const auto& [sg, steps] : c.subgroups) placement_[sg].released();  // written
    if (error) std::rethrow_exception(error);
    std::vector<std::vector<store::Written>> written(devices_.size());
    for (const auto& [sg, steps] : c.subgroups)
      written[placement_[sg].unit].push_back(store::Written{placement_[sg].local, steps});
    for (Unit& u : devices_) u.store->sync();  // every device's states durable, none current
    for (size_t i = 0; i < devices_.size(); ++i) {
      Unit& u = devices_[i];
      u.store->publish(written[i], c.step, c.hyper, placement_.size());
      fault::check("pipeline.device_committed", u.store->dir());
    }
  } catch (...) {
    if (rewritten()) {  // one copy, written over: nothing to go back to
      std::string what = "unknown error";
      try {
        throw;
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      lose_one_copy("the durable commit of step " + std::to_string(c.step) + " failed (" + what + ")");
    }
    // Some devices may be at `step` already: put them back, so that every device stays at
    // the last step all have.
    try {
      for (Unit& u : devices_)
        if (u.store->step() == c.step && c.step != durable_step_) u.store->rollback_last_step();
    } catch (const std::exception& e) {
      abandon();
      throw std::runtime_error(
          std::string("a commit failed and undoing it failed too (") + e.what() +
          "): the pipeline is closed; reopen the directories, which rolls them back to step " +
          std::to_string(durable_step_));
    }
    if (logs_or_rewritten()) {  // a log's journal is the commit's: its step is redone
      try {
        wait_step();  // no update in flight may touch what back_to_durable reloads
      } catch (...) {
      }
      back_to_durable();
      throw;
    }
    // The steps stand, their states in resident memory and the working copies: those it
    // held stay dirty (a resident one behind its extents), so the next durable commit
    // (commit_every, flush, close) writes them again. Nothing is undone.
    throw;
  }
  // Their committed copy is now what the commit wrote; one updated since stays dirty (its
  // states ahead in resident memory, its other extents behind).
  for (const auto& [sg, steps] : c.subgroups) placement_[sg].committed(steps);
  durable_step_ = c.step;
}

void Pipeline::abandon() {
  pending_.reset();  // its writes end with the rings; the directories reopen before it
  for (Unit& u : devices_) u.ring.reset();
  devices_.clear();
}

bool Pipeline::logs_or_rewritten() const {
  return rewritten() || std::any_of(devices_.begin(), devices_.end(), [](const Unit& u) {
    return u.store->logs();
  });
}

std::vector<size_t> Pipeline::undo_step() {
  std::lock_guard lock(mu_);
  require_open();
  if (!step_in_progress()) return kept_;  // a commit() whose updates failed undid it
  auto undo = undo_;
  bool failed = false;
  try {
    wait_step();  // (its error is the failed step's, raised already)
  } catch (...) {
    failed = true;
  }
  try {
    land();  // a commit the caller was promised; a failed one keeps the states
  } catch (...) {
    if (devices_.empty()) throw;
  }
  if (logs_or_rewritten()) {
    back_to_durable();
    return {};
  }
  return undo_updates(std::move(undo), failed);
}

void Pipeline::discard() {
  std::lock_guard lock(mu_);
  require_open();
  std::exception_ptr error;
  try {
    wait_step();
  } catch (...) {
    error = std::current_exception();
  }
  back_to_durable();
  if (error) std::rethrow_exception(error);
}

void Pipeline::close() {
  std::lock_guard lock(mu_);
  if (devices_.empty()) return;
  std::exception_ptr error;
  try {
    if (parked_) {  // the steps not yet durable are written from the devices' memory
      for (Unit& u : devices_) u.device->unpark();
      parked_ = false;
    }
    bool failed = false;  // a step in progress (its caller failed) is undone alone first
    const bool forget = step_in_progress();
    auto undo = undo_;
    try {
      wait_step();
    } catch (...) {
      if (!forget) throw;
      failed = true;
    }
    if (forget && logs_or_rewritten()) {
      back_to_durable();
    } else {
      if (forget) undo_updates(std::move(undo), failed);
      land();
      if (step_ > durable_step_ || rewritten() || unwritten()) make_durable(step_);  // new states too
      land();
    }
  } catch (...) {
    error = std::current_exception();
  }
  if (devices_.empty()) std::rethrow_exception(error);  // abandoned: nothing to save
  for (Unit& u : devices_) {
    u.ring.reset();
    try {
      u.store->save_layout(placement_.size());
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  devices_.clear();
  if (error) std::rethrow_exception(error);
}

uint64_t Pipeline::park() {
  std::lock_guard lock(mu_);
  if (parked_) return 0;
  require_open();
  if (step_in_progress())
    throw std::invalid_argument("a step is in progress: commit() or discard() it before park()");
  land();  // (its background writes read the resident states)
  uint64_t freed = 0;
  parked_ = true;
  try {
    for (Unit& u : devices_) freed += u.device->park();
  } catch (...) {
    for (Unit& u : devices_) u.device->unpark();
    parked_ = false;
    throw;
  }
  return freed;
}

void Pipeline::unpark() {
  std::lock_guard lock(mu_);
  if (devices_.empty()) throw std::invalid_argument("the pipeline is closed");
  if (!parked_) return;
  for (Unit& u : devices_) u.device->unpark();  // (one that fails: again, the rest no-ops)
  parked_ = false;
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

}  // namespace smartinf::pipeline
