#include "store/state_store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>

#include "error.h"
#include "fault.h"
#include "store/checksum.h"

namespace smartinf::store {
namespace {

// False when `path` does not exist; any other failure is an error, never "no manifest".
bool read_file(const std::string& path, std::string& text) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) return false;
  check_errno(fd, "cannot read the manifest", path);
  text.clear();
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      ::close(fd);
      if (err) throw SystemError(err, "cannot read the manifest", path);
      return true;
    }
    text.append(buf, static_cast<size_t>(n));
  }
}

void fsync_dir(const std::string& dir) {
  int dfd = check_errno(::open(dir.c_str(), O_RDONLY | O_DIRECTORY), "open directory", dir);
  int res = ::fsync(dfd);
  ::close(dfd);
  check_errno(res, "fsync directory", dir);
}

void mismatch(const std::string& dir, const std::string& what, const std::string& stored,
              const std::string& wanted) {
  throw std::invalid_argument(dir + " holds states made with " + what + " " + stored +
                              ", not " + wanted +
                              "; open it with the same settings or use another directory");
}

}  // namespace

StateStore::StateStore(const std::string& dir, const StoreConfig& config,
                       std::vector<std::string>& notes)
    : dir_(dir),
      states_path_(dir + "/states.bin"),
      manifest_path_(dir + "/manifest"),
      layout_(config.layout),
      chunks_{config.chunk, config.layout, 2, config.log} {
  lock_directory();
  std::string text;
  bool resume = read_file(manifest_path_, text);
  if (resume) manifest_ = Manifest::parse(text, manifest_path_);
  // (overwrite: any manifest goes, a run that never committed or was being rewritten too)
  if (resume && config.if_exists != "resume" && (holds_run() || config.if_exists == "overwrite")) {
    if (config.if_exists != "overwrite")
      throw std::invalid_argument(
          dir + " holds the states of an earlier run (step " + std::to_string(manifest_.step) +
          ", " + std::to_string(manifest_.subgroups.size()) + " sub-groups): pass " +
          "if_exists=\"resume\" to continue it (its stored weights replace the model's), " +
          "if_exists=\"overwrite\" to discard it and start from the model's weights, or " +
          "use another directory");
    discard_run();
    manifest_ = Manifest{};
    resume = false;
  }
  if (resume) {
    if (manifest_.chunk != config.chunk)
      mismatch(dir, "chunk", std::to_string(manifest_.chunk), std::to_string(config.chunk));
    if (manifest_.optimizer != config.optimizer)
      mismatch(dir, "optimizer", manifest_.optimizer, config.optimizer);
    if (manifest_.state_dtype != config.layout.dtype())
      mismatch(dir, "state dtype", manifest_.state_dtype, config.layout.dtype());
    if (manifest_.master != config.layout.master_format())
      mismatch(dir, "master", manifest_.master, config.layout.master_format());
    if (manifest_.copies != config.copies || manifest_.log != config.log)
      mismatch(dir, "copies", manifest_.log ? "'log'" : std::to_string(manifest_.copies),
               config.log ? "'log'" : std::to_string(config.copies));
    if (manifest_.rewriting)
      throw std::invalid_argument(
          dir + " was being rewritten in place by a durable commit after step " +
          std::to_string(manifest_.step) + " when its run stopped: a directory of one copy "
          "(copies=1) holds no step while a commit writes it, so its states are lost. Restore a "
          "checkpoint, or open it with if_exists=\"overwrite\" to start afresh (copies=2 keeps "
          "every instant recoverable, at twice the disk)");
    if (manifest_.state_dtype == "int4" && manifest_.version < 8)
      throw std::invalid_argument(
          dir + " holds int4 states of an earlier smartinf (manifest version " +
          std::to_string(manifest_.version) + "), whose second moment was coded on another map "
          "(kernels/quant4.h): read them (state_dict) with the version that wrote them, or open "
          "it with if_exists=\"overwrite\" to start afresh");
  } else {
    manifest_.chunk = config.chunk;
    manifest_.optimizer = config.optimizer;
    manifest_.state_dtype = config.layout.dtype();
    manifest_.master = config.layout.master_format();
    manifest_.copies = config.copies;
    manifest_.log = config.log;
    manifest_.spares = config.log ? std::max<uint64_t>(1, config.spares) : 0;
    if (config.if_exists != "overwrite") refuse_orphan_states();
  }

  const int flags = O_RDWR | O_CREAT | O_CLOEXEC | (resume ? 0 : O_TRUNC);
  int fd = config.direct ? ::open(states_path_.c_str(), flags | O_DIRECT, 0644) : -1;
  if (!config.direct) {
    direct_ = false;
    fd = ::open(states_path_.c_str(), flags, 0644);
  } else if (fd < 0 && errno == EINVAL) {
    direct_ = false;
    notes.push_back("no O_DIRECT on " + dir + " (tmpfs?): using buffered I/O there");
    fd = ::open(states_path_.c_str(), flags, 0644);
  }
  fd_.reset(check_errno(fd, "cannot open the states file", states_path_));
  chunks_.copies = manifest_.copies;
  if (!resume) fsync_dir(dir_);  // the new file's name survives a power loss

  struct stat st {};
  check_errno(::fstat(fd_.get(), &st), "fstat", states_path_);
  for (size_t i = 0; i < manifest_.subgroups.size(); ++i) {
    const SubgroupRecord& r = manifest_.subgroups[i];
    local_of_[r.id] = i;
    file_end_ = std::max(file_end_, r.offset + chunks_.bytes(r.numel));
  }
  if (manifest_.log && !manifest_.subgroups.empty())
    file_end_ = std::max(file_end_, manifest_.spares_offset +
                                        manifest_.spares * extent_bytes(manifest_.chunk, layout_));
  if (static_cast<uint64_t>(st.st_size) < file_end_)
    throw std::invalid_argument(states_path_ + " has " + std::to_string(st.st_size) +
                                " bytes but its manifest needs " + std::to_string(file_end_) +
                                " (truncated copy?)");
  if (manifest_.log) open_log();
}

// The log of a step after the manifest's, sealed: that step's input, complete. Its chunks
// whose journal record and new version hold are at that step; the others are updated
// again (replay_). Anything else in the journal is of a step never sealed or already
// committed: dropped, durably, so no later attempt at a step takes it for its own.
void StateStore::open_log() {
  log_ = std::make_unique<StepLog>(dir_);
  for (const SubgroupRecord& r : manifest_.subgroups) working_.push_back(r.at);
  if (log_->sealed() && log_->step() == manifest_.step + 1) {
    std::vector<std::vector<bool>> done(manifest_.subgroups.size());
    for (size_t i = 0; i < done.size(); ++i) done[i].assign(chunks(i), false);
    const uint64_t whole = extent_bytes(manifest_.chunk, layout_);
    std::unique_ptr<void, decltype(&std::free)> buf(std::aligned_alloc(kAlign, whole), &std::free);
    for (const JournalRecord& j : log_->journal()) {
      if (j.local >= done.size() || j.chunk >= done[j.local].size()) continue;
      const Extent e = extent(j.local, j.chunk, 0);
      const ssize_t n = ::pread(fd_.get(), buf.get(), e.bytes, static_cast<off_t>(j.offset));
      if (n != static_cast<ssize_t>(e.bytes) || extent_checksum(buf.get(), e.bytes) != j.sum) continue;
      working_[j.local][j.chunk] = j.offset;
      const SubgroupRecord& r = manifest_.subgroups[j.local];
      r.sums->copy[r.copy ^ 1u][j.chunk] = j.sum;
      done[j.local][j.chunk] = true;
    }
    for (const LoggedGradient& g : log_->entries()) {
      const auto it = local_of_.find(g.id);
      if (it == local_of_.end() || manifest_.subgroups[it->second].numel != g.numel)
        throw std::invalid_argument(dir_ + "'s log of step " + std::to_string(log_->step()) +
                                    " names sub-group " + std::to_string(g.id) + ", which the "
                                    "directory does not hold as logged: it is damaged. Restore "
                                    "a checkpoint");
      Replay r{it->second, g, {}};
      for (uint64_t c = 0; c < done[r.local].size(); ++c)
        if (!done[r.local][c]) r.chunks.push_back(c);
      replay_.push_back(r);
    }
    logging_ = pending_ = true;
  } else {
    log_->clear_journal();
  }
  rebuild_free();
}

void StateStore::rebuild_free() {
  const uint64_t whole = extent_bytes(manifest_.chunk, layout_);
  std::unordered_set<uint64_t> used;
  for (const auto& at : working_) used.insert(at.begin(), at.end());
  free_.clear();
  const auto add = [&](uint64_t from, uint64_t count) {
    for (uint64_t k = 0; k < count; ++k)
      if (!used.count(from + k * whole)) free_.push_back(from + k * whole);
  };
  if (!manifest_.subgroups.empty()) add(manifest_.spares_offset, manifest_.spares);
  for (size_t i = 0; i < manifest_.subgroups.size(); ++i)
    add(manifest_.subgroups[i].offset, chunks(i));
  std::reverse(free_.begin(), free_.end());  // taken from the back: the spares first
  released_.clear();
  left_.clear();
  reused_ = false;
}

// A new directory gets its manifest (the pipeline's membership) before any state is
// written, so states without a manifest are a run whose manifest was deleted, or a copy
// into the directory that was interrupted: never taken for a fresh directory.
void StateStore::refuse_orphan_states() const {
  struct stat st {};
  if (::stat(states_path_.c_str(), &st) != 0 || st.st_size == 0) return;
  throw std::invalid_argument(
      dir_ + " holds states (" + std::to_string(st.st_size) + " bytes in states.bin) but no " +
      "manifest: it was deleted, or a copy into the directory was interrupted, and the states "
      "cannot be read without it. Restore the directory from a checkpoint (opt.save, "
      "save_checkpoint), or open it with if_exists=\"overwrite\" to start afresh");
}

bool StateStore::holds_run() const { return manifest_.step > 0 || !manifest_.subgroups.empty(); }

// The manifest goes first: from then on the old states are never taken for a run, even if
// the process dies before the new directory's manifest is written.
void StateStore::discard_run() {
  if (::unlink(manifest_path_.c_str()) != 0 && errno != ENOENT)
    throw SystemError(errno, "cannot remove the manifest", manifest_path_);
  fsync_dir(dir_);
}

StateStore::~StateStore() = default;  // closing lock_fd_ releases the lock

// flock, not fcntl locks: those belong to the process, so a second pipeline in the same
// process would not be kept out, and closing any descriptor of the file would drop them.
void StateStore::lock_directory() {
  const std::string path = dir_ + "/lock";
  UniqueFd fd(check_errno(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644),
                          "cannot create the lock file", path));
  // A killed holder's lock lasts until the kernel has finished its in-flight I/O (io_uring
  // requests): where the recorded holder has exited, wait for that, up to kDeadHolderWaitMs.
  constexpr int kDeadHolderWaitMs = 10000, kPollMs = 50;
  for (int waited = 0;; waited += kPollMs) {
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) == 0) break;
    const int code = errno;
    char holder[32] = {};
    (void)!::pread(fd.get(), holder, sizeof holder - 1, 0);
    const long pid = std::strtol(holder, nullptr, 10);
    const bool dead = code == EWOULDBLOCK && pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    if (dead && waited < kDeadHolderWaitMs) {
      ::usleep(kPollMs * 1000);
      continue;
    }
    if (code == EWOULDBLOCK)
      throw SystemError(EBUSY, std::string("the directory is open in another pipeline (process ") +
                                   (holder[0] ? holder : "?") +
                                   (dead ? ", which has exited; its I/O still held the lock "
                                           "after 10 s): try again in a moment"
                                         : "); close that one first: two writers would mix "
                                           "their steps"),
                        dir_);
    throw SystemError(code, "cannot lock the directory", path);
  }
  const std::string pid = std::to_string(::getpid());
  if (::ftruncate(fd.get(), 0) == 0) (void)!::pwrite(fd.get(), pid.data(), pid.size(), 0);
  lock_fd_ = std::move(fd);
}

size_t StateStore::attach(int64_t id, uint64_t numel, uint64_t fingerprint, bool& created) {
  if (numel == 0) throw std::invalid_argument("a sub-group needs at least one parameter");
  if (auto it = local_of_.find(id); it != local_of_.end()) {
    SubgroupRecord& r = manifest_.subgroups[it->second];
    const std::string held = dir_ + " holds sub-group " + std::to_string(id);
    if (r.numel != numel)
      throw std::invalid_argument(held + " with " + std::to_string(r.numel) + " params, not " +
                                  std::to_string(numel) + "; add sub-groups in the same order " +
                                  "and sizes as when the directory was made");
    if (r.fingerprint && fingerprint && r.fingerprint != fingerprint)
      throw std::invalid_argument(held + " of another parameter layout (the same size, but "
                                  "other shapes or order: another model?); open it with the "
                                  "model it was made for, or use a fresh directory");
    if (manifest_.attached >= 0 && id >= manifest_.attached)
      throw std::invalid_argument(
          held + ", last updated at step " + std::to_string(r.last) + ", but step " +
          std::to_string(manifest_.step) + " was committed by a pipeline of " +
          std::to_string(manifest_.attached) + " sub-groups: its states are stale (the model " +
          "shrank and grew back?). Use a fresh directory, or restore a checkpoint");
    if (!r.fingerprint && fingerprint) {  // made by an older version: record it from now on
      r.fingerprint = fingerprint;
      layout_dirty_ = true;
    }
    created = false;
    return it->second;
  }
  uint64_t total = 0;
  for (size_t i = 0; i < manifest_.subgroups.size(); ++i) total += chunks(i);
  if (total + (numel + manifest_.chunk - 1) / manifest_.chunk > Manifest::kMaxChunks)
    throw std::invalid_argument(dir_ + " would hold more than " +
                                std::to_string(Manifest::kMaxChunks) +
                                " chunks; use a larger chunk size");
  SubgroupRecord r;
  r.id = id;
  r.numel = numel;
  r.fingerprint = fingerprint;
  manifest_.add_sums(r);
  const uint64_t whole = extent_bytes(manifest_.chunk, layout_);
  // The spares come with the first sub-group (a log's directory), before its extents.
  const uint64_t spares = unallocated_spare_bytes();
  r.offset = file_end_ + spares;
  const uint64_t bytes = spares + chunks_.bytes(numel);
  int res = ::posix_fallocate(fd_.get(), static_cast<off_t>(file_end_), static_cast<off_t>(bytes));
  if (res == EOPNOTSUPP || res == EINVAL) res = ::ftruncate(fd_.get(), file_end_ + bytes) ? errno : 0;
  if (res != 0) {
    (void)::ftruncate(fd_.get(), static_cast<off_t>(file_end_));  // give back what was allocated
    throw SystemError(res, "cannot allocate " + std::to_string(bytes) + " bytes of states",
                      states_path_);
  }
  if (spares) manifest_.spares_offset = file_end_;
  file_end_ += bytes;
  if (manifest_.log) {
    for (uint64_t c = 0; c < chunks_.chunks(numel); ++c) r.at.push_back(r.offset + c * whole);
    std::lock_guard lock(log_mu_);
    working_.push_back(r.at);
    for (uint64_t k = 0; k < spares / whole; ++k) free_.push_back(manifest_.spares_offset + k * whole);
  }
  manifest_.subgroups.push_back(r);
  local_of_[id] = manifest_.subgroups.size() - 1;
  layout_dirty_ = true;
  created = true;
  return manifest_.subgroups.size() - 1;
}

void StateStore::detach_last() {
  const SubgroupRecord r = manifest_.subgroups.back();
  manifest_.subgroups.pop_back();
  local_of_.erase(r.id);
  file_end_ = r.offset;
  if (manifest_.log) {
    std::lock_guard lock(log_mu_);
    working_.pop_back();
    if (manifest_.subgroups.empty()) file_end_ = manifest_.spares_offset;
    rebuild_free();
  }
  (void)::ftruncate(fd_.get(), static_cast<off_t>(file_end_));
}

uint64_t StateStore::chunks(size_t local) const {
  return chunks_.chunks(manifest_.subgroups[local].numel);
}

Extent StateStore::extent(size_t local, uint64_t chunk, uint32_t copy) const {
  const SubgroupRecord& r = manifest_.subgroups[local];
  const uint64_t numel = chunks_.numel_of(r.numel, chunk);
  const uint64_t bytes = extent_bytes(numel, layout_);
  // With a log, the committed version's extent (a writer gives an update's its own: take_spare)
  const uint64_t offset = manifest_.log ? r.at[chunk]
                          : r.offset + chunks_.pair_offset(chunk) + (chunks_.copies == 2 ? copy * bytes : 0);
  return Extent{offset, bytes, numel, &r.sums->copy[copy][chunk]};
}

void StateStore::sync() {
  check_errno(::fdatasync(fd_.get()), "fdatasync", states_path_);
  fault::check("store.synced", states_path_);
}

void StateStore::publish(const std::vector<Written>& written, uint64_t pipeline_step,
                         const std::map<std::string, double>& hyper, uint64_t attached) {
  Manifest next = manifest_;  // current only once durable: a failed commit changes nothing
  for (const Written& w : written) {
    SubgroupRecord& r = next.subgroups[w.local];
    r.copy ^= 1u;
    r.prev_steps = r.steps;
    r.steps = w.steps;
    r.last = pipeline_step;
  }
  if (manifest_.log) {
    std::lock_guard lock(log_mu_);
    for (const Written& w : written) next.subgroups[w.local].at = working_[w.local];
  }
  next.previous = next.step;
  next.step = pipeline_step;
  next.rewriting = false;
  next.attached = static_cast<int64_t>(attached);
  if (!hyper.empty()) next.hyper = hyper;
  write_manifest(next);
  if (!manifest_.log) return;
  std::lock_guard lock(log_mu_);
  log_->clear_journal();  // (a crash before this: the log's step is the manifest's, ignored)
  logging_ = pending_ = false;
  replay_.clear();
  working_.clear();
  for (const SubgroupRecord& r : manifest_.subgroups) working_.push_back(r.at);
  rebuild_free();
}

void StateStore::log_gradient(size_t local, kernels::DType dtype, uint64_t steps,
                              const kernels::Hyper& hyper, const void* data) {
  const SubgroupRecord& r = manifest_.subgroups[local];
  if (!logging_) {
    log_->begin(manifest_.step + 1);
    logging_ = true;
  }
  if (log_->find(r.id))
    throw std::invalid_argument("sub-group " + std::to_string(r.id) + "'s gradient was logged "
                                "already in this step");
  log_->add(r.id, r.numel, dtype, steps, hyper, data, r.numel * kernels::dtype_size(dtype));
}

void StateStore::seal_log() {
  if (!logging_) log_->begin(manifest_.step + 1), logging_ = true;
  log_->seal();
}

const LoggedGradient* StateStore::logged(int64_t id) const {
  return logging_ ? log_->find(id) : nullptr;
}

uint64_t StateStore::take_spare() {
  std::lock_guard lock(log_mu_);
  if (free_.empty()) return kNoExtent;
  const uint64_t at = free_.back();
  free_.pop_back();
  if (left_.count(at)) reused_ = true;
  return at;
}

void StateStore::written(size_t local, uint64_t chunk, uint64_t offset, uint64_t sum) {
  std::lock_guard lock(log_mu_);
  log_->record(JournalRecord{log_->step(), static_cast<uint32_t>(local), static_cast<uint32_t>(chunk),
                             offset, sum});
  released_.push_back(working_[local][chunk]);
  working_[local][chunk] = offset;
}

void StateStore::sync_spares() {
  check_errno(::fdatasync(fd_.get()), "fdatasync", states_path_);  // the versions, then where they are
  std::lock_guard lock(log_mu_);
  log_->sync_journal();
  fault::check("journal.synced", dir_);
  for (uint64_t at : released_) {
    free_.push_back(at);
    left_.insert(at);
  }
  released_.clear();
}

bool StateStore::reused() const {
  std::lock_guard lock(log_mu_);
  return reused_;
}

void StateStore::forget_step() {
  if (!manifest_.log) return;
  if (log_->sealed()) log_->unseal();
  std::lock_guard lock(log_mu_);
  log_->clear_journal();
  logging_ = false;
  working_.clear();
  for (const SubgroupRecord& r : manifest_.subgroups) working_.push_back(r.at);
  rebuild_free();
}

void StateStore::drop_log() {
  replay_.clear();
  pending_ = false;
  forget_step();
}

void StateStore::publish_logged_step() {
  std::vector<Written> written;
  for (const Replay& r : replay_) written.push_back({r.local, r.gradient.steps});
  sync();
  publish(written, log_->step(), {},
          manifest_.attached >= 0 ? static_cast<uint64_t>(manifest_.attached) : manifest_.subgroups.size());
}

void StateStore::save_layout(uint64_t attached) {
  if (!layout_dirty_) return;
  check_errno(::fdatasync(fd_.get()), "fdatasync", states_path_);
  Manifest next = manifest_;
  next.attached = std::max(next.attached, static_cast<int64_t>(attached));
  write_manifest(next);
}

void StateStore::set_membership(const Membership& m) {
  Manifest next = manifest_;
  next.member = m;
  write_manifest(next);  // claims the directory for this pipeline at once
}

void StateStore::begin_rewrite() {
  if (manifest_.copies != 1 || manifest_.rewriting) return;
  Manifest next = manifest_;
  next.rewriting = true;
  write_manifest(next);
}

void StateStore::rollback_last_step() {
  if (manifest_.copies == 1)
    throw std::logic_error(dir_ + " holds one copy of its states (copies=1): no step before " +
                           std::to_string(manifest_.step) + " to go back to");
  Manifest next = manifest_;
  for (SubgroupRecord& r : next.subgroups) {
    if (r.last != next.step) continue;
    r.copy ^= 1u;
    r.steps = r.prev_steps;
    r.last = 0;
  }
  next.step = next.previous;  // one step back is all the shadow copies hold
  write_manifest(next);
}

// Write-new + fdatasync + rename + fsync of the directory: a crash at any point leaves
// either the old manifest or the new one, whole. On an error (ENOSPC, EIO) the temporary
// file is removed and the old manifest stays current, on disk and in memory.
void StateStore::write_manifest(const Manifest& m) {
  const std::string text = m.serialize();
  const std::string tmp = manifest_path_ + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw SystemError(errno, "cannot write the manifest", tmp);
  const auto fail = [&](int code, const char* what) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw SystemError(code, what, tmp);
  };
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(errno, "cannot write the manifest");
    done += static_cast<size_t>(n);
  }
  if (::fdatasync(fd) < 0) fail(errno, "fdatasync");
  ::close(fd);
  try {
    fault::check("manifest.written", tmp);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), manifest_path_.c_str()) < 0) {
    const int code = errno;
    ::unlink(tmp.c_str());
    throw SystemError(code, "cannot replace the manifest", manifest_path_);
  }
  // Renamed: the new manifest is the one on disk (durable once the directory is synced).
  manifest_ = m;
  layout_dirty_ = false;
  fault::check("manifest.renamed", dir_);
  fsync_dir(dir_);
}

}  // namespace smartinf::store
