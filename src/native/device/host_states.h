// The host's side of a device whose slot states are host-visible (host RAM, or a mapped
// buffer object): state arrays in and out in the layout store/layout.h owns.
#pragma once
#include <algorithm>
#include <cstring>

#include "device/device.h"
#include "kernels/rules.h"
#include "kernels/split_master.h"
#include "store/checksum.h"

namespace smartinf::device {

// A split master from fp32 masters (the first array, or `fill`): the low halves, and the
// checksum of the bf16 params they belong to (the ones the caller holds: the masters rounded).
inline void import_split_master(const store::SplitMaster& s, const float* from, float fill,
                                size_t numel) {
  constexpr size_t kPiece = 4096;
  kernels::bf16 params[kPiece];
  float master[kPiece];
  store::ParamsChecksum sum;
  for (size_t lo = 0; lo < numel; lo += kPiece) {
    const size_t n = std::min(kPiece, numel - lo);
    for (size_t i = 0; i < n; ++i) {
      master[i] = from ? from[lo + i] : fill;
      params[i] = kernels::from_float<kernels::bf16>(master[i]);
    }
    kernels::split_masters(n, master, params, s.low + lo);
    sum.add(params, n * 2);
  }
  *s.params_sum = sum.value();
}

// init_states / export_states for a device whose slot states are host-visible, in `layout`.
// `from[0]`/`to[0]` are the fp32 masters; with a split master, exporting them takes the bf16
// params the caller holds (`params`), taken whole as the masters when `adopt`.
inline void import_host_states(void* states, const store::StateLayout& layout,
                               const float* const* from, const float* fill, size_t numel) {
  if (layout.split()) import_split_master(layout.split_at(states, numel), from[0], fill[0], numel);
  switch (layout.moments) {
    case store::Moments::int8:
      return kernels::import_int8(layout.int8_at(states, numel), numel, layout.moment_count(), from, fill);
    case store::Moments::int4:
      return kernels::import_int4(layout.int4_at(states, numel), numel, layout.moment_count(), from, fill);
    case store::Moments::fp32:
      break;
  }
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
  switch (layout.moments) {
    case store::Moments::int8:
      return kernels::export_int8(layout.int8_at(states, numel), numel, layout.moment_count(), to);
    case store::Moments::int4:
      return kernels::export_int4(layout.int4_at(states, numel), numel, layout.moment_count(), to);
    case store::Moments::fp32:
      break;
  }
  for (unsigned a = layout.split() ? 1 : 0; a < layout.arrays; ++a)
    if (to[a]) std::memcpy(to[a], layout.array(states, numel, a), numel * 4);
}

}  // namespace smartinf::device
