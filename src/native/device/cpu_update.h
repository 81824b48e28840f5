// The host's update kernels on params [lo, lo + n) of one slot (a chunk of `numel`;
// `s.grad` and `s.out` already point at lo; `grad`: the dense gradient's dtype), one entry
// per moments format, each in a translation unit of its own (cpu_update_<format>.cc)
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

// One entry per moments format, run_update_<name> (its unit: cpu_update_<name>.cc, which
// CMakeLists.txt writes for each format of store/layout.h's list).
#define SMARTINF_CPU_UPDATE_ENTRY(name, ...)                                         \
  void run_update_##name(const Slot& s, const Kernel& k, DType grad, size_t n,   \
                         const store::StateLayout& layout, size_t numel, size_t lo);
SMARTINF_CPU_UPDATE_ENTRY(fp32)
SMARTINF_QUANTIZED_MOMENTS(SMARTINF_CPU_UPDATE_ENTRY)
#undef SMARTINF_CPU_UPDATE_ENTRY

inline void run_update(const Slot& s, const Kernel& k, DType grad, size_t n,
                       const store::StateLayout& layout, size_t numel, size_t lo) {
  switch (layout.moments) {
#define SMARTINF_CPU_UPDATE_CASE(name, ...) \
  case store::Moments::name: return run_update_##name(s, k, grad, n, layout, numel, lo);
    SMARTINF_CPU_UPDATE_CASE(fp32)
    SMARTINF_QUANTIZED_MOMENTS(SMARTINF_CPU_UPDATE_CASE)
#undef SMARTINF_CPU_UPDATE_CASE
  }
}

}  // namespace smartinf::device
