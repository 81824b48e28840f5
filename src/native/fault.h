// Fault points for tests: a test arms one named point (smartinf._native.arm_fault) to
// make the I/O there fail, come back short, or kill the process, after a countdown of
// hits. Disarmed (always, unless a test armed one), a point costs one relaxed atomic load.
//   io.read, io.write          one storage request (a piece of up to 1 MiB) completing
//   store.synced               commit: states fdatasync'd, manifest not yet written
//   manifest.written           the new manifest is durable under its temporary name
//   manifest.renamed           renamed over the old one, directory not yet fsync'd
//   pipeline.device_committed  one device committed, the next not yet
//   log.written                a log's gradients synced, its header not yet written
//   log.sealed                 its header written and synced: the step's input complete
//   journal.synced             a log's rewritten chunks and their records synced (the
//                              extents they left are free from here)
#pragma once
#include <atomic>
#include <cstdint>
#include <string>

namespace smartinf::fault {

enum class Action { none, error, short_io, kill };

extern std::atomic<bool> armed;
Action hit(const char* point);  // counts the hit; the action once the countdown is over
void arm(const std::string& point, Action action, uint64_t after, int error_code);
void disarm();
int error_code();  // errno of Action::error

inline Action at(const char* point) {
  return armed.load(std::memory_order_relaxed) ? hit(point) : Action::none;
}

// A short transfer of a `done`-byte result: half of it, in whole 4 KiB blocks (what
// O_DIRECT can resume from); unchanged when that is nothing.
inline long short_length(long done) {
  const long half = done / 2 / 4096 * 4096;
  return half > 0 ? half : done;
}

// For the store and pipeline points: kill, or throw SystemError naming `path`.
void check(const char* point, const std::string& path);

}  // namespace smartinf::fault
