// XXH3_64bits (xxHash 0.8: the default secret, no seed) of an input longer than 240 bytes,
// written lane by lane so that eight GPU threads hash one input together (each keeps one of
// its eight accumulators) and give the value the host's libxxhash gives: a split master's
// params checksum (store/checksum.h) of params that stay in a GPU's memory. XXH3's long
// path, from xxhash.h's scalar code: stripes of 64 bytes, each lane taking 8 of them into
// its accumulator (and its neighbour's bytes unmixed), blocks of 16 stripes followed by a
// scramble, the last stripe re-read from the end, the eight accumulators merged.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/numeric.h"  // SMARTINF_HD

namespace smartinf::store::xxh3 {

inline constexpr std::size_t kLongAbove = 240;  // shorter inputs take XXH3's other paths
inline constexpr std::size_t kLanes = 8, kStripe = 64, kStripesPerBlock = 16;
inline constexpr std::size_t kBlock = kStripe * kStripesPerBlock;
inline constexpr uint64_t kPrime32_1 = 0x9E3779B1u, kPrime64_1 = 0x9E3779B185EBCA87ull;

// The default secret's 8 bytes at `at` (little-endian), at < 185.
SMARTINF_HD inline uint64_t secret64(std::size_t at) {
  constexpr uint8_t kSecret[192] = {
      0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
      0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
      0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
      0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
      0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
      0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
      0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
      0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
      0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
      0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
      0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
      0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
  };
  uint64_t v = 0;
  for (unsigned b = 0; b < 8; ++b) v |= uint64_t(kSecret[at + b]) << (8 * b);
  return v;
}

// 8 little-endian bytes of the input at p, which is 2-byte aligned (bf16 params).
SMARTINF_HD inline uint64_t read64(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return uint64_t(h[0]) | uint64_t(h[1]) << 16 | uint64_t(h[2]) << 32 | uint64_t(h[3]) << 48;
#else
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
#endif
}

// Every stripe loop unrolled: the secret's words stay in registers (a GPU keeps an array
// indexed at run time in local memory) and a block's loads are issued together.
#if defined(__CUDA_ARCH__)
#define SMARTINF_UNROLL_STRIPES _Pragma("unroll")
#else
#define SMARTINF_UNROLL_STRIPES _Pragma("GCC unroll 16")
#endif

// Lane `lane`'s accumulator before the input.
SMARTINF_HD inline uint64_t initial_accumulator(unsigned lane) {
  constexpr uint64_t kInit[kLanes] = {0xC2B2AE3Du,           kPrime64_1,
                                      0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
                                      0x85EBCA77C2B2AE63ull, 0x85EBCA77u,
                                      0x27D4EB2F165667C5ull, kPrime32_1};
  return kInit[lane];
}

// The secret's word lane `lane`'s accumulator is scrambled with at the end of each whole block.
SMARTINF_HD inline uint64_t scramble_key(unsigned lane) { return secret64(192 - kStripe + 8 * lane); }

SMARTINF_HD inline uint64_t scramble(uint64_t acc, uint64_t key) {
  acc ^= acc >> 47;
  acc ^= key;
  return acc * kPrime32_1;
}

// The secret's word the last stripe (the input's last 64 bytes, re-read) mixes lane `lane` with.
SMARTINF_HD inline uint64_t last_key(unsigned lane) { return secret64(192 - kStripe - 7 + 8 * lane); }

// Lane `lane`'s accumulator after the whole input (len > kLongAbove). Within a block a lane's
// accumulator only adds each stripe's term (the GPU sums them by groups of threads).
SMARTINF_HD inline uint64_t lane_accumulator(const uint8_t* input, std::size_t len, unsigned lane) {
  uint64_t key[kStripesPerBlock];  // stripe s of a block: the secret's word at 8 s + 8 lane
  SMARTINF_UNROLL_STRIPES
  for (std::size_t s = 0; s < kStripesPerBlock; ++s) key[s] = secret64(s * 8 + 8 * lane);
  const uint64_t scrambling = scramble_key(lane);
  uint64_t acc = initial_accumulator(lane);
  const unsigned other = lane ^ 1u;  // the lane whose bytes this one adds unmixed
  auto stripe = [&](const uint8_t* p, uint64_t k) {
    k ^= read64(p + 8 * lane);
    acc += read64(p + 8 * other) + (k & 0xFFFFFFFFu) * (k >> 32);
  };
  const std::size_t blocks = (len - 1) / kBlock;
  for (std::size_t b = 0; b < blocks; ++b) {
    SMARTINF_UNROLL_STRIPES
    for (std::size_t s = 0; s < kStripesPerBlock; ++s) stripe(input + b * kBlock + s * kStripe, key[s]);
    acc = scramble(acc, scrambling);
  }
  const std::size_t stripes = ((len - 1) - blocks * kBlock) / kStripe;  // < kStripesPerBlock
  SMARTINF_UNROLL_STRIPES
  for (std::size_t s = 0; s < kStripesPerBlock; ++s)
    if (s < stripes) stripe(input + blocks * kBlock + s * kStripe, key[s]);
  stripe(input + len - kStripe, last_key(lane));
  return acc;
}

SMARTINF_HD inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}

// The hash of the input of `len` bytes from its lanes' accumulators.
SMARTINF_HD inline uint64_t merge(const uint64_t (&acc)[kLanes], std::size_t len) {
  uint64_t h = uint64_t(len) * kPrime64_1;
  for (unsigned i = 0; i < 4; ++i)
    h += mul128_fold64(acc[2 * i] ^ secret64(11 + 16 * i), acc[2 * i + 1] ^ secret64(11 + 16 * i + 8));
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  return h ^ (h >> 32);
}

// The whole hash in one thread (what the GPU's lanes compute together; the tests' check).
SMARTINF_HD inline uint64_t hash_long(const void* input, std::size_t len) {
  uint64_t acc[kLanes];
  for (unsigned i = 0; i < kLanes; ++i) acc[i] = lane_accumulator(static_cast<const uint8_t*>(input), len, i);
  return merge(acc, len);
}

}  // namespace smartinf::store::xxh3
