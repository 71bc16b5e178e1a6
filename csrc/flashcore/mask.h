// Which keys each query sees: one description shared by the host, the CPU kernels and both CUDA families.
//
// A mask is a band of diagonals. With d = j - i (key index minus query index), key j is visible from query i iff
//   0 <= j < seqlen_k   and   lo <= d <= hi.
// The band comes from the op's arguments (MaskParams) and the sequence lengths of the (batch entry's) sequence:
//   aligned diagonal  offset = seqlen_k - seqlen_q (bottom_right, flash-attn's rule) or 0 (SDPA's is_causal);
//   causal            hi = offset (a window's right side is then 0, as in flash-attn);
//   sliding window    lo = offset - window_left, hi = offset + window_right (-1: that side unbounded).
// Everything a kernel needs follows from the band: the key tiles a query tile visits (KeyRange), the query
// tiles a key tile is seen from (the backward), whether a tile needs the element mask, and the per-row bounds of
// that mask. Variable-length batches build one Band per sequence from the same MaskParams.
#pragma once

#include <cstdint>

#include "macros.h"

namespace flashcore {

// "No bound" on a side of the band: beyond any diagonal of sequences shorter than 2^31, and small enough that
// index arithmetic with it never overflows int64.
constexpr int64_t kUnboundedDiagonal = int64_t(1) << 40;

// Half-open range [begin, end) of tile indices (or of indices); empty when end <= begin.
struct IndexRange {
  int64_t begin = 0, end = 0;
  FLASHCORE_HOST_DEVICE int64_t size() const { return end > begin ? end - begin : 0; }
};

// A range of tile indices in 32 bits, for kernels to hold in registers across their loops: tiles of a walk that
// the element mask can skip. Bounds are clamped to [-1, 2^31 - 1].
struct TileRange {
  int begin = 0, end = 0;
  FLASHCORE_HOST_DEVICE bool contains(int tile) const { return tile >= begin && tile < end; }
};

// Floor and ceiling of a / b for b > 0 and any sign of a.
FLASHCORE_HOST_DEVICE int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
FLASHCORE_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }

struct Band {
  int64_t lo = -kUnboundedDiagonal;  // smallest visible j - i
  int64_t hi = kUnboundedDiagonal;   // largest visible j - i
  int64_t seqlen_k = 0;              // keys at or past it do not exist

  FLASHCORE_HOST_DEVICE static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
  FLASHCORE_HOST_DEVICE static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

  // Keys [begin, end) seen by some query of [r0, r1) (r0 < r1), clamped to [0, seqlen_k).
  FLASHCORE_HOST_DEVICE IndexRange keys_of_queries(int64_t r0, int64_t r1) const {
    IndexRange r;
    r.begin = max64(r0 + lo, 0);
    r.end = min64(r1 - 1 + hi + 1, seqlen_k);
    if (r.end < r.begin) r.end = r.begin;
    return r;
  }

  // Queries [begin, end) that see some key of [c0, c1) (keys past seqlen_k do not count), clamped to
  // [0, seqlen_q).
  FLASHCORE_HOST_DEVICE IndexRange queries_of_keys(int64_t c0, int64_t c1, int64_t seqlen_q) const {
    c1 = min64(c1, seqlen_k);
    IndexRange r;
    r.begin = max64(c0 - hi, 0);
    r.end = min64(c1 - 1 - lo + 1, seqlen_q);
    if (c1 <= c0 || r.end < r.begin) r.end = r.begin;
    return r;
  }

  // Query tiles of `block_m` rows that see some key of [c0, c1): the steps of a backward key block. One function for
  // every caller, since the deterministic backward's turn order relies on blocks agreeing on it.
  FLASHCORE_HOST_DEVICE IndexRange query_tiles_of_keys(int64_t c0, int64_t c1, int64_t seqlen_q, int block_m) const {
    return tiles(queries_of_keys(c0, c1, seqlen_q), block_m);
  }

  // Tiles of `block` indices that cover a range: [floor(begin / block), ceil(end / block)).
  FLASHCORE_HOST_DEVICE static IndexRange tiles(const IndexRange& r, int block) {
    IndexRange t;
    t.begin = r.begin / block;
    t.end = r.end > r.begin ? (r.end + block - 1) / block : t.begin;
    return t;
  }

  // Key tiles of `block_n` keys that every query of [r0, r0 + rows) sees whole: the tile ends within the sequence,
  // its last key is within the first query's right edge (c0 + block_n - 1 - r0 <= hi) and its first key within the
  // last query's left edge (c0 - (r0 + rows - 1) >= lo). Tiles outside need the element mask.
  FLASHCORE_HOST_DEVICE TileRange unmasked_key_tiles(int64_t r0, int rows, int block_n) const {
    const int64_t begin = ceil_div(lo + r0 + rows - 1, block_n);
    const int64_t end = min64(seqlen_k / block_n, floor_div(hi + r0 + 1, block_n));
    return clamp_tiles(begin, end);
  }

  // Query tiles of `block_m` queries that see every key of [c0, c0 + cols) (c0 + cols <= seqlen_k, else none).
  FLASHCORE_HOST_DEVICE TileRange unmasked_query_tiles(int64_t c0, int cols, int block_m) const {
    if (c0 + cols > seqlen_k) return TileRange{};
    const int64_t begin = ceil_div(c0 + cols - 1 - hi, block_m);
    const int64_t end = floor_div(c0 - lo + 1, block_m);
    return clamp_tiles(begin, end);
  }

  FLASHCORE_HOST_DEVICE static TileRange clamp_tiles(int64_t begin, int64_t end) {
    constexpr int64_t kMax = (int64_t(1) << 31) - 1;
    return TileRange{(int)max64(min64(begin, kMax), -1), (int)max64(min64(end, kMax), -1)};
  }

  // Whether anything but the sequence end is hidden (a kernel may then skip the per-tile tests).
  FLASHCORE_HOST_DEVICE bool banded() const { return lo > -kUnboundedDiagonal || hi < kUnboundedDiagonal; }
};

// The mask as the op's arguments give it; a Band per sequence follows from it (band()).
struct MaskParams {
  bool causal = false;
  bool bottom_right = false;  // the aligned diagonal: j - i = seqlen_k - seqlen_q, else j = i
  int64_t window_left = -1;   // keys left of the aligned diagonal a query sees; -1: all
  int64_t window_right = -1;  // keys right of it; -1: all (causal: 0)

  FLASHCORE_HOST_DEVICE Band band(int64_t seqlen_q, int64_t seqlen_k) const {
    const int64_t offset = bottom_right ? seqlen_k - seqlen_q : 0;
    Band b;
    b.lo = window_left >= 0 ? offset - window_left : -kUnboundedDiagonal;
    b.hi = causal ? offset : window_right >= 0 ? offset + window_right : kUnboundedDiagonal;
    b.seqlen_k = seqlen_k;
    return b;
  }
  // A mask that can hide keys before the sequence end.
  FLASHCORE_HOST_DEVICE bool banded() const { return causal || window_left >= 0 || window_right >= 0; }
};

}  // namespace flashcore
