#include "io/engine.h"

#include "error.h"

namespace smartinf::io {

std::vector<Op> split(std::span<const Op> ops, uint64_t piece_bytes) {
  std::vector<Op> pieces;
  for (const Op& op : ops) {
    for (uint64_t done = 0; done < op.len; done += piece_bytes) {
      Op piece = op;
      piece.buf = static_cast<char*>(op.buf) + done;
      piece.offset = op.offset + done;
      piece.len = std::min(piece_bytes, op.len - done);
      pieces.push_back(piece);
    }
  }
  return pieces;
}

std::unique_ptr<Engine> make_engine(const std::string& kind, const Options& options,
                                    std::vector<std::string>& notes) {
  if (kind == "threads") return make_thread_engine(options);
  if (kind == "uring") return make_uring_engine(options);
  if (kind != "auto")
    throw std::invalid_argument("io engine must be 'auto', 'uring' or 'threads', got '" + kind +
                                "'");
  try {
    return make_uring_engine(options);
  } catch (const SystemError& e) {
    notes.push_back(std::string("io_uring unavailable, using the thread engine: ") + e.what());
    return make_thread_engine(options);
  }
}

}  // namespace smartinf::io
