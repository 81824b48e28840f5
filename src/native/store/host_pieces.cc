// store/host_pieces.h's walk, compiled with the update kernels' -O3: the check's max over
// a piece vectorises there (at -O2 it ran at half a copy's speed).
#include "store/host_pieces.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "store/checksum.h"

namespace smartinf::store {

namespace {

// Without the sign the bits are non-negative as signed integers, so (exponent - 1 - bits)
// turns negative exactly where bits >= exponent: its sign, ORed over the piece, vectorises
// on SSE2 alone (which has no 32-bit max), at a copy's speed.
template <typename Bits, typename Signed>
bool finite_bits(const void* data, size_t bytes, Bits magnitude, Bits exponent) {
  const Bits* b = static_cast<const Bits*>(data);
  const Signed below = Signed(exponent - 1);
  Signed any = 0;
  for (size_t i = 0, n = bytes / sizeof(Bits); i < n; ++i)
    any |= Signed(below - Signed(b[i] & magnitude));
  return any >= 0;
}

bool finite_piece(const void* data, size_t bytes, const FiniteCheck& check) {
  if (check.width == 4) return finite_bits<uint32_t, int32_t>(data, bytes, check.magnitude, check.exponent);
  if (check.width == 2)
    return finite_bits<uint16_t, int16_t>(data, bytes, uint16_t(check.magnitude),
                                          uint16_t(check.exponent));
  return true;
}

}  // namespace

std::vector<size_t> first_pieces(const std::vector<HostPart>& parts, size_t piece) {
  std::vector<size_t> first(1, 0);
  for (const HostPart& p : parts) first.push_back(first.back() + (p.bytes + piece - 1) / piece);
  return first;
}

bool walk_pieces(const std::vector<HostPart>& parts, size_t piece, unsigned threads,
                 const FiniteCheck& check, uint64_t* sums) {
  const std::vector<size_t> first = first_pieces(parts, piece);
  const size_t pieces = first.back();
  std::atomic<size_t> next{0};
  std::atomic<bool> bad{false};
  const auto run = [&] {
    size_t p = 0;  // (a thread's pieces come in order: its part only moves forward)
    for (size_t k; !bad.load(std::memory_order_relaxed) && (k = next.fetch_add(1)) < pieces;) {
      while (first[p + 1] <= k) ++p;
      const HostPart& part = parts[p];
      const size_t at = (k - first[p]) * piece, n = std::min(piece, part.bytes - at);
      const char* here = static_cast<const char*>(part.src) + at;
      if (part.dst) {
        std::memcpy(static_cast<char*>(part.dst) + at, here, n);
        here = static_cast<const char*>(part.dst) + at;  // (in cache now)
      }
      if (!finite_piece(here, n, check)) bad = true;
      if (sums) sums[k] = extent_checksum(here, n);
    }
  };
  threads = static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(threads, pieces)));
  std::vector<std::thread> workers;
  for (unsigned t = 1; t < threads; ++t) workers.emplace_back(run);
  run();
  for (std::thread& w : workers) w.join();
  return !bad;
}

}  // namespace smartinf::store
