// Backward pre-pass shared by the fused backward kernels, one pass over the query rows:
//   dsum[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] in fp32 (the row term of dS = P * (dP - dsum)), and
//   the fp32 dQ accumulator zeroed (the kernels add into it), padded rows included.
// A group of 4-32 lanes per row (one 16-byte chunk of O and dO a lane), two rows a thread so that more loads are
// in flight; the block walks rows of one (batch, head) pair, so no per-row division.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../params.h"

namespace flashcore::cuda {

// The fused kernel's tiles, where it counts them down (BwdParams::dq_tiles_pending): query rows a tile (a divisor
// of dq_rows) and keys a key block.
struct DqTileShape {
  int rows = 0, keys = 0;
};

// p.dout, p.out and their strides, p.batch, p.heads_q, p.seqlen_q and p.head_dim are read; dsum is contiguous
// (batch, heads_q, seqlen_q); dq_accum is (batch * heads_q, dq_rows, dq_cols) with dq_rows >= seqlen_q and
// dq_cols a multiple of 4. Both 16-bit dtypes; `bf16` picks the element type. Where p.dq_tiles_pending is set, each
// of its (batch, head, tile) counters gets the number of key blocks whose keys some query of the tile sees
// (p.band): exactly the blocks whose steps include the tile (Band::query_tiles_of_keys, the same band).
void launch_bwd_prepass(const BwdParams& p, bool bf16, float* dsum, float* dq_accum, int64_t dq_rows, int dq_cols,
                        DqTileShape tiles, cudaStream_t stream);

}  // namespace flashcore::cuda
