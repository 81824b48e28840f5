// The bookkeeping both engines share: which submitted batches (tickets) still have pieces
// in flight, and the first error of each, kept until the batch is waited for.
#pragma once
#include <cstddef>
#include <map>
#include <optional>

#include "error.h"
#include "io/engine.h"

namespace smartinf::io {

class Tickets {
 public:
  // A new batch of `pieces` pieces (0: done at once).
  Ticket open(size_t pieces) {
    state_[++last_] = State{pieces, std::nullopt};
    return last_;
  }

  // One piece of `ticket` finished, failed with `error` when given.
  void finish(Ticket ticket, std::optional<SystemError> error = std::nullopt) {
    State& s = state_.at(ticket);
    --s.pieces;
    if (error && !s.error) s.error = std::move(error);
  }

  // Whether a batch up to `ticket` still has pieces in flight.
  bool busy(Ticket ticket) const {
    for (auto it = state_.begin(); it != state_.end() && it->first <= ticket; ++it)
      if (it->second.pieces) return true;
    return false;
  }

  // Forgets the (finished) batches up to `ticket`; throws the first error among them.
  void settle(Ticket ticket) {
    std::optional<SystemError> error;
    while (!state_.empty() && state_.begin()->first <= ticket) {
      if (!error) error = std::move(state_.begin()->second.error);
      state_.erase(state_.begin());
    }
    if (error) throw *error;
  }

  Ticket last() const { return last_; }

 private:
  struct State {
    size_t pieces;
    std::optional<SystemError> error;
  };
  std::map<Ticket, State> state_;
  Ticket last_ = 0;
};

}  // namespace smartinf::io
