// The KV-cache kernel's two K/V tile loaders (decode_kernel.cuh runs the pipeline; decode_launch.cu picks one).
//
// Tile t of a block holds keys [t kBlockN, (t + 1) kBlockN) of its batch entry's sequence, for one kv head, as
// K then V SmemTiles in one stage. Both loaders find where a tile lives one tile ahead of loading it ("locate"),
// so that a paged cache's block-table reads are in flight during a tile's computation instead of stalling the
// copies that need them. Page numbers read from the block table are not trusted: the cp.async loader clamps them
// into the cache, the TMA loader lets TMA zero-fill what lies outside it.
//   CpAsyncLoader (every arch): each thread copies 16-byte chunks of kBlockN / kRowStep rows: one stride apart
//     where a tile is consecutive rows of one cache row or page (dense caches; pages of a multiple of 64 keys, the
//     entry starting on a tile edge) or, at head-dim tile 256, where each 16-key run of it is (pages of a multiple
//     of 16 keys, the entry starting on a 16-key edge); otherwise gathered through the page table one lookup a row
//     (a lane each), so a page may hold any number of keys.
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
  // A thread copies chunk c of rows r0 + kRowStep * it, it < kRowsPerThread (r0 < kRowStep).
  static constexpr int kCpr = KVTile::kChunksPerRow, kRowStep = Traits::kNThreads / kCpr;
  static constexpr int kRowsPerThread = kBlockN / kRowStep;
  // Runs: kRuns runs of kRunRows consecutive keys a tile; a thread's rows of run g are its steps
  // g * kItsPerRun .. (g + 1) * kItsPerRun - 1 (kRowStep divides kRunRows).
  static constexpr int kRunRows = 16, kRuns = kBlockN / kRunRows, kItsPerRun = kRunRows / kRowStep;
  static_assert(kRunRows % kRowStep == 0 && kItsPerRun * kRuns == kRowsPerThread, "whole runs a thread");
  static_assert(kRuns == 4, "copy_rows_run dispatches four runs");
  // Runs pay where a thread copies several rows of each (kItsPerRun 4: head-dim tile 256, pages of 16 189.9 ->
  // 131.3 us at 8 x 8k on the H200). At tiles 64 and 128 (1 and 2 rows a run) they measured no faster than the
  // gather (128: 70.9 vs 70.8 us, mixed 103.0 vs 102.0) or slower (64: 47.2 vs 43.6), so those pages gather.
  static constexpr bool kCopiesRuns = kItsPerRun >= 4;
  static constexpr int kLocatedRuns = kCopiesRuns ? kRuns : 1;  // block-table entries a thread reads a tile

  // How a block's tiles are copied (block-uniform). The row-at-a-time gather took 193 instructions a warp a tile
  // for a dense cache, more than the attention's own (docs/PERFORMANCE.md), so every layout that allows it copies
  // from one address a thread advanced by a stride: no per-row lookup, predicate or 64-bit multiply.
  //   kStrided: a tile is consecutive rows of one cache row (a dense cache) or of one page (pages of a multiple of
  //             kBlockN keys, the sequence starting on a tile edge of its first page): one table read a tile.
  //   kRuns:    a tile is kRuns runs of kRunRows consecutive rows, each inside one page (pages of a multiple of
  //             kRunRows keys, the sequence starting on a run edge): one table read a run (kCopiesRuns only).
  //   kGather:  other pages: a warp's lane l < 16 looks up row l of the 16 rows the warp copies (one table read
  //             and divide a lane, not one a row) and load() hands each thread its rows' addresses by shuffles.
  enum class Copy { kStrided, kRuns, kGather };
  const DecodeParams& p;
  const EntryKeys<Element>& e;
  const int c, r0;
  const bool col_ok;
  const int dst0;  // byte offset of (r0, c) in a stage's K tile
  const Copy copy;
  static constexpr int kRowsPerStep = 32 / kCpr;
  static_assert(kRowsPerStep * kRowsPerThread == 16, "16 rows a warp");
  // The located tile's raw block-table entries (read a tile ahead, so that no thread waits for them in the tile
  // they are issued in): kStrided the tile's page in [0], kRuns each run's page, kGather this lane's row's page in
  // [0] and its row in that page in [1] (-1: past the sequence).
  int located[kRuns];

  __device__ __forceinline__ CpAsyncLoader(const DecodeParams& p_, const EntryKeys<Element>& e_)
      : p(p_),
        e(e_),
        c(threadIdx.x % kCpr),
        r0(threadIdx.x / kCpr),
        col_ok(c * 8 < (int)p_.f.head_dim),
        dst0(KVTile::chunk_offset(r0, c) * (int)sizeof(Element)),
        copy(!p_.kv.paged() || (p_.kv.page_size % kBlockN == 0 && e_.seq.first_key % kBlockN == 0) ? Copy::kStrided
             : kCopiesRuns && p_.kv.page_size % kRunRows == 0 && e_.seq.first_key % kRunRows == 0  ? Copy::kRuns
                                                                                                  : Copy::kGather) {
#pragma unroll
    for (int g = 0; g < kRuns; ++g) located[g] = 0;
  }

  // Byte offset of row r0 + kRowStep * it from row r0: when kRowStep is a multiple of 8 (head-dim tiles 64 and 128)
  // the rows share their swizzle, so it is a constant per row.
  __device__ __forceinline__ int dst_of(int it) const {
    if constexpr (kRowStep % 8 == 0) return it * kRowStep * 64 * (int)sizeof(Element);
    return (KVTile::chunk_offset(r0 + it * kRowStep, c) - KVTile::chunk_offset(r0, c)) * (int)sizeof(Element);
  }

  // Paged: reads the block-table entries of tile t (dense rows need none).
  __device__ __forceinline__ void locate(int t) {
    if (!p.kv.paged()) return;
    const int seqlen_k = (int)e.seq.seqlen_k, first = (int)e.seq.first_key;
    const int32_t* table = p.kv.block_table + e.b * p.kv.block_table_stride;
    if (copy == Copy::kGather) {
      const int l = threadIdx.x & 15;
      const int j = t * kBlockN + (threadIdx.x >> 5) * kRowsPerStep + l % kRowsPerStep + kRowStep * (l / kRowsPerStep);
      located[0] = 0;
      located[1] = -1;
      if (j < seqlen_k) located[0] = table[p.kv.page_slot(first + j, located[1])];
      return;
    }
#pragma unroll
    for (int g = 0; g < kLocatedRuns; ++g) {
      const int j = t * kBlockN + g * kRunRows;
      int row = 0;
      if (g == 0 || copy == Copy::kRuns) located[g] = j < seqlen_k ? table[p.kv.page_slot(first + j, row)] : 0;
    }
  }

  // Copies the located tile t into the stage at shared address `stage` (K, then V); the caller commits.
  __device__ __forceinline__ void load(int t, uint32_t stage) const {
    const FwdParams& f = p.f;
    const uint32_t sK = stage + dst0;
    const uint32_t sV = sK + KVTile::kElems * (int)sizeof(Element);
    const int rows_left = (int)e.seq.seqlen_k - t * kBlockN - r0;  // this thread's rows: it * kRowStep < rows_left
    const bool whole = rows_left + r0 >= kBlockN;  // the tile lies inside the sequence (block-uniform)
    if (copy == Copy::kStrided && !p.kv.paged()) {
      const int64_t key = e.seq.first_key + t * kBlockN + r0;
      const int64_t row_k = e.seq.cache_row * f.k_stride.batch + key * f.k_stride.seq;
      const int64_t row_v = e.seq.cache_row * f.v_stride.batch + key * f.v_stride.seq;
      copy_rows<0, kRowsPerThread>(sK, sV, e.k + row_k + c * 8, e.v + row_v + c * 8, whole, rows_left);
      return;
    }
    if (copy != Copy::kGather) {  // kStrided (one run of kBlockN rows) or kRuns
#pragma unroll
      for (int g = 0; g < kLocatedRuns; ++g) {
        if (g > 0 && copy == Copy::kStrided) break;  // block-uniform
        int row = 0;  // the run's first row in its page (the located page holds the whole run)
        p.kv.page_slot((int)e.seq.first_key + t * kBlockN + g * kRunRows, row);
        const int64_t pg = min(max(located[g], 0), (int)p.kv.cache_rows - 1);  // cache_rows < 2^31 (host check)
        const int64_t row_k = pg * f.k_stride.batch + (row + r0) * f.k_stride.seq;
        const int64_t row_v = pg * f.v_stride.batch + (row + r0) * f.v_stride.seq;
        const Element* src_k = e.k + row_k + c * 8;
        const Element* src_v = e.v + row_v + c * 8;
        if (!kCopiesRuns || copy == Copy::kStrided) {
          copy_rows<0, kRowsPerThread>(sK, sV, src_k, src_v, whole, rows_left);
        } else {
          const int run_left = rows_left - g * kRunRows;  // this thread's rows of run g: i * kRowStep < run_left
          copy_rows_run(g, sK, sV, src_k, src_v, whole, run_left);
        }
      }
      return;
    }
    // Gather: lane l < 16 turns its row's page into the row's element offsets in K and V (-1: no row), once a
    // tile; each thread takes its rows' offsets by shuffles.
    int64_t lane_k = -1, lane_v = -1;
    if (located[1] >= 0) {
      const int64_t pg = min(max(located[0], 0), (int)p.kv.cache_rows - 1);  // cache_rows < 2^31 (host check)
      lane_k = pg * f.k_stride.batch + located[1] * f.k_stride.seq;
      lane_v = pg * f.v_stride.batch + located[1] * f.v_stride.seq;
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
  // Copies this thread's rows kIt0 .. kIt0 + kIts - 1 of a tile, consecutive ones kRowStep rows apart from src_k /
  // src_v (the first's address, column chunk c). A tile wholly inside the sequence (every tile but an entry's last)
  // takes no per-row predicate; rows_left counts from row kIt0; column chunks past the head dim copy nothing, from
  // the kv head's first element.
  template <int kIt0, int kIts>
  __device__ __forceinline__ void copy_rows(uint32_t sK, uint32_t sV, const Element* src_k, const Element* src_v,
                                            bool whole, int rows_left) const {
    const int64_t step_k = col_ok ? kRowStep * p.f.k_stride.seq : 0;
    const int64_t step_v = col_ok ? kRowStep * p.f.v_stride.seq : 0;
    if (!col_ok) {
      src_k = e.k;
      src_v = e.v;
    }
    if (whole) {
#pragma unroll
      for (int i = 0; i < kIts; ++i) {
        ptx::cp_async_16(sK + dst_of(kIt0 + i), src_k, col_ok);
        ptx::cp_async_16(sV + dst_of(kIt0 + i), src_v, col_ok);
        src_k += step_k;
        src_v += step_v;
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < kIts; ++i) {
      const bool valid = col_ok && i * kRowStep < rows_left;
      ptx::cp_async_16(sK + dst_of(kIt0 + i), valid ? src_k : e.k, valid);
      ptx::cp_async_16(sV + dst_of(kIt0 + i), valid ? src_v : e.v, valid);
      src_k += step_k;
      src_v += step_v;
    }
  }

  // Run g's rows (its steps are compile-time only under the unrolled loop over g; this dispatch keeps them so).
  __device__ __forceinline__ void copy_rows_run(int g, uint32_t sK, uint32_t sV, const Element* src_k,
                                                const Element* src_v, bool whole, int run_left) const {
    switch (g) {
      case 0: copy_rows<0 * kItsPerRun, kItsPerRun>(sK, sV, src_k, src_v, whole, run_left); break;
      case 1: copy_rows<1 * kItsPerRun, kItsPerRun>(sK, sV, src_k, src_v, whole, run_left); break;
      case 2: copy_rows<2 * kItsPerRun, kItsPerRun>(sK, sV, src_k, src_v, whole, run_left); break;
      default: copy_rows<3 * kItsPerRun, kItsPerRun>(sK, sV, src_k, src_v, whole, run_left); break;
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
