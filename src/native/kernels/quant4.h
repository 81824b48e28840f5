// 4-bit block-wise optimizer states (after Li et al., "Memory Efficient Optimizers with
// 4-bit States", NeurIPS 2023). Where the codes and scales sit is store/layout.h's
// (Int4States). PLACEHOLDER: the kernels are being written.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "kernels/adam.h"
#include "kernels/lion.h"
#include "kernels/numeric.h"
#include "store/layout.h"

namespace smartinf::kernels {

using store::Int4States;

template <class G, class P>
inline void adam4(std::size_t, const Int4States&, const G*, P*, const AdamStep&) {
  throw std::logic_error("int4 Adam: not written yet");
}

template <class G, class P>
inline void lion4(std::size_t, const Int4States&, const G*, P*, const LionStep&) {
  throw std::logic_error("int4 Lion: not written yet");
}

inline void import_int4(const Int4States&, std::size_t, unsigned, const float* const*,
                        const float*) {
  throw std::logic_error("int4 import: not written yet");
}

inline void export_int4(const Int4States&, std::size_t, unsigned, float* const*) {
  throw std::logic_error("int4 export: not written yet");
}

}  // namespace smartinf::kernels
