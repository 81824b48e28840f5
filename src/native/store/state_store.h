// A device's storage directory: `states.bin` (per chunk two extents, copy A and B, each
// 4 KiB aligned and laid out as store/layout.h says: the fp32 param and the optimizer's
// fp32 arrays, or fp32 params and int8 moments), `manifest` and `lock`. A step reads each
// sub-group's committed copy and writes the other one; sync() makes those writes durable
// and publish() then flips the copies in a manifest replaced atomically (shadow paging).
// A directory of one copy (`copies` 1: half the disk) is rewritten in place at a durable
// commit, marked `rewriting` in its manifest meanwhile: it holds the states of its step
// between commits, none while one is written (a reopen then refuses it).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "store/layout.h"
#include "store/step_log.h"
#include "unique_fd.h"
#include "store/manifest.h"

namespace smartinf::store {

struct StoreConfig {
  uint64_t chunk = 0;
  std::string optimizer;
  StateLayout layout;  // fp32 arrays per param (fixed by the optimizer) or int8
  bool direct = true;  // O_DIRECT where the file system has it (false: the slots cannot take it)
  // A directory that holds a run: "resume" it, "overwrite" it (start afresh), or "error".
  std::string if_exists = "resume";
  uint32_t copies = 2;  // extents per chunk, fixed when the directory is made: 2 or 1
  // One copy with forward recovery, fixed when the directory is made (copies 1): each
  // chunk's new version goes to a free extent of `spares` (or one a chunk left in the step,
  // once the journal says where that chunk went), the step's gradients logged first
  // (step_log.h); a crash at any instant reopens at the step before, or finishes the
  // logged step.
  bool log = false;
  uint64_t spares = 16;
};

inline constexpr uint64_t kNoExtent = ~uint64_t(0);

// A logged step's sub-group whose chunks a crash left at the step before: the pipeline
// updates them again from the logged gradient (StateStore::publish_logged_step after).
struct Replay {
  size_t local;
  LoggedGradient gradient;
  std::vector<uint64_t> chunks;
};

// A sub-group written in the step being committed, and its optimizer step count after it.
struct Written {
  size_t local;
  uint64_t steps;
};

struct Extent {
  uint64_t offset;  // bytes into states.bin
  uint64_t bytes;   // aligned I/O size
  uint64_t numel;   // params in this chunk
  uint64_t* sum;    // its checksum in the manifest (stable while the sub-group exists)
};

class StateStore {
 public:
  // Opens `dir` (which must exist), resuming from its manifest when there is one, and
  // locks it (`dir/lock`, flock) against other pipelines until destroyed.
  // Throws std::invalid_argument when the directory was made with another layout, or
  // holds states without a manifest (which is written before any state is).
  StateStore(const std::string& dir, const StoreConfig& config, std::vector<std::string>& notes);
  ~StateStore();
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  // Local index of sub-group `id`; a new one gets fresh extents at the end of the file.
  // `created` tells whether it was new (its states must be initialised before commit).
  // A held one must have the same size and fingerprint (0: unchecked), and must not have
  // been left behind by a pipeline of fewer sub-groups (stale).
  size_t attach(int64_t id, uint64_t numel, uint64_t fingerprint, bool& created);
  // Forgets the sub-group attach() just created (its initialisation failed).
  void detach_last();

  bool holds(int64_t id) const { return local_of_.count(id) != 0; }
  const SubgroupRecord& record(size_t local) const { return manifest_.subgroups[local]; }
  size_t subgroup_count() const { return manifest_.subgroups.size(); }
  uint64_t chunks(size_t local) const;
  Extent extent(size_t local, uint64_t chunk, uint32_t copy) const;

  // A commit in two halves, so that a pipeline makes every device's states durable before
  // any device says so: sync() makes the step's writes durable (nothing is current yet);
  // publish() then applies the step, the listed sub-groups' written copies current, in a
  // manifest replaced atomically. `attached`: the sub-groups the pipeline has (any held
  // beyond them are stale from now).
  void sync();
  void publish(const std::vector<Written>& written, uint64_t pipeline_step,
               const std::map<std::string, double>& hyper, uint64_t attached);
  // Persists the layout (new sub-groups) without a step; a no-op when nothing changed.
  void save_layout(uint64_t attached);
  // Undoes the last commit (its shadow copies are still intact): back to previous_step().
  // A directory of one copy holds no earlier step: refused.
  void rollback_last_step();
  // Before states are written over the committed ones (one copy only; else a no-op): the
  // manifest says so, durably, until publish() replaces it.
  void begin_rewrite();

  // -- forward recovery (a directory with a log) -------------------------------------
  bool logs() const { return manifest_.log; }
  // The bytes of the spares its first sub-group's attach allocates beside it (0 once there).
  uint64_t unallocated_spare_bytes() const {
    return manifest_.log && manifest_.subgroups.empty() ? manifest_.spares * extent_bytes(manifest_.chunk, layout_) : 0;
  }
  size_t local(int64_t id) const { return local_of_.at(id); }
  // The step's gradient of sub-group `local`, logged before any update (the first opens
  // the log of step() + 1); then seal_log(), once all are.
  void log_gradient(size_t local, kernels::DType dtype, uint64_t steps, const kernels::Hyper& hyper,
                    const void* data);
  bool log_open() const { return logging_; }
  bool log_sealed() const { return logging_ && log_->sealed(); }
  void seal_log();
  const LoggedGradient* logged(int64_t id) const;  // null: not logged in this step
  // The ring's writer: a free extent for a chunk's new version (kNoExtent: none until
  // sync_spares), and the version written there (journaled; the extent it left becomes
  // free at the next sync_spares, which makes the writes and their records durable).
  uint64_t take_spare();
  void written(size_t local, uint64_t chunk, uint64_t offset, uint64_t sum);
  void sync_spares();
  // An extent a chunk left in this step was written over: the step cannot be undone.
  bool reused() const;
  // The step is forgotten (nothing reused): its log unsealed, its extents free again.
  void forget_step();
  // What a reopen found to finish (a sealed log of step() + 1: pending()); the pipeline
  // updates those chunks again, then publish_logged_step() makes the step durable. Or,
  // where another device's log of that step was never sealed (no extent was written over
  // anywhere), drop_log(): the directory stays at step().
  bool pending() const { return pending_; }
  const std::vector<Replay>& replay() const { return replay_; }
  void drop_log();
  void read_logged(const LoggedGradient& g, void* into) const { log_->read(g, into); }
  void publish_logged_step();

  uint64_t step() const { return manifest_.step; }
  // What a rollback returns to (one copy: the step itself, nothing earlier is held).
  uint64_t previous_step() const { return copies() == 1 ? manifest_.step : manifest_.previous; }
  uint32_t copies() const { return manifest_.copies; }
  bool rewriting() const { return manifest_.rewriting; }
  const Membership& membership() const { return manifest_.member; }
  void set_membership(const Membership& m);  // written to the manifest at once
  int fd() const { return fd_.get(); }
  const std::string& file_path() const { return states_path_; }
  const std::string& dir() const { return dir_; }
  bool direct() const { return direct_; }
  const StateLayout& layout() const { return layout_; }

 private:
  void write_manifest(const Manifest& m);  // durably replaces the manifest; then current
  void lock_directory();
  void refuse_orphan_states() const;
  bool holds_run() const;
  void discard_run();
  void open_log();      // a reopen: the log read, a logged step's finished chunks found
  void rebuild_free();  // every extent that holds no chunk's current version, free

  std::string dir_, states_path_, manifest_path_;
  Manifest manifest_;
  std::map<int64_t, size_t> local_of_;
  StateLayout layout_;
  ChunkLayout chunks_;  // where each chunk's extents sit
  uint64_t file_end_ = 0;
  bool layout_dirty_ = false;
  bool direct_ = true;
  UniqueFd lock_fd_, fd_;  // the lock (held while open) and states.bin
  // Forward recovery: the log, each chunk's extent now (the manifest's `at` until a step
  // rewrites it), the free extents, those the step's chunks left (free once journaled),
  // which of them may be taken now, and whether one was.
  std::unique_ptr<StepLog> log_;
  bool logging_ = false;
  std::vector<std::vector<uint64_t>> working_;
  std::vector<uint64_t> free_, released_;
  std::unordered_set<uint64_t> left_;  // extents this step's chunks left, synced as left
  bool reused_ = false;
  std::vector<Replay> replay_;
  bool pending_ = false;
  mutable std::mutex log_mu_;
};

}  // namespace smartinf::store
