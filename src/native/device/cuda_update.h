// The update kernels on a CUDA GPU: the element-wise functions of kernels/ (the ones the
// cpu device and the HLS tops run), compiled for the device. The same IEEE operations in the
// same order, with nvcc's contraction of a * b + c into one FMA turned off (-fmad=false) and
// division and square root correctly rounded (its defaults), so the bits are the cpu
// device's. fp32 moments run one thread per param; int8 and int4 moments one kernel for
// every format and every rule that has them: a thread block of warps takes a piece
// (int8: four 256-param blocks, four warps; int4: a 128 x 128 tile, sixteen), a warp a row at a time, whose new
// maxima are reduced within the warp before its codes are written (int4's second moment at
// the tile's end). A split master is rebuilt per param from the bf16 param sent in and split again.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/numeric.h"
#include "kernels/rules.h"
#include "store/layout.h"

namespace smartinf::device::cuda {

// The step's rule over the n params of one chunk whose states (in `layout`) are at `states`
// in GPU memory; `grad` of dtype `grad_dtype`, the params out of `param_dtype` (a split
// master: bf16, the params sent in, rebuilt into masters; `adopt`: taken as they are).
void update(const kernels::Step& step, const store::StateLayout& layout, void* states,
            std::size_t n, kernels::DType grad_dtype, kernels::DType param_dtype, const void* grad,
            void* out, bool adopt, cudaStream_t stream);

}  // namespace smartinf::device::cuda
