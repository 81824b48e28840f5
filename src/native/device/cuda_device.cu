// A GPU as the update device (cuda_device.h): host slots the storage engine fills and
// drains as on the cpu device, the kernel on the GPU over a mirror of the slot.
#include "device/cuda_device.h"

#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "device/cuda_update.h"
#include "device/host_states.h"

namespace smartinf::device {

namespace {

void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess)
    throw std::runtime_error("CUDA device: " + what + ": " + cudaGetErrorString(e));
}

// One slot's GPU side: its states, gradient and params, and the stream its chunk runs on.
struct Mirror {
  void* states = nullptr;
  void* grad = nullptr;
  void* out = nullptr;
  cudaStream_t stream = nullptr;
};

class CudaDevice final : public Device {
 public:
  CudaDevice(std::string dir, const SlotGeometry& g, const CudaOptions& o)
      : dir_(std::move(dir)), geometry_(g), gpu_(o.gpu), slots_(g) {
    if (g.layout.moments != store::Moments::fp32)
      throw std::invalid_argument(std::string(g.layout.dtype()) + " states run on cpu devices; "
                                  "the CUDA device has the fp32-state kernels only so far");
    int count = 0;
    const cudaError_t found = cudaGetDeviceCount(&count);
    if (found != cudaSuccess || count == 0)
      throw std::invalid_argument(std::string("no CUDA GPU is visible to this process (") +
                                  cudaGetErrorString(found) + "): a CudaDevice needs one; use "
                                  "a CpuDevice here");
    if (gpu_ < 0 || gpu_ >= count)
      throw std::invalid_argument("no CUDA GPU " + std::to_string(gpu_) + " (this machine has " +
                                  std::to_string(count) + ")");
    check(cudaSetDevice(gpu_), "selecting GPU " + std::to_string(gpu_));
    // The host slots page-locked, so the copies to the GPU run at the link's speed.
    const size_t io = store::align_up(g.chunk * 4);
    try {
      for (size_t i = 0; i < slots_.size(); ++i) {
        check(cudaHostRegister(slots_.memory(i), slots_.slot_bytes(), cudaHostRegisterPortable),
              "page-locking a slot");
        registered_ = i + 1;
        Mirror& m = mirrors_.emplace_back();
        check(cudaMalloc(&m.states, g.states_bytes()), "allocating a slot's states on the GPU");
        check(cudaMalloc(&m.grad, io), "allocating a slot's gradient on the GPU");
        check(cudaMalloc(&m.out, io), "allocating a slot's params on the GPU");
        check(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking), "creating a stream");
      }
    } catch (...) {  // no destructor runs for a constructor that throws
      release();
      throw;
    }
  }

  ~CudaDevice() override { release(); }

  std::string describe() const override { return "cuda:" + std::to_string(gpu_) + ":" + dir_; }
  const std::string& storage_dir() const override { return dir_; }
  size_t slot_count() const override { return slots_.size(); }
  Slot slot(size_t i) override { return slots_[i]; }
  size_t slot_states_bytes() const override { return geometry_.states_bytes(); }
  bool registrable() const override { return true; }

  // The host's side of the slots is the cpu device's (HostSlots).
  void copy_in(size_t i, const void* grad, size_t bytes) override { slots_.copy_in(i, grad, bytes); }
  void copy_in_params(size_t i, const void* params, size_t bytes) override {
    slots_.copy_in_params(i, params, bytes);
  }
  void copy_in_compressed(size_t i, const int32_t* index, const void* values, size_t nnz,
                          size_t value_bytes) override {
    slots_.copy_in_compressed(i, index, values, nnz, value_bytes);
  }
  void copy_out(size_t i, void* dst, size_t bytes) override { slots_.copy_out(i, dst, bytes); }

  // The chunk's states and gradient (and a split master's params) to the GPU, the kernel,
  // states and params back; the slot's host memory holds the result when this returns.
  void compute(size_t i, const Kernel& k, size_t numel) override {
    if (k.compressed)
      throw std::invalid_argument("top-k gradients run on cpu devices; " + describe() +
                                  " takes dense gradients only so far");
    const store::StateLayout& layout = geometry_.layout;
    const Slot& s = slots_[i];
    const Mirror& m = mirrors_[i];
    const size_t states = layout.bytes(numel), gsize = kernels::dtype_size(k.grad),
                 psize = kernels::dtype_size(k.param);
    check(cudaSetDevice(gpu_), "selecting the GPU");
    check(cudaMemcpyAsync(m.states, s.states, states, cudaMemcpyHostToDevice, m.stream), "states in");
    check(cudaMemcpyAsync(m.grad, s.grad, numel * gsize, cudaMemcpyHostToDevice, m.stream), "gradient in");
    float* arrays[kMaxStateArrays] = {};
    for (unsigned a = 0; a < layout.arrays; ++a) arrays[a] = layout.array(m.states, numel, a);
    if (layout.split()) {
      if (k.param != DType::bf16) throw std::logic_error("a split master needs bfloat16 params");
      check(cudaMemcpyAsync(m.out, s.out, numel * 2, cudaMemcpyHostToDevice, m.stream), "params in");
      cuda::update_split(k.step, k.grad, numel, arrays, layout.split_at(m.states, numel).low,
                         m.grad, static_cast<kernels::bf16*>(m.out), k.adopt, m.stream);
    } else {
      cuda::update(k.step, k.grad, k.param, numel, arrays, m.grad, m.out, m.stream);
    }
    check(cudaMemcpyAsync(s.states, m.states, states, cudaMemcpyDeviceToHost, m.stream), "states out");
    check(cudaMemcpyAsync(s.out, m.out, numel * psize, cudaMemcpyDeviceToHost, m.stream), "params out");
    check(cudaStreamSynchronize(m.stream), "the update of a chunk");
  }

  void init_states(size_t i, const float* const* arrays, const float* fill, size_t numel) override {
    slots_.init_states(i, arrays, fill, numel);
  }

  void export_states(size_t i, float* const* arrays, size_t numel, bool adopt) override {
    slots_.export_states(i, arrays, numel, adopt);
  }

 private:
  void release() {  // what was made so far (cudaFree(nullptr) is a no-op)
    cudaSetDevice(gpu_);
    for (Mirror& m : mirrors_) {
      if (m.stream) cudaStreamDestroy(m.stream);
      cudaFree(m.states);
      cudaFree(m.grad);
      cudaFree(m.out);
    }
    mirrors_.clear();
    for (size_t i = 0; i < registered_; ++i) cudaHostUnregister(slots_.memory(i));
    registered_ = 0;
  }

  std::string dir_;
  SlotGeometry geometry_;
  int gpu_;
  HostSlots slots_;
  size_t registered_ = 0;  // slots page-locked so far (a failed constructor unlocks them)
  std::vector<Mirror> mirrors_;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(const std::string& dir, const SlotGeometry& geometry,
                                         const CudaOptions& options) {
  return std::make_unique<CudaDevice>(dir, geometry, options);
}

}  // namespace smartinf::device
