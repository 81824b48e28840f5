// Where one sub-group of a Pipeline lives and where its states stand against its
// directory's committed copy: the commit state placement.cc, steps.cc and commit.cc share, changed
// only through the transitions below, each named for what happened to the sub-group.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include <utility>

#include "device/device.h"
#include "pipeline/completion.h"

namespace smartinf::pipeline {

struct Placement {
  size_t unit;
  size_t local;
  // Its states' first byte in the device's resident memory; kOwnStates: streamed.
  uint64_t resident = device::kOwnStates;
  // Updated since the last durable commit: its working copy (resident memory, or the
  // shadow extents) is current, at `steps` optimizer steps.
  bool dirty = false;
  bool behind = false;  // resident and dirty, but its shadow extents not written since
  bool was_dirty = false;  // dirty before the step in progress wrote it
  // Made by this pipeline and resident, its states not yet on storage: the first durable
  // commit that holds it writes them (so no byte is written before that commit falls due).
  bool unwritten = false;
  uint64_t steps = 0;
  // A second copy of its resident states (kOwnStates: none), given at a background commit
  // from what is left of the budget: while the pending commit writes `resident`, the next
  // update copies it here and the two swap (pinned until then).
  uint64_t twin = device::kOwnStates;
  bool pinned = false;
  // The pending commit's write of its resident states: an update without a twin waits
  // for this one, not for the whole commit (Pipeline::wait_written).
  std::shared_ptr<Completion> written;

  // Updated (or its states written) in the step in progress, to `to` steps; `behind`: its
  // new states stay in resident memory, not yet in its shadow extents.
  void updated(uint64_t to, bool stays_resident) {
    was_dirty = dirty;
    dirty = true;
    steps = to;
    behind = stays_resident;
  }
  // A durable commit writes its resident states, in the background: held until written.
  void persisting(std::shared_ptr<Completion> write) {
    written = std::move(write);
    pinned = true;
  }
  // That write is over (done, or its commit landed or was dropped): its copy is free.
  void released() {
    pinned = false;
    written.reset();
  }
  // The update goes to the twin while the resident copy is held (or must survive a
  // retract): the two swap.
  void swap_twin() {
    std::swap(resident, twin);
    pinned = false;
  }
  // Made in resident memory, written by the first durable commit.
  void made() {
    updated(0, true);
    unwritten = true;
  }
  // A durable commit at `committed` steps landed: the committed copy is its states, unless
  // it was updated since, or never written (that commit did not hold it).
  void landed(uint64_t committed) {
    if (!unwritten && steps == committed) dirty = behind = false;
  }
  // A durable commit that held it, at `committed` steps, landed: its states are on storage.
  void committed(uint64_t at) {
    unwritten = false;
    landed(at);
  }
  // Back to the durable commit: its working copy forgotten.
  void forgotten() { dirty = behind = false; }
};

}  // namespace smartinf::pipeline
