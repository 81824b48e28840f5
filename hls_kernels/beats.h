// 512-bit AXI beats and on-chip tiles: how the HLS kernels move arrays between the
// SmartSSD's FPGA DRAM and the element-wise math of src/native/kernels/.
//
// Every array argument is a run of 64-byte beats (16 floats, 32 fp16/bf16, 16 int32).
// Arrays are read and written a tile (TILE elements) at a time in bursts; the last beat
// of an array whose length is not a multiple of the beat is read-modified-written so the
// bytes after the array's end are left as they were. Buffers are allocated in whole beats
// (XRT buffer objects are 4 KiB-granular). Plain C++: `#pragma HLS` lines are ignored by
// g++, so the C-simulation test compiles these same functions.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace smartinf::hls {

constexpr int BEAT_BYTES = 64;
constexpr int TILE = 1024;  // elements per on-chip tile: a multiple of every per_beat

struct Beat {
  uint32_t word[BEAT_BYTES / 4];
};

template <class T>
constexpr int per_beat() { return BEAT_BYTES / static_cast<int>(sizeof(T)); }

// Elements [start, start + count) of a T array into tile[0, count); start is a multiple
// of per_beat<T>().
template <class T>
inline void load(const Beat* src, std::size_t start, int count, T* tile) {
  constexpr int k = per_beat<T>();
  const Beat* from = src + start / k;
  const int beats = (count + k - 1) / k;
load_beats:
  for (int b = 0; b < beats; ++b) {
#pragma HLS PIPELINE II = 1
    const Beat beat = from[b];
    for (int l = 0; l < k; ++l) {
#pragma HLS UNROLL
      if (b * k + l < count)
        std::memcpy(&tile[b * k + l], reinterpret_cast<const char*>(&beat) + l * sizeof(T), sizeof(T));
    }
  }
}

// tile[0, count) into elements [start, start + count) of a T array; lanes of the last beat
// past `count` keep their stored bytes.
template <class T>
inline void store(Beat* dst, std::size_t start, int count, const T* tile) {
  constexpr int k = per_beat<T>();
  Beat* to = dst + start / k;
  const int beats = (count + k - 1) / k;
store_beats:
  for (int b = 0; b < beats; ++b) {
#pragma HLS PIPELINE II = 1
    Beat beat;
    if ((b + 1) * k > count) beat = to[b];  // partial last beat: keep what follows
    for (int l = 0; l < k; ++l) {
#pragma HLS UNROLL
      if (b * k + l < count)
        std::memcpy(reinterpret_cast<char*>(&beat) + l * sizeof(T), &tile[b * k + l], sizeof(T));
    }
    to[b] = beat;
  }
}

// load (kStore false) or store (true): a tile's arrays moved in and out by one description.
template <bool kStore, class T>
inline void transfer(Beat* beats, std::size_t start, int count, T* tile) {
  if constexpr (kStore)
    store(beats, start, count, tile);
  else
    load(beats, start, count, tile);
}

// Element i of a T array (for the sparse top-k pairs, read in order).
template <class T>
inline T element(const Beat* src, std::size_t i) {
  constexpr int k = per_beat<T>();
  T x;
  std::memcpy(&x, reinterpret_cast<const char*>(&src[i / k]) + (i % k) * sizeof(T), sizeof(T));
  return x;
}

}  // namespace smartinf::hls
