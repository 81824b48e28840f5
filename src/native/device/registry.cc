#include "device/registry.h"

#include <stdexcept>

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

}  // namespace smartinf::device
