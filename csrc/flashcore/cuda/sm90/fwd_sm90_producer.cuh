// Producer of the Hopper forward kernel: one thread issues every TMA load of the block (paged keys in the varlen
// kernels of two consumer warpgroups: a second thread, in the next warp, issues the V loads; produce_paged_v).
// Per tile: Q (kBlockM rows) once the consumers have released the previous tile's Q buffer (after their last
// Q K^T, or where the epilogue staged O there after its TMA store: FwdSm90Traits::kSeparateO); then, for each key
// tile in the consumers' order (last tile first), K and V into the next ring stage after the consumers have
// released it. The ring position runs on across tiles (kv_count), so the next tile's K/V stream in while the
// consumers still finish the current one. A load of rows past the sequence end is zero-filled by TMA and still
// counts its full box bytes, so expect_tx is always the whole tile.
#pragma once

#include <cuda.h>

#include "../common/fwd_block.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/prefetch.cuh"
#include "../ptx/tma.cuh"
#include "fwd_sm90_traits.cuh"

namespace flashcore::sm90 {

// Varlen with paged keys (seqlen.h: VarlenParams::block_table): a tile's kBlockN keys from `key0` of sequence `seq`
// are kBlockN / page_box_rows boxes, each inside one page at (row in page, page). Keys past the sequence get page -1,
// and pages outside the cache read nothing: TMA zero-fills both and counts the full box, so the stage's expect_tx
// stays the whole tile. A small page costs its producer thread a box per 16 keys and span, and that thread is on
// these calls' critical path, so:
//   read_tile_pages issues all of a tile's block-table reads at once, before the producer waits for the stage, and
//     parks the entries in shared memory (SharedStorage::tile_pages, a half for each producer thread: too few
//     registers to hold them) for the boxes: each box's asm would otherwise order the next read after it, one
//     memory latency a box (128 new tokens at 8 x 8k through pages of 16: ~400 -> ~351 us);
//   where the producer has the registers (FwdSm90Traits::kTwoPagedProducers) K and V are issued by two threads of
//     two warps side by side (~351 -> ~298 us; pages of 256 ~253 -> ~223).
// The next tile's entries (the walk goes down) are prefetched into L1 while this one's boxes fly.
template <typename Traits>
__device__ __forceinline__ void read_tile_pages(const FwdParams& p, int* parked, int seq, int key0, int seqlen_k) {
  const VarlenParams& v = p.varlen;
  const int32_t* table = v.block_table + (int64_t)seq * v.block_table_stride;
  const int box = v.page_box_rows, page_size = v.page_size;
  int slot = key0 / page_size, row = key0 - slot * page_size;
  int page[Traits::kMaxPageBoxes];
#pragma unroll
  for (int i = 0; i < Traits::kMaxPageBoxes; ++i) {
    page[i] = i * box < Traits::kBlockN && key0 + i * box < seqlen_k ? table[slot] : -1;
    row += box;
    if (row == page_size) row = 0, ++slot;
  }
#pragma unroll
  for (int i = 0; i < Traits::kMaxPageBoxes; ++i) parked[i] = page[i];
  if (key0 > 0) ptx::prefetch_l1(table + (key0 - Traits::kBlockN) / page_size);
}

// One K or V stage through the pages read_tile_pages parked.
template <typename Traits>
__device__ __forceinline__ void load_paged_keys(const FwdParams& p, const int* parked, typename Traits::Element* stage,
                                                const CUtensorMap* tm, uint64_t* full, int key0, int h_kv) {
  const int box = p.varlen.page_box_rows, page_size = p.varlen.page_size;
  int row = key0 % page_size;
#pragma unroll
  for (int i = 0; i < Traits::kMaxPageBoxes; ++i) {
    if (i * box >= Traits::kBlockN) break;
    const int page = parked[i];
#pragma unroll
    for (int span = 0; span < Traits::kSpans; ++span)
      ptx::tma_load_4d(stage + span * Traits::kBlockN * 64 + i * box * 64, tm, full, span * 64, row, h_kv, page);
    row += box;
    if (row == page_size) row = 0;
  }
}

// Use number `use` of the K/V ring (the block's key tiles so far): its stage, the parity of the empty barrier's
// phase to wait for, and whether there is one to wait for (a stage's first use waits for nothing).
template <typename Traits>
struct RingUse {
  int stage;
  uint32_t parity;
  bool reused;
  __device__ __forceinline__ explicit RingUse(int use)
      : stage(use % Traits::kStages), parity(ptx::empty_parity(use / Traits::kStages)), reused(use >= Traits::kStages) {}
};

// Paged keys with two producers: the second producer thread, in the producer warpgroup's next warp (a thread of the
// same warp would issue its boxes in the same instruction stream), loads V (produce_paged_v).
constexpr int kVPagedProducerThread = 32;

template <typename Traits>
__device__ __forceinline__ void produce_tile(const FwdParams& p, const cuda::FwdBlock<typename Traits::Element>& blk,
                                             const SharedStorage<Traits>& smem, const CUtensorMap* tm_q,
                                             const CUtensorMap* tm_k, const CUtensorMap* tm_v, int tile_count,
                                             int kv_count, bool loads_v) {
  // loads_v false: the second producer thread loads V (paged keys, kTwoPagedProducers).
  int* parked = smem.tile_pages;  // this thread's half
  // Varlen: the packed tensors are one batch entry; the sequence's rows start at q_begin / k_begin.
  const int b = Traits::kVarlen ? 0 : blk.b, h = blk.h, h_kv = blk.h_kv;
  const int q_row0 = Traits::kVarlen ? blk.q_begin + blk.m0 : blk.m0;
  const int k_row0 = Traits::kVarlen ? blk.k_begin : 0;

  // Q is loaded even for a tile that sees no key (n_blocks == 0): the consumers wait for it on every tile.
  // A buffer's first use needs no wait (a fresh barrier's preceding phase counts as complete), and skipping the
  // try_wait (~100 cycles) puts the block's first loads on their way sooner.
  if (tile_count > 0) ptx::mbarrier_wait(smem.q_empty, ptx::empty_parity(tile_count));
  ptx::mbarrier_arrive_expect_tx(smem.q_full, Traits::kQBytes);
#pragma unroll
  for (int span = 0; span < Traits::kSpans; ++span)
    ptx::tma_load_4d(smem.q + span * Traits::kBlockM * 64, tm_q, smem.q_full, span * 64, q_row0, h, b);

  const int n_count = blk.n_blocks - blk.n_first;
  for (int it = 0; it < n_count; ++it) {
    const int use = kv_count + it;
    const RingUse<Traits> ring(use);
    const int stage = ring.stage;
    const uint32_t parity = ring.parity;
    const int row0 = k_row0 + (blk.n_blocks - 1 - it) * Traits::kBlockN;
    const bool reused = ring.reused;

    // Varlen with paged keys: boxes through the block table (load_paged_keys), K and V alike.
    const bool paged = Traits::kVarlen && p.varlen.block_table != nullptr;
    const int key0 = (blk.n_blocks - 1 - it) * Traits::kBlockN;

    if (paged) read_tile_pages<Traits>(p, parked, blk.b, key0, blk.seqlen_k);
    if (reused) ptx::mbarrier_wait(&smem.k_empty[stage], parity);
    ptx::mbarrier_arrive_expect_tx(&smem.k_full[stage], Traits::kKVBytes);
    if (paged) {
      load_paged_keys<Traits>(p, parked, smem.k_stage(stage), tm_k, &smem.k_full[stage], key0, h_kv);
    } else {
#pragma unroll
      for (int span = 0; span < Traits::kSpans; ++span)
        ptx::tma_load_4d(smem.k_stage(stage) + span * Traits::kBlockN * 64, tm_k, &smem.k_full[stage], span * 64,
                         row0, h_kv, b);
    }
    // Compact blocks: V of key tile it (and the next tile's K) go out once this tile's K has landed. TMA
    // interleaves the boxes in flight (docs/experiments/tma_ingest.cu: the first box lands later the more there
    // are), and a block that issued Q and a full ring of K/V tiles at once got its first K late; with at most two
    // boxes in flight the first S starts earlier and each later tile still lands before it is needed (head dim 64,
    // docs/PERFORMANCE.md, ablation).
    if constexpr (Traits::kCompact) ptx::mbarrier_wait(&smem.k_full[stage], (uint32_t)((use / Traits::kStages) & 1));

    if (!loads_v) continue;
    if (reused) ptx::mbarrier_wait(&smem.v_empty[stage], parity);
    ptx::mbarrier_arrive_expect_tx(&smem.v_full[stage], Traits::kKVBytes);
    if (paged) {
      load_paged_keys<Traits>(p, parked, smem.v_stage(stage), tm_v, &smem.v_full[stage], key0, h_kv);
    } else {
#pragma unroll
      for (int span = 0; span < Traits::kSpans; ++span)
        ptx::tma_load_4d(smem.v_stage(stage) + span * Traits::kBlockN * 64, tm_v, &smem.v_full[stage], span * 64,
                         row0, h_kv, b);
    }
  }
}

// The V loads of a varlen block's paged tiles, by the second producer thread (kVPagedProducerThread): the ring
// walk of produce_tile, V only.
template <typename Traits>
__device__ __forceinline__ void produce_paged_v(const FwdParams& p, const cuda::FwdBlock<typename Traits::Element>& blk,
                                                const SharedStorage<Traits>& smem, const CUtensorMap* tm_v,
                                                int kv_count) {
  int* parked = smem.tile_pages + Traits::kMaxPageBoxes;  // this thread's half
  const int n_count = blk.n_blocks - blk.n_first;
  for (int it = 0; it < n_count; ++it) {
    const RingUse<Traits> ring(kv_count + it);
    const int key0 = (blk.n_blocks - 1 - it) * Traits::kBlockN;
    read_tile_pages<Traits>(p, parked, blk.b, key0, blk.seqlen_k);
    if (ring.reused) ptx::mbarrier_wait(&smem.v_empty[ring.stage], ring.parity);
    ptx::mbarrier_arrive_expect_tx(&smem.v_full[ring.stage], Traits::kKVBytes);
    load_paged_keys<Traits>(p, parked, smem.v_stage(ring.stage), tm_v, &smem.v_full[ring.stage], key0, blk.h_kv);
  }
}

}  // namespace flashcore::sm90
