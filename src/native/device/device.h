// A near-storage device: slot memory the storage engine reads states into, a host link
// (gradients in, params out) and the update kernel. The pipeline's ring drives it; the
// device only knows how to move and compute one chunk held in one slot.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "kernels/adam.h"
#include "kernels/numeric.h"

namespace smartinf::device {

using kernels::DType;

enum class Optimizer { adam, adamw };

// What COMPUTE does to one chunk.
struct Kernel {
  Optimizer optimizer = Optimizer::adamw;
  kernels::AdamStep adam{};
  DType grad = DType::f32;
  DType param = DType::f32;
};

struct Slot {
  float* states = nullptr;  // [param | exp_avg | exp_avg_sq] of up to `chunk` params
  void* grad = nullptr;     // gradient of the chunk (up to 4 B/param)
  void* out = nullptr;      // updated params in the caller's dtype (up to 4 B/param)
};

struct SlotGeometry {
  size_t count = 0;
  size_t chunk = 0;  // params per slot
  size_t states_bytes() const;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string describe() const = 0;
  virtual const std::string& storage_dir() const = 0;
  virtual size_t slot_count() const = 0;
  virtual Slot slot(size_t i) = 0;
  virtual size_t slot_states_bytes() const = 0;
  // Whether slot memory may be registered with io_uring as fixed buffers.
  virtual bool registrable() const = 0;
  virtual void copy_in(size_t slot, const void* grad, size_t bytes) = 0;  // host -> device
  // Runs the kernel over `numel` params of the slot; the states are laid out as stored.
  virtual void compute(size_t slot, const Kernel& kernel, size_t numel) = 0;
  virtual void copy_out(size_t slot, void* dst, size_t bytes) = 0;  // device -> host
  // Fresh states from the host: param (zeros when null), exp_avg = exp_avg_sq = 0.
  virtual void init_states(size_t slot, const float* param, size_t numel) = 0;
  // The slot's states to the host, one array each (any may be null).
  virtual void export_states(size_t slot, float* param, float* exp_avg, float* exp_avg_sq,
                             size_t numel) = 0;
};

// The emulated CSD: slot memory in host RAM (page aligned for O_DIRECT), kernels on the
// calling thread.
std::unique_ptr<Device> make_cpu_device(const std::string& dir, const SlotGeometry& geometry);

}  // namespace smartinf::device
