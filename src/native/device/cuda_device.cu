// A GPU as the update device (device/registry.h's "cuda" row; cuda_unavailable.cc where
// CMake finds no CUDA toolkit): host slots the storage engine fills and drains as on the cpu
// device, the kernel on the GPU over a mirror of the slot.

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "device/compute_pool.h"
#include "device/cuda_checksum.h"
#include "device/cuda_update.h"
#include "device/host_states.h"
#include "device/registry.h"

namespace smartinf::device {

namespace {

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
  int gpu = 0;                  // option gpu: the CUDA device ordinal
  uint64_t resident_bytes = 0;  // option memory_budget: GPU memory, or host memory (host_memory)
  bool host_memory = false;     // option memory: "gpu" (the default) or "host"
  // option host_twin: a budget in GPU memory with a page-locked host copy of its size
  // (Device::host_twin): a durable commit copies the resident states there and writes them
  // from it, so the next update never waits for the disk.
  bool host_twin = false;

  explicit CudaOptions(const OwnOptions& own)
      : gpu(static_cast<int>(own.count("gpu"))), resident_bytes(own.count("memory_budget")),
        host_twin(own.flag("host_twin")) {
    const std::string memory = own.text("memory", "gpu");
    if (memory != "gpu" && memory != "host")
      throw std::invalid_argument("a cuda device's memory is \"gpu\" or \"host\", got '" + memory + "'");
    host_memory = memory == "host";
  }
};

void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess)
    throw std::runtime_error("CUDA device: " + what + ": " + cudaGetErrorString(e));
}

// One slot's GPU side: its states (its own, or resident ones bound for a job), gradient
// and params (its own, or the caller's where they are in this GPU's memory), and the
// stream its chunk runs on.
struct Mirror {
  void* own_states = nullptr;
  void* own_grad = nullptr;
  void* own_out = nullptr;
  // A split master's params checksums: of the params sent, and of those emitted; and one
  // checksum's way to and from the GPU (copy_sum), page-locked as theirs (PieceSums).
  cuda::PieceSums sent, emitted;
  uint64_t* sum = nullptr;
  void* states = nullptr;
  const void* grad = nullptr;
  void* out = nullptr;
  bool resident = false;  // states bound to resident memory
  // The caller's gradient and params copied straight into own_grad / own_out for this job
  // (copy_in, copy_in_params), not through the slot's host memory.
  bool grad_in = false, params_in = false;
  cudaStream_t stream = nullptr;
};

class CudaDevice final : public SlottedDevice<HostSlots> {
 public:
  CudaDevice(std::string dir, const SlotGeometry& g, const CudaOptions& o)
      : SlottedDevice(std::move(dir), g, g), gpu_(o.gpu), host_memory_(o.host_memory) {
    if (o.host_twin && o.host_memory)
      throw std::invalid_argument("a host twin is for a budget in GPU memory: states in host "
                                  "memory (memory=\"host\") are written from where they are");
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
    io_bytes_ = io;
    try {
      for (size_t i = 0; i < slots_.size(); ++i) {
        check(cudaHostRegister(slots_.memory(i), slots_.slot_bytes(), cudaHostRegisterPortable),
              "page-locking a slot");
        registered_ = i + 1;
        Mirror& m = mirrors_.emplace_back();
        check(cudaMalloc(&m.own_states, g.states_bytes()), "allocating a slot's states on the GPU");
        check(cudaMalloc(&m.own_grad, io), "allocating a slot's gradient on the GPU");
        check(cudaMalloc(&m.own_out, io), "allocating a slot's params on the GPU");
        for (cuda::PieceSums* sums : {&m.sent, &m.emitted}) cuda::allocate_piece_sums(*sums, g.chunk);
        check(cudaHostAlloc(&m.sum, sizeof(uint64_t), cudaHostAllocPortable), "page-locking a checksum");
        m.states = m.own_states, m.grad = m.own_grad, m.out = m.own_out;
        check(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking), "creating a stream");
      }
      check(cudaStreamCreateWithFlags(&persist_stream_, cudaStreamNonBlocking), "creating a stream");
      allocate_resident(store::align_up(o.resident_bytes));
      if (o.host_twin && resident_bytes_) {
        require_host_memory(resident_bytes_, dir_ + "'s host twin");
        check(cudaHostAlloc(&host_twin_, resident_bytes_, cudaHostAllocPortable),
              "page-locking a host twin of " + std::to_string(resident_bytes_) + " bytes");
      }
    } catch (...) {  // no destructor runs for a constructor that throws
      release();
      throw;
    }
  }

  ~CudaDevice() override { release(); }

  std::string describe() const override {
    return "cuda:" + std::to_string(gpu_) + (host_memory_ ? " (states in host memory):" : ":") + dir_;
  }
  bool registrable() const override { return true; }

  // Resident states in GPU memory, or in page-locked host memory (the budget, allocated at
  // creation). In host memory they are the slot's host states while it is bound to them:
  // the host reads and writes them there as a cpu device's, and each update moves them
  // across PCIe as a streamed chunk's (the copy engines run at the link's speed, where a
  // kernel reading host memory would not).
  uint64_t resident_bytes() const override { return resident_bytes_; }
  bool host_visible_resident() const override { return host_memory_; }
  bool resident_over_link() const override { return host_memory_; }
  const void* resident_at(uint64_t at) const override {
    if (!host_memory_) return Device::resident_at(at);
    return resident(at);
  }
  bool placed_first() const override { return true; }
  void bind_states(size_t i, uint64_t at) override {
    Mirror& m = mirrors_[i];
    if (host_memory_) {
      slots_[i].states = static_cast<float*>(at == kOwnStates ? slots_.memory(i) : resident(at));
      return;
    }
    m.resident = at != kOwnStates;
    m.states = m.resident ? resident(at) : m.own_states;
  }
  void copy_states(size_t i, uint64_t from, size_t bytes) override {
    if (host_memory_) {
      std::memcpy(slots_[i].states, resident(from), bytes);
      return;
    }
    const Mirror& m = mirrors_[i];
    check(cudaSetDevice(gpu_), "selecting the GPU");
    check(cudaMemcpyAsync(m.states, resident(from), bytes, cudaMemcpyDeviceToDevice, m.stream),
          "copying resident states");
    check(cudaStreamSynchronize(m.stream), "copying resident states");
  }
  void resident_loaded(size_t i, size_t bytes) override {
    if (!host_memory_) states_to_gpu(i, bytes);
  }
  char* host_twin() const override { return static_cast<char*>(host_twin_); }

  // Between phases of a run (Pipeline::park, no job running): the resident states copied
  // into (pageable) host memory, byte for byte, and every GPU buffer of the budget and the
  // slots freed; unpark() allocates them again and copies the states back. A budget in host
  // memory has nothing to give back. Nothing changes where park or unpark throws.
  uint64_t park() override {
    if (parked_ || host_memory_) return 0;
    check(cudaSetDevice(gpu_), "selecting the GPU");
    std::unique_ptr<char[]> host;
    if (resident_bytes_) {
      require_host_memory(resident_bytes_, dir_ + "'s states parked in host memory");
      host.reset(new char[resident_bytes_]);
      check(cudaMemcpy(host.get(), resident_, resident_bytes_, cudaMemcpyDeviceToHost),
            "parking the resident states in host memory");
    }
    parked_states_ = std::move(host);
    parked_ = true;
    uint64_t freed = resident_bytes_;
    cudaFree(resident_);
    resident_ = nullptr;
    for (Mirror& m : mirrors_) {
      for (void** p : {&m.own_states, &m.own_grad, &m.own_out}) {
        cudaFree(*p);
        *p = nullptr;
      }
      m.states = m.out = nullptr;
      m.grad = nullptr;
      m.resident = false;
      freed += geometry_.states_bytes() + 2 * io_bytes_;
    }
    return freed;
  }
  void unpark() override {
    if (!parked_) return;
    check(cudaSetDevice(gpu_), "selecting the GPU");
    std::vector<void*> made;  // freed again if any allocation fails: still parked
    auto allocate = [&](size_t bytes, const char* what) {
      void* p = nullptr;
      const cudaError_t e = cudaMalloc(&p, bytes);
      if (e != cudaSuccess) {
        for (void* q : made) cudaFree(q);
        check(e, std::string("allocating ") + what + " again (unpark): " +
                     std::to_string(bytes) + " bytes; free GPU memory and call it again");
      }
      made.push_back(p);
      return p;
    };
    void* resident = resident_bytes_ ? allocate(resident_bytes_, "the memory budget") : nullptr;
    for (size_t i = 0; i < mirrors_.size(); ++i) {
      allocate(geometry_.states_bytes(), "a slot's states");
      allocate(io_bytes_, "a slot's gradient");
      allocate(io_bytes_, "a slot's params");
    }
    if (resident) {
      const cudaError_t e = cudaMemcpy(resident, parked_states_.get(), resident_bytes_,
                                       cudaMemcpyHostToDevice);
      if (e != cudaSuccess) {
        for (void* q : made) cudaFree(q);
        check(e, "the parked states back to the GPU");
      }
    }
    resident_ = resident;
    for (size_t i = 0; i < mirrors_.size(); ++i) {
      Mirror& m = mirrors_[i];
      const size_t at = (resident ? 1 : 0) + 3 * i;
      m.own_states = made[at], m.own_grad = made[at + 1], m.own_out = made[at + 2];
      m.states = m.own_states, m.grad = m.own_grad, m.out = m.own_out;
    }
    parked_states_.reset();
    parked_ = false;
  }
  void resident_to_host(uint64_t at, void* dst, size_t bytes) const override {
    check(cudaSetDevice(gpu_), "selecting the GPU");
    check(cudaMemcpyAsync(dst, resident(at), bytes, cudaMemcpyDeviceToHost, persist_stream_),
          "resident states to the host");
    check(cudaStreamSynchronize(persist_stream_), "resident states to the host");
  }

  // A resident split master's checksum is in GPU memory with its states: copied on the
  // slot's stream, as the states are (a plain cudaMemcpy would also wait for the caller's
  // work on the legacy default stream).
  uint64_t params_sum(size_t i, uint64_t offset) override {
    const Mirror& m = mirrors_[i];
    if (!m.resident) return Device::params_sum(i, offset);
    copy_sum(m, m.sum, static_cast<char*>(m.states) + offset, cudaMemcpyDeviceToHost);
    return *m.sum;
  }
  void set_params_sum(size_t i, uint64_t offset, uint64_t sum) override {
    const Mirror& m = mirrors_[i];
    if (!m.resident) return Device::set_params_sum(i, offset, sum);
    *m.sum = sum;
    copy_sum(m, static_cast<char*>(m.states) + offset, m.sum, cudaMemcpyHostToDevice);
  }

  // Params in this GPU's memory are hashed here (the rare checksum of a whole chunk, of
  // states stored before the pieces, on the host from a copy).
  uint64_t params_checksum(size_t i, const void* params, size_t numel, bool whole) override {
    if (!reaches(params)) return Device::params_checksum(i, params, numel, whole);
    check(cudaSetDevice(gpu_), "selecting the GPU");
    if (!whole) return cuda::params_checksum(params, numel, mirrors_[i].sent, mirrors_[i].stream);
    std::vector<uint16_t> host(numel);
    check(cudaMemcpyAsync(host.data(), params, numel * 2, cudaMemcpyDeviceToHost, mirrors_[i].stream),
          "params to the host");
    check(cudaStreamSynchronize(mirrors_[i].stream), "params to the host");
    return store::whole_params_checksum(host.data(), numel);
  }

  // This GPU's memory: a gradient there is read and params written where they are.
  bool reaches(const void* p) const override {
    cudaPointerAttributes a{};
    if (!p || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();  // a pointer CUDA does not know: host memory, not an error
      return false;
    }
    return a.type == cudaMemoryTypeDevice && a.device == gpu_;
  }
  void bind_caller(size_t i, const void* grad, void* out, const void* ready) override {
    Mirror& m = mirrors_[i];
    // Everything of the job runs on the slot's stream (copies, checksums, the update), so
    // one wait orders it after what the caller queued for these buffers.
    if (ready)
      check(cudaStreamWaitEvent(m.stream, static_cast<cudaEvent_t>(const_cast<void*>(ready)), 0),
            "waiting for the caller's stream");
    m.grad = grad ? grad : m.own_grad;
    m.out = out ? out : m.own_out;
    m.grad_in = m.params_in = false;
  }

  // The caller's buffers this GPU does not reach (host memory, another GPU's) are copied
  // straight to and from the slot's GPU buffers (cudaMemcpyDefault), not through its host
  // memory: that host-to-host copy was one thread's memcpy, 48 s of a 65B step's lanes a
  // rank with the params in host memory (offload_param).
  void copy_in(size_t i, const void* grad, size_t bytes) override {
    Mirror& m = mirrors_[i];
    copy_on(m, m.own_grad, grad, bytes, "a gradient in");
    m.grad_in = true;
  }
  void copy_in_params(size_t i, const void* params, size_t bytes) override {
    Mirror& m = mirrors_[i];
    copy_on(m, m.own_out, params, bytes, "params in");
    m.params_in = true;
  }
  void copy_in_compressed(size_t i, const int32_t* index, const void* values, size_t nnz,
                          size_t value_bytes) override {
    slots_.copy_in_compressed(i, index, values, nnz, value_bytes);
  }
  // After compute(), whose params stay in the slot's GPU buffer when the caller's are not
  // in this GPU's memory.
  void copy_out(size_t i, void* dst, size_t bytes) override {
    const Mirror& m = mirrors_[i];
    copy_on(m, dst, m.own_out, bytes, "params out");
  }

  // The kernel on the GPU: streamed states cross PCIe to it and back (the slot's host
  // memory holds the result when this returns), resident ones are updated where they are;
  // so are the caller's gradient and params where they are in this GPU's memory (others
  // came in by copy_in / copy_in_params; the params go out by copy_out).
  void compute(size_t i, const Kernel& k, size_t numel) override {
    if (k.compressed)
      throw std::invalid_argument("top-k gradients run on cpu devices; " + describe() +
                                  " takes dense gradients only so far");
    const store::StateLayout& layout = geometry_.layout;
    const Slot& s = slots_[i];
    Mirror& m = mirrors_[i];
    const size_t states = layout.bytes(numel), gsize = kernels::dtype_size(k.grad);
    check(cudaSetDevice(gpu_), "selecting the GPU");
    if (k.copy_from != kOwnStates)  // a resident chunk's first update from its twin
      check(cudaMemcpyAsync(m.states, resident(k.copy_from), states,
                            host_memory_ ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToDevice,
                            m.stream), "states from the twin");
    else if (!m.resident)
      check(cudaMemcpyAsync(m.states, s.states, states, cudaMemcpyHostToDevice, m.stream), "states in");
    if (m.grad == m.own_grad && !m.grad_in)
      check(cudaMemcpyAsync(m.own_grad, s.grad, numel * gsize, cudaMemcpyHostToDevice, m.stream),
            "gradient in");
    if (layout.split() && m.out == m.own_out && !m.params_in)  // the params the masters are rebuilt from
      check(cudaMemcpyAsync(m.own_out, s.out, numel * 2, cudaMemcpyHostToDevice, m.stream),
            "params in");
    // A split master's params hashed where they are, on the slot's stream, before the update
    // (when asked: Kernel::sent_sum) and after it (hashes_params).
    if (layout.split() && k.sent_sum) cuda::queue_piece_sums(m.out, numel, m.sent, m.stream);
    // (not knowing yet whether the params sent are the ones emitted: every master rebuilt
    // as `adopt` does, which for those is the exact master)
    cuda::update(k.step, layout, m.states, numel, k.grad, k.param, m.grad, m.out,
                 k.adopt || k.sent_sum, m.stream);
    if (layout.split()) cuda::queue_piece_sums(m.out, numel, m.emitted, m.stream);
    if (!m.resident)
      check(cudaMemcpyAsync(s.states, m.states, states, cudaMemcpyDeviceToHost, m.stream), "states out");
    check(cudaStreamSynchronize(m.stream), "the update of a chunk");
    if (!layout.split()) return;
    if (k.sent_sum) *k.sent_sum = cuda::join_piece_sums(m.sent, numel);
    set_params_sum(i, layout.params_sum_offset(numel), cuda::join_piece_sums(m.emitted, numel));
  }

  // Three chunks at once: one's states in, one's kernel, one's states out (PCIe's two
  // directions and the SMs busy together; a single lane left each idle two thirds of the
  // time, and a chunk's launches and waits between them).
  unsigned compute_lanes() const override { return 3; }

  // A split master's params are hashed on the GPU by compute(), wherever the caller's are:
  // the slot's copy of them is there.
  bool hashes_params() const override { return true; }

  // In the slot's host memory, then to the resident states the slot is bound to.
  void init_states(size_t i, const float* const* arrays, const float* fill, size_t numel) override {
    slots_.init_states(i, arrays, fill, numel);
    if (mirrors_[i].resident) states_to_gpu(i, geometry_.layout.bytes(numel));
  }

  // Resident states come to the slot's host memory first, and so do a split master's params
  // (copy_in_params put them on the GPU).
  void export_states(size_t i, float* const* arrays, size_t numel, bool adopt) override {
    const Mirror& m = mirrors_[i];
    if (m.params_in) copy_on(m, slots_[i].out, m.own_out, numel * 2, "params to the host");
    if (m.resident) {
      check(cudaSetDevice(gpu_), "selecting the GPU");
      check(cudaMemcpyAsync(slots_[i].states, m.states, geometry_.layout.bytes(numel),
                            cudaMemcpyDeviceToHost, m.stream), "resident states out");
      check(cudaStreamSynchronize(m.stream), "resident states out");
    }
    slots_.export_states(i, arrays, numel, adopt);
  }

 private:
  // The slot's host states to the GPU states it is bound to.
  void states_to_gpu(size_t i, size_t bytes) {
    const Mirror& m = mirrors_[i];
    check(cudaSetDevice(gpu_), "selecting the GPU");
    check(cudaMemcpyAsync(m.states, slots_[i].states, bytes, cudaMemcpyHostToDevice, m.stream),
          "resident states in");
    check(cudaStreamSynchronize(m.stream), "resident states in");
  }

  // On the slot's stream, waited for; the caller's buffer may be in any memory CUDA knows.
  void copy_on(const Mirror& m, void* dst, const void* src, size_t bytes, const char* what) const {
    check(cudaSetDevice(gpu_), "selecting the GPU");
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, m.stream), what);
    check(cudaStreamSynchronize(m.stream), what);
  }

  void* resident(uint64_t at) const {
    if (parked_)
      throw std::logic_error(describe() + "'s resident states are parked in host memory: "
                             "unpark() first");
    if (at >= resident_bytes_ || at % store::kAlign != 0)
      throw std::out_of_range("resident states at byte " + std::to_string(at) + " of " +
                              std::to_string(resident_bytes_));
    return static_cast<char*>(resident_) + at;
  }

  // The budget in GPU memory (or page-locked host memory), zeroed now: held from creation,
  // as the cpu device's RAM.
  void allocate_resident(uint64_t bytes) {
    if (!bytes) return;
    if (host_memory_) {
      require_host_memory(bytes, dir_);
      check(cudaHostAlloc(&resident_, bytes, cudaHostAllocPortable),
            "page-locking a host memory budget of " + std::to_string(bytes) + " bytes");
      resident_bytes_ = bytes;
      ComputePool pool(default_compute_threads());  // (the rank's cores; none of its own after)
      zero_in_parallel(pool, resident_, bytes);
      return;
    }
    size_t free = 0, total = 0;
    check(cudaMemGetInfo(&free, &total), "reading the GPU's free memory");
    if (bytes > free)
      throw std::invalid_argument("a memory budget of " + std::to_string(bytes) + " bytes on GPU " +
                                  std::to_string(gpu_) + " is more than its free memory (" +
                                  std::to_string(free) + " of " + std::to_string(total) +
                                  " bytes): give the CUDA device a budget that leaves room for "
                                  "the model, its activations and the slots");
    check(cudaMalloc(&resident_, bytes), "allocating the memory budget on the GPU");
    resident_bytes_ = bytes;
    check(cudaMemset(resident_, 0, bytes), "clearing the memory budget");
  }

  void release() {  // what was made so far (cudaFree(nullptr) is a no-op)
    cudaSetDevice(gpu_);
    for (Mirror& m : mirrors_) {
      if (m.stream) cudaStreamDestroy(m.stream);
      cudaFree(m.own_states);
      cudaFree(m.own_grad);
      cudaFree(m.own_out);
      cuda::free_piece_sums(m.sent);
      cuda::free_piece_sums(m.emitted);
      cudaFreeHost(m.sum);
    }
    mirrors_.clear();
    if (persist_stream_) cudaStreamDestroy(persist_stream_);
    persist_stream_ = nullptr;
    if (host_memory_)
      cudaFreeHost(resident_);
    else
      cudaFree(resident_);
    resident_ = nullptr;
    cudaFreeHost(host_twin_);
    host_twin_ = nullptr;
    for (size_t i = 0; i < registered_; ++i) cudaHostUnregister(slots_.memory(i));
    registered_ = 0;
  }

  void copy_sum(const Mirror& m, void* dst, const void* src, cudaMemcpyKind kind) const {
    check(cudaSetDevice(gpu_), "selecting the GPU");
    check(cudaMemcpyAsync(dst, src, sizeof(uint64_t), kind, m.stream),
          "a split master's params checksum");
    check(cudaStreamSynchronize(m.stream), "a split master's params checksum");
  }

  int gpu_;
  bool host_memory_;  // the budget is page-locked host memory (CudaOptions::host_memory)
  size_t registered_ = 0;  // slots page-locked so far (a failed constructor unlocks them)
  std::vector<Mirror> mirrors_;
  void* resident_ = nullptr;
  uint64_t resident_bytes_ = 0;
  void* host_twin_ = nullptr;  // CudaOptions::host_twin: page-locked, resident_bytes_ of it
  cudaStream_t persist_stream_ = nullptr;  // the background lane's copies to the host
  size_t io_bytes_ = 0;  // a slot's gradient or params buffer on the GPU
  bool parked_ = false;  // park(): the GPU's buffers freed, the resident states below
  std::unique_ptr<char[]> parked_states_;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(const std::string& dir, const SlotGeometry& geometry,
                                         const DeviceOptions& options) {
  return std::make_unique<CudaDevice>(dir, geometry, CudaOptions(options.own));
}

}  // namespace smartinf::device
