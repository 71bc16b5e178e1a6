// The element mask (mask.h's Band) on a warp's score fragments in the m16n8 accumulator layout, which is also the
// wgmma accumulator layout: a thread holds rows g and g + 8 of each m16 tile (g = lane / 4) and columns 2t, 2t + 1
// of each n8 tile (t = lane % 4). Applied only to tiles that need it (Band::tile_needs_mask, uniform for the
// block); hidden scores become -inf.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../mask.h"

namespace flashcore::cuda {

// row0: query index of this thread's row g of m-tile 0; col0: key index of its column 2t of n-tile 0.
// Row i sees keys [i + lo, min(i + hi, seqlen_k - 1)]. The right edge (with the sequence end) is one bound a row,
// as a causal mask always had; the left edge (a sliding window) one value a thread: element (row0 + dr,
// col0 + dc) lies left of it iff (col0 - row0 - lo) + dc - dr < 0, a compare with an immediate. Bounds are
// clamped so that they fit 32 bits (the offsets dr, dc < 256 cannot cross the clamp). The Hopper consumers have
// no registers to spare: this form held the fewest across their loops.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask(float (&s)[kMTiles][kNTiles][4], int row0, int col0, const Band& band) {
  constexpr int64_t kClamp = int64_t(1) << 30;
  const int left = (int)Band::max64(Band::min64((int64_t)col0 - row0 - band.lo, kClamp), -kClamp);
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int dr = mi * 16 + half * 8;
      const int end = (int)Band::max64(Band::min64((int64_t)row0 + dr + band.hi + 1, band.seqlen_k), 0);
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int dc = ni * 8 + e;
          if (col0 + dc >= end || left < dr - dc) s[mi][ni][2 * half + e] = -INFINITY;
        }
      }
    }
  }
}

// The same mask on a transposed fragment (the backward's S^T: rows are keys, columns queries), as a thread holds
// it in one m64nN wgmma accumulator: value 4 ni + e is key key0 + 8 (e / 2) and query query0 + 8 ni + e % 2.
template <int kQTiles>
__device__ __forceinline__ void apply_mask_transposed(float (&s)[4 * kQTiles], int key0, int query0,
                                                      const Band& band) {
  constexpr int64_t kClamp = int64_t(1) << 30;
  auto clamp32 = [](int64_t x) { return (int)Band::max64(Band::min64(x, kClamp), -kClamp); };
  const int64_t diag = (int64_t)key0 - query0;
  const int left = clamp32(diag - band.lo);           // hidden iff left + dd < 0, dd = 8 (e / 2) - 8 ni - e % 2
  const int right = clamp32(diag - band.hi);          // hidden iff right + dd > 0
  const int keys_left = clamp32(band.seqlen_k - key0);  // hidden iff 8 (e / 2) >= keys_left
#pragma unroll
  for (int ni = 0; ni < kQTiles; ++ni) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int dk = 8 * (e >> 1), dd = dk - 8 * ni - (e & 1);
      if (left < -dd || right > -dd || dk >= keys_left) s[4 * ni + e] = -INFINITY;
    }
  }
}

}  // namespace flashcore::cuda
