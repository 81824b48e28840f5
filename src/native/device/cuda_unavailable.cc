// Built instead of cuda_device.cu when CMake finds no CUDA toolkit: a CUDA device is a
// clear error.
#include <stdexcept>

#include "device/registry.h"

namespace smartinf::device {

std::unique_ptr<Device> make_cuda_device(const std::string&, const SlotGeometry&, const DeviceOptions&) {
  throw std::invalid_argument("smartinf was built without CUDA: install a CUDA toolkit (nvcc on "
                              "the PATH, or CUDACXX) and reinstall smartinf");
}

uint64_t gpu_params_checksum(const void*, std::size_t) {
  throw std::invalid_argument("smartinf was built without CUDA: no GPU checksum");
}

uint64_t digest_chunk_units() { return 1; }

void queue_gpu_unit_sums(const DigestPart*, std::size_t, std::size_t, uint64_t*, int, void*) {
  throw std::invalid_argument("smartinf was built without CUDA: no GPU digest");
}

}  // namespace smartinf::device
