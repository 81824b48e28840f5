// The emulated CSD (cpu_device.cc).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "device/device.h"

namespace smartinf::device {

class ComputePool;

// The emulated CSD: slot memory and `resident_bytes` of resident states in host RAM (page
// aligned for O_DIRECT, touched at creation), kernels split over `pool`'s threads.
struct CpuOptions {
  uint64_t resident_bytes = 0;
  std::shared_ptr<ComputePool> pool;
};
std::unique_ptr<Device> make_cpu_device(const std::string& dir, const SlotGeometry& geometry,
                                        const CpuOptions& options);

}  // namespace smartinf::device
