// The device kinds, one row each: what a pipeline may ask of each kind (state formats, a
// host memory budget, a GPU memory budget, an emulated storage cap, a phased I/O schedule)
// and its factory. The pipeline reads rows; nothing else switches on a kind's name. A new
// kind: its device files (the factory and the Device) and its row here.
#pragma once
#include <memory>
#include <string>

#include "device/cpu_device.h"
#include "device/cuda_device.h"
#include "device/device.h"
#include "device/xrt_device.h"
#include "store/layout.h"

namespace smartinf::device {

struct DeviceOptions {
  CpuOptions cpu;
  XrtOptions xrt;
  CudaOptions cuda;
};

struct DeviceKind {
  const char* name;        // DeviceSpec::kind, smartinf.devices' `kind`
  bool quantized;          // runs int8 and int4 moments
  bool split_master;       // runs a split master
  bool host_budget;        // holds the pipeline's memory_budget (host RAM)
  bool gpu_budget;         // takes a GPU memory budget of its own (CudaOptions)
  bool storage_cap;        // takes an emulated internal storage bandwidth (storage_bps)
  bool phased_io;          // its ring may run a phased I/O schedule that needs more slots
  const char* why_not;     // what a refused state format is told
  std::unique_ptr<Device> (*make)(const std::string& dir, const SlotGeometry& geometry,
                                  const DeviceOptions& options);
};

inline constexpr DeviceKind kDeviceKinds[] = {
    {"cpu", true, true, true, false, true, true, "",
     [](const std::string& d, const SlotGeometry& g, const DeviceOptions& o) { return make_cpu_device(d, g, o.cpu); }},
    // hls_kernels/ has int8/int4 tops, but xrt_device.cc neither names nor launches them
    {"xrt", false, false, false, false, false, false,
     "the SmartSSD device (xrt_device.cc) drives the fp32-state kernels only so far",
     [](const std::string& d, const SlotGeometry& g, const DeviceOptions& o) { return make_xrt_device(d, g, o.xrt); }},
    {"cuda", true, true, false, true, false, false, "",
     [](const std::string& d, const SlotGeometry& g, const DeviceOptions& o) { return make_cuda_device(d, g, o.cuda); }},
};

// The row of `kind`; an unknown kind is refused, naming the known ones.
const DeviceKind& device_kind(const std::string& kind);

// Why a device of `kind` cannot hold states laid out as `layout` ("": it can).
std::string refuses(const DeviceKind& kind, const store::StateLayout& layout);

}  // namespace smartinf::device
