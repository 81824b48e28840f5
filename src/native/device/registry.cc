#include "device/registry.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace smartinf::device {

const DeviceKind& device_kind(const std::string& kind) {
  std::string known;
  for (const DeviceKind& row : kDeviceKinds) {
    if (kind == row.name) return row;
    known += (known.empty() ? "" : ", ") + std::string(row.name);
  }
  throw std::invalid_argument("unknown device kind '" + kind + "' (known: " + known + ")");
}

std::string refuses(const DeviceKind& kind, const store::StateLayout& layout) {
  const bool quantized = layout.moments != store::Moments::fp32;
  if ((quantized && !kind.quantized) || (layout.split() && !kind.split_master))
    return std::string(layout.split() ? "a split master" : "int8/int4 states") + " runs on " +
           "cpu and cuda devices; " + kind.why_not;
  return "";
}

std::unique_ptr<Device> make_device(const DeviceKind& kind, const std::string& dir, const SlotGeometry& geometry,
                                    const CpuOptions& host, const KindOptions& options) {
  std::vector<std::string> takes;
  std::istringstream names(kind.options);
  for (std::string n; names >> n;) takes.push_back(n);
  for (const auto& [name, value] : options) {
    if (std::find(takes.begin(), takes.end(), name) != takes.end()) continue;
    std::string known;
    for (const std::string& n : takes) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("a " + std::string(kind.name) + " device takes no option '" + name + "' (" +
                                (known.empty() ? "it takes none" : "it takes: " + known) + "); for " + dir);
  }
  return kind.make(dir, geometry, {host, OwnOptions(kind.name, options)});
}

const std::string* OwnOptions::find(const std::string& name) const {
  const auto it = values_.find(name);
  return it == values_.end() ? nullptr : &it->second;
}

std::string OwnOptions::text(const std::string& name, const std::string& fallback) const {
  const std::string* v = find(name);
  return v ? *v : fallback;
}

uint64_t OwnOptions::count(const std::string& name, uint64_t fallback) const {
  const std::string* v = find(name);
  if (!v) return fallback;
  size_t used = 0;
  uint64_t n = 0;
  try {
    n = std::stoull(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v->size() || (*v)[0] == '-')
    throw std::invalid_argument("the " + kind_ + " device's option " + name +
                                " must be a non-negative integer, got '" + *v + "'");
  return n;
}

bool OwnOptions::flag(const std::string& name, bool fallback) const {
  const std::string* v = find(name);
  if (!v) return fallback;
  if (*v != "true" && *v != "false")
    throw std::invalid_argument("the " + kind_ + " device's option " + name + " must be true or false, got '" +
                                *v + "'");
  return *v == "true";
}

}  // namespace smartinf::device
