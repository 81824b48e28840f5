// A GPU as the update device (cuda_device.h): host slots the storage engine fills and
// drains as on the cpu device, the kernel on the GPU over a mirror of the slot.
#include "device/cuda_device.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "device/cuda_update.h"
#include "device/host_states.h"
#include "store/state_store.h"

namespace smartinf::device {

namespace {

void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess)
    throw std::runtime_error("CUDA device: " + what + ": " + cudaGetErrorString(e));
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

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
      : dir_(std::move(dir)), geometry_(g), gpu_(o.gpu) {
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
    // As the cpu device: one page-aligned host allocation per slot (states, grad, out,
    // compressed pairs), page-locked so the copies to the GPU run at the link's speed.
    io_ = store::align_up(g.chunk * 4);
    slot_bytes_ = g.states_bytes() + 3 * io_ + store::align_up(g.chunk * 2);
    for (size_t i = 0; i < g.count; ++i) {
      void* mem = std::aligned_alloc(store::kAlign, slot_bytes_);
      if (!mem) throw std::bad_alloc();
      std::memset(mem, 0, slot_bytes_);
      memory_.emplace_back(mem);
      check(cudaHostRegister(mem, slot_bytes_, cudaHostRegisterPortable), "page-locking a slot");
      char* base = static_cast<char*>(mem);
      char* io_base = base + g.states_bytes();
      slots_.push_back(Slot{reinterpret_cast<float*>(base), io_base, io_base + io_,
                            reinterpret_cast<int32_t*>(io_base + 2 * io_), io_base + 3 * io_});
      Mirror m;
      check(cudaMalloc(&m.states, g.states_bytes()), "allocating a slot's states on the GPU");
      check(cudaMalloc(&m.grad, io_), "allocating a slot's gradient on the GPU");
      check(cudaMalloc(&m.out, io_), "allocating a slot's params on the GPU");
      check(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking), "creating a stream");
      mirrors_.push_back(m);
    }
  }

  ~CudaDevice() override {
    cudaSetDevice(gpu_);
    for (Mirror& m : mirrors_) {
      cudaStreamDestroy(m.stream);
      cudaFree(m.states);
      cudaFree(m.grad);
      cudaFree(m.out);
    }
    for (auto& mem : memory_) cudaHostUnregister(mem.get());
  }

  std::string describe() const override { return "cuda:" + std::to_string(gpu_) + ":" + dir_; }
  const std::string& storage_dir() const override { return dir_; }
  size_t slot_count() const override { return slots_.size(); }
  Slot slot(size_t i) override { return slots_[i]; }
  size_t slot_states_bytes() const override { return geometry_.states_bytes(); }
  bool registrable() const override { return true; }

  void copy_in(size_t i, const void* grad, size_t bytes) override {
    std::memcpy(slots_[i].grad, grad, bytes);
  }
  void copy_in_params(size_t i, const void* params, size_t bytes) override {
    std::memcpy(slots_[i].out, params, bytes);
  }
  void copy_in_compressed(size_t i, const int32_t* index, const void* values, size_t nnz,
                          size_t value_bytes) override {
    std::memcpy(slots_[i].index, index, nnz * 4);
    std::memcpy(slots_[i].values, values, nnz * value_bytes);
  }
  void copy_out(size_t i, void* dst, size_t bytes) override {
    std::memcpy(dst, slots_[i].out, bytes);
  }

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
    import_host_states(slots_[i].states, geometry_.layout, arrays, fill, numel);
  }

  void export_states(size_t i, float* const* arrays, size_t numel, bool adopt) override {
    export_host_states(slots_[i].states, geometry_.layout, arrays, numel,
                       static_cast<const kernels::bf16*>(slots_[i].out), adopt);
  }

 private:
  std::string dir_;
  SlotGeometry geometry_;
  int gpu_;
  size_t io_ = 0, slot_bytes_ = 0;
  std::vector<std::unique_ptr<void, FreeDeleter>> memory_;
  std::vector<Slot> slots_;
  std::vector<Mirror> mirrors_;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(const std::string& dir, const SlotGeometry& geometry,
                                         const CudaOptions& options) {
  return std::make_unique<CudaDevice>(dir, geometry, options);
}

}  // namespace smartinf::device
