// How one chunk's states sit in an extent (and in a device slot): `arrays` fp32 arrays
// of the chunk's params one after another (param first, then the optimizer's), or, with
// int8 states, the fp32 params and the rule's moments as 8-bit codes with per-block fp32
// scales (how a moment is coded: kernels/quant8.h). The only owner of these byte layouts:
// the store, the devices, the host import/export, the kernels and the HLS tops read them here.
#pragma once
#include <cstddef>
#include <cstdint>

namespace smartinf::store {

inline constexpr uint64_t kAlign = 4096;

inline uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// int8 states: each moment's values are coded in blocks of kQuantBlock params, one fp32
// scale per block; blocks restart at every chunk.
inline constexpr std::size_t kQuantBlock = 256;
inline constexpr unsigned kMaxInt8Moments = 2;  // Adam: exp_avg and sqrt(exp_avg_sq)

inline std::size_t quant_blocks(std::size_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

// One chunk's int8 states: the fp32 master, then M code arrays (one byte per param), padding
// to 4 B, then M arrays of block scales. Moment k's codes are code[k], its scales scale[k];
// those past M are null. For M = 2 (Adam) this is the layout directories have always had.
struct Int8States {
  float* param;
  uint8_t* code[kMaxInt8Moments];
  float* scale[kMaxInt8Moments];
  // The params from `lo` on, a whole number of blocks in: one thread's part of the chunk.
  Int8States from(std::size_t lo) const {
    Int8States s = *this;
    s.param += lo;
    for (unsigned m = 0; m < kMaxInt8Moments; ++m) {
      if (s.code[m]) s.code[m] += lo;
      if (s.scale[m]) s.scale[m] += lo / kQuantBlock;
    }
    return s;
  }
};

inline std::size_t int8_codes_end(std::size_t n, unsigned moments) {
  return (n * (4 + moments) + 3) / 4 * 4;
}

inline std::size_t int8_bytes(std::size_t n, unsigned moments) {
  return int8_codes_end(n, moments) + moments * quant_blocks(n) * 4;
}

inline Int8States int8_states(void* base, std::size_t n, unsigned moments) {
  char* p = static_cast<char*>(base);
  float* scales = reinterpret_cast<float*>(p + int8_codes_end(n, moments));
  Int8States s{reinterpret_cast<float*>(p), {}, {}};
  for (unsigned k = 0; k < moments && k < kMaxInt8Moments; ++k) {
    s.code[k] = reinterpret_cast<uint8_t*>(p + (4 + k) * n);
    s.scale[k] = scales + k * quant_blocks(n);
  }
  return s;
}

struct StateLayout {
  unsigned arrays = 3;  // the rule's fp32 arrays per param: the master, then its states
  bool int8 = false;    // the states as 8-bit moments (the rule's row says whether it may)
  // int8: every state array of the rule is one coded moment.
  unsigned int8_moments() const { return arrays - 1; }
  uint64_t bytes(uint64_t numel) const {
    return int8 ? int8_bytes(numel, int8_moments()) : numel * arrays * 4;
  }
  const char* dtype() const { return int8 ? "int8" : "fp32"; }
  // Byte offset of fp32 array `a` (0: the param) of a chunk of `numel` params (fp32 only).
  uint64_t array_offset(uint64_t numel, unsigned a) const { return uint64_t(a) * numel * 4; }
  // fp32 array `a` of a chunk's states held at `states` (fp32 layout only).
  float* array(void* states, uint64_t numel, unsigned a) const {
    return reinterpret_cast<float*>(static_cast<char*>(states) + array_offset(numel, a));
  }
  // A chunk's int8 states held at `states` (int8 layout only).
  Int8States int8_at(void* states, uint64_t numel) const {
    return int8_states(states, numel, int8_moments());
  }
};

// One chunk's extent: 4 KiB aligned, for O_DIRECT.
inline uint64_t extent_bytes(uint64_t numel, const StateLayout& layout) {
  return align_up(layout.bytes(numel));
}

// A sub-group's chunks in states.bin: full chunks first, each a pair of extents (copy A,
// then B), then the tail's pair.
struct ChunkLayout {
  uint64_t chunk = 0;  // params per chunk
  StateLayout layout;
  uint64_t chunks(uint64_t numel) const { return (numel + chunk - 1) / chunk; }
  uint64_t numel_of(uint64_t numel, uint64_t c) const {
    return c * chunk + chunk <= numel ? chunk : numel - c * chunk;
  }
  // Offset of chunk c's pair from the sub-group's first byte; copy B follows copy A.
  uint64_t pair_offset(uint64_t c) const { return 2 * c * extent_bytes(chunk, layout); }
  uint64_t bytes(uint64_t numel) const {  // the whole sub-group, both copies
    const uint64_t last = chunks(numel) - 1;
    return pair_offset(last) + 2 * extent_bytes(numel_of(numel, last), layout);
  }
};

}  // namespace smartinf::store
