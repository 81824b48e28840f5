// Sub-groups over near-storage devices: placement, steps and their atomic commit.
// One Ring per device; a step's updates go to the shadow copies and become current only
// when commit() has made every device's writes durable.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device/device.h"
#include "pipeline/ring.h"
#include "store/state_store.h"

namespace smartinf::pipeline {

struct DeviceSpec {
  std::string kind = "cpu";
  std::string dir;
};

struct PipelineOptions {
  std::vector<DeviceSpec> devices;
  std::string optimizer = "adamw";  // adam | adamw
  uint64_t chunk = 1 << 20;         // params per chunk (slot size)
  size_t slots = 4;                 // K slots per device
  RingOptions ring;
};

// Hyper-parameters of one update; the step count t comes from the stored sub-group.
struct UpdateHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  double grad_scale = 1.0;  // 1 / loss scale
};

class Pipeline {
 public:
  explicit Pipeline(const PipelineOptions& options);
  ~Pipeline();

  // Registers sub-group number subgroup_count() with `numel` params. A new one is
  // initialised (params from `init`, zeros when null; moments zero) before this returns;
  // one the directories already hold is resumed and `init` is ignored.
  size_t add_subgroup(uint64_t numel, const float* init, bool& resumed);

  // Queues one sub-group's update; the completion is done when all params are in `out`.
  std::shared_ptr<Completion> update(size_t sg, const void* grad, kernels::DType grad_dtype,
                                     void* out, kernels::DType out_dtype,
                                     const UpdateHyper& hyper);
  // The committed states of a sub-group (any pointer may be null).
  void read_states(size_t sg, float* param, float* exp_avg, float* exp_avg_sq);

  void commit();   // waits for the step, makes it durable, advances step()
  void discard();  // waits for the step and forgets its updates
  void close();    // discards an uncommitted step, persists the layout

  bool closed() const { return devices_.empty(); }
  uint64_t step() const { return step_; }
  size_t subgroup_count() const { return placement_.size(); }
  uint64_t numel(size_t sg) const;
  uint64_t subgroup_steps(size_t sg) const;
  bool pending() const { return !completions_.empty(); }
  std::map<std::string, double> stats() const;
  std::string engine() const;
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  struct Unit {  // one device with its storage and ring
    std::unique_ptr<device::Device> device;
    std::unique_ptr<store::StateStore> store;
    std::unique_ptr<Ring> ring;
    std::vector<size_t> updated;  // local sub-groups written this step
    uint64_t numel = 0;           // placed so far, for balancing
  };
  struct Placement {
    size_t unit;
    size_t local;
  };
  const Placement& placed(size_t sg) const;
  void require_open() const;
  void wait_step(bool keep);
  void submit_and_wait(size_t unit, std::vector<Job>& jobs);

  PipelineOptions options_;
  device::Optimizer optimizer_;
  std::vector<Unit> devices_;
  std::vector<Placement> placement_;
  std::vector<bool> updated_;
  std::vector<std::shared_ptr<Completion>> completions_;
  std::map<std::string, double> last_hyper_;
  std::vector<std::string> notes_;
  uint64_t step_ = 0;
  mutable std::mutex mu_;
};

}  // namespace smartinf::pipeline
