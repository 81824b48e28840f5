// Asynchronous storage engine: submit a batch of reads/writes, do other work, wait.
// One engine serves one thread (an io_uring ring is single-issuer); the pipeline gives
// its load and write-back stages one engine each so reads and writes overlap.
#pragma once
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace smartinf::io {

struct Op {
  bool write = false;
  int fd = -1;
  const std::string* path = nullptr;  // for error messages; owned by the file's owner
  void* buf = nullptr;
  uint64_t len = 0;
  uint64_t offset = 0;
  int buf_index = -1;  // index of a registered (fixed) buffer containing buf, or -1
};

struct Options {
  unsigned queue_depth = 32;       // pieces in flight
  uint64_t piece_bytes = 1 << 20;  // large ops are split so several are in flight
  unsigned threads = 2;            // thread engine only
  std::vector<iovec> fixed_buffers;  // io_uring: registered once, used by Op::buf_index
  bool low_priority = false;         // best-effort class, lowest level (write-back)
};

// The ioprio value of `low_priority` requests (linux/ioprio.h: BE class, level 7).
inline constexpr unsigned short kLowIoPriority = (2u << 13) | 7u;

// A batch of ops given to submit(); tickets increase from 1 in submission order.
using Ticket = uint64_t;

class Engine {
 public:
  virtual ~Engine() = default;
  // Starts the ops; returns once they are queued (some may wait for queue room). Batches
  // submitted one after another share the queue: the device never idles between them.
  virtual Ticket submit(std::span<const Op> ops) = 0;
  // Completes the batches up to `ticket`; later ones go on. Throws SystemError for the
  // first failed op among them, after all of them have finished (buffers are never left
  // in use by the kernel).
  virtual void wait_for(Ticket ticket) = 0;
  // Completes everything submitted, as wait_for(the last ticket).
  virtual void wait() = 0;
  virtual const char* name() const = 0;
};

// Throws SystemError when io_uring cannot be set up (seccomp, io_uring_disabled, ...).
std::unique_ptr<Engine> make_uring_engine(const Options& options);
std::unique_ptr<Engine> make_thread_engine(const Options& options);
bool uring_available_at_build();

// "auto" tries io_uring and falls back to threads, appending the reason to `notes`.
std::unique_ptr<Engine> make_engine(const std::string& kind, const Options& options,
                                    std::vector<std::string>& notes);

// Splits ops into pieces of at most piece_bytes (the unit both engines queue).
std::vector<Op> split(std::span<const Op> ops, uint64_t piece_bytes);

}  // namespace smartinf::io
