#include "store/manifest.h"

#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <type_traits>

namespace smartinf::store {
namespace {

constexpr const char* kMagic = "smartinf-manifest";

uint32_t crc_of(const std::string& body) {
  return static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(body.data()), static_cast<uInt>(body.size())));
}

[[noreturn]] void bad(const std::string& path, const std::string& why) {
  throw std::invalid_argument("corrupt or foreign manifest " + path + ": " + why +
                              " (restore it from a checkpoint or use a fresh directory)");
}

}  // namespace

// Plain snprintf/strto* instead of iostreams: a core built by a newer GCC than the
// process's libstdc++ (torch's environment on the GPU machines) crashed in ostream
// formatting, whose static initialisation moved into the library in GCC 13.
namespace {

template <class... Args>
void append(std::string& out, const char* format, Args... args) {
  char line[512];
  const int n = std::snprintf(line, sizeof line, format, args...);
  out.append(line, static_cast<size_t>(std::min(n, static_cast<int>(sizeof line) - 1)));
}

// Whitespace-separated words of the manifest body, read one at a time.
class Words {
 public:
  explicit Words(const std::string& text) : p_(text.c_str()), end_(p_ + text.size()) {}
  bool next(std::string& word) {
    while (p_ < end_ && std::isspace(static_cast<unsigned char>(*p_))) ++p_;
    const char* start = p_;
    while (p_ < end_ && !std::isspace(static_cast<unsigned char>(*p_))) ++p_;
    word.assign(start, p_);
    return !word.empty();
  }
  bool hex(uint64_t& value) {
    std::string word;
    if (!next(word) || word.size() != 16) return false;
    char* stop = nullptr;
    errno = 0;
    value = std::strtoull(word.c_str(), &stop, 16);
    return stop == word.c_str() + word.size() && errno == 0;
  }
  template <class T>
  bool number(T& value) {
    std::string word;
    if (!next(word) || (std::is_unsigned_v<T> && word[0] == '-')) return false;
    char* stop = nullptr;
    errno = 0;
    if constexpr (std::is_floating_point_v<T>) {
      value = std::strtod(word.c_str(), &stop);
      if (errno == ERANGE && std::fabs(value) < 1.0) errno = 0;  // underflow: subnormals are fine
    }
    else if constexpr (std::is_signed_v<T>)
      value = static_cast<T>(std::strtoll(word.c_str(), &stop, 10));
    else
      value = static_cast<T>(std::strtoull(word.c_str(), &stop, 10));
    return stop == word.c_str() + word.size() && errno == 0;
  }

 private:
  const char* p_;
  const char* end_;
};

}  // namespace

std::string Manifest::serialize() const {
  std::string body;
  append(body, "%s %d\n", kMagic, kVersion);
  append(body, "chunk %" PRIu64 "\n", chunk);
  append(body, "state_dtype %s\n", state_dtype.c_str());
  append(body, "master %s\n", master.c_str());
  append(body, "optimizer %s\n", optimizer.c_str());
  for (const auto& [key, value] : hyper) append(body, "hyper %s %.17g\n", key.c_str(), value);
  append(body, "step %" PRIu64 "\n", step);
  append(body, "previous %" PRIu64 "\n", previous);
  if (attached >= 0) append(body, "attached %" PRId64 "\n", attached);
  append(body, "copies %" PRIu32 "\n", copies);
  if (rewriting) append(body, "rewriting\n");
  if (log) append(body, "log\nspares %" PRIu64 " %" PRIu64 "\n", spares_offset, spares);
  if (member.count)
    append(body, "member %s %" PRIu32 " %" PRIu32 "\n", member.pipeline.c_str(), member.index,
           member.count);
  append(body, "subgroups %zu\n", subgroups.size());
  for (const SubgroupRecord& r : subgroups)
    append(body, "sg %" PRId64 " %" PRIu64 " %" PRIu64 " %" PRIu32 " %" PRIu64 " %" PRIu64
                 " %" PRIu64 "\n",
           r.id, r.numel, r.offset, r.copy, r.steps, r.last, r.prev_steps);
  for (const SubgroupRecord& r : subgroups) {
    if (r.at.empty()) continue;
    append(body, "at %" PRId64, r.id);
    for (uint64_t x : r.at) append(body, " %016" PRIx64, x);
    body += '\n';
  }
  for (const SubgroupRecord& r : subgroups)
    if (r.fingerprint) append(body, "fingerprint %" PRId64 " %016" PRIx64 "\n", r.id, r.fingerprint);
  for (const SubgroupRecord& r : subgroups) {
    for (uint32_t c = 0; c < 2; ++c) {
      const std::vector<uint64_t>& sums = r.sums->copy[c];
      if (std::all_of(sums.begin(), sums.end(), [](uint64_t x) { return x == 0; })) continue;
      append(body, "sums %" PRId64 " %" PRIu32, r.id, c);
      for (uint64_t x : sums) append(body, " %016" PRIx64, x);
      body += '\n';
    }
  }
  char crc[32];
  std::snprintf(crc, sizeof crc, "crc32 %08" PRIx32 "\n", crc_of(body));
  return body + crc;
}

Manifest Manifest::parse(const std::string& text, const std::string& path) {
  const size_t crc_at = text.rfind("crc32 ");
  if (crc_at == std::string::npos || text.empty() || text.back() != '\n')
    bad(path, "no checksum line (truncated?)");
  const std::string body = text.substr(0, crc_at);
  unsigned long stored = 0;
  char tail = 0;
  if (std::sscanf(text.c_str() + crc_at, "crc32 %8lx%c", &stored, &tail) != 2 || tail != '\n' ||
      crc_at + 15 != text.size())
    bad(path, "malformed checksum line");
  if (stored != crc_of(body)) bad(path, "checksum mismatch");

  Words in(body);
  std::string magic;
  int version = 0;
  if (!in.next(magic) || magic != kMagic || !in.number(version)) bad(path, "not a smartinf manifest");
  if (version < kOldestVersion || version > kVersion)
    bad(path, "format version " + std::to_string(version) + ", this smartinf reads " +
                  std::to_string(kOldestVersion) + " to " + std::to_string(kVersion));
  Manifest m;
  m.version = version;
  uint64_t total_chunks = 0;
  size_t count = 0;
  bool have_count = false, have_previous = false;
  std::string key;
  while (in.next(key)) {
    bool ok = true;
    if (key == "chunk") ok = in.number(m.chunk);
    else if (key == "state_dtype") ok = in.next(m.state_dtype);
    else if (key == "master") ok = in.next(m.master) && (m.master == "fp32" || m.master == "split");
    else if (key == "optimizer") ok = in.next(m.optimizer);
    else if (key == "step") ok = in.number(m.step);
    else if (key == "previous") ok = in.number(m.previous) && (have_previous = true);
    else if (key == "attached") ok = in.number(m.attached) && m.attached >= 0;
    else if (key == "copies") ok = in.number(m.copies) && (m.copies == 1 || m.copies == 2);
    else if (key == "rewriting") m.rewriting = true;
    else if (key == "log") m.log = true;
    else if (key == "spares") ok = in.number(m.spares_offset) && in.number(m.spares);
    else if (key == "at") {
      int64_t id = 0;
      SubgroupRecord* r = in.number(id) ? m.find(id) : nullptr;
      ok = r != nullptr && r->at.empty();
      if (ok) r->at.resize(r->sums->copy[0].size());
      if (ok)
        for (uint64_t& x : r->at) ok = ok && in.hex(x);
    }
    else if (key == "member")
      ok = in.next(m.member.pipeline) && in.number(m.member.index) &&
           in.number(m.member.count) && m.member.index < m.member.count;
    else if (key == "hyper") {
      std::string name;
      double value = 0;
      ok = in.next(name) && in.number(value);
      if (ok) m.hyper[name] = value;
    } else if (key == "subgroups") {
      ok = in.number(count) && count < (1u << 24);
      have_count = ok;
    } else if (key == "sg") {
      SubgroupRecord r;
      ok = m.chunk > 0 && in.number(r.id) && in.number(r.numel) && in.number(r.offset) &&
           in.number(r.copy) && in.number(r.steps) && in.number(r.last) &&
           in.number(r.prev_steps) && r.copy < 2 && r.numel > 0 && r.numel < (uint64_t(1) << 48) &&
           r.offset < (uint64_t(1) << 60);
      total_chunks += ok ? (r.numel + m.chunk - 1) / m.chunk : 0;
      if (ok && total_chunks > kMaxChunks)
        bad(path, "more than " + std::to_string(kMaxChunks) + " chunks");
      if (ok) {
        m.add_sums(r);
        m.subgroups.push_back(r);
      }
    } else if (key == "sums") {
      int64_t id = 0;
      uint32_t c = 0;
      ok = in.number(id) && in.number(c) && c < 2;
      SubgroupRecord* r = ok ? m.find(id) : nullptr;
      ok = r != nullptr;
      if (ok)
        for (uint64_t& x : r->sums->copy[c]) ok = ok && in.hex(x);
    } else if (key == "fingerprint") {
      int64_t id = 0;
      SubgroupRecord* r = in.number(id) ? m.find(id) : nullptr;
      ok = r != nullptr && in.hex(r->fingerprint) && r->fingerprint != 0;
    } else {
      bad(path, "unknown record '" + key.substr(0, 40) + "'");
    }
    if (!ok) bad(path, "bad '" + key + "' record");
  }
  if (m.chunk == 0) bad(path, "chunk size missing");
  if (m.optimizer.empty()) bad(path, "optimizer missing");
  if (!have_count || count != m.subgroups.size()) bad(path, "sub-group count mismatch");
  if (!have_previous) m.previous = m.step ? m.step - 1 : 0;  // before version 6: every step
  if (m.previous > m.step) bad(path, "previous step after the step");
  if (m.rewriting && m.copies != 1) bad(path, "'rewriting' in a directory of two copies");
  if (m.log && m.copies != 1) bad(path, "'log' in a directory of two copies");
  for (const SubgroupRecord& r : m.subgroups)
    if (m.log == r.at.empty()) bad(path, "sub-group " + std::to_string(r.id) + (m.log ? " without" : " with") + " 'at' extents");
  return m;
}

SubgroupRecord* Manifest::find(int64_t id) {
  auto r = std::find_if(subgroups.begin(), subgroups.end(),
                        [&](const SubgroupRecord& x) { return x.id == id; });
  return r == subgroups.end() ? nullptr : &*r;
}

void Manifest::add_sums(SubgroupRecord& r) const {
  const uint64_t chunks = (r.numel + chunk - 1) / chunk;
  r.sums = std::make_shared<ChunkSums>();
  for (auto& copy : r.sums->copy) copy.assign(chunks, 0);
}

}  // namespace smartinf::store
