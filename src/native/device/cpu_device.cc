#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "device/device.h"
#include "kernels/decompress.h"
#include "store/state_store.h"

namespace smartinf::device {

namespace {

// The update kernels on one slot, compiled for the portable baseline and for AVX2 and
// picked when the library loads (GCC function multi-versioning; `flatten` inlines every
// kernel into each clone). The same IEEE operations (no FMA contraction), so both give
// the same bits; AVX2 halves the time of the int8 kernel. `grad`: the dense gradient's dtype.
__attribute__((target_clones("avx2", "default"), flatten))
void run_update(const Slot& s, const Kernel& k, DType grad, size_t numel,
                const store::StateLayout& layout) {
  float* arrays[kMaxStateArrays] = {};  // the param, then the rule's states, one after another
  for (unsigned a = 0; a < layout.arrays && !layout.int8; ++a) arrays[a] = layout.array(s.states, numel, a);
  kernels::dispatch(grad, k.param, [&](auto g, auto p) {
    const auto* gp = static_cast<const decltype(g)*>(s.grad);
    auto* op = static_cast<decltype(p)*>(s.out);
    if (layout.int8) return kernels::run_rule_int8(k.step, numel, layout.int8_at(s.states, numel), gp, op);
    kernels::run_rule(k.step, numel, arrays, gp, op);
  });
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

class CpuDevice final : public Device {
 public:
  CpuDevice(std::string dir, const SlotGeometry& g) : dir_(std::move(dir)), geometry_(g) {
    // One allocation per slot: states, grad, out, compressed pairs, each page aligned.
    const size_t io = store::align_up(g.chunk * 4);
    slot_bytes_ = g.states_bytes() + 3 * io + store::align_up(g.chunk * 2);
    for (size_t i = 0; i < g.count; ++i) {
      void* mem = std::aligned_alloc(store::kAlign, slot_bytes_);
      if (!mem) throw std::bad_alloc();
      std::memset(mem, 0, slot_bytes_);  // touch now: memory is fixed at creation
      char* base = static_cast<char*>(mem);
      memory_.emplace_back(mem);
      char* io_base = base + g.states_bytes();
      slots_.push_back(Slot{reinterpret_cast<float*>(base), io_base, io_base + io,
                            reinterpret_cast<int32_t*>(io_base + 2 * io), io_base + 3 * io});
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

  void copy_in_compressed(size_t i, const int32_t* index, const void* values, size_t nnz,
                          size_t value_bytes) override {
    std::memcpy(slots_[i].index, index, nnz * 4);
    std::memcpy(slots_[i].values, values, nnz * value_bytes);
  }

  void compute(size_t i, const Kernel& k, size_t numel) override {
    const Slot& s = slots_[i];
    DType grad = k.grad;
    if (k.compressed) {  // the dense fp32 gradient is rebuilt in the slot first
      float* dense = static_cast<float*>(s.grad);
      if (grad == DType::bf16)
        kernels::decompress(numel, dense, s.index, static_cast<const kernels::bf16*>(s.values),
                            k.nnz, k.base);
      else
        kernels::decompress(numel, dense, s.index, static_cast<const kernels::f16*>(s.values),
                            k.nnz, k.base);
      grad = DType::f32;
    }
    run_update(s, k, grad, numel, geometry_.layout);
  }

  void copy_out(size_t i, void* dst, size_t bytes) override {
    std::memcpy(dst, slots_[i].out, bytes);
  }

  void init_states(size_t i, const float* const* arrays, const float* fill,
                   size_t numel) override {
    import_host_states(slots_[i].states, geometry_.layout, arrays, fill, numel);
  }

  void export_states(size_t i, float* const* arrays, size_t numel) override {
    export_host_states(slots_[i].states, geometry_.layout, arrays, numel);
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
