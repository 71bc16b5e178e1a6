// Masking of one warp's score fragments: keys past the end of the sequence, and keys a causal mask hides
// (key j is visible from query i iff j <= i + causal_offset). Applied only to tiles that need it; the kernel
// decides that per tile, uniformly for the block.
#pragma once

#include <cmath>

namespace flashcore::sm80 {

// row0: query index of this thread's row g of m-tile 0; col0: key index of this thread's column 2t of n-tile 0.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask(float (&s)[kMTiles][kNTiles][4], int row0, int col0, int seqlen_k,
                                           bool causal, int64_t causal_offset) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + mi * 16 + half * 8;
      // Last visible key of this row (exclusive bound), clipped to the sequence.
      int64_t limit = causal ? row + causal_offset + 1 : seqlen_k;
      if (limit > seqlen_k) limit = seqlen_k;
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = col0 + ni * 8 + e;
          if (col >= limit) s[mi][ni][2 * half + e] = -INFINITY;
        }
      }
    }
  }
}

}  // namespace flashcore::sm80
