// store/xxh3_lanes.h (XXH3's long path, lane by lane: what the GPU hashes params with)
// against libxxhash's XXH3_64bits, for every length from 241 bytes to 3 KiB and more.
#include <cstdio>
#include <random>
#include <vector>

#include <xxhash.h>

#include "store/xxh3_lanes.h"

int main() {
  std::mt19937_64 rng(1);
  std::vector<uint8_t> bytes(70000);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  int cases = 0, differ = 0;
  for (std::size_t len = 241; len < bytes.size(); len += len < 3072 ? 1 : 997)
    for (std::size_t offset : {0, 1}) {
      ++cases;
      if (smartinf::store::xxh3::hash_long(bytes.data() + offset, len) !=
          XXH3_64bits(bytes.data() + offset, len)) {
        ++differ;
        std::printf("len %zu offset %zu differs\n", len, offset);
      }
    }
  std::printf("%d cases, %d differ\n", cases, differ);
  return differ != 0;
}
