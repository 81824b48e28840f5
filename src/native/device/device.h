// A near-storage device: slot memory the storage engine reads states into, a host link
// (gradients in, params out) and the update kernel. The pipeline's ring drives it; the
// device only knows how to move and compute one chunk held in one slot.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/numeric.h"
#include "kernels/rules.h"
#include "store/checksum.h"
#include "store/layout.h"

namespace smartinf::device {

using kernels::DType;
using kernels::kMaxStateArrays;

inline constexpr uint64_t kOwnStates = UINT64_MAX;  // bind_states: the slot's own memory

// A sub-group's gradient and params where the caller holds them, in parts (a model's
// params are many tensors): part i is params [start[i], start[i + 1]) of the sub-group, its
// gradient at grad[i], its params written to out[i]. The cpu device updates from and into
// them where they lie (takes_parts), so the host neither gathers the gradients into one
// buffer nor copies the params back out of one.
struct CallerParts {
  std::vector<uint64_t> start;  // parts + 1, from 0 to the sub-group's size
  std::vector<const void*> grad;
  std::vector<void*> out;
};

// What COMPUTE does to one chunk: the update rule with this step's scalars
// (kernels/rules.h), and how the gradient arrived (dense in `grad`, or `nnz` top-k pairs
// to decompress first).
struct Kernel {
  kernels::Step step;
  DType grad = DType::f32;   // dense gradient dtype, or the compressed values' dtype
  DType param = DType::f32;  // dtype of the updated params sent out
  bool compressed = false;
  uint64_t nnz = 0;          // compressed: pairs in this chunk
  uint64_t base = 0;         // compressed, parts: sub-group position of the chunk's first param
  // The gradient and params in the caller's parts (takes_parts), the slot's grad and out
  // then unused; null: in the slot's (or bound) buffers.
  const CallerParts* parts = nullptr;
  // Split master (store/layout.h): the bf16 params sent in (in `out`) are not the ones
  // emitted with the stored low halves, so they are the masters as they are.
  bool adopt = false;
  // Byte of the resident memory holding the states this update starts from, when they are
  // not the bound ones (a twin's first update: see copy_states); kOwnStates: the bound ones.
  // The cpu device copies them in part by part, each part just before its update, so the
  // copy costs no pass over memory of its own.
  uint64_t copy_from = kOwnStates;
  // Split master: where the update writes the checksum of each store::kParamsPiece of the
  // params it emitted (store::params_piece_sum, by the piece's index in the chunk); null:
  // the ring hashes the params itself (Device::hashes_params).
  uint64_t* params_sums = nullptr;
  // Split master, a device that hashes_params(): where the update also writes the checksum
  // of the params it was sent (store::params_checksum), hashed piece by piece in
  // `sent_sums` before each piece's update. Not knowing yet whether they are the ones
  // emitted, it rebuilds every master as `adopt` does, which for those is the exact master.
  uint64_t* sent_sum = nullptr;
  uint64_t* sent_sums = nullptr;
};

struct Slot {
  float* states = nullptr;  // the state arrays of up to `chunk` params, one after another
  void* grad = nullptr;     // gradient of the chunk (up to 4 B/param)
  // updated params in the caller's dtype (up to 4 B/param); with a split master also the
  // params sent in, the masters' upper halves
  void* out = nullptr;
  int32_t* index = nullptr; // compressed gradient: indices, then values (up to 6 B/param)
  void* values = nullptr;
};

struct SlotGeometry {
  size_t count = 0;
  size_t chunk = 0;   // params per slot
  store::StateLayout layout;
  size_t states_bytes() const { return store::extent_bytes(chunk, layout); }
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
  // Whether slot memory is aligned for O_DIRECT (XRT's emulation maps unaligned memory).
  virtual bool direct_io() const { return true; }
  // Whether the host can read slot states at memory speed (for checksums); P2P buffers
  // mapped over PCIe cannot be.
  virtual bool host_visible_states() const { return true; }
  // Chunks and sub-groups must hold a multiple of this many params (FPGA beat width).
  virtual size_t param_multiple() const { return 1; }
  // The memory tier: bytes of device memory beyond the slots where sub-groups' states stay
  // resident (0: none; fixed at creation). bind_states points slot `slot`'s states at byte
  // `at` of it for one job (kOwnStates: back to the slot's own), so the stages work on
  // resident states in place; the ring owns a slot's binding while it holds the slot.
  virtual uint64_t resident_bytes() const { return 0; }
  virtual void bind_states(size_t slot, uint64_t at);
  // Byte `at` of the resident memory, for the host to write to storage (host-visible only).
  virtual const void* resident_at(uint64_t at) const;
  // Copies `bytes` of states from byte `from` of the resident memory into the states slot
  // `slot` is bound to: a resident chunk's first update after its copy was pinned by a
  // background commit (the pinned copy is being written; the update goes to the other).
  virtual void copy_states(size_t slot, uint64_t from, size_t bytes);
  // Whether sub-groups fill this device's resident memory before any are balanced over the
  // devices (Pipeline::place): its update of resident states is far the fastest (a GPU).
  virtual bool placed_first() const { return false; }
  // Whether resident states are in host memory (resident_at works). Elsewhere (a GPU's
  // memory) the host reaches them through the slot's host states: a resident chunk's
  // states read from storage land there first (resident_loaded), and the background lane
  // writes them from a host copy (resident_to_host).
  virtual bool host_visible_resident() const { return true; }
  // Whether resident states cross the host link to be updated (a GPU's budget in host
  // memory), so their bytes count as the link's, not as device memory's.
  virtual bool resident_over_link() const { return false; }
  // The states of slot `slot` (bound to resident memory) were read from storage into the
  // slot's host states: to the device's memory. Host-visible: already there.
  virtual void resident_loaded(size_t slot, size_t bytes);
  // `bytes` at byte `at` of resident memory into host memory `dst`.
  virtual void resident_to_host(uint64_t at, void* dst, size_t bytes) const;
  // Host memory as large as the resident memory, byte for byte, that a durable commit's
  // writes are made from (null: none, they are made from resident memory or bounce
  // buffers): its states are copied there when the commit is queued, and the resident
  // copy may be updated at once (CudaOptions::host_twin).
  virtual char* host_twin() const { return nullptr; }
  // The device's own memory handed back between phases of a run (DeepSpeed's
  // offload_states): resident states in a GPU's memory copied byte for byte into host memory
  // and the GPU's allocations (budget and slot mirrors) freed; returns the GPU bytes freed
  // (0: nothing of its own to free, as a cpu device's). unpark() allocates them again and
  // copies the states back. Only while no job runs (Pipeline::park); while parked, binding
  // resident states throws.
  virtual uint64_t park() { return 0; }
  virtual void unpark() {}
  // A split master's checksum of the params its states were emitted with, 8 bytes at
  // `offset` of the states slot `slot` is bound to: read when the params come back, written
  // after the update. In the slot's host states; a GPU's resident states hold their own.
  virtual uint64_t params_sum(size_t slot, uint64_t offset);
  virtual void set_params_sum(size_t slot, uint64_t offset, uint64_t sum);
  // That checksum (store::params_checksum; `whole`: store::whole_params_checksum, of states
  // stored before the pieces) of `numel` bf16 params at `params`: in host memory, or in the
  // memory of a device that reaches() them, hashed there (slot `slot`'s stream for a GPU),
  // so params that stay in a GPU's memory never cross to the host.
  virtual uint64_t params_checksum(size_t slot, const void* params, size_t numel, bool whole = false);
  // Whether compute() stores that checksum itself (its update hashes the params it emits,
  // in parallel and in cache), so the ring does not hash them again, and hashes the params
  // it is sent when asked (Kernel::sent_sum), so the ring need not before the update.
  virtual bool hashes_params() const { return false; }
  // Whether the device computes in host memory (the cpu device): it reaches every host
  // buffer, and the bytes it reads and writes there still count as crossing its link.
  virtual bool host_memory() const { return false; }
  // Whether the update can read a caller's buffer at `p` where it is (host memory for the
  // cpu device; its own GPU's memory for the cuda device): the ring then points a slot's
  // gradient and params at the caller's buffers (bind_caller) instead of copying them in
  // and out.
  virtual bool reaches(const void*) const { return host_memory(); }
  // Whether compute() takes a Kernel's parts (CallerParts): fp32 states updated element by
  // element, so a chunk's params may be cut anywhere.
  virtual bool takes_parts(const store::StateLayout&) const { return false; }
  // Slot `slot`'s dense gradient and params for one job (null: the slot's own buffers), and
  // the event of the caller's stream after which its buffers hold what it queued (a
  // cudaEvent_t for the cuda device, whose slot's stream waits for it before anything of the
  // job reads them; null: ready now).
  virtual void bind_caller(size_t slot, const void* grad, void* out, const void* ready = nullptr);
  virtual void copy_in(size_t slot, const void* grad, size_t bytes) = 0;  // host -> device
  // host -> device: the bf16 params a split master is rebuilt from, into the slot's `out`.
  virtual void copy_in_params(size_t slot, const void* params, size_t bytes) = 0;
  // host -> device: `nnz` top-k pairs (int32 index, value of `value_bytes`).
  virtual void copy_in_compressed(size_t slot, const int32_t* index, const void* values,
                                  size_t nnz, size_t value_bytes) = 0;
  // Runs the kernel over `numel` params of the slot; the states are laid out as stored.
  virtual void compute(size_t slot, const Kernel& kernel, size_t numel) = 0;
  // How many slots' compute() may run at once, each from a thread of its own: 1 for a
  // device whose kernel takes every core (the cpu device's pool); more for a GPU, whose
  // slots' streams then overlap one chunk's copies in with another's kernel and copies out.
  virtual unsigned compute_lanes() const { return 1; }
  virtual void copy_out(size_t slot, void* dst, size_t bytes) = 0;  // device -> host
  // States from the host, one array each; a null array is filled with `fill[a]`.
  virtual void init_states(size_t slot, const float* const* arrays, const float* fill,
                           size_t numel) = 0;
  // The slot's states to the host, one array each (a null array is skipped); a split master
  // from the params copied in (copy_in_params), `adopt` as in Kernel.
  virtual void export_states(size_t slot, float* const* arrays, size_t numel, bool adopt) = 0;
};

// What every device with slots of its own shares: its storage directory, the slots'
// geometry and the slots (`Slots`: host memory, HostSlots; or device-mapped, a vector).
template <class Slots>
class SlottedDevice : public Device {
 public:
  const std::string& storage_dir() const override { return dir_; }
  size_t slot_count() const override { return slots_.size(); }
  Slot slot(size_t i) override { return slots_[i]; }
  size_t slot_states_bytes() const override { return geometry_.states_bytes(); }

 protected:
  template <class... SlotsArgs>
  SlottedDevice(std::string dir, const SlotGeometry& g, SlotsArgs&&... slots)
      : dir_(std::move(dir)), geometry_(g), slots_(std::forward<SlotsArgs>(slots)...) {}

  std::string dir_;
  SlotGeometry geometry_;
  Slots slots_;
};

inline void Device::bind_states(size_t, uint64_t at) {
  if (at != kOwnStates)
    throw std::invalid_argument(describe() + " has no memory for resident states");
}

inline void Device::bind_caller(size_t, const void* grad, void* out, const void*) {
  if (grad || out) throw std::logic_error(describe() + " reaches no caller's buffer");
}

inline void Device::resident_loaded(size_t, size_t) {}

inline uint64_t Device::params_sum(size_t s, uint64_t offset) {
  uint64_t sum;
  std::memcpy(&sum, reinterpret_cast<const char*>(slot(s).states) + offset, sizeof sum);
  return sum;
}

inline void Device::set_params_sum(size_t s, uint64_t offset, uint64_t sum) {
  std::memcpy(reinterpret_cast<char*>(slot(s).states) + offset, &sum, sizeof sum);
}

inline uint64_t Device::params_checksum(size_t, const void* params, size_t numel, bool whole) {
  return whole ? store::whole_params_checksum(params, numel) : store::params_checksum(params, numel);
}

inline void Device::resident_to_host(uint64_t, void*, size_t) const {
  throw std::logic_error(describe() + "'s resident states are in host memory: resident_at");
}

inline const void* Device::resident_at(uint64_t) const {
  throw std::invalid_argument(describe() + " has no memory for resident states");
}

inline void Device::copy_states(size_t, uint64_t, size_t) {
  throw std::invalid_argument(describe() + " has no memory for resident states");
}

}  // namespace smartinf::device
