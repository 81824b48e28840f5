// Raw storage bandwidth through an engine, and the update kernel's throughput: the limits
// the probe reports and benchmarks divide by, measured with the pipeline's own code.
#pragma once
#include <cstdint>
#include <string>

#include "io/engine.h"
#include "kernels/numeric.h"
#include "store/layout.h"

namespace smartinf::io {

// Seconds to write (then, with write=false, read back) `bytes` of `path` sequentially
// with O_DIRECT, in `block` bytes per request, `depth` blocks in flight. The file is
// created when writing and left in place for the read pass.
double time_io(const std::string& path, uint64_t bytes, bool write, const std::string& engine,
               uint64_t block, unsigned depth);

// Seconds for one Adam(W) update over `numel` in-memory params on `threads` threads, with
// states in `layout` (its moments and master format; 3 arrays).
double time_adam_kernel(uint64_t numel, kernels::DType grad, kernels::DType param,
                        const store::StateLayout& layout, unsigned threads);

// Seconds for one STREAM triad pass over `bytes` (three fp32 arrays) on `threads` threads:
// what host memory gives a memory-bound kernel (it moves `bytes`).
double time_triad(uint64_t bytes, unsigned threads);

}  // namespace smartinf::io
