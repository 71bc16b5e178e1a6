// Pieces of a forward thread block shared by the kernel families (sm80/, sm90/): which (batch, head, query
// block) a block computes and which key blocks it must visit, and the epilogue that writes O and LSE.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../mask.h"
#include "../../params.h"
#include "pack.cuh"
#include "tile_io.cuh"

namespace flashcore::cuda {

template <typename Element>
struct FwdBlock {
  int64_t bh;     // b * heads_q + h: also the row of lse (dense; pack-GQA: b * (heads_q / heads) + h / heads)
  int b, h, h_kv;  // batch, query head, key/value head
  int m0;         // first query row of the block
  // Key blocks [n_first, n_blocks) may be visible from some row of the block (the mask's band), visited last
  // first. In a key split (sm90 one-warpgroup blocks) it is the slice of block split_rank of num_splits sharing
  // the query tile, whose partial results merge.
  int n_first = 0;
  int n_blocks;
  int split_rank = 0, num_splits = 1;
  // The sequence of this batch entry (seqlen.h): its lengths, its band and lse's index of its row 0. Dense calls
  // set them from the params; the pointers below already point at the sequence's first rows.
  int seqlen_q, seqlen_k;
  int64_t lse_row0;
  Band band;
  int q_begin = 0, k_begin = 0;  // varlen: the sequence's first rows in the packed tensors (TMA coordinates)
  const Element* q;
  const Element* k;
  const Element* v;
  Element* out;
};

// Tiles (query blocks) of one (batch, head) are adjacent in the tile order, so blocks running at the same time
// share K/V in L2; within a head the last query blocks (the longest under a causal mask) come first. `tile` is
// the block index for one-tile-per-block grids, the scheduler's tile for persistent ones. The host keeps tiles
// below 2^31, so FastDiv's 32-bit quotients are exact. The query block stays a plain int division of the tile:
// computed that way it lives in uniform registers, and the mask tests of the key loop with it (a FastDiv there
// moved them to the vector pipe and changed the schedule of every key loop).
// kVarlen: a variable-length batch; the block's query rows may lie past its sequence's end (the caller exits). The
// varlen caller waits for prior grids first: the offsets may come from the previous kernel.
// kPackGqa (with kVarlen): p.pack.heads query heads from h share the block (params.h: PackGqa); m0 and the key
// range are then those of p.pack.rows queries, and bh is b * (heads_q / p.pack.heads) + h / p.pack.heads.
template <typename Element, int kBlockM, int kBlockN, bool kVarlen = false, bool kPackGqa = false>
__device__ __forceinline__ FwdBlock<Element> fwd_block(const FwdParams& p, int num_m_blocks, int tile) {
  static_assert(!kPackGqa || kVarlen, "pack-GQA is built for the varlen kernels");
  FwdBlock<Element> blk;
  const uint32_t bh = (uint32_t)(tile / num_m_blocks);
  const int m_block = num_m_blocks - 1 - tile % num_m_blocks;
  uint32_t h;
  blk.bh = bh;
  int rows = kBlockM;  // queries of one head in the block
  if constexpr (kPackGqa) {
    blk.b = (int)p.pack.groups_div.divmod(bh, h);
    h *= (uint32_t)p.pack.heads;
    rows = p.pack.rows;
  } else {
    blk.b = (int)p.heads_q_div.divmod(bh, h);
  }
  blk.h = (int)h;
  blk.h_kv = (int)p.group_div.div(h);
  blk.m0 = m_block * rows;
  blk.q = static_cast<const Element*>(p.q) + blk.b * p.q_stride.batch + blk.h * p.q_stride.head;
  blk.k = static_cast<const Element*>(p.k) + blk.b * p.k_stride.batch + blk.h_kv * p.k_stride.head;
  blk.v = static_cast<const Element*>(p.v) + blk.b * p.v_stride.batch + blk.h_kv * p.v_stride.head;
  blk.out = static_cast<Element*>(p.out) + blk.b * p.out_stride.batch + blk.h * p.out_stride.head;
  if constexpr (kVarlen) {
    const SeqInfo seq = p.seq(blk.b);
    blk.seqlen_q = (int)seq.seqlen_q;
    blk.seqlen_k = (int)seq.seqlen_k;
    blk.lse_row0 = p.row_index(seq, blk.b, blk.h);
    blk.band = p.band_of(seq);
    blk.q_begin = (int)seq.q_begin;  // < 2^31: the host checks the packed lengths
    blk.k_begin = (int)seq.k_begin;
    blk.q += seq.q_begin * p.q_stride.seq;
    blk.out += seq.q_begin * p.out_stride.seq;
    blk.k += seq.k_begin * p.k_stride.seq;
    blk.v += seq.k_begin * p.v_stride.seq;
  } else {
    blk.seqlen_q = (int)p.seqlen_q;
    blk.seqlen_k = (int)p.seqlen_k;
    blk.lse_row0 = (int64_t)blk.bh * p.seqlen_q;
  }
  const Band& band = kVarlen ? blk.band : p.band;
  const IndexRange tiles = Band::tiles(band.keys_of_queries(blk.m0, (int64_t)blk.m0 + rows), kBlockN);
  blk.n_first = (int)tiles.begin;
  blk.n_blocks = (int)tiles.end;
  return blk;
}

template <typename Element, int kBlockM, int kBlockN, bool kVarlen = false>
__device__ __forceinline__ FwdBlock<Element> fwd_block(const FwdParams& p, int num_m_blocks) {
  return fwd_block<Element, kBlockM, kBlockN, kVarlen>(p, num_m_blocks, (int)blockIdx.x);
}

// The block as the rows of one warp see it under pack-GQA (params.h: PackGqa; varlen only, where a head's lse rows
// are total_q apart): the warp's rows are query head h + head's (head = warp_row0 / p.pack.rows), and m0, lse_row0
// and out are shifted so that block row r of the warp is query m0 + r of that head, which is how the mask and the
// epilogue helpers below index rows.
template <typename Element>
__device__ __forceinline__ FwdBlock<Element> packed_warp_view(const FwdBlock<Element>& blk, const FwdParams& p,
                                                              int head) {
  FwdBlock<Element> w = blk;
  w.h += head;
  w.m0 -= head * p.pack.rows;
  w.lse_row0 += head * p.varlen.total_q;
  w.q += head * p.q_stride.head;
  w.out += head * p.out_stride.head;
  return w;
}

// The attention sink of query head h in log2 units, or -inf without sinks (score_mod.h). A global load: after the
// kernel's wait for prior grids.
__device__ __forceinline__ float sink_log2(const FwdParams& p, int h) {
  return p.score.sinks != nullptr ? p.score.sinks[h] * kLog2e : -INFINITY;
}

// One row of this warp's normalized O fragments (C layout: row `row` of the block, values `half` of each n8 tile of
// m16 tile mi) into the shared Q tile (its swizzled layout), and that row's LSE: the pieces of the epilogues below.
template <typename QTile, int kMTiles, int kDTiles, typename Element>
__device__ __forceinline__ void stage_output_row(const float (&o)[kMTiles][kDTiles][4], Element* sQ, int mi, int half,
                                                 int row, int lane) {
  const int frag_col = 2 * (lane & 3);
#pragma unroll
  for (int di = 0; di < kDTiles; ++di) {
    const uint32_t packed = pack2<Element>(o[mi][di][2 * half], o[mi][di][2 * half + 1]);
    *reinterpret_cast<uint32_t*>(sQ + QTile::elem_offset(row, di * 8 + frag_col)) = packed;
  }
}

template <typename Element>
__device__ __forceinline__ void write_lse_row(float lse, const FwdBlock<Element>& blk, const FwdParams& p, int row,
                                              int lane) {
  if ((lane & 3) == 0) {
    const int q_row = blk.m0 + row;
    if (q_row < blk.seqlen_q) p.lse[blk.lse_row0 + q_row] = lse;
  }
}

// Stages this warp's normalized O fragments (kMTiles m16 tiles from block row warp_row0) in the shared Q tile and
// writes their LSE, row by row; the caller guarantees no thread still reads sQ.
template <typename QTile, int kMTiles, int kDTiles, typename Element>
__device__ __forceinline__ void stage_output(const float (&o)[kMTiles][kDTiles][4], const float (&lse)[2 * kMTiles],
                                             Element* sQ, const FwdBlock<Element>& blk, const FwdParams& p,
                                             int warp_row0, int lane) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row0 + mi * 16 + (lane >> 2) + half * 8;
      stage_output_row<QTile>(o, sQ, mi, half, row, lane);
      write_lse_row(lse[2 * mi + half], blk, p, row, lane);
    }
  }
}

// The two halves of stage_output, for an epilogue that writes the LSE at another point than it stages O.
template <typename QTile, int kMTiles, int kDTiles, typename Element>
__device__ __forceinline__ void stage_output_tile(const float (&o)[kMTiles][kDTiles][4], Element* sQ,
                                                  int warp_row0, int lane) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      stage_output_row<QTile>(o, sQ, mi, half, warp_row0 + mi * 16 + (lane >> 2) + half * 8, lane);
}

template <int kMTiles, typename Element>
__device__ __forceinline__ void write_lse(const float (&lse)[2 * kMTiles], const FwdBlock<Element>& blk,
                                          const FwdParams& p, int warp_row0, int lane) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      write_lse_row(lse[2 * mi + half], blk, p, warp_row0 + mi * 16 + (lane >> 2) + half * 8, lane);
}

// stage_output, then the tile to global memory with 16-byte stores by threads [0, kNThreads); `sync`
// synchronizes exactly them (__syncthreads by default, a named barrier when a block also holds threads that do
// not).
struct SyncThreads {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

template <typename QTile, int kNThreads, int kMTiles, int kDTiles, typename Element, typename Sync = SyncThreads>
__device__ __forceinline__ void write_output(const float (&o)[kMTiles][kDTiles][4], const float (&lse)[2 * kMTiles],
                                             Element* sQ, const FwdBlock<Element>& blk, const FwdParams& p,
                                             int warp_row0, int lane, Sync sync = Sync{}) {
  stage_output<QTile>(o, lse, sQ, blk, p, warp_row0, lane);
  sync();
  store_tile<QTile, kNThreads>(sQ, blk.out, p.out_stride.seq, blk.m0, blk.seqlen_q, (int)p.head_dim);
}

}  // namespace flashcore::cuda
