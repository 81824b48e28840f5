#include "store/manifest.h"

#include <zlib.h>

#include <cinttypes>
#include <cstdio>
#include <sstream>
#include <stdexcept>

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

std::string Manifest::serialize() const {
  std::ostringstream out;
  out.precision(17);
  out << kMagic << ' ' << kVersion << '\n';
  out << "chunk " << chunk << '\n';
  out << "state_dtype " << state_dtype << '\n';
  out << "optimizer " << optimizer << '\n';
  for (const auto& [key, value] : hyper) out << "hyper " << key << ' ' << value << '\n';
  out << "step " << step << '\n';
  out << "subgroups " << subgroups.size() << '\n';
  for (const SubgroupRecord& r : subgroups)
    out << "sg " << r.id << ' ' << r.numel << ' ' << r.offset << ' ' << r.copy << ' '
        << r.steps << ' ' << r.last << ' ' << r.prev_steps << '\n';
  std::string body = out.str();
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

  std::istringstream in(body);
  std::string magic;
  int version = 0;
  if (!(in >> magic >> version) || magic != kMagic) bad(path, "not a smartinf manifest");
  if (version != kVersion)
    bad(path, "format version " + std::to_string(version) + ", this smartinf reads " +
                  std::to_string(kVersion));
  Manifest m;
  size_t count = 0;
  bool have_count = false;
  std::string key;
  while (in >> key) {
    bool ok = true;
    if (key == "chunk") ok = bool(in >> m.chunk);
    else if (key == "state_dtype") ok = bool(in >> m.state_dtype);
    else if (key == "optimizer") ok = bool(in >> m.optimizer);
    else if (key == "step") ok = bool(in >> m.step);
    else if (key == "hyper") {
      std::string name;
      double value;
      ok = bool(in >> name >> value);
      if (ok) m.hyper[name] = value;
    } else if (key == "subgroups") {
      ok = bool(in >> count) && count < (1u << 24);
      have_count = ok;
    } else if (key == "sg") {
      SubgroupRecord r;
      ok = bool(in >> r.id >> r.numel >> r.offset >> r.copy >> r.steps >> r.last >> r.prev_steps) &&
           r.copy < 2;
      if (ok) m.subgroups.push_back(r);
    } else {
      bad(path, "unknown record '" + key + "'");
    }
    if (!ok) bad(path, "bad '" + key + "' record");
  }
  if (m.chunk == 0) bad(path, "chunk size missing");
  if (m.optimizer.empty()) bad(path, "optimizer missing");
  if (!have_count || count != m.subgroups.size()) bad(path, "sub-group count mismatch");
  return m;
}

}  // namespace smartinf::store
