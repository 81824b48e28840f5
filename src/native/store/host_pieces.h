// Host tensors walked piece by piece on several threads: the step's gradients gathered into
// staging and checked for inf/NaN, the updated params copied into the model and hashed
// (smartinf.edits' digest), the params hashed where they lie. Each piece is copied, then
// checked or hashed while it is in the core's cache, so a check or a digest costs a copy
// little more. One call walks every part of a step's sub-group (a model's params are many
// tensors): threads take pieces as they come free, so one another process holds delays a
// piece, not a share; a Python loop over numpy pieces had held the GIL for most of a 23 M
// step's 22 ms gather on the 2-core VM.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace smartinf::store {

// `bytes` from `src` to `dst`; dst null: src is only read (checked or hashed where it lies).
struct HostPart {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

// The inf/NaN check of floats by their bits: an exponent of all ones. `width` 4 (fp32) or 2
// (fp16, bf16), 0: none; with the sign cleared (`magnitude`) the bits of a non-finite value
// are at least `exponent`'s. Exact in every format; no sum to overflow.
struct FiniteCheck {
  unsigned width = 0;
  uint32_t magnitude = 0, exponent = 0;
};

// Pieces of each part, `piece` bytes counted from its start: part p's piece i is
// sums[first[p] + i] where `sums` is given (first[p]: the pieces of the parts before).
std::vector<size_t> first_pieces(const std::vector<HostPart>& parts, size_t piece);

// Walks `parts` on `threads` threads: each piece copied (where dst is given), checked
// (`check`) and hashed into `sums` (where given: first_pieces(parts, piece).back() of them,
// the XXH3 of the piece as it now lies). Returns false where a piece held inf/NaN: the
// walk then stops, the rest uncopied.
bool walk_pieces(const std::vector<HostPart>& parts, size_t piece, unsigned threads,
                 const FiniteCheck& check, uint64_t* sums);

}  // namespace smartinf::store
