// Sub-groups over near-storage devices: placement, steps and their atomic commit.
// One Ring per device; a step's updates go to the shadow copies and become current only
// when commit() has made every device's writes durable.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "device/device.h"
#include "device/registry.h"
#include "pipeline/activity.h"
#include "pipeline/placement.h"
#include "pipeline/ring.h"
#include "store/state_store.h"

namespace smartinf::pipeline {

struct DeviceSpec {
  std::string kind = "cpu";  // a row of device/registry.h: cpu | xrt | cuda
  std::string dir;
  device::KindOptions options;  // the kind's own (its row names them; its factory reads them)
  double storage_bps = 0;    // kind cpu: emulated internal storage bandwidth; 0: the disk's
  std::string io_schedule = "mixed";  // mixed | phased: see RingOptions
  uint64_t io_burst = 0;     // phased: bytes of one direction per turn; 0: RingOptions' default
  // Resident sub-groups are placed with their twin (twice their bytes of the budget): a
  // durable commit's write never holds their next update, at the price of half the
  // resident capacity (smartinf.model weighs the two for a GPU). false: twins only from
  // what is left of the budget at a commit.
  bool twins = false;
};

struct PipelineOptions {
  std::vector<DeviceSpec> devices;
  std::string optimizer = "adamw";  // a row of kernels/rules.h
  std::string state_dtype = "fp32"; // fp32 | int8 | int4 (the moments, block-wise)
  std::string master = "fp32";      // fp32 | split (bf16 params: the low halves stored)
  float initial_state = 0.0f;       // optimizer states of new sub-groups (AdaGrad's sum)
  uint64_t chunk = 1 << 20;         // params per chunk (slot size)
  size_t slots = 0;                 // K slots per device; 0: auto_slots() (pipeline.cc)
  double host_link_bps = 0;         // shared host link, each direction; 0: no cap
  bool verify = false;              // checksum every extent loaded (always on resume)
  std::string if_exists = "resume";  // directories holding a run: resume | overwrite | error
  // The memory tier: bytes of states per cpu device kept resident in host RAM, held from
  // creation (a cuda device's GPU budget is its own option); sub-groups that fit stay
  // there, the rest stream. 0: none.
  uint64_t memory_budget = 0;
  // Every commit_every-th commit() is durable (written, synced, the manifest switched); the
  // others keep the step in resident memory and the working copies. 1: every step.
  uint64_t commit_every = 1;
  // Whether a durable commit due while the last is still written in the background waits for
  // it (true: every commit_every-th step, exactly) or is put off to the first commit() after
  // that write landed (false: the interval stretches to what the disk sustains, and no step
  // waits for it; the planner's intervals).
  bool commit_waits = true;
  // Extents per chunk in each directory (store/state_store.h), fixed when it is made: 2 (every
  // instant recoverable) or 1 (half the disk: every sub-group resident, written in place at
  // durable commits; a crash during one loses the states, and the reopen says so).
  uint32_t copies = 2;
  // copies 1 with forward recovery (store/step_log.h), fixed when the directories are made:
  // every chunk's new version goes to a free extent; each step's gradients are logged
  // (update(log_only)) before its first update; a crash reopens at the step before, or
  // finishes the logged one. cpu devices, streamed fp32-master states, a durable commit
  // every step.
  bool log = false;
  // With a log, several processes (ranks) whose directories a crash may leave with a logged
  // step: the caller decides for all of them whether it is finished or forgotten
  // (logged_step_pending, finish_logged_step, drop_logged_step) before adding sub-groups.
  bool defer_logged_step = false;
  // A durable commit's resident states are written in the background while later steps
  // run; it becomes durable when they are written (see make_durable). false: commit() waits.
  bool background_commit = true;
  unsigned compute_threads = 0;  // threads of the update kernel; 0: default_compute_threads()
  RingOptions ring;
  // int8/int4 states: sub-groups added as small (small tensors: biases, norms) keep fp32
  // moments, in a cpu device of their own over this directory ("": none), placed after the
  // others in the device list. Quantisation blocks shared with larger neighbours cost small
  // tensors most of their moments' precision (lpmm keeps tensors of <= 4096 elements in
  // fp32). small_numels: the sizes of the small sub-groups to come, all resident when
  // memory_budget is given (their bytes held from creation, apart from it).
  std::string small_dir;
  std::vector<uint64_t> small_numels;
};

// Hyper-parameters of one update (each rule reads its own); the step count t comes from
// the stored sub-group.
using UpdateHyper = kernels::Hyper;

// One sub-group's gradient as it crosses the host link: dense (`data`, numel elements of
// `dtype`), or SmartComp top-k pairs (`index`: nnz ascending int32 positions, `data`: nnz
// values of `dtype`, fp16/bf16) that the device decompresses. Compressed is said, not
// inferred from `index`: an empty top-k (nnz 0) may come with null pointers.
struct Gradient {
  const void* data = nullptr;
  kernels::DType dtype = kernels::DType::f32;
  bool compressed = false;
  const int32_t* index = nullptr;
  uint64_t nnz = 0;
  // Gradient and params in a GPU's memory: an event the caller's stream recorded after what
  // it queued for them (a cudaEvent_t), which the device's stream waits for before reading
  // them (Device::bind_caller), where the caller's thread would wait; null: ready now.
  const void* ready = nullptr;
  // Dense gradient and params in the caller's parts (takes_parts): `data` and update()'s
  // `out` unused.
  std::shared_ptr<const device::CallerParts> parts;
};

class Pipeline {
 public:
  explicit Pipeline(const PipelineOptions& options);
  ~Pipeline();

  // Registers sub-group number subgroup_count() with `numel` params. A new one is
  // initialised (params from `init`, zeros when null; states `initial_state`) before this
  // returns; one the directories already hold is resumed and `init` is ignored, if its
  // size and `fingerprint` (the caller's name for its layout; 0: unchecked) match.
  // `small`: its params are small tensors, whose moments stay fp32 (PipelineOptions::small_dir).
  size_t add_subgroup(uint64_t numel, const float* init, uint64_t fingerprint, bool& resumed,
                      bool small = false);

  // Queues one sub-group's update; the completion is done when all params are in `out`.
  // With a log (PipelineOptions::log), `log_only` logs the gradient and hyper-parameters of
  // the step's update (done at once, nothing updated); every sub-group the step updates is
  // logged before its first update, which seals the log, and updated with the same.
  std::shared_ptr<Completion> update(size_t sg, const Gradient& grad, void* out,
                                     kernels::DType out_dtype, const UpdateHyper& hyper,
                                     bool speculative = false, bool log_only = false);
  // Speculation (an update started before its gradient or the step's global decisions are
  // known to be final): whether `sg`'s next update could be retracted, i.e. it would leave
  // the states it reads untouched (a streamed sub-group's committed extents; a resident
  // one with a twin, whose update copies into the twin first). update(speculative=true)
  // needs it.
  bool retractable(size_t sg) const;
  // Whether `sg`'s update takes its gradient and params in the caller's parts
  // (Gradient::parts): its device works in host memory on fp32 states element by element.
  bool takes_parts(size_t sg) const;
  // Forgets `sg`'s speculative update of the step in progress once it is done (its params
  // out, its writes finished): the sub-group is as before it, to be updated again or not.
  void retract(size_t sg);
  // Replaces a sub-group's states (state_arrays() arrays of numel; a null one keeps the
  // optimizer's initial value) and its step count, as part of the current step: they
  // become current at commit(), like an update.
  void write_states(size_t sg, const float* const* arrays, uint64_t steps);
  // The states of a sub-group at step(), state_arrays() arrays (a null one is skipped). With
  // a split master the masters (arrays[0]) are rebuilt from the sub-group's bf16 `params`.
  void read_states(size_t sg, float* const* arrays, const void* params = nullptr);
  unsigned state_arrays() const { return kernels::rule_row(rule_).arrays; }

  // Waits for the step and advances step(); every commit_every-th one also makes the steps
  // since the last durable commit durable (all devices, or none): at once, or with
  // background_commit once its resident states are written (durable_step() tells).
  void commit();
  void flush();    // makes the committed steps durable now (no step in progress)
  // Waits for a durable commit written in the background to land; if it fails, the
  // pipeline is back at the durable commit before it, and the error is rethrown.
  void settle();
  // Waits for the step and goes back to durable_step(): the step's updates and those of
  // the non-durable commits before it are forgotten (resident states reloaded).
  void discard();
  // Waits for the step and undoes it alone (a failed step): each update (or states written)
  // is retracted where the states it read are still held (a streamed sub-group's committed
  // extents, a resident one's other copy), or its resident states are reloaded from the
  // committed copy (its first update since the last durable commit); the steps before stay.
  // An update made in place over steps not yet durable cannot be undone: it is kept, and
  // its sub-group returned (as torch keeps what its loop updated before an exception);
  // where the devices' work failed (an I/O error) such an update may be half written, so
  // the pipeline goes back to durable_step() (discard()), as with a log or a directory of
  // one copy written over.
  std::vector<size_t> undo_step();
  // Undoes a step in progress as undo_step() does, then makes the committed steps durable;
  // persists the layout (parked: unparked first).
  void close();
  // Between steps (none in progress; a durable commit written in the background landed
  // first): each device's own memory given back, its resident states in a GPU's memory
  // copied into host memory (Device::park); returns the GPU bytes freed. Until unpark(),
  // which copies them back, every other call but close() is refused. DeepSpeed's
  // offload_states / reload_states.
  uint64_t park();
  void unpark();
  bool parked() const { return parked_; }

  bool closed() const { return devices_.empty(); }
  uint64_t step() const { return step_; }
  uint64_t durable_step() const { return durable_step_; }  // what a crash reopens at
  // The durable step before the current one, which every directory's shadow copies still
  // hold (durable_step() where they differ): what roll_back_to can go back to.
  uint64_t previous_step() const;
  // Before any sub-group is added: back to `step`, the current durable step or the one
  // before it (previous_step), as the pipelines of other ranks are after a crash between
  // their commits; anything else is refused naming both.
  void roll_back_to(uint64_t step);
  bool commit_pending() const { return pending_.has_value(); }  // written in the background
  bool resident(size_t sg) const { return placed(sg).resident != device::kOwnStates; }
  size_t subgroup_count() const { return placement_.size(); }
  uint64_t numel(size_t sg) const;
  size_t device_of(size_t sg) const;  // the index of the device sub-group sg is placed on
  // The bytes each device's states file would grow by if sub-groups of `numels` (`small`
  // each, as add_subgroup takes them) were added next, in order, as add_subgroup would
  // place them; nothing is placed or written (a caller checks the space first). With a
  // log, a step's gradients of `gradient_bytes` a param too.
  std::vector<uint64_t> planned_bytes(const std::vector<uint64_t>& numels,
                                      const std::vector<bool>& small, uint32_t gradient_bytes = 4) const;
  uint64_t subgroup_steps(size_t sg) const;
  // With a log: every device's log sealed now (the first update does it otherwise), so that
  // a caller can tell other processes before any update runs. After a deferred reopen
  // (PipelineOptions::defer_logged_step): whether every device holds a sealed log of the
  // step after its own; finish it, or forget it (no update of it ran anywhere).
  void seal_logs();
  bool logged_step_pending() const;
  void finish_logged_step();
  void drop_logged_step();
  bool pending() const { return !completions_.empty(); }
  std::map<std::string, double> stats() const;  // all devices together
  std::vector<std::map<std::string, double>> device_stats() const;  // one per device
  std::string engine() const;
  const std::vector<std::string>& notes() const { return notes_; }
  // Split master: the chunks whose params came back other than the devices emitted them
  // (since the last call); their params were taken as the masters.
  std::vector<ForeignChunk> take_foreign();

 private:
  struct Unit {  // one device with its storage and ring
    std::unique_ptr<device::Device> device;
    std::unique_ptr<store::StateStore> store;
    std::unique_ptr<Ring> ring;
    uint64_t numel = 0;           // placed so far
    uint64_t balanced_numel = 0;  // of those, the ones placement balances (Pipeline::place)
    uint64_t resident_used = 0;   // bytes of the device's resident memory given out
    bool twins = false;           // DeviceSpec::twins
    bool small = false;           // holds the small sub-groups (PipelineOptions::small_dir)
    store::StateLayout layout;    // its states' bytes (fp32 moments where small)
  };
  // A durable commit whose resident states are being written in the background.
  struct PendingCommit {
    uint64_t step = 0;
    std::vector<std::pair<size_t, uint64_t>> subgroups;  // (sub-group, steps) it holds
    std::vector<std::shared_ptr<Completion>> writes;
    std::map<std::string, double> hyper;
  };
  const Placement& placed(size_t sg) const;
  // What placement has given out on each device so far (Unit::resident_used and
  // balanced_numel), or a copy planned_bytes advances.
  struct Load {
    uint64_t resident_used = 0, balanced_numel = 0;
  };
  std::vector<Load> loads() const;
  size_t place(int64_t id, uint64_t bytes, bool small, const std::vector<Load>& loads) const;
  // `numel` params (`bytes` of states) placed on `unit`: resident or not, and the loads after.
  bool settle_load(size_t unit, uint64_t numel, uint64_t bytes, std::vector<Load>& loads) const;
  uint64_t current_steps(const Placement& p) const;  // ahead of the store's record while dirty
  void check_membership();
  void require_open() const;
  void wait_step();  // waits for the step's work; rethrows its first error
  void wait_written(size_t sg);  // its resident states written by the pending commit
  void submit_and_wait(size_t unit, std::vector<Job>& jobs);
  // One job per chunk of a sub-group, sharing one completion, with the chunk's identity,
  // where its states are held, and its extents: src the current copy, dst the working one.
  std::vector<Job> chunk_jobs(const Placement& p, JobKind kind) const;
  // chunk_jobs that write the host's `arrays` (or the optimizer's initial values) to `copy`.
  std::vector<Job> init_jobs(const Placement& p, uint32_t copy, const float* const* arrays) const;
  // Persists resident states and commits every device at `step`: at once, or with
  // background_commit when the writes are done (pending_, landed by land()).
  void make_durable(uint64_t step);
  // Waits for the pending commit's writes and commits every device (none pending: nothing).
  // On failure, back to the durable commit before it, and rethrows.
  void land();
  void land_if_written();  // lands the pending commit if its writes are done, without waiting
  uint64_t resident_size(const Placement& p) const;  // bytes of one copy of its states
  // A resident sub-group's twin, from what is left of its device's budget, if it has none
  // and one fits (kept from then on); whether it has one.
  bool twin_fits(const Placement& p) const;
  // Whether unit `u`'s updates take the caller's parts (takes_parts; mu_ held).
  static bool parts_taken(const Unit& u);
  // A new sub-group's `bytes` of states, with its twin where `u` keeps twins, fit in what
  // is left of u's budget.
  static bool fits_resident(const Unit& u, uint64_t used, uint64_t bytes);
  bool give_twin(Placement& p);
  // Back to the last durable commit: dirty sub-groups forgotten, resident ones reloaded.
  void back_to_durable();
  // How an update (or states written) of the step in progress is undone: its placement put
  // back (its states elsewhere untouched), its resident states reloaded from the committed
  // copy, or not at all (kept: written in place over steps not yet durable).
  enum class Undo { restore, reload, keep };
  Undo undo_of(const Placement& before, bool elsewhere) const;
  void restore(size_t sg, Placement before);  // `before` back, as retract does
  // The step's updates in `undo` undone (after wait_step, which threw where `failed`: then
  // any kept one sends the pipeline back to the durable commit); returns the kept (kept_).
  std::vector<size_t> undo_updates(std::map<size_t, std::pair<Placement, Undo>> undo,
                                   bool failed);
  void abandon();  // drops every device without saving: after a failure it cannot undo
  // Sub-group `sg` updated (or written) in the step in progress, to `steps`; its new states
  // stay in resident memory (`stays_resident`) or go to its shadow extents.
  void mark_written(size_t sg, uint64_t steps, bool stays_resident);
  bool step_in_progress() const;
  // With one copy, a sub-group placed to stream would be written over its committed states
  // every step: refused, naming what would hold it (`id`, `numel` params on `unit`).
  void refuse_streamed_one_copy(int64_t id, uint64_t numel, size_t unit) const;
  bool rewritten() const;  // a directory of one copy written over since its durable step
  bool unwritten() const;  // some sub-group's states not yet on storage (Placement::unwritten)
  bool lost_unwritten() const;  // ... and updated since: going back to a durable commit loses it
  bool logs_or_rewritten() const;  // a failure goes back to the durable step (back_to_durable)
  [[noreturn]] void lose_one_copy(const std::string& why);  // abandons, then says so
  // A directory with a log whose step was partly written where the step before was:
  // abandons, and says the reopen finishes the logged step.
  [[noreturn]] void finish_on_reopen(const std::string& why);
  void refuse_log_options(const PipelineOptions& o) const;
  void settle_logs(uint64_t lo, uint64_t hi);
  bool logged_undecided_ = false;  // a deferred logged step: finish_ or drop_logged_step
  // A reopen that found a logged step half done: its other chunks updated again.
  void finish_logged_step(Unit& u);

  PipelineOptions options_;
  kernels::Rule rule_;
  store::StateLayout layout_;  // the states' bytes (a small unit's moments: Unit::layout)
  std::vector<Unit> devices_;
  std::vector<Placement> placement_;
  std::vector<bool> updated_;
  std::vector<std::shared_ptr<Completion>> completions_;
  std::map<std::string, double> last_hyper_;
  std::vector<std::string> notes_;
  uint64_t step_ = 0, durable_step_ = 0;
  bool parked_ = false;  // park()
  std::optional<PendingCommit> pending_;
  // Speculative updates of the step in progress: each sub-group's placement before it.
  std::map<size_t, std::pair<Placement, std::shared_ptr<Completion>>> speculative_;
  // Every update (or states written) of the step in progress: its placement before, and how
  // a failed step undoes it; kept_: the sub-groups the last undone step kept (a commit()
  // whose updates failed undoes the step itself: undo_step() then returns these).
  std::map<size_t, std::pair<Placement, Undo>> undo_;
  std::vector<size_t> kept_;
  uint64_t speculative_updates_ = 0, retracted_updates_ = 0;
  uint64_t background_commits_ = 0, commit_wait_ns_ = 0;
  std::shared_ptr<Activity> updates_ = std::make_shared<Activity>();  // the updates' wall time
  mutable std::mutex mu_;
};

}  // namespace smartinf::pipeline
