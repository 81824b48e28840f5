// The CUDA device (cuda_device.cu where CMake finds a CUDA toolkit, else
// cuda_unavailable.cc): the update runs on a GPU.
#pragma once
#include <memory>
#include <string>

#include "device/device.h"

namespace smartinf::device {

// Slots in page-locked host memory (the storage engine reads and writes them as on the cpu
// device), mirrored in GPU memory for the kernel (device/cuda_update.h): each chunk's states
// and gradient cross PCIe to the GPU and its states and params back. fp32 states with an
// fp32 or a split master; no resident states yet (a memory budget is refused), no top-k.
struct CudaOptions {
  int gpu = 0;  // CUDA device ordinal
};
std::unique_ptr<Device> make_cuda_device(const std::string& dir, const SlotGeometry& geometry,
                                         const CudaOptions& options);

}  // namespace smartinf::device
