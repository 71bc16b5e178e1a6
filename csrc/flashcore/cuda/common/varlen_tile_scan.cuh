// A varlen forward grid without the blocks that lie past a sequence's end (VarlenParams::scan_grid).
//
// The dense-shaped grid launches ceil(max_seqlen_q / rows) query tiles for every (sequence, head group), so a batch
// of unequal lengths leaves most of them empty (16 sequences of 128 ... 8192 tokens at 128 rows: 9 424 of 16 384
// blocks), and each empty block is still launched, set up and retired on an SM that it fills alone. The packed grid
// launches a bound the host knows without a sync, groups x min(batch x ceil(max_seqlen_q / rows),
// ceil(total_q / rows) + batch) blocks, and every warp of a block finds the block's tile by the same scan of
// cu_seqlens_q: one round of loads (lane l reads sequences l, l + 32, ...) and shuffles, no pre-pass kernel and no
// search through global memory (the backward's tile_end, a pre-pass and a binary search, measured slower for the
// forward's short blocks).
//
// The result is a tile index of the dense-shaped grid, so fwd_block maps it as before: (sequence, head group) in
// the batch's order, then the sequence's query blocks heaviest first, each sequence cut into min(ceil(seqlen_q /
// rows), num_m_blocks) of them (SeqInfo's clamped lengths: lying offsets never make more tiles than the dense grid).
#pragma once

#include <cstdint>

#include "../../params.h"

namespace flashcore::cuda {

// Sequences a block's warp scans; larger batches keep the dense-shaped grid (the host decides, launch_fwd_varlen).
constexpr int kVarlenScanMaxBatch = 256;

// Block `block`'s tile of the dense-shaped grid (fwd_block's `tile`), or -1 past the batch's last tile. Warp-
// collective: all 32 lanes call it with the same arguments, after the wait for prior grids (the offsets may come
// from the previous kernel). groups: head groups of a sequence (heads_q / p.pack.heads); rows: queries of one head a
// block (p.pack.rows). Every shuffle runs on every lane whatever the data (the chunk loop's bound is the batch, a
// kernel parameter), so the warp stays converged: a data-dependent exit around the shuffles made ptxas compile the
// whole kernel's warp-synchronous code twice, converged and not.
__device__ __forceinline__ int scan_varlen_tile(const FwdParams& p, int groups, int rows, int num_m_blocks,
                                                int block) {
  constexpr int kChunks = kVarlenScanMaxBatch / 32;
  const int lane = threadIdx.x & 31;
  const int batch = (int)p.batch;
  // Query blocks of sequence chunk * 32 + lane (0 past the batch): every load issued before the first use.
  int blocks_of[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int b = c * 32 + lane;
    blocks_of[c] = 0;
    if (b < batch) {
      // 32-bit: a length is at most total_q, which the host keeps below 2^31
      const unsigned len = (unsigned)varlen_seqlen_q(p.varlen, b, p.seqlen_q);
      const int blocks = (int)((len + (unsigned)rows - 1u) / (unsigned)rows);
      blocks_of[c] = blocks < num_m_blocks ? blocks : num_m_blocks;
    }
  }
  // The sequence whose tiles hold `block`: its index, tile count and first tile (seq < 0: none yet).
  int seq = -1, n = 1, first = 0;
  int before = 0;  // tiles of the chunks scanned so far
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (c * 32 >= batch) break;
    const int tiles = blocks_of[c] * groups;
    int end = tiles;  // inclusive prefix sum over the chunk's lanes
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int up = __shfl_up_sync(0xffffffffu, end, d);
      if (lane >= d) end += up;
    }
    // The first lane whose tiles end past `block` holds its sequence (none: lane 0's values, unused).
    const unsigned past = __ballot_sync(0xffffffffu, block < before + end);
    const int owner = past != 0 ? __ffs(past) - 1 : 0;
    const int owner_blocks = __shfl_sync(0xffffffffu, blocks_of[c], owner);
    const int owner_first = before + __shfl_sync(0xffffffffu, end - tiles, owner);
    if (seq < 0 && past != 0) seq = c * 32 + owner, n = owner_blocks, first = owner_first;
    before += __shfl_sync(0xffffffffu, end, 31);
  }
  if (seq < 0) return -1;
  const int rel = block - first;  // < groups * n, so n > 0
  return (seq * groups + rel / n) * num_m_blocks + (num_m_blocks - n + rel % n);  // query block n - 1 - rel % n
}

}  // namespace flashcore::cuda
