#include <cstdlib>
#include <cstring>
#include <new>

#include "device/device.h"
#include "store/state_store.h"

namespace smartinf::device {

size_t SlotGeometry::states_bytes() const { return store::extent_bytes(chunk); }

namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

class CpuDevice final : public Device {
 public:
  CpuDevice(std::string dir, const SlotGeometry& g) : dir_(std::move(dir)), geometry_(g) {
    // One allocation per slot: states, then grad, then out, each page aligned.
    const size_t io = store::align_up(g.chunk * 4);
    slot_bytes_ = g.states_bytes() + 2 * io;
    for (size_t i = 0; i < g.count; ++i) {
      void* mem = std::aligned_alloc(store::kAlign, slot_bytes_);
      if (!mem) throw std::bad_alloc();
      std::memset(mem, 0, slot_bytes_);  // touch now: memory is fixed at creation
      char* base = static_cast<char*>(mem);
      memory_.emplace_back(mem);
      slots_.push_back(Slot{reinterpret_cast<float*>(base), base + g.states_bytes(),
                            base + g.states_bytes() + io});
    }
  }

  std::string describe() const override { return "cpu:" + dir_; }
  const std::string& storage_dir() const override { return dir_; }
  size_t slot_count() const override { return slots_.size(); }
  Slot slot(size_t i) override { return slots_[i]; }
  size_t slot_states_bytes() const override { return geometry_.states_bytes(); }
  bool registrable() const override { return true; }

  void copy_in(size_t i, const void* grad, size_t bytes) override {
    std::memcpy(slots_[i].grad, grad, bytes);
  }

  void compute(size_t i, const Kernel& k, size_t numel) override {
    const Slot& s = slots_[i];
    float* param = s.states;
    float* exp_avg = param + numel;
    float* exp_avg_sq = exp_avg + numel;
    kernels::dispatch(k.grad, k.param, [&](auto g, auto p) {
      using G = decltype(g);
      using P = decltype(p);
      kernels::adam(numel, param, exp_avg, exp_avg_sq, static_cast<const G*>(s.grad),
                    static_cast<P*>(s.out), k.adam);
    });
  }

  void copy_out(size_t i, void* dst, size_t bytes) override {
    std::memcpy(dst, slots_[i].out, bytes);
  }

  void init_states(size_t i, const float* param, size_t numel) override {
    float* states = slots_[i].states;
    if (param)
      std::memcpy(states, param, numel * 4);
    else
      std::memset(states, 0, numel * 4);
    std::memset(states + numel, 0, 2 * numel * 4);
  }

  void export_states(size_t i, float* param, float* exp_avg, float* exp_avg_sq,
                     size_t numel) override {
    const float* states = slots_[i].states;
    float* dst[store::kStateArrays] = {param, exp_avg, exp_avg_sq};
    for (unsigned a = 0; a < store::kStateArrays; ++a)
      if (dst[a]) std::memcpy(dst[a], states + a * numel, numel * 4);
  }

 private:
  std::string dir_;
  SlotGeometry geometry_;
  size_t slot_bytes_ = 0;
  std::vector<std::unique_ptr<void, FreeDeleter>> memory_;
  std::vector<Slot> slots_;
};

}  // namespace

std::unique_ptr<Device> make_cpu_device(const std::string& dir, const SlotGeometry& geometry) {
  return std::make_unique<CpuDevice>(dir, geometry);
}

}  // namespace smartinf::device
