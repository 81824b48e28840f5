// The host's side of a device whose slot states are host-visible (host RAM, or a mapped
// buffer object): state arrays in and out in the layout store/layout.h owns.
#pragma once
#include <algorithm>
#include <cstring>

#include "device/device.h"
#include "kernels/rules.h"

namespace smartinf::device {

// init_states / export_states for a device whose slot states are host-visible (host RAM, or
// a mapped buffer object), in `layout`: fp32 arrays of `numel` one after another, or int8.
inline void import_host_states(void* states, const store::StateLayout& layout,
                               const float* const* from, const float* fill, size_t numel) {
  if (layout.int8)
    return kernels::import_int8(layout.int8_at(states, numel), numel, layout.int8_moments(), from, fill);
  for (unsigned a = 0; a < layout.arrays; ++a) {
    float* to = layout.array(states, numel, a);
    if (from[a])
      std::memcpy(to, from[a], numel * 4);
    else
      std::fill(to, to + numel, fill[a]);
  }
}

inline void export_host_states(void* states, const store::StateLayout& layout,
                               float* const* to, size_t numel) {
  if (layout.int8)
    return kernels::export_int8(layout.int8_at(states, numel), numel, layout.int8_moments(), to);
  for (unsigned a = 0; a < layout.arrays; ++a)
    if (to[a]) std::memcpy(to[a], layout.array(states, numel, a), numel * 4);
}

}  // namespace smartinf::device
