// A Samsung SmartSSD through XRT's native C++ API: slot states in P2P buffer objects
// (FPGA DRAM mapped into the host address space, so the storage engine reads the SSD
// straight into them, peer to peer), gradients in and params out through normal buffer
// objects with explicit syncs, and one kernel run (hls_kernels/) per chunk.
#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>

#include <xrt/xrt_bo.h>
#include <xrt/xrt_device.h>
#include <xrt/xrt_kernel.h>

#include "device/host_states.h"
#include "device/xrt_device.h"
#include "device/registry.h"
#include "store/state_store.h"

namespace smartinf::device {

namespace {

const char* dtype_name(DType t) { return t == DType::f32 ? "f32" : t == DType::f16 ? "f16" : "bf16"; }

// The hls_kernels/ top function for this update (kernels.cpp names them so).
std::string kernel_name(const Kernel& k) {
  const std::string types = std::string(dtype_name(k.grad)) + "_" + dtype_name(k.param);
  return std::string(kernels::rule_row(k.step.rule).hls) + (k.compressed ? "_topk_" : "_") + types;
}

// The row's options: fpga (an index, or a PCIe BDF) and xclbin.
XrtOptions xrt_options(const OwnOptions& own) {
  XrtOptions o;
  const std::string fpga = own.text("fpga", "0");
  if (!fpga.empty() && fpga.find_first_not_of("0123456789") == std::string::npos)
    o.index = static_cast<unsigned>(own.count("fpga"));
  else
    o.bdf = fpga;
  o.xclbin = own.text("xclbin");
  return o;
}

class XrtDevice final : public SlottedDevice<std::vector<Slot>> {
 public:
  XrtDevice(std::string dir, const SlotGeometry& g, const XrtOptions& o)
      : SlottedDevice(std::move(dir), g), device_(open(o)) {
    if (!o.xclbin.empty()) {
      try {
        uuid_ = device_.load_xclbin(o.xclbin);
      } catch (const std::exception& e) {
        throw std::runtime_error("cannot load " + o.xclbin + " on " + name(o) + " (" + e.what() +
                                 "): it must be built from hls_kernels/ for this card's platform "
                                 "(SmartSSD: xilinx_u2_gen3x4_xdma_gc_2_202110_1; `make -C "
                                 "hls_kernels PLATFORM=...`)");
      }
      loaded_ = true;
    }
    const size_t io = io_ = store::align_up(g.chunk * 4);
    for (size_t i = 0; i < g.count; ++i) {
      Buffers b;
      // Memory group 0: the SmartSSD's single DDR bank, which holds its P2P window.
      try {
        b.states = xrt::bo(device_, g.states_bytes(), xrt::bo::flags::p2p, 0);
      } catch (const std::exception& e) {
        throw std::runtime_error("cannot allocate a P2P buffer on " + name(o) + " (" + e.what() +
                                 "): enable P2P with `sudo xbutil configure --p2p enable -d " +
                                 (o.bdf.empty() ? "<BDF>" : o.bdf) + "` (then a warm reboot) and "
                                 "\"Above 4G decoding\" in the BIOS");
      }
      b.grad = xrt::bo(device_, io, xrt::bo::flags::normal, 0);
      b.out = xrt::bo(device_, io, xrt::bo::flags::normal, 0);
      b.pairs = xrt::bo(device_, io + store::align_up(g.chunk * 2), xrt::bo::flags::normal, 0);
      char* pairs = b.pairs.map<char*>();
      slots_.push_back(Slot{b.states.map<float*>(), b.grad.map<void*>(), b.out.map<void*>(),
                            reinterpret_cast<int32_t*>(pairs), pairs + io});
      buffers_.push_back(std::move(b));
    }
  }

  std::string describe() const override { return "xrt:" + dir_; }
  xrt::device& xrt() { return device_; }
  // P2P pages cannot be pinned as io_uring fixed buffers: plain reads into the mapping.
  bool registrable() const override { return false; }
  bool host_visible_states() const override { return false; }
  // 512-bit beats of fp32: each state array of a chunk starts on a beat.
  size_t param_multiple() const override { return 16; }
  bool direct_io() const override {
    for (const Slot& s : slots_)
      if (reinterpret_cast<uintptr_t>(s.states) % store::kAlign != 0) return false;
    return true;
  }

  void copy_in(size_t i, const void* grad, size_t bytes) override {
    std::memcpy(slots_[i].grad, grad, bytes);
    buffers_[i].grad.sync(XCL_BO_SYNC_BO_TO_DEVICE, bytes, 0);
  }

  void copy_in_compressed(size_t i, const int32_t* index, const void* values, size_t nnz,
                          size_t value_bytes) override {
    std::memcpy(slots_[i].index, index, nnz * 4);
    std::memcpy(slots_[i].values, values, nnz * value_bytes);
    buffers_[i].pairs.sync(XCL_BO_SYNC_BO_TO_DEVICE);
  }

  void compute(size_t i, const Kernel& k, size_t numel) override {
    if (!loaded_)
      throw std::runtime_error("kernel stage unavailable on " + describe() +
                               ": no xclbin loaded (pass xclbin= with the build of hls_kernels/)");
    if (numel % param_multiple() != 0)
      throw std::runtime_error("the SmartSSD kernels need chunks of a multiple of " +
                               std::to_string(param_multiple()) + " params (512-bit beats); "
                               "this chunk has " + std::to_string(numel));
    if (k.copy_from != kOwnStates) copy_states(i, k.copy_from, slot_states_bytes());
    xrt::kernel& kernel = kernel_for(k);
    Buffers& b = buffers_[i];
    // The top's arguments: the rule's state arrays (sub-buffers of the slot), the gradient
    // (or top-k pairs: int32 indices, then the values), the params out, n, the scalars.
    std::vector<xrt::bo> a;
    for (unsigned s = 0; s < kernels::rule_row(k.step.rule).arrays; ++s)
      a.emplace_back(b.states, numel * 4, geometry_.layout.array_offset(numel, s));
    const int n = static_cast<int>(numel);
    xrt::run run = kernels::with_scalars(k.step, [&](const auto& scalars) {
      if (k.compressed) {
        if (a.size() != 3) throw std::runtime_error("top-k kernels exist for Adam(W) only");
        xrt::bo index(b.pairs, io_, 0), values(b.pairs, b.pairs.size() - io_, io_);
        return kernel(a[0], a[1], a[2], index, values, static_cast<int>(k.nnz),
                      static_cast<unsigned long long>(k.base), b.out, n, scalars);
      }
      switch (a.size()) {
        case 2: return kernel(a[0], a[1], b.grad, b.out, n, scalars);
        case 3: return kernel(a[0], a[1], a[2], b.grad, b.out, n, scalars);
        default: return kernel(a[0], a[1], a[2], a[3], b.grad, b.out, n, scalars);
      }
    });
    run.wait();
  }

  void copy_in_params(size_t i, const void* params, size_t bytes) override {
    std::memcpy(slots_[i].out, params, bytes);
    buffers_[i].out.sync(XCL_BO_SYNC_BO_TO_DEVICE, bytes, 0);
  }

  void copy_out(size_t i, void* dst, size_t bytes) override {
    buffers_[i].out.sync(XCL_BO_SYNC_BO_FROM_DEVICE, bytes, 0);
    std::memcpy(dst, slots_[i].out, bytes);
  }

  void init_states(size_t i, const float* const* arrays, const float* fill,
                   size_t numel) override {
    import_host_states(slots_[i].states, geometry_.layout, arrays, fill, numel);
  }

  void export_states(size_t i, float* const* arrays, size_t numel, bool adopt) override {
    export_host_states(slots_[i].states, geometry_.layout, arrays, numel,
                       static_cast<const kernels::bf16*>(slots_[i].out), adopt);
  }

 private:
  struct Buffers {
    xrt::bo states, grad, out, pairs;
  };

  // Kernel handles are looked up in the xclbin once, not per chunk (one compute thread
  // per device calls this).
  xrt::kernel& kernel_for(const Kernel& k) {
    const std::string name = kernel_name(k);
    auto it = kernels_.find(name);
    if (it == kernels_.end()) it = kernels_.emplace(name, xrt::kernel(device_, uuid_, name)).first;
    return it->second;
  }

  static std::string name(const XrtOptions& o) {
    return o.bdf.empty() ? "XRT device " + std::to_string(o.index) : "XRT device " + o.bdf;
  }

  static xrt::device open(const XrtOptions& o) {
    try {
      return o.bdf.empty() ? xrt::device(o.index) : xrt::device(o.bdf);
    } catch (const std::exception& e) {
      const bool container = ::access("/.dockerenv", F_OK) == 0 ||
                             ::access("/run/.containerenv", F_OK) == 0;
      throw std::runtime_error(
          "cannot open " + name(o) + " (" + e.what() + "): `xbutil examine` lists the cards " +
          "XRT sees" + (container ? "; this is a container: pass the card's /dev/xclmgmt* and "
                                    "/dev/dri/renderD* devices through (docker --device)"
                                  : ""));
    }
  }

  xrt::device device_;
  xrt::uuid uuid_;
  bool loaded_ = false;
  size_t io_ = 0;
  std::map<std::string, xrt::kernel> kernels_;
  std::vector<Buffers> buffers_;
};

// Whole-buffer file I/O in 1 MiB requests (the pipeline's piece size), timed.
double timed_io(int fd, char* data, uint64_t nbytes, bool write) {
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t off = 0; off < nbytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(1 << 20, nbytes - off));
    const ssize_t got = write ? ::pwrite(fd, data + off, n, static_cast<off_t>(off))
                              : ::pread(fd, data + off, n, static_cast<off_t>(off));
    if (got <= 0) throw std::runtime_error(std::string("P2P ") + (write ? "write" : "read") +
                                           " failed: " + std::strerror(got < 0 ? errno : EIO));
    off += static_cast<uint64_t>(got);
  }
  if (write && ::fdatasync(fd) != 0) throw std::runtime_error("fdatasync failed");
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double timed_sync(xrt::bo& bo, xclBOSyncDirection direction) {
  const auto start = std::chrono::steady_clock::now();
  bo.sync(direction);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

XrtBandwidth time_xrt(const XrtOptions& options, const std::string& dir, uint64_t nbytes) {
  XrtDevice device(dir, SlotGeometry{0, 1, 1}, options);
  xrt::bo p2p(device.xrt(), nbytes, xrt::bo::flags::p2p, 0);
  xrt::bo host(device.xrt(), nbytes, xrt::bo::flags::normal, 0);
  char* data = p2p.map<char*>();
  XrtBandwidth bw;
  bw.direct = reinterpret_cast<uintptr_t>(data) % store::kAlign == 0;
  const std::string path = dir + "/.smartinf-xrt-probe";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | (bw.direct ? O_DIRECT : 0), 0600);
  if (fd < 0) throw std::runtime_error("cannot create " + path + ": " + std::strerror(errno));
  try {
    bw.p2p_write_s = timed_io(fd, data, nbytes, true);   // FPGA DRAM -> SSD
    bw.p2p_read_s = timed_io(fd, data, nbytes, false);   // SSD -> FPGA DRAM
  } catch (...) {
    ::close(fd);
    ::unlink(path.c_str());
    throw;
  }
  ::close(fd);
  ::unlink(path.c_str());
  std::memset(host.map<char*>(), 1, nbytes);
  bw.to_fpga_s = timed_sync(host, XCL_BO_SYNC_BO_TO_DEVICE);
  bw.from_fpga_s = timed_sync(host, XCL_BO_SYNC_BO_FROM_DEVICE);
  return bw;
}

std::unique_ptr<Device> make_xrt_device(const std::string& dir, const SlotGeometry& geometry,
                                        const DeviceOptions& options) {
  return std::make_unique<XrtDevice>(dir, geometry, xrt_options(options.own));
}

}  // namespace smartinf::device
