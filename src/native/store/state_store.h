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
#include <string>
#include <vector>

#include "store/layout.h"
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

  std::string dir_, states_path_, manifest_path_;
  Manifest manifest_;
  std::map<int64_t, size_t> local_of_;
  StateLayout layout_;
  ChunkLayout chunks_;  // where each chunk's extents sit
  uint64_t file_end_ = 0;
  bool layout_dirty_ = false;
  bool direct_ = true;
  UniqueFd lock_fd_, fd_;  // the lock (held while open) and states.bin
};

}  // namespace smartinf::store
