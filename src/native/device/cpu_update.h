// The host's update kernels on params [lo, lo + n) of one slot (a chunk of `numel`;
// `s.grad` and `s.out` already point at lo; `grad`: the dense gradient's dtype), one entry
// per moments format, each in a translation unit of its own (cpu_update_{fp32,int8,int4}.cc)
// so that they compile in parallel: in one unit, every kernel inlined into both ISA clones,
// it took 6 minutes of one core here and 4 on the H100 host, and the whole native build
// waited for it.
#pragma once
#include <cstddef>

#include "device/device.h"
#include "store/checksum.h"
#include "store/layout.h"

namespace smartinf::device {

// A split master is rebuilt piece by piece (whole int8 blocks and int4 tiles) from the
// params sent in (in `out`) into an fp32 buffer, updated there, and split again.
constexpr size_t kSplitPiece = store::kQuant4Tile;
static_assert(kSplitPiece % store::kQuantBlock == 0);
static_assert(kSplitPiece == store::kParamsPiece);  // a piece's params hashed as it is split

void run_update_fp32(const Slot& s, const Kernel& k, DType grad, size_t n,
                     const store::StateLayout& layout, size_t numel, size_t lo);
void run_update_int8(const Slot& s, const Kernel& k, DType grad, size_t n,
                     const store::StateLayout& layout, size_t numel, size_t lo);
void run_update_int4(const Slot& s, const Kernel& k, DType grad, size_t n,
                     const store::StateLayout& layout, size_t numel, size_t lo);

inline void run_update(const Slot& s, const Kernel& k, DType grad, size_t n,
                       const store::StateLayout& layout, size_t numel, size_t lo) {
  switch (layout.moments) {
    case store::Moments::fp32: return run_update_fp32(s, k, grad, n, layout, numel, lo);
    case store::Moments::int8: return run_update_int8(s, k, grad, n, layout, numel, lo);
    case store::Moments::int4: return run_update_int4(s, k, grad, n, layout, numel, lo);
  }
}

}  // namespace smartinf::device
