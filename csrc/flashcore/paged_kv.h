// Where the keys of a KV-cache call live: one description shared by the host, the CPU path and the CUDA decode
// kernel (flash-attn's flash_attn_with_kvcache semantics).
//
// The cache is dense, (cache_batch, capacity, heads_kv, head_dim), or paged, (num_pages, page_size, heads_kv,
// head_dim) read through block_table (batch, max_pages): key j of batch entry b is row j % page_size of page
// block_table[b][j / page_size]. Batch entry b reads cache row cache_batch_idx[b] (dense; b when absent); its keys
// are [cache_leftpad[b], cache_seqlens[b]) of that row (leftpad 0 when absent), so its sequence has
// cache_seqlens[b] - cache_leftpad[b] keys; the query's causal diagonal and window are aligned bottom-right to them.
//
// Lengths, indices and page numbers live on the device and are not checked on the hot path (a sync). Whatever
// they say, every access stays inside the cache: kv_seq clamps lengths to the capacity, the left pad to the
// length and cache rows into the tensor; the decode kernel clamps page numbers into it too (the CPU path validates
// them all instead).
//
// The decode kernel also serves a varlen forward whose sequences have one query each (flash_attn_varlen_func at a
// decode step): the packed keys (total_k, heads_kv, head_dim) are one cache row of total_k keys, and entry b's keys
// are sequence b's rows as seqlen.h defines them (cu_seqlens_k, seqused_k), clamped into the keys. (seqlen.h also
// clamps a length to the next sequence's start and to max_seqlen_k; offsets that break those promises are the
// caller's error, read here inside the tensor all the same.)
#pragma once

#include <cstdint>

#include "macros.h"
#include "mask.h"
#include "params.h"

namespace flashcore {

struct KvCacheParams {
  const int32_t* cache_seqlens = nullptr;    // (batch,); nullptr: every entry holds `capacity` keys
  const int32_t* cache_batch_idx = nullptr;  // (batch,) or null
  const int32_t* cache_leftpad = nullptr;    // (batch,) or null
  const int32_t* block_table = nullptr;      // (batch, max_pages) with row stride block_table_stride, or null
  int64_t block_table_stride = 0;
  int64_t max_pages = 0;    // block_table's columns
  int64_t page_size = 0;    // paged: rows of a page
  int64_t cache_rows = 0;   // dense: cache_batch; paged: num_pages (the first dim of the cache)
  int64_t capacity = 0;     // keys one batch entry can hold: dense seq len, or max_pages * page_size
  FastDiv page_div;         // paged: by page_size (the kernels split a key into page slot and row without a divide)
  // A varlen batch's packed keys (the decode route of the varlen forward): one cache row of total_k keys
  // (capacity), cache_leftpad = cu_seqlens_k (entry b's keys start at cu_seqlens_k[b]) and cache_seqlens =
  // cu_seqlens_k + 1 (they end at the next sequence's start) or seqused_k with seqlens_from_leftpad (they end
  // seqused_k[b] keys after the start). max_seqlen_k > 0: the longest entry the caller promises, which sizes the
  // split-KV grid (kv_seq does not clamp to it: an entry that runs longer is read whole, inside the tensor).
  bool seqlens_from_leftpad = false;
  int64_t max_seqlen_k = 0;

  // The most keys an entry can have: what sizes the split-KV grid.
  FLASHCORE_HOST_DEVICE int64_t longest_entry() const { return max_seqlen_k > 0 ? max_seqlen_k : capacity; }

  FLASHCORE_HOST_DEVICE bool paged() const { return block_table != nullptr; }
  // Rows of the cache's second dimension: a page's keys, or a dense cache row's.
  FLASHCORE_HOST_DEVICE int64_t rows_per_cache_row() const { return paged() ? page_size : capacity; }
  // Paged: key `key` (0 <= key < capacity < 2^31) of an entry lies in block-table column `return` at row `row`.
  FLASHCORE_HOST_DEVICE int page_slot(int key, int& row) const {
    uint32_t r = 0;
    const int slot = (int)page_div.divmod((uint32_t)key, r);
    row = (int)r;
    return slot;
  }
};

// One batch entry's keys, clamped: cache row (dense), first key and count.
struct KvSeq {
  int64_t cache_row = 0;
  int64_t first_key = 0;  // the left pad
  int64_t seqlen_k = 0;   // keys visible to the attention: [first_key, first_key + seqlen_k)
};

FLASHCORE_HOST_DEVICE KvSeq kv_seq(const KvCacheParams& kv, int64_t b) {
  KvSeq s;
  const int64_t start = kv.cache_leftpad ? kv.cache_leftpad[b] : 0;
  const int64_t len = kv.cache_seqlens ? kv.cache_seqlens[b] : kv.capacity;  // none: every entry full
  const int64_t end = clamp64(len + (kv.seqlens_from_leftpad ? start : 0), 0, kv.capacity);
  s.first_key = clamp64(start, 0, end);
  s.seqlen_k = end - s.first_key;
  s.cache_row = kv.paged() ? 0 : clamp64(kv.cache_batch_idx ? kv.cache_batch_idx[b] : b, 0, kv.cache_rows - 1);
  return s;
}

// One KV-cache call: the attention part as FwdParams (q/out as (batch, heads, seq, dim) strides, k/v strides of
// the cache: batch = a cache row or a page, seq = a key row), the cache's layout, and the split-KV workspace.
// f.seqlen_k is the capacity (the grid's bound); each entry's own length comes from kv_seq.
struct DecodeParams {
  FwdParams f;
  KvCacheParams kv;
  int num_splits = 1;
  bool longest_first = false;  // blocks take batch entries longest first (decode_kernel.cuh, entry_of_rank)
  // The splits of one (entry, kv head, row block) are one thread-block cluster (sm_90, num_splits <= 8) and merge
  // their partial results through distributed shared memory: no partials in global memory, no combine kernel.
  bool cluster_merge = false;
  // num_splits > 1 without cluster_merge: each split's normalized partial output (num_splits, batch, heads_q,
  // seqlen_q, head_dim) and log-sum-exp (num_splits, batch, heads_q, seqlen_q), float32, merged by the combine
  // kernel.
  float* o_partial = nullptr;
  float* lse_partial = nullptr;
  // f.lse's layout, row (b, hq, pos) at b * lse_batch_stride + hq * lse_head_stride + pos: (batch, heads_q,
  // seqlen_q), or a varlen forward's (heads_q, batch * seqlen_q). The partials keep the first.
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  FLASHCORE_HOST_DEVICE int64_t lse_index(int64_t b, int64_t hq, int64_t pos) const {
    return b * lse_batch_stride + hq * lse_head_stride + pos;
  }
};

}  // namespace flashcore
