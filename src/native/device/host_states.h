// The host's side of a device whose slot states are host-visible (host RAM, or a mapped
// buffer object): state arrays in and out in the layout store/layout.h owns, and slots in
// host memory (HostSlots).
#pragma once
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "device/device.h"
#include "kernels/rules.h"
#include "kernels/split_master.h"
#include "store/checksum.h"
#include "store/layout.h"

namespace smartinf::device {

// A memory budget of `bytes` of host memory for `dir` (a cpu device's, or a GPU's in host
// memory) is refused where the machine has less memory in all.
inline void require_host_memory(uint64_t bytes, const std::string& dir) {
  const uint64_t ram = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGE_SIZE));
  if (bytes > ram)
    throw std::invalid_argument("a memory budget of " + std::to_string(bytes) + " bytes for " +
                                dir + " is more than this machine's memory (" +
                                std::to_string(ram) + " bytes); give each device a budget "
                                "that fits, beside the model and the other devices'");
}

// A split master from fp32 masters (the first array, or `fill`): the low halves, and the
// checksum of the bf16 params they belong to (the ones the caller holds: the masters rounded).
inline void import_split_master(const store::SplitMaster& s, const float* from, float fill,
                                size_t numel) {
  constexpr size_t kPiece = store::kParamsPiece;
  std::vector<kernels::bf16> params(kPiece);
  std::vector<float> master(kPiece);
  std::vector<uint64_t> sums(store::params_pieces(numel));
  for (size_t lo = 0; lo < numel; lo += kPiece) {
    const size_t n = std::min(kPiece, numel - lo);
    for (size_t i = 0; i < n; ++i) {
      master[i] = from ? from[lo + i] : fill;
      params[i] = kernels::from_float<kernels::bf16>(master[i]);
    }
    kernels::split_masters(n, master.data(), params.data(), s.low + lo);
    sums[lo / kPiece] = store::params_piece_sum(params.data(), n);
  }
  *s.params_sum = store::join_params_sums(sums.data(), sums.size());
}

// init_states / export_states for a device whose slot states are host-visible, in `layout`.
// `from[0]`/`to[0]` are the fp32 masters; with a split master, exporting them takes the bf16
// params the caller holds (`params`), taken whole as the masters when `adopt`.
inline void import_host_states(void* states, const store::StateLayout& layout,
                               const float* const* from, const float* fill, size_t numel) {
  if (layout.split()) import_split_master(layout.split_at(states, numel), from[0], fill[0], numel);
  if (store::with_quantized(layout.moments, [&](auto m) {
        kernels::import_quantized(layout.quantized_at<m.value>(states, numel), numel, layout.moment_count(),
                                  from, fill);
      }))
    return;
  for (unsigned a = layout.split() ? 1 : 0; a < layout.arrays; ++a) {
    float* to = layout.array(states, numel, a);
    if (from[a])
      std::memcpy(to, from[a], numel * 4);
    else
      std::fill(to, to + numel, fill[a]);
  }
}

inline void export_host_states(void* states, const store::StateLayout& layout,
                               float* const* to, size_t numel, const kernels::bf16* params,
                               bool adopt) {
  if (layout.split() && to[0]) {
    if (!params) throw std::logic_error("a split master is exported with its params");
    kernels::rebuild_masters(numel, params, layout.split_at(states, numel).low, adopt, to[0]);
  }
  if (store::with_quantized(layout.moments, [&](auto m) {
        kernels::export_quantized(layout.quantized_at<m.value>(states, numel), numel, layout.moment_count(), to);
      }))
    return;
  for (unsigned a = layout.split() ? 1 : 0; a < layout.arrays; ++a)
    if (to[a]) std::memcpy(to[a], layout.array(states, numel, a), numel * 4);
}

// Slots in host memory (the cpu device computes in them, the cuda device stages each chunk
// there): one page-aligned allocation per slot, touched at creation (memory is fixed then),
// holding the states, the gradient, the params and a compressed gradient's pairs; and the
// host's side of the device interface's copies and state import/export on them.
class HostSlots {
 public:
  explicit HostSlots(const SlotGeometry& g) : layout_(g.layout) {
    const size_t io = store::align_up(g.chunk * 4);
    bytes_ = g.states_bytes() + 3 * io + store::align_up(g.chunk * 2);
    for (size_t i = 0; i < g.count; ++i) {
      void* mem = std::aligned_alloc(store::kAlign, bytes_);
      if (!mem) throw std::bad_alloc();
      std::memset(mem, 0, bytes_);
      memory_.emplace_back(mem);
      char* base = static_cast<char*>(mem);
      char* io_base = base + g.states_bytes();
      slots_.push_back(Slot{reinterpret_cast<float*>(base), io_base, io_base + io,
                            reinterpret_cast<int32_t*>(io_base + 2 * io), io_base + 3 * io});
    }
  }

  size_t size() const { return slots_.size(); }
  size_t slot_bytes() const { return bytes_; }
  void* memory(size_t i) const { return memory_[i].get(); }
  Slot& operator[](size_t i) { return slots_[i]; }
  const Slot& operator[](size_t i) const { return slots_[i]; }

  void copy_in(size_t i, const void* grad, size_t bytes) { std::memcpy(slots_[i].grad, grad, bytes); }
  void copy_in_params(size_t i, const void* params, size_t bytes) {
    std::memcpy(slots_[i].out, params, bytes);
  }
  void copy_in_compressed(size_t i, const int32_t* index, const void* values, size_t nnz,
                          size_t value_bytes) {
    std::memcpy(slots_[i].index, index, nnz * 4);
    std::memcpy(slots_[i].values, values, nnz * value_bytes);
  }
  void copy_out(size_t i, void* dst, size_t bytes) const { std::memcpy(dst, slots_[i].out, bytes); }
  void init_states(size_t i, const float* const* arrays, const float* fill, size_t numel) {
    import_host_states(slots_[i].states, layout_, arrays, fill, numel);
  }
  // A split master's params are the ones in the slot's `out` (copy_in_params).
  void export_states(size_t i, float* const* arrays, size_t numel, bool adopt) const {
    export_host_states(slots_[i].states, layout_, arrays, numel,
                       static_cast<const kernels::bf16*>(slots_[i].out), adopt);
  }

 private:
  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };
  store::StateLayout layout_;
  size_t bytes_ = 0;
  std::vector<std::unique_ptr<void, FreeDeleter>> memory_;
  std::vector<Slot> slots_;
};

}  // namespace smartinf::device
