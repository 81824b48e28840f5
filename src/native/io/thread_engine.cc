// Fallback engine: a small pool of threads doing pread/pwrite, for when io_uring cannot
// be set up. Same contract as the io_uring engine: submit, then wait.
#include <sys/syscall.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "error.h"
#include "fault.h"
#include "io/engine.h"
#include "io/tickets.h"

namespace smartinf::io {
namespace {

// Runs one op to completion: retries EINTR/EAGAIN and resubmits the rest of short I/O.
int transfer(Op op) {
  while (op.len > 0) {
    ssize_t res = op.write ? ::pwrite(op.fd, op.buf, op.len, static_cast<off_t>(op.offset))
                           : ::pread(op.fd, op.buf, op.len, static_cast<off_t>(op.offset));
    switch (fault::at(op.write ? "io.write" : "io.read")) {
      case fault::Action::error: return fault::error_code();
      case fault::Action::short_io: res = fault::short_length(res); break;  // rest redone
      default: break;
    }
    if (res < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return errno;
    }
    if (res == 0) return EIO;  // unexpected end of file
    op.buf = static_cast<char*>(op.buf) + res;
    op.offset += static_cast<uint64_t>(res);
    op.len -= static_cast<uint64_t>(res);
  }
  return 0;
}

class ThreadEngine final : public Engine {
 public:
  explicit ThreadEngine(const Options& options) : piece_bytes_(options.piece_bytes) {
    for (unsigned i = 0; i < std::max(1u, options.threads); ++i)
      workers_.emplace_back([this, low = options.low_priority] {
        // ioprio_set(IOPRIO_WHO_PROCESS, this thread); advisory, so failure is ignored.
        if (low) (void)::syscall(SYS_ioprio_set, 1, 0, kLowIoPriority);
        work();
      });
  }
  ~ThreadEngine() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    ready_.notify_all();
    for (auto& t : workers_) t.join();
  }

  Ticket submit(std::span<const Op> ops) override {
    const std::vector<Op> pieces = split(ops, piece_bytes_);
    Ticket ticket;
    {
      std::lock_guard lock(mu_);
      ticket = tickets_.open(pieces.size());
      for (const Op& piece : pieces) queue_.push_back(Piece{piece, ticket});
    }
    ready_.notify_all();
    return ticket;
  }

  void wait() override {
    Ticket last;
    {
      std::lock_guard lock(mu_);
      last = tickets_.last();
    }
    wait_for(last);
  }

  void wait_for(Ticket ticket) override {
    std::unique_lock lock(mu_);
    done_.wait(lock, [&] { return !tickets_.busy(ticket); });
    tickets_.settle(ticket);
  }

  const char* name() const override { return "threads"; }

 private:
  void work() {
    std::unique_lock lock(mu_);
    for (;;) {
      ready_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      const Piece piece = queue_.front();
      const Op& op = piece.op;
      queue_.pop_front();
      lock.unlock();
      const int code = transfer(op);
      lock.lock();
      if (code)
        tickets_.finish(piece.ticket, SystemError(code, op.write ? "write failed" : "read failed",
                                                  op.path ? *op.path : std::string("?")));
      else
        tickets_.finish(piece.ticket);
      done_.notify_all();
    }
  }

  struct Piece {
    Op op;
    Ticket ticket;
  };

  uint64_t piece_bytes_;
  std::mutex mu_;
  std::condition_variable ready_, done_;
  std::deque<Piece> queue_;
  Tickets tickets_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Engine> make_thread_engine(const Options& options) {
  return std::make_unique<ThreadEngine>(options);
}

}  // namespace smartinf::io
