// Forward recovery's two files in a directory of one copy with a log (StoreConfig::log):
//   grads.bin  the step's gradients, one region per sub-group, after a header that names
//              each one's region, dtype, hyper-parameters, step count and hash. Sealed
//              before the step's first update: the regions synced, then the header written
//              and synced. A sealed header of the step after the manifest's is that step's
//              input, complete: a reopen finishes the step from it.
//   journal    one record per chunk the step rewrote (where its new version is, and that
//              version's checksum), appended as the writes finish and synced before the
//              extents they left are written over.
// The store (state_store.h) decides when each is written; this file only reads and writes
// them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/rules.h"
#include "unique_fd.h"

namespace smartinf::store {

struct LoggedGradient {
  int64_t id = 0;         // the sub-group
  uint64_t numel = 0;
  uint32_t dtype = 0;     // kernels::DType of its elements
  uint64_t steps = 0;     // its optimizer step count after the update
  kernels::Hyper hyper;
  uint64_t offset = 0;    // bytes into grads.bin
  uint64_t hash = 0;      // XXH3 of its bytes
};

struct JournalRecord {
  uint64_t step = 0;      // the logged step it belongs to
  uint32_t local = 0;     // the sub-group's index in the manifest
  uint32_t chunk = 0;
  uint64_t offset = 0;    // where the chunk's new version is, in states.bin
  uint64_t sum = 0;       // its XXH3 (store/checksum.h)
};

class StepLog {
 public:
  explicit StepLog(const std::string& dir);  // reads a header there, if any

  // The step being logged (its header not yet written) or the one the file holds.
  uint64_t step() const { return step_; }
  bool sealed() const { return sealed_; }
  const std::vector<LoggedGradient>& entries() const { return entries_; }
  const LoggedGradient* find(int64_t id) const;

  // A new step's log: nothing of it written yet (the sealed header of the last one is
  // overwritten only by this step's seal, so a crash before that reopens as before).
  void begin(uint64_t step);
  // Appends a sub-group's gradient of `bytes` (not synced); returns its entry.
  const LoggedGradient& add(int64_t id, uint64_t numel, kernels::DType dtype, uint64_t steps,
                            const kernels::Hyper& hyper, const void* data, uint64_t bytes);
  void seal();    // the regions synced, then the header, sealed, written and synced
  void unseal();  // the header zeroed and synced: its step will not be finished by a reopen
  void read(const LoggedGradient& e, void* into) const;  // checked against its hash

  void record(const JournalRecord& r);  // appended, not synced
  void sync_journal();
  // Emptied, durably: after the step's manifest is, and at an open that finished none (a
  // crashed attempt's records must never be taken for a later attempt's at the same step).
  void clear_journal();
  std::vector<JournalRecord> journal() const;  // the intact records of step()

 private:
  std::string dir_, grads_path_, journal_path_;
  UniqueFd grads_, journal_;
  uint64_t step_ = 0, end_ = 0, records_ = 0;
  bool sealed_ = false;
  std::vector<LoggedGradient> entries_;
};

}  // namespace smartinf::store
