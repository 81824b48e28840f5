// The device kinds, one row each: what a pipeline may ask of each kind (state formats, a
// host memory budget, an emulated storage cap, a phased I/O schedule), the options of its
// own it takes, and its factory. The pipeline reads rows; nothing else switches on a kind's
// name, and a kind's own options pass through the pipeline and the binding as text. A new
// kind: its <kind>_device.cc (the Device and its factory, declared here) and its row here
// (docs/extending.md, "A new device kind", lists the rest: its Python class, test and docs line).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "device/cpu_device.h"
#include "device/device.h"
#include "store/layout.h"

namespace smartinf::device {

// A kind's own options as the front-end names them (smartinf.devices' native_spec): name ->
// value as text ("true"/"false" for flags, decimal integers).
using KindOptions = std::map<std::string, std::string>;

// A factory's typed reads of its options: absent gives the fallback, a malformed value is
// refused naming the option and the kind.
class OwnOptions {
 public:
  OwnOptions(std::string kind, const KindOptions& values) : kind_(std::move(kind)), values_(values) {}
  std::string text(const std::string& name, const std::string& fallback = "") const;
  uint64_t count(const std::string& name, uint64_t fallback = 0) const;
  bool flag(const std::string& name, bool fallback = false) const;

 private:
  const std::string* find(const std::string& name) const;
  std::string kind_;
  const KindOptions& values_;
};

// What a factory is given: the pipeline's host memory budget and compute pool (what the
// cpu kind runs on), and the kind's own options.
struct DeviceOptions {
  CpuOptions host;
  OwnOptions own;
};

using MakeDevice = std::unique_ptr<Device> (*)(const std::string& dir, const SlotGeometry& geometry,
                                               const DeviceOptions& options);
// Each in its <kind>_device.cc (or <kind>_unavailable.cc where its toolkit was not found).
std::unique_ptr<Device> make_xrt_device(const std::string&, const SlotGeometry&, const DeviceOptions&);
std::unique_ptr<Device> make_cuda_device(const std::string&, const SlotGeometry&, const DeviceOptions&);
// A split master's params checksum (store::params_checksum) of bf16 params in the current
// GPU's memory, hashed there (cuda_checksum.cu): what the tests compare with the host's.
uint64_t gpu_params_checksum(const void* params, std::size_t numel);

// One run of bytes of a GPU digest (cuda_digest.cu; smartinf/step/edits.py builds the table):
// `units` 2-byte units at `address` (GPU memory, 2-byte aligned), from unit `offset` of key
// `key`'s stream of units on; its blocks are those from `first_chunk` (digest_chunk_units()
// units each).
struct DigestPart {
  uint64_t address, units, offset, key, first_chunk;
};
static_assert(sizeof(DigestPart) == 5 * sizeof(uint64_t), "the table is an int64 tensor of 5 columns");
uint64_t digest_chunk_units();
// Queues on `stream` (a cudaStream_t of GPU `gpu`) the adding, into sums[2 key] and
// sums[2 key + 1] (zeros to begin with), of each key's plain and position-weighted sums of
// its units, for the `count` parts at `parts` (GPU memory) and their `chunks` blocks.
void queue_gpu_unit_sums(const DigestPart* parts, std::size_t count, std::size_t chunks,
                         uint64_t* sums, int gpu, void* stream);

struct DeviceKind {
  const char* name;        // DeviceSpec::kind, smartinf.devices' `kind`
  bool quantized;          // runs int8 and int4 moments
  bool split_master;       // runs a split master
  bool host_budget;        // holds the pipeline's memory_budget (host RAM)
  bool storage_cap;        // takes an emulated internal storage bandwidth (storage_bps)
  bool phased_io;          // its ring may run a phased I/O schedule that needs more slots
  const char* options;     // the options of its own it takes, space separated
  const char* why_not;     // what a refused state format is told
  MakeDevice make;
};

inline constexpr DeviceKind kDeviceKinds[] = {
    {"cpu", true, true, true, true, true, "", "",
     [](const std::string& d, const SlotGeometry& g, const DeviceOptions& o) { return make_cpu_device(d, g, o.host); }},
    // fpga: an index or a PCIe BDF; xclbin: the build of hls_kernels/. hls_kernels/ has
    // int8/int4 tops, but xrt_device.cc neither names nor launches them.
    {"xrt", false, false, false, false, false, "fpga xclbin",
     "the SmartSSD device (xrt_device.cc) drives the fp32-state kernels only so far", make_xrt_device},
    // gpu: the CUDA ordinal; memory_budget: bytes of resident states, in GPU memory or, with
    // memory "host", page-locked host memory; host_twin: a page-locked host copy of a GPU
    // budget (cuda_device.cu says what each does).
    {"cuda", true, true, false, false, false, "gpu memory_budget memory host_twin", "", make_cuda_device},
};

// The row of `kind`; an unknown kind is refused, naming the known ones.
const DeviceKind& device_kind(const std::string& kind);

// Why a device of `kind` cannot hold states laid out as `layout` ("": it can).
std::string refuses(const DeviceKind& kind, const store::StateLayout& layout);

// A device of `kind` in `dir`: options the kind does not take are refused (naming those it
// does) before anything is made.
std::unique_ptr<Device> make_device(const DeviceKind& kind, const std::string& dir, const SlotGeometry& geometry,
                                    const CpuOptions& host, const KindOptions& options);

}  // namespace smartinf::device
