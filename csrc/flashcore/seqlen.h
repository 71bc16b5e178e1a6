// Where each batch entry's sequence lives: one description shared by the host, the CPU kernels and the CUDA
// kernels, for dense (batch, heads, seq, dim) tensors and for variable-length ("varlen") batches packed along the
// sequence dimension, as flash-attn's flash_attn_varlen_func takes them.
//
// Varlen: q is (total_q, heads_q, dim), k/v (total_k, heads_kv, dim); sequence b owns rows
// [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b] + seqlen_k(b)) of k/v, where
// seqlen_k(b) = cu_seqlens_k[b+1] - cu_seqlens_k[b], or seqused_k[b] when given (FlashAttention-3's "use only the
// first n keys"). The kernels address a packed tensor as a batch of one-stride-0 entries: batch stride 0, and the
// sequence's first row added to the row index. FwdParams::seqlen_q/seqlen_k then hold max_seqlen_q/max_seqlen_k,
// which size the grids.
//
// The offsets live on the device and are not checked on the hot path (that would need a sync). Whatever they say,
// SeqInfo keeps every sequence inside its tensor: offsets are clamped to [0, total], ends to [begin, total], and
// lengths to the max_seqlen the grid covers (a longer sequence is truncated to it; the opt-in validation mode,
// FLASHCORE_CHECK_VARLEN=1, reports such input instead). No kernel can then touch memory outside its tensors.
#pragma once

#include <cstdint>

#include "macros.h"

namespace flashcore {

struct VarlenParams {
  const int32_t* cu_seqlens_q = nullptr;  // (batch + 1,); null: dense tensors
  const int32_t* cu_seqlens_k = nullptr;  // (batch + 1,)
  const int32_t* seqused_k = nullptr;     // (batch,) or null
  // (batch,): the sequence the i-th batch slot of a grid computes, or null (slot i is sequence i). For the CUDA
  // backward the host sorts the sequences longest first on the device (no sync), so the longest blocks start first
  // and the short ones fill the last wave (a grid in the given order ends with whatever sequence came last, alone
  // on the GPU). A permutation of [0, batch): the host builds it, never the caller.
  const int32_t* launch_order = nullptr;
  // A packed grid (the sm90 backward), or null: a grid of max_seqlen's tiles for every sequence, whose blocks past a
  // short sequence's end exit at once. tile_end[s]: tiles (blocks of one head) of slots 0..s, each slot's sequence
  // cut into ceil(length / tile); the grid launches grid_tiles >= tile_end[batch - 1] tiles a head (a bound the
  // host knows without a sync) and locate_packed_tile maps a block to its (slot, head, tile).
  const int32_t* tile_end = nullptr;
  int64_t grid_tiles = 0;
  // The sm90 forward's packed grid (cuda/common/varlen_tile_scan.cuh), or false: the dense-shaped grid.
  bool scan_grid = false;
  int64_t total_q = 0;                    // rows of the packed q (and out, lse's last dim)
  int64_t total_k = 0;                    // rows of the packed k and v
  // Paged keys (a KV cache's chunked prefill on the Hopper forward, paged_kv.h), or null: k/v are
  // (num_pages, page_size, heads_kv, dim) caches and key j of sequence b is row j % page_size of page
  // block_table[b * block_table_stride + j / page_size]; the sequence's length is seqused_k[b] (cu_seqlens_k is not
  // read), clamped to max_seqlen_k (the capacity). Page numbers are not trusted: the loads address pages through
  // TMA, which zero-fills what lies outside the cache.
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int page_size = 0;
  int page_box_rows = 0;                  // keys of one TMA box: a power of two dividing page_size and the tile

  FLASHCORE_HOST_DEVICE bool enabled() const { return cu_seqlens_q != nullptr; }
  // The batch entry (sequence) of grid slot `slot`.
  FLASHCORE_HOST_DEVICE int64_t sequence_of_slot(int64_t slot) const {
    return launch_order != nullptr ? launch_order[slot] : slot;
  }
};

// Tiles a packed grid launches per head: a bound on sum_b ceil(len_b / tile) that the host knows without a sync,
// for `batch` sequences of at most max_seqlen each and `total` in all (each sequence wastes less than one tile).
FLASHCORE_HOST_DEVICE int64_t packed_grid_tiles(int64_t batch, int64_t max_seqlen, int64_t total, int64_t tile) {
  const int64_t per_sequence = batch * ((max_seqlen + tile - 1) / tile), by_total = (total + tile - 1) / tile + batch;
  return per_sequence < by_total ? per_sequence : by_total;
}

// Block `block` of a packed grid (VarlenParams::tile_end) of `heads` heads: slot s owns blocks
// [heads * tile_end[s - 1], heads * tile_end[s]), head by head, so a sequence's tiles of one head run side by side
// (they share K/V or Q/dO in L2). Binary search over the batch. false: past the last slot (the block exits).
struct PackedTile {
  int slot = 0, head = 0, tile = 0, tiles = 0;
};
FLASHCORE_HOST_DEVICE bool locate_packed_tile(const VarlenParams& v, int64_t batch, int64_t heads, int64_t block,
                                              PackedTile& out) {
  int64_t lo = 0, hi = batch;  // the first slot whose blocks end past `block`
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (heads * v.tile_end[mid] > block) hi = mid; else lo = mid + 1;
  }
  if (lo == batch) return false;
  const int64_t first = lo > 0 ? v.tile_end[lo - 1] : 0, tiles = v.tile_end[lo] - first;
  const int64_t rel = block - heads * first;  // < heads * tiles, so tiles > 0
  out.slot = (int)lo;
  out.tiles = (int)tiles;
  out.head = (int)(rel / tiles);
  out.tile = (int)(rel % tiles);
  return true;
}

// One batch entry's sequence: its first rows in the (packed) tensors and its lengths. Dense: begins 0.
struct SeqInfo {
  int64_t q_begin = 0, k_begin = 0;
  int64_t seqlen_q = 0, seqlen_k = 0;
};

FLASHCORE_HOST_DEVICE int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

// Sequence b's queries, as varlen_seq_info gives them (its q_begin: the first clamp).
FLASHCORE_HOST_DEVICE int64_t varlen_seqlen_q(const VarlenParams& v, int64_t b, int64_t max_seqlen_q) {
  const int64_t begin = clamp64(v.cu_seqlens_q[b], 0, v.total_q);
  return clamp64(clamp64(v.cu_seqlens_q[b + 1], begin, v.total_q) - begin, 0, max_seqlen_q);
}

// max_seqlen_q/max_seqlen_k: the lengths the call's grids cover (FwdParams::seqlen_q/seqlen_k).
FLASHCORE_HOST_DEVICE SeqInfo varlen_seq_info(const VarlenParams& v, int64_t b, int64_t max_seqlen_q,
                                              int64_t max_seqlen_k) {
  SeqInfo s;
  s.q_begin = clamp64(v.cu_seqlens_q[b], 0, v.total_q);
  s.seqlen_q = varlen_seqlen_q(v, b, max_seqlen_q);
  if (v.block_table != nullptr) {  // paged keys: begin 0 in the sequence's own pages
    s.seqlen_k = clamp64(v.seqused_k[b], 0, max_seqlen_k);
    return s;
  }
  s.k_begin = clamp64(v.cu_seqlens_k[b], 0, v.total_k);
  int64_t len_k = clamp64(v.cu_seqlens_k[b + 1], s.k_begin, v.total_k) - s.k_begin;
  if (v.seqused_k != nullptr) len_k = clamp64(v.seqused_k[b], 0, len_k);
  s.seqlen_k = clamp64(len_k, 0, max_seqlen_k);
  return s;
}

}  // namespace flashcore
