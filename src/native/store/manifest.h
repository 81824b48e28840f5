// The manifest of a device directory: layout, optimizer, per-sub-group copy/step, and the
// pipeline step it was committed at. Text, one record per line, CRC32 of the body last.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace smartinf::store {

// XXH3-64 checksums of a sub-group's extents, per copy (A/B) and chunk; 0: not known
// (written by an older version, or by a device whose states the host cannot read).
struct ChunkSums {
  std::vector<uint64_t> copy[2];
};

struct SubgroupRecord {
  int64_t id = 0;        // the pipeline's sub-group id
  uint64_t numel = 0;
  uint64_t offset = 0;   // byte offset of the first chunk's extents in states.bin
  uint32_t copy = 0;     // which of the A/B copies holds the committed state
  uint64_t steps = 0;    // optimizer steps applied (Adam's t)
  uint64_t last = 0;     // pipeline step that last updated it (one-step rollback)
  uint64_t prev_steps = 0;  // `steps` before that update (a state import may set any)
  // What the caller says the sub-group holds (e.g. a hash of its params' shapes), so a
  // model of the same size but another layout is refused; 0: not known.
  uint64_t fingerprint = 0;
  // Shared by copies of the manifest, so the ring's writer can fill it in place.
  std::shared_ptr<ChunkSums> sums;
  // A directory with a log: where each chunk's committed version is (bytes into
  // states.bin); its extents move between steps (StateStore's spares).
  std::vector<uint64_t> at;
};

// Which device of which pipeline a directory is: reopening with another device list (a
// directory missing, added, swapped or reordered) would place sub-groups elsewhere.
struct Membership {
  std::string pipeline;  // random id shared by the pipeline's directories
  uint32_t index = 0;    // position in the device list
  uint32_t count = 0;    // devices in the list; 0: unknown (a version 2 manifest)
};

struct Manifest {
  // 2: prev_steps; 3: membership; 4: checksums; 5: fingerprints, attached; 6: previous;
  // 7: master; 8: int4's second moment on the powers of two (kernels/quant4.h); 9: copies,
  // rewriting; 10: log, spares, at
  static constexpr int kVersion = 10;
  static constexpr int kOldestVersion = 2;
  static constexpr uint64_t kMaxChunks = uint64_t(1) << 22;  // per directory
  int version = kVersion;        // the format it was read in (written: always kVersion)
  uint64_t chunk = 0;            // params per chunk
  std::string state_dtype = "fp32";
  std::string master = "fp32";   // fp32 | split (store/layout.h); before version 7: fp32
  std::string optimizer;         // adam, adamw, ...
  std::map<std::string, double> hyper;  // informational: last hyper-parameters used
  uint64_t step = 0;             // pipeline steps committed
  // The step committed before `step` (step - 1, or step - K with a commit interval K): the
  // one the shadow copies hold, where rollback_last_step() returns to.
  uint64_t previous = 0;
  // Sub-groups the pipeline had when it last wrote the manifest; held ones at or above it
  // were left behind by a smaller model since and are stale. -1: not known (version < 5).
  int64_t attached = -1;
  // Extents per chunk: 2 (the committed copy and the one a step writes: every instant
  // recoverable) or 1 (written in place at durable commits; before version 9: 2).
  uint32_t copies = 2;
  // One copy only: a durable commit is rewriting it in place, so the states are those of
  // no step until the commit's manifest replaces this one (a reopen refuses them).
  bool rewriting = false;
  // One copy with forward recovery (step_log.h): each chunk rewritten to a free extent, the
  // step's gradients logged; `spares` extents of the chunk's size at `spares_offset` were
  // allocated with the first sub-group, beyond its own.
  bool log = false;
  uint64_t spares_offset = 0, spares = 0;
  Membership member;
  std::vector<SubgroupRecord> subgroups;

  std::string serialize() const;
  // Throws std::invalid_argument naming `path` and the first thing that is wrong.
  static Manifest parse(const std::string& text, const std::string& path);
  SubgroupRecord* find(int64_t id);  // null when not held
  // Gives `r` zeroed checksums for its chunks.
  void add_sums(SubgroupRecord& r) const;
};

}  // namespace smartinf::store
