// store/xxh3_lanes.h (XXH3's long path, lane by lane: what the GPU hashes params with)
// against libxxhash's XXH3_64bits, for every length from 241 bytes to 3 KiB and more; and
// the same by device/cuda_checksum.cu's split of a block's stripes among a warp's four
// groups of eight threads (stripe k * 4 + group; each group's terms summed, then the groups'),
// here in plain loops.
#include <cstdio>
#include <random>
#include <vector>

#include <xxhash.h>

#include "store/xxh3_lanes.h"

namespace xxh3 = smartinf::store::xxh3;

uint64_t by_groups(const uint8_t* input, std::size_t len) {
  constexpr unsigned kGroups = 4, kPerGroup = xxh3::kStripesPerBlock / kGroups;
  uint64_t acc[xxh3::kLanes];
  for (unsigned lane = 0; lane < xxh3::kLanes; ++lane) acc[lane] = xxh3::initial_accumulator(lane);
  auto terms = [&](const uint8_t* block, std::size_t stripes, unsigned lane) {
    uint64_t sum = 0;
    for (unsigned group = 0; group < kGroups; ++group) {
      uint64_t group_sum = 0;
      for (unsigned k = 0; k < kPerGroup; ++k) {
        const std::size_t s = k * kGroups + group;
        if (s >= stripes) continue;
        const uint64_t own = xxh3::read64(block + s * xxh3::kStripe + 8 * lane);
        const uint64_t other = xxh3::read64(block + s * xxh3::kStripe + 8 * (lane ^ 1));
        const uint64_t mixed = own ^ xxh3::secret64(s * 8 + 8 * lane);
        group_sum += other + (mixed & 0xFFFFFFFFu) * (mixed >> 32);
      }
      sum += group_sum;
    }
    return sum;
  };
  const std::size_t blocks = (len - 1) / xxh3::kBlock;
  for (unsigned lane = 0; lane < xxh3::kLanes; ++lane) {
    for (std::size_t b = 0; b < blocks; ++b)
      acc[lane] = xxh3::scramble(acc[lane] + terms(input + b * xxh3::kBlock, xxh3::kStripesPerBlock, lane),
                                 xxh3::scramble_key(lane));
    const std::size_t stripes = ((len - 1) - blocks * xxh3::kBlock) / xxh3::kStripe;
    acc[lane] += terms(input + blocks * xxh3::kBlock, stripes, lane);
    const uint8_t* last = input + len - xxh3::kStripe;
    const uint64_t mixed = xxh3::read64(last + 8 * lane) ^ xxh3::last_key(lane);
    acc[lane] += xxh3::read64(last + 8 * (lane ^ 1)) + (mixed & 0xFFFFFFFFu) * (mixed >> 32);
  }
  return xxh3::merge(acc, len);
}

int main() {
  std::mt19937_64 rng(1);
  std::vector<uint8_t> bytes(70000);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  int cases = 0, differ = 0;
  for (std::size_t len = 241; len < bytes.size(); len += len < 3072 ? 1 : 997)
    for (std::size_t offset : {0, 1}) {
      ++cases;
      const uint64_t expected = XXH3_64bits(bytes.data() + offset, len);
      if (xxh3::hash_long(bytes.data() + offset, len) != expected ||
          by_groups(bytes.data() + offset, len) != expected) {
        ++differ;
        std::printf("len %zu offset %zu differs\n", len, offset);
      }
    }
  std::printf("%d cases, %d differ\n", cases, differ);
  return differ != 0;
}
