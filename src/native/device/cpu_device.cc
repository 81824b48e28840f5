#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include <xmmintrin.h>

#include "device/compute_pool.h"
#include "device/cpu_device.h"
#include "device/cpu_update.h"
#include "device/host_states.h"
#include "kernels/decompress.h"
#include "store/state_store.h"

namespace smartinf::device {

namespace {

// dst[0, n) = src[0, n) with non-temporal stores where dst is 16-byte aligned.
void stream_copy(float* dst, const float* src, size_t n) {
  size_t i = 0;
  for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 16 != 0; ++i) dst[i] = src[i];
  for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

class CpuDevice final : public SlottedDevice<HostSlots> {
 public:
  CpuDevice(std::string dir, const SlotGeometry& g, const CpuOptions& options)
      : SlottedDevice(std::move(dir), g, g), pool_(options.pool) {
    if (!pool_) pool_ = std::make_shared<ComputePool>(1);
    for (size_t i = 0; i < slots_.size(); ++i) own_.push_back(slots_[i]);
    params_sums_.assign(slots_.size(), std::vector<uint64_t>(store::params_pieces(g.chunk)));
    sent_sums_ = params_sums_;
    resident_bytes_ = store::align_up(options.resident_bytes);
    require_host_memory(resident_bytes_, dir_);
    if (resident_bytes_) {
      try {  // (page aligned, for O_DIRECT)
        resident_ = ZeroedMemory(*pool_, resident_bytes_);
      } catch (const std::bad_alloc&) {
        throw std::invalid_argument("cannot allocate a memory budget of " +
                                    std::to_string(resident_bytes_) + " bytes for " + dir_);
      }
    }
  }

  std::string describe() const override { return "cpu:" + dir_; }
  bool registrable() const override { return true; }
  uint64_t resident_bytes() const override { return resident_bytes_; }
  void bind_states(size_t i, uint64_t at) override {
    if (at == kOwnStates) {
      slots_[i].states = own_[i].states;
      return;
    }
    slots_[i].states = static_cast<float*>(const_cast<void*>(resident_at(at)));
  }

  const void* resident_at(uint64_t at) const override {
    if (at >= resident_bytes_ || at % store::kAlign != 0)
      throw std::out_of_range("resident states at byte " + std::to_string(at) + " of " +
                              std::to_string(resident_bytes_));
    return static_cast<const char*>(resident_.get()) + at;
  }

  // On the pool's threads: one thread's memcpy is far below the memory's bandwidth.
  void copy_states(size_t i, uint64_t from, size_t bytes) override {
    const char* src = static_cast<const char*>(resident_at(from));
    char* dst = reinterpret_cast<char*>(slots_[i].states);
    pool_->run(bytes, kCopyGrain, [&](uint64_t lo, uint64_t hi) {
      std::memcpy(dst + lo, src + lo, hi - lo);
    });
  }

  bool host_memory() const override { return true; }
  void bind_caller(size_t i, const void* grad, void* out, const void*) override {  // (host memory: ready)
    slots_[i].grad = grad ? const_cast<void*>(grad) : own_[i].grad;
    slots_[i].out = out ? out : own_[i].out;
  }

  void copy_in(size_t i, const void* grad, size_t bytes) override { slots_.copy_in(i, grad, bytes); }

  void copy_in_compressed(size_t i, const int32_t* index, const void* values, size_t nnz,
                          size_t value_bytes) override {
    slots_.copy_in_compressed(i, index, values, nnz, value_bytes);
  }

  // The chunk in parts on the pool's threads; a compressed gradient is rebuilt part by part
  // (each part's pairs found by binary search) before that part's update.
  void compute(size_t i, const Kernel& k, size_t numel) override {
    const Slot& s = slots_[i];
    const store::StateLayout& layout = geometry_.layout;
    // fp32 states start from their twin piece by piece (through_cache); quantized ones,
    // whose blocks share scales, are copied whole first.
    const bool by_piece = k.copy_from != kOwnStates && layout.moments == store::Moments::fp32 &&
                          !layout.split();
    if (k.copy_from != kOwnStates && !by_piece)
      copy_states(i, k.copy_from, layout.bytes(numel));
    Kernel kernel = k;
    if (layout.split()) kernel.params_sums = params_sums_[i].data();
    if (layout.split() && k.sent_sum) kernel.sent_sums = sent_sums_[i].data();
    pool_->run(numel, kGrain, [&, &k = kernel](uint64_t lo, uint64_t hi) {
      if (k.parts) return by_parts(s, k, numel, lo, hi);
      const Slot part = part_of(s, k, lo);
      DType grad = k.grad;
      if (k.compressed) {
        const int32_t* index = s.index;
        const int32_t* first = std::lower_bound(index, index + k.nnz, int64_t(k.base + lo));
        const int32_t* last = std::lower_bound(first, index + k.nnz, int64_t(k.base + hi));
        const size_t j = first - s.index, nnz = last - first;
        float* dense = static_cast<float*>(part.grad);
        if (grad == DType::bf16)
          kernels::decompress(hi - lo, dense, first, static_cast<const kernels::bf16*>(s.values) + j,
                              nnz, k.base + lo);
        else
          kernels::decompress(hi - lo, dense, first, static_cast<const kernels::f16*>(s.values) + j,
                              nnz, k.base + lo);
        grad = DType::f32;
      }
      if (!by_piece) return run_update(part, k, grad, hi - lo, layout, numel, lo);
      through_cache(part, k, grad, numel, lo, hi, resident_at(k.copy_from));
    });
    if (!layout.split()) return;
    const size_t pieces = store::params_pieces(numel);
    set_params_sum(i, layout.params_sum_offset(numel), store::join_params_sums(params_sums_[i].data(), pieces));
    if (k.sent_sum) *k.sent_sum = store::join_params_sums(sent_sums_[i].data(), pieces);
  }

  bool hashes_params() const override { return true; }

  bool takes_parts(const store::StateLayout& layout) const override {
    return layout.moments == store::Moments::fp32 && !layout.split();
  }

  // The update of params [lo, hi) of the chunk from and into the caller's parts
  // (Kernel::parts), cut where a part ends: fp32 states, element by element, so a cut
  // changes no bit.
  void by_parts(const Slot& s, const Kernel& k, size_t numel, uint64_t lo, uint64_t hi) const {
    const CallerParts& parts = *k.parts;
    const size_t gsize = kernels::dtype_size(k.grad), osize = kernels::dtype_size(k.param);
    size_t j = std::upper_bound(parts.start.begin(), parts.start.end(), k.base + lo) -
               parts.start.begin() - 1;
    for (uint64_t at = lo; at < hi; ++j) {
      const uint64_t end = std::min<uint64_t>(hi, parts.start[j + 1] - k.base);
      if (end <= at) continue;  // (an empty part)
      const uint64_t into = k.base + at - parts.start[j];
      Slot piece = s;
      piece.grad = const_cast<char*>(static_cast<const char*>(parts.grad[j])) + into * gsize;
      piece.out = static_cast<char*>(parts.out[j]) + into * osize;
      if (k.copy_from != kOwnStates)
        through_cache(piece, k, k.grad, numel, at, end, resident_at(k.copy_from));
      else
        run_update(piece, k, k.grad, end - at, geometry_.layout, numel, at);
      at = end;
    }
  }

  // The update of params [lo, hi) reading fp32 states at `from` (the twin) and writing the
  // slot's: each piece's arrays copied into a buffer of this thread, updated there while in
  // cache, and streamed out (non-temporal stores: no read of the lines they replace), so
  // starting from the twin moves the bytes an update in place moves.
  void through_cache(const Slot& part, const Kernel& k, DType grad, size_t numel, uint64_t lo,
                     uint64_t hi, const void* from) const {
    const store::StateLayout& layout = geometry_.layout;
    thread_local std::vector<float> buffer;
    buffer.resize(size_t(layout.arrays) * kPiece);
    const size_t gsize = kernels::dtype_size(grad), osize = kernels::dtype_size(k.param);
    for (uint64_t at = lo; at < hi; at += kPiece) {
      const size_t len = std::min<uint64_t>(kPiece, hi - at);
      for (unsigned a = 0; a < layout.arrays; ++a)
        std::memcpy(buffer.data() + a * len, layout.array(const_cast<void*>(from), numel, a) + at,
                    len * sizeof(float));
      Slot piece = part;
      piece.states = buffer.data();  // laid out as a chunk of len params
      piece.grad = static_cast<char*>(part.grad) + (at - lo) * gsize;
      piece.out = static_cast<char*>(part.out) + (at - lo) * osize;
      run_update(piece, k, grad, len, layout, len, 0);
      for (unsigned a = 0; a < layout.arrays; ++a)
        stream_copy(layout.array(part.states, numel, a) + at, buffer.data() + a * len, len);
    }
    _mm_sfence();  // the streamed stores are seen before the chunk is handed on
  }

  void copy_in_params(size_t i, const void* params, size_t bytes) override {
    slots_.copy_in_params(i, params, bytes);
  }

  void copy_out(size_t i, void* dst, size_t bytes) override { slots_.copy_out(i, dst, bytes); }

  void init_states(size_t i, const float* const* arrays, const float* fill,
                   size_t numel) override {
    slots_.init_states(i, arrays, fill, numel);
  }

  void export_states(size_t i, float* const* arrays, size_t numel, bool adopt) override {
    slots_.export_states(i, arrays, numel, adopt);
  }

 private:
  // Parts of whole int8 blocks, int4 tiles and split-master pieces, large enough that a
  // thread's share outweighs waking it.
  static constexpr uint64_t kGrain = uint64_t(1) << 14;
  static_assert(kGrain % kSplitPiece == 0);
  static constexpr uint64_t kCopyGrain = uint64_t(1) << 20;  // bytes
  // Params of one piece started from a twin: its fp32 arrays (12-16 B a param) fit in L2.
  static constexpr uint64_t kPiece = uint64_t(1) << 13;
  static_assert(kGrain % kPiece == 0);

  // The slot's grad and out buffers from param `lo` on (the states are cut by run_update:
  // their arrays are laid out for the whole chunk).
  Slot part_of(const Slot& s, const Kernel& k, uint64_t lo) const {
    Slot p = s;
    const size_t gsize = k.compressed ? 4 : kernels::dtype_size(k.grad);
    p.grad = static_cast<char*>(s.grad) + lo * gsize;
    p.out = static_cast<char*>(s.out) + lo * kernels::dtype_size(k.param);
    return p;
  }

  std::shared_ptr<ComputePool> pool_;
  // Each slot's own buffers, while others are bound (bind_states, bind_caller).
  std::vector<Slot> own_;
  // Per slot: the checksums of the pieces of params its last update emitted, and of those
  // it was sent (split master).
  std::vector<std::vector<uint64_t>> params_sums_, sent_sums_;
  uint64_t resident_bytes_ = 0;
  ZeroedMemory resident_;
};

}  // namespace

std::unique_ptr<Device> make_cpu_device(const std::string& dir, const SlotGeometry& geometry,
                                        const CpuOptions& options) {
  return std::make_unique<CpuDevice>(dir, geometry, options);
}

}  // namespace smartinf::device
