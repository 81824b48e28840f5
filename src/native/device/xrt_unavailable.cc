// Built instead of xrt_device.cc when XRT is not found: an XRT device is a clear error.
#include <stdexcept>

#include "device/registry.h"
#include "device/xrt_device.h"

namespace smartinf::device {

namespace {
[[noreturn]] void unavailable() {
  throw std::invalid_argument("smartinf was built without XRT: install XRT (Debian: libxrt-dev; "
                              "or Xilinx's xrt package) and rebuild smartinf");
}
}  // namespace

std::unique_ptr<Device> make_xrt_device(const std::string&, const SlotGeometry&, const DeviceOptions&) {
  unavailable();
}

XrtBandwidth time_xrt(const XrtOptions&, const std::string&, uint64_t) { unavailable(); }

}  // namespace smartinf::device
