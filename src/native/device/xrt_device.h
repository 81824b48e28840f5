// The SmartSSD device (xrt_device.cc, or xrt_unavailable.cc without XRT).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "device/device.h"

namespace smartinf::device {

// A SmartSSD through XRT (xrt_device.cc when CMake finds libxrt, else
// xrt_unavailable.cc; device/registry.h's "xrt" row, whose options fpga and xclbin these
// are): the FPGA by index or PCIe BDF, and the xclbin of hls_kernels/ (without one the
// kernel stage is unavailable; data movement still works).
struct XrtOptions {
  unsigned index = 0;
  std::string bdf;
  std::string xclbin;
};

// The probe's SmartSSD figures: `nbytes` through a P2P buffer to and from a file in `dir`
// (SSD -> FPGA DRAM and back, no host copy), and host <-> FPGA DRAM syncs of a normal one.
struct XrtBandwidth {
  double p2p_read_s = 0, p2p_write_s = 0, to_fpga_s = 0, from_fpga_s = 0;
  bool direct = true;  // O_DIRECT was possible (the P2P mapping is page aligned)
};
XrtBandwidth time_xrt(const XrtOptions& options, const std::string& dir, uint64_t nbytes);

}  // namespace smartinf::device
