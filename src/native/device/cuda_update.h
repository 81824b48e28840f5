// The update kernels on a CUDA GPU: the element-wise functions of kernels/ (the ones the
// cpu device and the HLS tops run), compiled for the device, one thread per param. The same
// IEEE operations in the same order, with nvcc's contraction of a * b + c into one FMA
// turned off (-fmad=false) and division and square root correctly rounded (its defaults), so
// the bits are the cpu device's. fp32 moments, with an fp32 or a split master; int8 and int4
// moments, whose blocks share scales, are not ported yet.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/numeric.h"
#include "kernels/rules.h"

namespace smartinf::device::cuda {

// The step's rule over n params in GPU memory: `arrays[0 .. rule arrays)` the fp32 master,
// then the states; `grad` of dtype `grad_dtype`, the params out of `param_dtype`.
void update(const kernels::Step& step, kernels::DType grad_dtype, kernels::DType param_dtype,
            std::size_t n, float* const* arrays, const void* grad, void* out, cudaStream_t stream);

// The same with a split master (kernels/split_master.h): `low` the masters' low halves,
// `out` the bf16 params sent in, rebuilt into masters per param, updated, split again;
// `adopt`: the params are the masters as they are. arrays[0] is not read.
void update_split(const kernels::Step& step, kernels::DType grad_dtype, std::size_t n,
                  float* const* arrays, uint16_t* low, const void* grad, kernels::bf16* out,
                  bool adopt, cudaStream_t stream);

}  // namespace smartinf::device::cuda
