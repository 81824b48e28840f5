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
// with O_DIRECT, in `block` bytes per request, `depth` blocks in flight all along (as the
// pipeline's engines keep them). The file is
// created when writing and left in place for the read pass.
double time_io(const std::string& path, uint64_t bytes, bool write, const std::string& engine,
               uint64_t block, unsigned depth);

// Seconds to read `bytes` / 2 of `path` (which must hold `bytes`) and write the other half,
// as a step moves states: with burst 0 reads and writes in flight together (two engines,
// as the pipeline's loader and writer), else alternating bursts of `burst` bytes of one
// direction. The aggregate bandwidth is bytes / seconds.
double time_mixed_io(const std::string& path, uint64_t bytes, const std::string& engine,
                     uint64_t block, unsigned depth, uint64_t burst);

// Seconds for one Adam(W) update over `numel` in-memory params on `threads` threads, with
// states in `layout` (its moments and master format; 3 arrays): the best of `repeats`
// after one to warm up.
double time_adam_kernel(uint64_t numel, kernels::DType grad, kernels::DType param,
                        const store::StateLayout& layout, unsigned threads, unsigned repeats);

// Seconds to write `bytes` of `path` as time_io does while Adam(W) updates over `numel`
// in-memory params (time_adam_kernel's) run back to back on `threads` threads: what a
// durable commit's background write gets from the disk while the next steps update resident
// states (their memory traffic and cores shared with the write's).
double time_write_beside_update(const std::string& path, uint64_t bytes, const std::string& engine,
                                uint64_t block, unsigned depth, uint64_t numel, kernels::DType grad,
                                kernels::DType param, const store::StateLayout& layout,
                                unsigned threads);

// Seconds for one STREAM triad pass over `bytes` (three fp32 arrays) on `threads` threads:
// what host memory gives a memory-bound kernel (it moves `bytes`).
double time_triad(uint64_t bytes, unsigned threads);

}  // namespace smartinf::io
