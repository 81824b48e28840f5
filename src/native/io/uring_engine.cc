// io_uring engine: O_DIRECT-friendly, fixed buffers, bounded queue depth, batched submits.
// The submit/reap loop follows liburing's examples/io_uring-cp.c.
#include <deque>
#include <optional>

#include "error.h"
#include "fault.h"
#include "io/engine.h"
#include "io/tickets.h"

#ifdef SMARTINF_HAVE_URING
#include <liburing.h>

namespace smartinf::io {
namespace {

class UringEngine final : public Engine {
 public:
  explicit UringEngine(const Options& options) : options_(options) {
    check(io_uring_queue_init(options.queue_depth, &ring_, 0), "io_uring_queue_init",
          "io_uring");
    if (!options.fixed_buffers.empty()) {
      int res = io_uring_register_buffers(&ring_, options.fixed_buffers.data(),
                                          options.fixed_buffers.size());
      fixed_ = res == 0;  // without registration, plain reads/writes still work
    }
  }
  ~UringEngine() override {
    try {
      wait();
    } catch (...) {
    }
    io_uring_queue_exit(&ring_);
  }

  Ticket submit(std::span<const Op> ops) override {
    const std::vector<Op> pieces = split(ops, options_.piece_bytes);
    const Ticket ticket = tickets_.open(pieces.size());
    for (const Op& piece : pieces) pending_.push_back(Piece{piece, ticket});
    fill();
    return ticket;
  }

  void wait() override { wait_for(tickets_.last()); }

  void wait_for(Ticket ticket) override {
    while (tickets_.busy(ticket)) {
      io_uring_cqe* cqe = nullptr;
      int res = io_uring_wait_cqe(&ring_, &cqe);
      if (res == -EINTR) continue;
      check(res, "io_uring_wait_cqe", "io_uring");
      unsigned head, seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        complete(static_cast<size_t>(cqe->user_data), cqe->res);
        ++seen;
      }
      io_uring_cq_advance(&ring_, seen);
      fill();
    }
    tickets_.settle(ticket);
  }

  const char* name() const override { return "uring"; }

 private:
  void complete(size_t index, int res) {
    --inflight_;
    Piece& piece = slots_[index];
    Op& op = piece.op;
    free_.push_back(index);
    switch (fault::at(op.write ? "io.write" : "io.read")) {
      case fault::Action::error: res = -fault::error_code(); break;
      case fault::Action::short_io: res = fault::short_length(res); break;  // rest resubmitted
      default: break;
    }
    if (res == -EAGAIN || res == -EINTR) {
      pending_.push_front(piece);
    } else if (res < 0) {
      tickets_.finish(piece.ticket, failure(-res, op));
    } else if (res == 0 && op.len > 0) {
      tickets_.finish(piece.ticket, failure(EIO, op));  // unexpected end of file
    } else if (static_cast<uint64_t>(res) < op.len) {  // short I/O: resubmit the rest
      op.buf = static_cast<char*>(op.buf) + res;
      op.offset += res;
      op.len -= res;
      pending_.push_front(piece);
    } else {
      tickets_.finish(piece.ticket);
    }
  }

  static SystemError failure(int code, const Op& op) {
    return SystemError(code, op.write ? "write failed" : "read failed",
                       op.path ? *op.path : std::string("?"));
  }

  void fill() {
    unsigned queued = 0;
    while (!pending_.empty() && inflight_ < options_.queue_depth) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (!sqe) break;
      const Piece piece = pending_.front();
      const Op& op = piece.op;
      pending_.pop_front();
      size_t index;
      if (free_.empty()) {
        index = slots_.size();
        slots_.push_back(piece);
      } else {
        index = free_.back();
        free_.pop_back();
        slots_[index] = piece;
      }
      const unsigned len = static_cast<unsigned>(op.len);
      if (fixed_ && op.buf_index >= 0) {
        if (op.write)
          io_uring_prep_write_fixed(sqe, op.fd, op.buf, len, op.offset, op.buf_index);
        else
          io_uring_prep_read_fixed(sqe, op.fd, op.buf, len, op.offset, op.buf_index);
      } else if (op.write) {
        io_uring_prep_write(sqe, op.fd, op.buf, len, op.offset);
      } else {
        io_uring_prep_read(sqe, op.fd, op.buf, len, op.offset);
      }
      if (options_.low_priority) sqe->ioprio = kLowIoPriority;
      io_uring_sqe_set_data64(sqe, index);
      ++inflight_;
      ++queued;
    }
    if (queued == 0) return;
    int res;
    do res = io_uring_submit(&ring_);
    while (res == -EINTR || res == -EAGAIN);
    check(res, "io_uring_submit", "io_uring");
  }

  struct Piece {
    Op op;
    Ticket ticket;
  };

  Options options_;
  io_uring ring_{};
  bool fixed_ = false;
  std::deque<Piece> pending_;
  std::vector<Piece> slots_;  // pieces in flight, indexed by user_data
  std::vector<size_t> free_;
  unsigned inflight_ = 0;
  Tickets tickets_;
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(const Options& options) {
  return std::make_unique<UringEngine>(options);
}
bool uring_available_at_build() { return true; }

}  // namespace smartinf::io

#else  // built without liburing

namespace smartinf::io {
std::unique_ptr<Engine> make_uring_engine(const Options&) {
  throw SystemError(ENOSYS, "smartinf was built without liburing (install liburing-dev)",
                    "io_uring");
}
bool uring_available_at_build() { return false; }
}  // namespace smartinf::io

#endif
