// The CUDA device (cuda_device.cu where CMake finds a CUDA toolkit, else
// cuda_unavailable.cc): the update runs on a GPU.
#pragma once
#include <memory>
#include <string>

#include "device/device.h"

namespace smartinf::device {

// Slots in page-locked host memory (the storage engine reads and writes them as on the cpu
// device), mirrored in GPU memory for the kernel (device/cuda_update.h): a streamed chunk's
// states cross PCIe to the GPU and back. `resident_bytes` of GPU memory (allocated at
// creation) hold resident states, updated where they are; a gradient and params in this
// GPU's memory are read and written where they are. With `host_memory` the budget is
// page-locked host memory instead: resident states cross PCIe to the GPU and back each
// update (the copy engines, both directions at once over the slots' streams), and the host
// reads and writes them as a cpu device's (loads, durable commits, twins). fp32, int8 and
// int4 moments with an fp32 or a split master; dense gradients.
struct CudaOptions {
  int gpu = 0;  // CUDA device ordinal
  uint64_t resident_bytes = 0;  // the memory budget: GPU memory, or host memory (host_memory)
  bool host_memory = false;
  // A budget in GPU memory with a page-locked host copy of its size (Device::host_twin): a
  // durable commit copies the resident states there and writes them from it, so the next
  // update never waits for the disk.
  bool host_twin = false;
};
std::unique_ptr<Device> make_cuda_device(const std::string& dir, const SlotGeometry& geometry,
                                         const CudaOptions& options);

}  // namespace smartinf::device
