#include "store/step_log.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "error.h"
#include "fault.h"
#include "store/checksum.h"

namespace smartinf::store {
namespace {

constexpr char kMagic[8] = {'s', 'i', '-', 'l', 'o', 'g', '0', '1'};
constexpr uint64_t kSealed = 0x5ea1ed5ea1edull;
constexpr uint64_t kHeaderBytes = uint64_t(1) << 20;  // the header's room: 8,000 sub-groups
constexpr uint64_t kEntryBytes = 128;
constexpr uint64_t kRecordBytes = 40;
constexpr uint64_t kRegionAlign = 4096;  // each gradient region

uint32_t crc_of(const void* data, size_t bytes) {
  return static_cast<uint32_t>(crc32(0L, static_cast<const Bytef*>(data), static_cast<uInt>(bytes)));
}

template <class T>
void put(std::vector<char>& out, const T& value) {
  const char* p = reinterpret_cast<const char*>(&value);
  out.insert(out.end(), p, p + sizeof value);
}

template <class T>
T take(const char*& p) {
  T value;
  std::memcpy(&value, p, sizeof value);
  p += sizeof value;
  return value;
}

void write_all(int fd, const void* data, uint64_t bytes, uint64_t at, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes) {
    const ssize_t n = ::pwrite(fd, p, bytes, static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    check_errno(n, "cannot write the step's log", path);
    p += n, at += static_cast<uint64_t>(n), bytes -= static_cast<uint64_t>(n);
  }
}

// False where the file ends first.
bool read_all(int fd, void* into, uint64_t bytes, uint64_t at, const std::string& path) {
  char* p = static_cast<char*>(into);
  while (bytes) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    check_errno(n, "cannot read the step's log", path);
    if (n == 0) return false;
    p += n, at += static_cast<uint64_t>(n), bytes -= static_cast<uint64_t>(n);
  }
  return true;
}

void put_hyper(std::vector<char>& out, const kernels::Hyper& h) {
  for (double x : {h.lr, h.weight_decay, h.beta1, h.beta2, h.eps, h.momentum, h.dampening,
                   h.nesterov ? 1.0 : 0.0, h.lr_decay, h.grad_scale})
    put(out, x);
}

kernels::Hyper take_hyper(const char*& p) {
  kernels::Hyper h;
  h.lr = take<double>(p), h.weight_decay = take<double>(p), h.beta1 = take<double>(p);
  h.beta2 = take<double>(p), h.eps = take<double>(p), h.momentum = take<double>(p);
  h.dampening = take<double>(p), h.nesterov = take<double>(p) != 0.0;
  h.lr_decay = take<double>(p), h.grad_scale = take<double>(p);
  return h;
}

}  // namespace

StepLog::StepLog(const std::string& dir)
    : dir_(dir), grads_path_(dir + "/grads.bin"), journal_path_(dir + "/journal") {
  grads_.reset(check_errno(::open(grads_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644),
                           "cannot open the step's log", grads_path_));
  journal_.reset(check_errno(::open(journal_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644),
                             "cannot open the journal", journal_path_));
  const off_t size = ::lseek(journal_.get(), 0, SEEK_END);
  records_ = size > 0 ? (static_cast<uint64_t>(size) + kRecordBytes - 1) / kRecordBytes : 0;  // appended after
  std::vector<char> head(kHeaderBytes);
  if (!read_all(grads_.get(), head.data(), 32, 0, grads_path_) ||
      std::memcmp(head.data(), kMagic, sizeof kMagic) != 0)
    return;  // no header: nothing logged
  const char* p = head.data() + sizeof kMagic;
  const uint64_t step = take<uint64_t>(p), count = take<uint64_t>(p), sealed = take<uint64_t>(p);
  const uint64_t bytes = 32 + count * kEntryBytes;
  if (count > (kHeaderBytes - 36) / kEntryBytes ||
      !read_all(grads_.get(), head.data(), bytes + 4, 0, grads_path_))
    return;
  p = head.data() + bytes;
  if (take<uint32_t>(p) != crc_of(head.data(), bytes) || sealed != kSealed) return;
  p = head.data() + 32;
  for (uint64_t i = 0; i < count; ++i) {
    const char* e = p + i * kEntryBytes;
    LoggedGradient g;
    g.id = take<int64_t>(e), g.numel = take<uint64_t>(e), g.dtype = take<uint32_t>(e);
    take<uint32_t>(e);
    g.steps = take<uint64_t>(e), g.hyper = take_hyper(e), g.offset = take<uint64_t>(e);
    g.hash = take<uint64_t>(e);
    entries_.push_back(g);
  }
  step_ = step;
  sealed_ = true;
}

const LoggedGradient* StepLog::find(int64_t id) const {
  for (const LoggedGradient& e : entries_)
    if (e.id == id) return &e;
  return nullptr;
}

void StepLog::begin(uint64_t step) {
  step_ = step;
  sealed_ = false;
  entries_.clear();
  end_ = kHeaderBytes;
}

const LoggedGradient& StepLog::add(int64_t id, uint64_t numel, kernels::DType dtype, uint64_t steps,
                                   const kernels::Hyper& hyper, const void* data, uint64_t bytes) {
  if (sealed_) throw std::logic_error("the step's log is sealed");
  if ((entries_.size() + 1) * kEntryBytes + 36 > kHeaderBytes)
    throw std::invalid_argument("a step's log names at most " +
                                std::to_string((kHeaderBytes - 36) / kEntryBytes) +
                                " sub-groups per directory: use larger sub-groups");
  LoggedGradient g{id, numel, static_cast<uint32_t>(dtype), steps, hyper, end_,
                   extent_checksum(data, bytes)};
  write_all(grads_.get(), data, bytes, end_, grads_path_);
  end_ += (bytes + kRegionAlign - 1) / kRegionAlign * kRegionAlign;
  entries_.push_back(g);
  return entries_.back();
}

void StepLog::seal() {
  check_errno(::fdatasync(grads_.get()), "fdatasync", grads_path_);
  fault::check("log.written", grads_path_);
  std::vector<char> head(kMagic, kMagic + sizeof kMagic);
  put(head, step_);
  put(head, static_cast<uint64_t>(entries_.size()));
  put(head, kSealed);
  for (const LoggedGradient& g : entries_) {
    const size_t at = head.size();
    put(head, g.id), put(head, g.numel), put(head, g.dtype), put(head, uint32_t(0));
    put(head, g.steps), put_hyper(head, g.hyper), put(head, g.offset), put(head, g.hash);
    head.resize(at + kEntryBytes);
  }
  put(head, crc_of(head.data(), head.size()));
  write_all(grads_.get(), head.data(), head.size(), 0, grads_path_);
  check_errno(::fdatasync(grads_.get()), "fdatasync", grads_path_);
  sealed_ = true;
  fault::check("log.sealed", grads_path_);
}

void StepLog::unseal() {
  const char zero[32] = {};
  write_all(grads_.get(), zero, sizeof zero, 0, grads_path_);
  check_errno(::fdatasync(grads_.get()), "fdatasync", grads_path_);
  sealed_ = false;
}

void StepLog::read(const LoggedGradient& e, void* into) const {
  const uint64_t bytes = e.numel * kernels::dtype_size(static_cast<kernels::DType>(e.dtype));
  if (!read_all(grads_.get(), into, bytes, e.offset, grads_path_) ||
      extent_checksum(into, bytes) != e.hash)
    throw std::invalid_argument(grads_path_ + ": sub-group " + std::to_string(e.id) +
                                "'s logged gradient of step " + std::to_string(step_) +
                                " does not match its hash: the log is damaged, so the step "
                                "cannot be finished. Restore a checkpoint");
}

void StepLog::record(const JournalRecord& r) {
  std::vector<char> out;
  put(out, r.step), put(out, r.local), put(out, r.chunk), put(out, r.offset), put(out, r.sum);
  put(out, crc_of(out.data(), out.size()));
  out.resize(kRecordBytes);
  write_all(journal_.get(), out.data(), out.size(), records_ * kRecordBytes, journal_path_);
  ++records_;
}

void StepLog::sync_journal() {
  check_errno(::fdatasync(journal_.get()), "fdatasync", journal_path_);
}

void StepLog::clear_journal() {
  check_errno(::ftruncate(journal_.get(), 0), "cannot empty the journal", journal_path_);
  check_errno(::fdatasync(journal_.get()), "fdatasync", journal_path_);
  records_ = 0;
}

std::vector<JournalRecord> StepLog::journal() const {
  std::vector<JournalRecord> out;
  char raw[kRecordBytes];
  for (uint64_t i = 0; read_all(journal_.get(), raw, kRecordBytes, i * kRecordBytes, journal_path_); ++i) {
    const char* p = raw;
    JournalRecord r;
    r.step = take<uint64_t>(p), r.local = take<uint32_t>(p), r.chunk = take<uint32_t>(p);
    r.offset = take<uint64_t>(p), r.sum = take<uint64_t>(p);
    if (take<uint32_t>(p) != crc_of(raw, 32)) continue;  // torn: never synced
    if (r.step == step_) out.push_back(r);
  }
  return out;
}

}  // namespace smartinf::store
