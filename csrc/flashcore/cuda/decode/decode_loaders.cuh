// The KV-cache kernel's two K/V tile loaders (decode_kernel.cuh runs the pipeline; decode_launch.cu picks one).
//
// Tile t of a block holds keys [t kBlockN, (t + 1) kBlockN) of its batch entry's sequence, for one kv head, as
// K then V SmemTiles in one stage. Both loaders find where a tile lives one tile ahead of loading it ("locate"),
// so that a paged cache's block-table reads are in flight during a tile's computation instead of stalling the
// copies that need them. Page numbers read from the block table are not trusted: the cp.async loader clamps them
// into the cache, the TMA loader lets TMA zero-fill what lies outside it.
//   CpAsyncLoader (every arch): each thread copies 16-byte chunks of kBlockN / kRowStep rows: one stride apart
//     where a tile is consecutive rows of one cache row or page (dense caches, pages of whole tiles), otherwise
//     gathered through the page table one lookup a row (a lane each), so a page may hold any number of keys.
//   TmaLoader (Hopper): thread 0 loads a tile as boxes of 64 columns x box_rows keys into the same swizzled layout
//     (SmemTile's 128-byte rows are TMA's 128-byte swizzle) and signals the stage's mbarrier. A box never crosses a
//     page (box_rows divides the page size; the host takes this loader only without a left pad, so the sequence
//     starts a page); a box past the entry's length gets page number cache_rows, which TMA zero-fills without
//     reading anything. Rows inside the cache but past the entry's length hold whatever the cache holds there, so
//     their V rows are zeroed before P V (a NaN would survive P = 0).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../../paged_kv.h"
#include "../ptx/cp_async.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/tma.cuh"

namespace flashcore::decode {

// The TMA loader's descriptors: K and V caches as (head_dim, rows of a cache row or page, heads_kv, cache rows or
// pages), boxes of 64 columns x box_rows rows (64 for a dense cache; a paged one's page size's largest
// power-of-two divisor up to 64, at least 16).
struct DecodeTmaMaps {
  CUtensorMap k, v;
  int box_rows = 64;
};

// What a block reads: one batch entry's keys of one kv head.
template <typename Element>
struct EntryKeys {
  const Element* k;  // the kv head's keys: k + cache row (or page) * stride.batch + key row * stride.seq
  const Element* v;
  KvSeq seq;
  int b;  // batch entry (its block-table row)
};

template <typename Traits>
struct CpAsyncLoader {
  using Element = typename Traits::Element;
  using KVTile = typename Traits::KVTile;
  static constexpr int kBlockN = Traits::kBlockN;
  // A thread copies chunk c of rows r0 + kRowStep * it, it < kRowsPerThread.
  static constexpr int kCpr = KVTile::kChunksPerRow, kRowStep = Traits::kNThreads / kCpr;
  static constexpr int kRowsPerThread = kBlockN / kRowStep;

  const DecodeParams& p;
  const EntryKeys<Element>& e;
  const int c, r0;
  const bool col_ok;
  const int dst0;  // byte offset of (r0, c) in a stage's K tile
  // Strided tiles: a tile's keys are consecutive rows of one cache row (a dense cache) or of one page (pages of a
  // multiple of kBlockN keys, the sequence starting on a tile boundary of its first page), so a thread's rows lie
  // kRowStep rows apart from one address: no per-row lookup, predicate or 64-bit multiply (the row-at-a-time form
  // took 193 instructions a warp a tile of a dense cache; docs/PERFORMANCE.md). Block-uniform.
  const bool strided;
  // A warp's threads copy 16 rows of a tile (kRowsPerStep rows r0 at each of kRowsPerThread steps). Paged, not
  // strided: lane l < 16 looks up row l of them (locate: one block-table read and divide a lane, not one a row)
  // and load() hands each thread its rows' addresses by shuffles. Paged and strided: every lane reads the tile's
  // one page. The page stays raw until load(), so no thread waits for the read during the tile it is issued in.
  static constexpr int kRowsPerStep = 32 / kCpr;
  static_assert(kRowsPerStep * kRowsPerThread == 16, "16 rows a warp");
  int lane_page = 0;  // the located tile: lane l's row's block-table entry (raw); strided: the tile's page
  int lane_row = -1;  // its row in that page (strided: the tile's first row); -1: past the sequence

  __device__ __forceinline__ CpAsyncLoader(const DecodeParams& p_, const EntryKeys<Element>& e_)
      : p(p_),
        e(e_),
        c(threadIdx.x % kCpr),
        r0(threadIdx.x / kCpr),
        col_ok(c * 8 < (int)p_.f.head_dim),
        dst0(KVTile::chunk_offset(r0, c) * (int)sizeof(Element)),
        strided(!p_.kv.paged() || (p_.kv.page_size % kBlockN == 0 && e_.seq.first_key % kBlockN == 0)) {}

  // Byte offset of row r0 + kRowStep * it from row r0: when kRowStep is a multiple of 8 (head-dim tiles 64 and 128)
  // the rows share their swizzle, so it is a constant per row.
  __device__ __forceinline__ int dst_of(int it) const {
    if constexpr (kRowStep % 8 == 0) return it * kRowStep * 64 * (int)sizeof(Element);
    return (KVTile::chunk_offset(r0 + it * kRowStep, c) - KVTile::chunk_offset(r0, c)) * (int)sizeof(Element);
  }

  // Paged: this lane's row of tile t (strided: the tile's first row; dense rows need no lookup).
  __device__ __forceinline__ void locate(int t) {
    if (!p.kv.paged()) return;
    int r = 0;
    if (!strided) {
      const int l = threadIdx.x & 15;
      r = (threadIdx.x >> 5) * kRowsPerStep + l % kRowsPerStep + kRowStep * (l / kRowsPerStep);
    }
    const int j = t * kBlockN + r;
    lane_row = -1;
    lane_page = 0;
    if (j < (int)e.seq.seqlen_k) {
      const int slot = p.kv.page_slot((int)e.seq.first_key + j, lane_row);
      lane_page = p.kv.block_table[e.b * p.kv.block_table_stride + slot];
    }
  }

  // Copies the located tile t into the stage at shared address `stage` (K, then V); the caller commits.
  __device__ __forceinline__ void load(int t, uint32_t stage) const {
    const FwdParams& f = p.f;
    const uint32_t sK = stage + dst0;
    const uint32_t sV = sK + KVTile::kElems * (int)sizeof(Element);
    const int rows_left = (int)e.seq.seqlen_k - t * kBlockN - r0;  // this thread's rows: it * kRowStep < rows_left
    if (strided) {
      int64_t row_k, row_v;  // element offsets of this thread's first row of the tile
      if (!p.kv.paged()) {
        const int64_t key = e.seq.first_key + t * kBlockN + r0;
        row_k = e.seq.cache_row * f.k_stride.batch + key * f.k_stride.seq;
        row_v = e.seq.cache_row * f.v_stride.batch + key * f.v_stride.seq;
      } else {
        const int64_t pg = min(max(lane_page, 0), (int)p.kv.cache_rows - 1);  // cache_rows < 2^31 (host check)
        const int row = max(lane_row, 0) + r0;  // lane_row = -1 only past the sequence, where rows_left <= 0
        row_k = pg * f.k_stride.batch + row * f.k_stride.seq;
        row_v = pg * f.v_stride.batch + row * f.v_stride.seq;
      }
      copy_strided(sK, sV, e.k + row_k + c * 8, e.v + row_v + c * 8, rows_left);
      return;
    }
    // Lane l < 16 turns its row's page into the row's element offsets in K and V (-1: no row), once a tile; each
    // thread takes its rows' offsets by shuffles.
    int64_t lane_k = -1, lane_v = -1;
    if (lane_row >= 0) {
      const int64_t pg = min(max(lane_page, 0), (int)p.kv.cache_rows - 1);  // cache_rows < 2^31 (host check)
      lane_k = pg * f.k_stride.batch + lane_row * f.k_stride.seq;
      lane_v = pg * f.v_stride.batch + lane_row * f.v_stride.seq;
    }
    const int sub = (threadIdx.x & 31) / kCpr;  // r0 = warp * kRowsPerStep + sub
#pragma unroll
    for (int it = 0; it < kRowsPerThread; ++it) {
      const int64_t off_k = __shfl_sync(0xffffffffu, lane_k, it * kRowsPerStep + sub);
      const int64_t off_v = __shfl_sync(0xffffffffu, lane_v, it * kRowsPerStep + sub);
      const bool valid = col_ok && off_k >= 0;
      const Element* src_k = valid ? e.k + off_k + c * 8 : e.k;
      const Element* src_v = valid ? e.v + off_v + c * 8 : e.v;
      const int dst = dst_of(it);
      ptx::cp_async_16(sK + dst, src_k, valid);
      ptx::cp_async_16(sV + dst, src_v, valid);
    }
  }

 private:
  // A strided tile's copies: this thread's rows from src_k / src_v (row r0 of the tile, column chunk c) on, one
  // stride apart. A tile wholly inside the sequence (every tile but an entry's last) takes no per-row predicate;
  // column chunks past the head dim copy nothing, from the kv head's first element.
  __device__ __forceinline__ void copy_strided(uint32_t sK, uint32_t sV, const Element* src_k, const Element* src_v,
                                               int rows_left) const {
    const int64_t step_k = col_ok ? kRowStep * p.f.k_stride.seq : 0;
    const int64_t step_v = col_ok ? kRowStep * p.f.v_stride.seq : 0;
    if (!col_ok) {
      src_k = e.k;
      src_v = e.v;
    }
    if (rows_left + r0 >= kBlockN) {  // the whole tile (block-uniform: rows_left + r0 is the tile's keys left)
#pragma unroll
      for (int it = 0; it < kRowsPerThread; ++it) {
        ptx::cp_async_16(sK + dst_of(it), src_k, col_ok);
        ptx::cp_async_16(sV + dst_of(it), src_v, col_ok);
        src_k += step_k;
        src_v += step_v;
      }
      return;
    }
#pragma unroll
    for (int it = 0; it < kRowsPerThread; ++it) {
      const bool valid = col_ok && it * kRowStep < rows_left;
      ptx::cp_async_16(sK + dst_of(it), valid ? src_k : e.k, valid);
      ptx::cp_async_16(sV + dst_of(it), valid ? src_v : e.v, valid);
      src_k += step_k;
      src_v += step_v;
    }
  }
};

// Run by thread 0 only (the copies spread over the four warps' lane 0 measured slower: docs/PERFORMANCE.md).
template <typename Traits>
struct TmaLoader {
  using Element = typename Traits::Element;
  using KVTile = typename Traits::KVTile;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kMaxBoxes = kBlockN / 16, kSpans = KVTile::kChunksPerRow / KVTile::kSpanChunks;

  const DecodeParams& p;
  const DecodeTmaMaps& maps;
  const EntryKeys<Element>& e;
  const int kvh;
  int box_page[kMaxBoxes];  // the located tile, paged: the page of each box

  __device__ __forceinline__ TmaLoader(const DecodeParams& p_, const DecodeTmaMaps& maps_,
                                       const EntryKeys<Element>& e_, int kvh_)
      : p(p_), maps(maps_), e(e_), kvh(kvh_) {}

  // Paged: reads the page of each box of tile t.
  __device__ __forceinline__ void locate(int t) {
    if (!p.kv.paged()) return;
    const int seqlen_k = (int)e.seq.seqlen_k;
#pragma unroll
    for (int g = 0; g < kMaxBoxes; ++g) {
      const int j = t * kBlockN + g * maps.box_rows;
      if (g * maps.box_rows < kBlockN)
        box_page[g] = j < seqlen_k ? p.kv.block_table[e.b * p.kv.block_table_stride + p.kv.page_div.div(j)]
                                   : (int)p.kv.cache_rows;
    }
  }

  // Issues the located tile t into `stage` (K, then V) and arms its full barrier with the tile's bytes.
  __device__ __forceinline__ void load(int t, Element* stage, uint64_t* full) const {
    Element* const sK = stage;
    Element* const sV = sK + KVTile::kElems;
    ptx::mbarrier_arrive_expect_tx(full, Traits::kStageElems * (int)sizeof(Element));
#pragma unroll
    for (int g = 0; g < kMaxBoxes; ++g) {
      if (g * maps.box_rows >= kBlockN) break;
      const int j = t * kBlockN + g * maps.box_rows;
      const int page = p.kv.paged() ? box_page[g] : (int)e.seq.cache_row;
      int row = (int)e.seq.first_key + j;
      if (p.kv.paged()) p.kv.page_slot(j, row);
#pragma unroll
      for (int span = 0; span < kSpans; ++span) {
        const int dst = span * KVTile::kNumRows * 64 + g * maps.box_rows * 64;  // SmemTile: 128-byte rows a span
        ptx::tma_load_4d(sK + dst, &maps.k, full, span * 64, row, kvh, page);
        ptx::tma_load_4d(sV + dst, &maps.v, full, span * 64, row, kvh, page);
      }
    }
  }

  // All threads, once tile t's stage has landed: zeroes its V rows past the entry's length, then orders that
  // before the stage's next TMA write (proxy fence) and before every warp's reads.
  __device__ __forceinline__ static void zero_v_past_end(int t, Element* stage, int seqlen_k) {
    KVTile::zero_rows(stage + KVTile::kElems, max(0, seqlen_k - t * kBlockN), kBlockN, threadIdx.x,
                      Traits::kNThreads);
    ptx::fence_proxy_async_shared();
    __syncthreads();
  }
};

}  // namespace flashcore::decode
