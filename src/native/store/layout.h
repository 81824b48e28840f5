// How one chunk's states sit in an extent (and in a device slot): the master weights, then
// the rule's moments, then (split master) a checksum of the params it belongs to.
//   master:  fp32 (4 B/param), or "split" for bf16 params: the low 16 bits of each fp32
//            master (the high 16 are the bf16 param, which the caller holds and sends in;
//            kernels/split_master.h), 2 B/param, padded to 64 B
//   moments: the rule's fp32 arrays one after another; or int8 codes with per-block fp32
//            scales (kernels/quant8.h); or int4 codes, two per byte, with per-block scales for
//            a first moment and rank-1 (row and column) scales per tile for a second one
//            (kernels/quant4.h)
//   split:   8 B at the end (8-aligned): the checksum of the bf16 params the device emitted
//            with these states (store::params_checksum), checked when they come back
// The only owner of these byte layouts: the store, the devices, the host import/export, the
// kernels and the HLS tops read them here. With an fp32 master the bytes are those directories
// have always had.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace smartinf::store {

inline constexpr uint64_t kAlign = 4096;

inline uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
inline uint64_t align4(uint64_t n) { return (n + 3) / 4 * 4; }

enum class Master : uint8_t { fp32, split };

// The moments formats (a pipeline's state_dtype): fp32, then each quantized one as
// X(name, coding), its coding below with its name##_moment_bytes and name##_moments_at, its
// kernels in a header of its own (kernels/quant8.h, quant4.h; docs/extending.md lists what a new
// one takes). The one list of them: the enum, the names, the bytes, every device's dispatch
// (with_quantized) and the host's update units (CMakeLists.txt, which reads this one line) follow it.
#define SMARTINF_QUANTIZED_MOMENTS(X) X(int8, Int8Coding) X(int4, Int4Coding)

#define SMARTINF_MOMENTS_ENUM(name, coding) name,
enum class Moments : uint8_t { fp32, SMARTINF_QUANTIZED_MOMENTS(SMARTINF_MOMENTS_ENUM) };
#undef SMARTINF_MOMENTS_ENUM

#define SMARTINF_MOMENTS_NAME(name, coding) #name,
inline constexpr const char* kMomentsNames[] = {"fp32", SMARTINF_QUANTIZED_MOMENTS(SMARTINF_MOMENTS_NAME)};
#undef SMARTINF_MOMENTS_NAME
inline constexpr unsigned kMomentsCount = sizeof kMomentsNames / sizeof kMomentsNames[0];

// The format named `name` into *m; false where none is.
inline bool moments_named(const char* name, Moments* m) {
  for (unsigned i = 0; i < kMomentsCount; ++i)
    if (std::strcmp(name, kMomentsNames[i]) == 0) {
      *m = static_cast<Moments>(i);
      return true;
    }
  return false;
}

// int8 states: each moment's values are coded in blocks of kQuantBlock params, one fp32
// scale per block; blocks restart at every chunk.
inline constexpr std::size_t kQuantBlock = 256;
inline constexpr unsigned kMaxInt8Moments = 2;  // Adam: exp_avg and sqrt(exp_avg_sq)

inline std::size_t quant_blocks(std::size_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

// One chunk's quantized states (int8 or int4, `Coding` below): the fp32 master (null with a
// split master: the kernel is given it), then the moments' codes and scales. Moment k's
// codes are code[k], its scales scale[k]; those past the rule's M are null.
template <class Coding>
struct QuantStates {
  float* param;
  uint8_t* code[kMaxInt8Moments];
  float* scale[kMaxInt8Moments];
  // The params from `lo` on, a whole number of blocks (tiles) in: one thread's part.
  QuantStates from(std::size_t lo) const {
    QuantStates s = *this;
    if (s.param) s.param += lo;
    for (unsigned m = 0; m < kMaxInt8Moments; ++m) {
      if (s.code[m]) s.code[m] += Coding::code_byte(lo);
      if (s.scale[m]) s.scale[m] += Coding::first_scale(m, lo);
    }
    return s;
  }
};

// int8: M code arrays (one byte per param), padding to 4 B, then M arrays of block scales.
// For M = 2 (Adam) with an fp32 master this is the layout directories have always had.
struct Int8Coding {
  static std::size_t code_byte(std::size_t i) { return i; }
  static std::size_t first_scale(unsigned, std::size_t i) { return i / kQuantBlock; }
};
using Int8States = QuantStates<Int8Coding>;

// The int8 moments of n params: codes, padding, scales.
inline std::size_t int8_moment_bytes(std::size_t n, unsigned moments) {
  return align4(n * moments) + moments * quant_blocks(n) * 4;
}

// The int8 moments starting at `base`, with the master at `param`.
inline Int8States int8_moments_at(void* base, float* param, std::size_t n, unsigned moments) {
  char* p = static_cast<char*>(base);
  float* scales = reinterpret_cast<float*>(p + align4(n * moments));
  Int8States s{param, {}, {}};
  for (unsigned k = 0; k < moments && k < kMaxInt8Moments; ++k) {
    s.code[k] = reinterpret_cast<uint8_t*>(p + k * n);
    s.scale[k] = scales + k * quant_blocks(n);
  }
  return s;
}

// With an fp32 master in front (the HLS tops' and their tests' layout).
inline std::size_t int8_bytes(std::size_t n, unsigned moments) {
  return 4 * n + int8_moment_bytes(n, moments);
}

inline Int8States int8_states(void* base, std::size_t n, unsigned moments) {
  return int8_moments_at(static_cast<char*>(base) + 4 * n, static_cast<float*>(base), n, moments);
}

// int4 states: a first moment coded in blocks of kQuant4Block params (one fp32 scale each); a
// second moment in tiles of kQuant4Block x kQuant4Block params (the chunk's params row by
// row), each param's scale the smaller of its row's and its column's maximum (rank-1
// normalisation), 2 x kQuant4Block fp32 scales per tile. Blocks and tiles restart at every chunk.
inline constexpr std::size_t kQuant4Block = 128;
inline constexpr std::size_t kQuant4Tile = kQuant4Block * kQuant4Block;

inline std::size_t quant4_blocks(std::size_t n) { return (n + kQuant4Block - 1) / kQuant4Block; }
inline std::size_t quant4_tiles(std::size_t n) { return (n + kQuant4Tile - 1) / kQuant4Tile; }
inline std::size_t int4_code_bytes(std::size_t n) { return align4((n + 1) / 2); }

// One chunk's int4 states: the master (null with a split master), M code arrays (param i's
// code in byte i / 2, the low nibble for even i), then the first moment's block scales and
// (M = 2) the second moment's tile scales: per tile, kQuant4Block row maxima then
// kQuant4Block column maxima.
struct Int4Coding {
  static std::size_t code_byte(std::size_t i) { return i / 2; }
  static std::size_t first_scale(unsigned moment, std::size_t i) {
    return moment == 0 ? i / kQuant4Block : i / kQuant4Tile * 2 * kQuant4Block;
  }
};
using Int4States = QuantStates<Int4Coding>;

inline std::size_t int4_moment_bytes(std::size_t n, unsigned moments) {
  return moments * int4_code_bytes(n) + (moments > 0 ? quant4_blocks(n) * 4 : 0) +
         (moments > 1 ? quant4_tiles(n) * 2 * kQuant4Block * 4 : 0);
}

inline Int4States int4_moments_at(void* base, float* param, std::size_t n, unsigned moments) {
  char* p = static_cast<char*>(base);
  Int4States s{param, {}, {}};
  for (unsigned k = 0; k < moments && k < kMaxInt8Moments; ++k)
    s.code[k] = reinterpret_cast<uint8_t*>(p + k * int4_code_bytes(n));
  float* scales = reinterpret_cast<float*>(p + moments * int4_code_bytes(n));
  if (moments > 0) s.scale[0] = scales;
  if (moments > 1) s.scale[1] = scales + quant4_blocks(n);
  return s;
}

// Each quantized format's coding, bytes and states (QuantizedStates<M>), from the list.
template <Moments M> struct MomentsFormat;
#define SMARTINF_MOMENTS_FORMAT(name, coding)                                                  \
  template <> struct MomentsFormat<Moments::name> {                                            \
    using States = QuantStates<coding>;                                                        \
    static std::size_t bytes(std::size_t n, unsigned moments) { return name##_moment_bytes(n, moments); } \
    static States at(void* base, float* param, std::size_t n, unsigned moments) {             \
      return name##_moments_at(base, param, n, moments);                                       \
    }                                                                                          \
  };
SMARTINF_QUANTIZED_MOMENTS(SMARTINF_MOMENTS_FORMAT)
#undef SMARTINF_MOMENTS_FORMAT
template <Moments M> using QuantizedStates = typename MomentsFormat<M>::States;

// f(std::integral_constant<Moments, m>{}) where m is a quantized format (true); nothing for
// fp32 moments (false): every device's dispatch over the formats.
template <class F>
inline bool with_quantized(Moments m, F&& f) {
  switch (m) {
#define SMARTINF_MOMENTS_CASE(name, coding) \
  case Moments::name: f(std::integral_constant<Moments, Moments::name>{}); return true;
    SMARTINF_QUANTIZED_MOMENTS(SMARTINF_MOMENTS_CASE)
#undef SMARTINF_MOMENTS_CASE
    default: return false;
  }
}

// A split master: the low 16 bits of each fp32 master, and the checksum of the bf16 params
// (the high halves) the device emitted with them.
struct SplitMaster {
  uint16_t* low;
  uint64_t* params_sum;
};

struct StateLayout {
  unsigned arrays = 3;  // the rule's arrays per param: the master, then its states
  Moments moments = Moments::fp32;
  Master master = Master::fp32;

  unsigned moment_count() const { return arrays - 1; }
  bool split() const { return master == Master::split; }
  uint64_t master_bytes(uint64_t numel) const {
    return split() ? (2 * numel + 63) / 64 * 64 : 4 * numel;
  }
  uint64_t moment_bytes(uint64_t numel) const {
    uint64_t bytes = uint64_t(moment_count()) * numel * 4;  // fp32
    with_quantized(moments, [&](auto m) { bytes = MomentsFormat<m.value>::bytes(numel, moment_count()); });
    return bytes;
  }
  uint64_t params_sum_offset(uint64_t numel) const {  // split only
    return (master_bytes(numel) + moment_bytes(numel) + 7) / 8 * 8;
  }
  uint64_t bytes(uint64_t numel) const {
    return split() ? params_sum_offset(numel) + 8 : master_bytes(numel) + moment_bytes(numel);
  }
  const char* dtype() const { return kMomentsNames[static_cast<unsigned>(moments)]; }
  const char* master_format() const { return split() ? "split" : "fp32"; }
  // fp32 array `a` of a chunk of `numel` params held at `states`: 0 the fp32 master (not
  // with a split one), then the fp32 moments.
  uint64_t array_offset(uint64_t numel, unsigned a) const {
    return a == 0 ? 0 : master_bytes(numel) + uint64_t(a - 1) * numel * 4;
  }
  float* array(void* states, uint64_t numel, unsigned a) const {
    return reinterpret_cast<float*>(static_cast<char*>(states) + array_offset(numel, a));
  }
  float* fp32_master(void* states) const {
    return split() ? nullptr : static_cast<float*>(states);
  }
  // The states of quantized format M (this layout's).
  template <Moments M>
  QuantizedStates<M> quantized_at(void* states, uint64_t numel) const {
    return MomentsFormat<M>::at(static_cast<char*>(states) + master_bytes(numel), fp32_master(states),
                                numel, moment_count());
  }
  SplitMaster split_at(void* states, uint64_t numel) const {
    char* p = static_cast<char*>(states);
    return {reinterpret_cast<uint16_t*>(p),
            reinterpret_cast<uint64_t*>(p + params_sum_offset(numel))};
  }
};

// One chunk's extent: 4 KiB aligned, for O_DIRECT.
inline uint64_t extent_bytes(uint64_t numel, const StateLayout& layout) {
  return align_up(layout.bytes(numel));
}

// A sub-group's chunks in states.bin: full chunks first, each a pair of extents (copy A,
// then B), then the tail's pair; a directory of one copy (StoreConfig::copies) has one
// extent per chunk, which both copies name.
struct ChunkLayout {
  uint64_t chunk = 0;  // params per chunk
  StateLayout layout;
  uint32_t copies = 2;
  // Every extent a full chunk's (a directory with a log: a chunk's new version goes to any
  // free extent, so all must hold any chunk).
  bool uniform = false;
  uint64_t chunks(uint64_t numel) const { return (numel + chunk - 1) / chunk; }
  uint64_t numel_of(uint64_t numel, uint64_t c) const {
    return c * chunk + chunk <= numel ? chunk : numel - c * chunk;
  }
  // Offset of chunk c's extents from the sub-group's first byte; copy B follows copy A.
  uint64_t pair_offset(uint64_t c) const { return copies * c * extent_bytes(chunk, layout); }
  uint64_t bytes(uint64_t numel) const {  // the whole sub-group, every copy
    const uint64_t last = chunks(numel) - 1;
    return pair_offset(last) + copies * extent_bytes(uniform ? chunk : numel_of(numel, last), layout);
  }
  uint64_t copy_bytes(uint64_t numel) const { return ChunkLayout{chunk, layout, 1, uniform}.bytes(numel); }
};

}  // namespace smartinf::store
