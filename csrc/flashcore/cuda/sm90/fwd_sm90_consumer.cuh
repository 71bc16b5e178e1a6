// Consumer warpgroups of the Hopper forward kernel: the two GEMMs on wgmma, masking and online softmax in
// registers (shared with the mma.sync family: the wgmma accumulator layout equals the m16n8k16 one), and the
// epilogue. Each warpgroup owns 64 query rows; the ring stages are released per warp as soon as the wgmma that
// read them has retired. Within a warpgroup the QK^T of the next tile and the PV of the previous one are in
// flight while the softmax runs (FlashAttention-3's intra-warpgroup pipelining), and the warpgroups take turns to
// issue their GEMMs (ping-pong, fwd_sm90_issue_turns.cuh).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../ptx/mbarrier.cuh"
#include "../ptx/tma.cuh"
#include "../ptx/warpgroup.cuh"
#include "../ptx/wgmma_sm90.cuh"
#include "../common/fragment_mask.cuh"
#include "../common/fragment_score_mod.cuh"
#include "../common/fwd_block.cuh"
#include "../common/online_softmax.cuh"
#include "../common/pack.cuh"
#include "fwd_sm90_issue_turns.cuh"
#include "fwd_sm90_split.cuh"
#include "smem_desc.cuh"
#include "fwd_sm90_traits.cuh"

namespace flashcore::sm90 {

// Hardware barrier shared by the consumer warpgroups only (the producer never uses it); 0 is __syncthreads.
constexpr uint32_t kConsumerBarrier = 1;

// Pack-GQA (varlen kernels; params.h: PackGqa): the query head, counted from the block's first, of the warp whose
// rows start at block row warp_row0: warp_row0 / p.pack.rows, as a division by the constant kBlockM (rows =
// kBlockM / heads), cheap to recompute where it is needed instead of held across the key loop. 0 otherwise.
template <typename Traits>
__device__ __forceinline__ int pack_head(const FwdParams& p, int warp_row0) {
  if constexpr (Traits::kVarlen)
    return warp_row0 * p.pack.heads / Traits::kBlockM;
  else
    return 0;
}

// The block as this warp's rows see it: under pack-GQA one query head of the block's group
// (cuda::packed_warp_view), else the block itself.
template <typename Traits, typename Block>
__device__ __forceinline__ Block warp_block(const Block& blk, const FwdParams& p, int warp_row0) {
  if constexpr (Traits::kVarlen)
    return cuda::packed_warp_view(blk, p, pack_head<Traits>(p, warp_row0));
  else
    return blk;
}

// One tile (query block) of the persistent loop: tile_count tiles and kv_count K/V ring uses came before it in
// this block, in the same order as the producer's (fwd_sm90_producer.cuh).
template <typename Traits>
__device__ __forceinline__ void consume_tile(const FwdParams& p, const cuda::FwdBlock<typename Traits::Element>& blk,
                                             const SharedStorage<Traits>& smem, const CUtensorMap* tm_o,
                                             int tile_count, int kv_count) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kStages = Traits::kStages;
  constexpr int kNTiles = kBlockN / 8, kDTiles = Traits::kHeadDim / 8, kKSteps = Traits::kHeadDim / 16;
  using MmaQK = ptx::Wgmma<Element, kBlockN>;
  using MmaPV = ptx::Wgmma<Element, Traits::kHeadDim>;

  const int lane = threadIdx.x & 31;
  const int wg = ptx::warpgroup_index(threadIdx.x);
  const int warp_row0 = wg * 64 + ((threadIdx.x >> 5) & 3) * 16;  // this warp's 16 rows inside the block
  // Pack-GQA: this warp's rows are query head blk.h + pack_head's, block row r its query
  // m0 - pack_head * p.pack.rows + r; the epilogue sees the block through warp_block.
  const uint32_t q_addr = ptx::smem_addr(smem.q);
  const uint32_t k_addr = ptx::smem_addr(smem.k);
  const uint32_t v_addr = ptx::smem_addr(smem.v);
  // Key blocks n_last, n_last - 1, ... (n_count of them: all of [0, blk.n_blocks) unless the block is one slice
  // of a key split).
  const int m0 = blk.m0, n_last = blk.n_blocks - 1, n_count = blk.n_blocks - blk.n_first;
  const Band& band = Traits::kVarlen ? blk.band : p.band;
  // Key tiles the mask can skip: those every query of the block sees (pack-GQA: p.pack.rows queries a head).
  const TileRange unmasked = band.unmasked_key_tiles(m0, Traits::kVarlen ? p.pack.rows : kBlockM, kBlockN);

  float o[1][kDTiles][4];
#pragma unroll
  for (int di = 0; di < kDTiles; ++di)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][di][e] = 0.f;
  float(&o_flat)[Traits::kHeadDim / 2] = *reinterpret_cast<float(*)[Traits::kHeadDim / 2]>(&o[0][0][0]);
  cuda::OnlineSoftmax<1, kNTiles, kDTiles> softmax;
  const int frag_row0 =
      m0 - (Traits::kVarlen ? pack_head<Traits>(p, warp_row0) * p.pack.rows : 0) + warp_row0 + (lane >> 2);
  const int frag_col_in_tile = 2 * (lane & 3);

  using STile = float[1][kNTiles][4];  // one key tile's scores (m16n8k16 C layout), then its P
  auto flat = [](STile& t) -> float(&)[kBlockN / 2] { return *reinterpret_cast<float(*)[kBlockN / 2]>(&t[0][0][0]); };
  STile s;
  float(&s_flat)[kBlockN / 2] = flat(s);
  uint32_t pa[kBlockN / 16][4];  // P of the previous tile as wgmma A fragments
  uint32_t(&pa_flat)[kBlockN / 4] = *reinterpret_cast<uint32_t(*)[kBlockN / 4]>(&pa[0][0]);

  // The plain kernel folds the (positive) scale into the softmax's exp2; the score-mod one transforms first.
  ScoreMod mod;
  if constexpr (Traits::kScoreMod)
    mod = ScoreMod::make(p.score, p.scale_log2, blk.b, blk.h + pack_head<Traits>(p, warp_row0));
  if constexpr (Traits::kVarlen) mod.alibi_offset = blk.seqlen_k - blk.seqlen_q;
  const float softmax_scale = Traits::kScoreMod ? cuda::folded_softmax_scale(mod) : p.scale_log2;

  // S = Q K^T of ring stage `stage` into t, issued asynchronously.
  auto issue_qk_into = [&](int stage, STile& t) {
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      MmaQK::ss(flat(t), kmajor_desc(q_addr, kBlockM, wg * 64, ks),
                kmajor_desc(k_addr + stage * Traits::kKVBytes, kBlockN, 0, ks), ks > 0);
    ptx::wgmma_commit();
  };
  auto issue_qk = [&](int stage) { issue_qk_into(stage, s); };
  // O += P V of ring stage `stage`, issued asynchronously.
  auto issue_pv = [&](int stage) {
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      MmaPV::rs(o_flat, pa[kk], mnmajor_desc(v_addr + stage * Traits::kKVBytes, kBlockN, kk), true);
    ptx::wgmma_commit();
  };
  // Transform (score-mod variant), mask and fold the scores t of key tile n_block into the running softmax; t
  // becomes P. Logits before the mask, so that hidden keys stay -inf whatever the transform.
  auto softmax_on = [&](int n_block, float (&correction)[2], STile& t) {
    if constexpr (Traits::kScoreMod)
      cuda::apply_score_mod</*kFoldSoftcap=*/true>(t, frag_row0, n_block * kBlockN + frag_col_in_tile, mod);
    if (!unmasked.contains(n_block))
      cuda::apply_mask(t, frag_row0, n_block * kBlockN + frag_col_in_tile, band);
    return softmax.step(t, softmax_scale, correction);
  };
  auto softmax_step = [&](int n_block, float (&correction)[2]) { return softmax_on(n_block, correction, s); };
  // P (in t) as the A fragments of the P V wgmma.
  auto pack_from = [&](const STile& t) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      pa[kk][0] = cuda::pack2<Element>(t[0][2 * kk][0], t[0][2 * kk][1]);
      pa[kk][1] = cuda::pack2<Element>(t[0][2 * kk][2], t[0][2 * kk][3]);
      pa[kk][2] = cuda::pack2<Element>(t[0][2 * kk + 1][0], t[0][2 * kk + 1][1]);
      pa[kk][3] = cuda::pack2<Element>(t[0][2 * kk + 1][2], t[0][2 * kk + 1][3]);
    }
  };
  auto pack_p = [&] { pack_from(s); };
  // Waits until at most kPending wgmma groups are in flight (the P V of the previous tile has retired: o and pa
  // are free), then rescales o. The row sums (which every exp2 of the softmax feeds) are first stored to this
  // warp's scratch slot: ptxas hoisted the WARPGROUP.DEPBAR above the whole softmax otherwise (in every sm90
  // forward kernel), and the softmax then waited for the P V it is meant to overlap (tests/test_sass.py checks the
  // order).
  const uint32_t order_slot = ptx::smem_addr(smem.order_slots + (threadIdx.x >> 5));
  auto wait_pv_then_rescale = [&](auto pending_constant, const float(&correction)[2], bool moved) {
    constexpr int kPending = decltype(pending_constant)::value;
    ptx::store_before_wait(order_slot, softmax.row_sum[0], softmax.row_sum[1], lane == 0);
    ptx::wgmma_wait<kPending>();
    ptx::fence_operand(o_flat);
    ptx::fence_operand(pa_flat);
    softmax.rescale(o, correction, moved);
  };

  auto full_parity = [&](int use) { return (uint32_t)((use / kStages) & 1); };
  // Varlen: rows of the first key tile walked (n_last) past the sequence's keys lie inside the packed tensors (the
  // next sequence's rows, or below seqused_k's end whatever the caller's buffer holds, a KV cache's unwritten
  // slots). P is 0 there, but 0 x NaN is NaN in P V, so the consumers zero those V rows once they have landed,
  // before any P V: the rows are shared out over all consumer threads, which then meet at their barrier. Called
  // where no wgmma is in flight and every consumer warpgroup arrives (block-uniform condition).
  auto zero_v_past_end = [&] {
    if constexpr (Traits::kVarlen) {
      const int from = blk.seqlen_k - n_last * kBlockN;
      if (n_count > 0 && from < kBlockN) {
        const int first = kv_count % kStages;
        ptx::mbarrier_wait(&smem.v_full[first], full_parity(kv_count));
        Traits::KVTile::zero_rows(smem.v_stage(first), from, kBlockN, threadIdx.x, Traits::kConsumerThreads);
        ptx::fence_proxy_async_shared();  // the generic writes, before the wgmma's (async proxy) reads
        ptx::named_barrier_sync(kConsumerBarrier, Traits::kConsumerThreads);
      }
    }
  };
  // With a separate O buffer, each warp hands Q back once its last Q K^T has retired (the other GEMM, P V,
  // reads V and registers only), so the producer loads the next tile's Q behind this tile's tail.
  auto release_q = [&] {
    if constexpr (Traits::kSeparateO) {
      if (lane == 0) ptx::mbarrier_arrive(smem.q_empty);
    }
  };
  // Two score buffers (one-warpgroup blocks with long key walks): tile it's S is in buffer it & 1 and is issued
  // one step ahead, so the tensor cores run S of tile it + 1 (and P V of tile it - 1) during the softmax of tile
  // it; a lone warpgroup has no ping-pong partner to fill them, and the loop below leaves S's issue and latency
  // exposed (~370 of ~1 630 cycles a tile, H100 timeline, head dim 64). Its code is unrolled by two with distinct
  // tails, each copy cold in the instruction cache once per block, so it pays only on long walks (graph us:
  // 4 tiles 5.24 -> 5.74, 8 tiles 8.96 -> 9.02, 32 tiles 28.99 -> 27.07; docs/PERFORMANCE.md).
  // Every wgmma issue and wait is unconditional on each path, and the pending group (S of the next tile, into
  // buffer 1) is the same at each pair boundary: where ptxas cannot track what is in flight it serializes every
  // wgmma of the kernel (an earlier form: 48 of 48 HGMMAs followed by a wait 0).
  auto consume_key_tiles_two_buffers = [&] {
    STile buf[2];
    float correction[2];
    const int first = kv_count % kStages, second = (kv_count + 1) % kStages;
    ptx::mbarrier_wait(&smem.k_full[first], full_parity(kv_count));
    issue_qk_into(first, buf[0]);
    ptx::wgmma_wait<0>();
    ptx::fence_operand(flat(buf[0]));
    if (lane == 0) ptx::mbarrier_arrive(&smem.k_empty[first]);
    zero_v_past_end();
    ptx::mbarrier_wait(&smem.k_full[second], full_parity(kv_count + 1));
    issue_qk_into(second, buf[1]);
    softmax_on(n_last, correction, buf[0]);
    pack_from(buf[0]);
    // Step it: in flight at its top, S of tile it. Issue P V of tile it - 1; wait for S (groups retire in order);
    // with kMore, issue S of tile it + 1 into the other buffer; softmax; wait for P V (o and pa are its
    // operands) before the rescale and the new P.
    auto step = [&](auto cur_constant, auto more_constant, int it) {
      constexpr int cur = decltype(cur_constant)::value;
      constexpr bool kMore = decltype(more_constant)::value;
      const int use = kv_count + it;
      const int stage = use % kStages, prev = (use - 1) % kStages;
      ptx::mbarrier_wait(&smem.v_full[prev], full_parity(use - 1));
      issue_pv(prev);
      ptx::wgmma_wait<1>();
      ptx::fence_operand(flat(buf[cur]));
      if (lane == 0) ptx::mbarrier_arrive(&smem.k_empty[stage]);
      if constexpr (kMore) {
        const int next = (use + 1) % kStages;
        ptx::mbarrier_wait(&smem.k_full[next], full_parity(use + 1));
        issue_qk_into(next, buf[cur ^ 1]);
      } else {
        release_q();
      }
      const bool moved = softmax_on(n_last - it, correction, buf[cur]);
      wait_pv_then_rescale(std::integral_constant<int, kMore ? 1 : 0>{}, correction, moved);
      if (lane == 0) ptx::mbarrier_arrive(&smem.v_empty[prev]);
      pack_from(buf[cur]);
    };
    using One = std::integral_constant<int, 1>;
    using Zero = std::integral_constant<int, 0>;
    int it = 1;
    for (; it + 2 < n_count; it += 2) {
      step(One{}, std::true_type{}, it);
      step(Zero{}, std::true_type{}, it + 1);
    }
    if (it + 1 < n_count) {
      step(One{}, std::true_type{}, it);
      step(Zero{}, std::false_type{}, it + 1);
    } else {
      step(One{}, std::false_type{}, it);
    }
    const int last_use = kv_count + n_count - 1, last = last_use % kStages;
    ptx::mbarrier_wait(&smem.v_full[last], full_parity(last_use));
    issue_pv(last);
    ptx::wgmma_wait<0>();
    ptx::fence_operand(o_flat);
    ptx::fence_operand(pa_flat);
    if (lane == 0) ptx::mbarrier_arrive(&smem.v_empty[last]);
  };
  ptx::mbarrier_wait(smem.q_full, tile_count & 1);
  if (Traits::kScoreBuffers == 2 && n_count >= Traits::kDeepMinTiles) {
    consume_key_tiles_two_buffers();  // the whole key walk, its last P V included
  } else if (n_count > 0) {
    float correction[2];

#ifdef FLASHCORE_SM90_NO_PINGPONG  // ablation builds only
    IssueTurns<1> turns(0, n_count + 1);
#else
    IssueTurns<Traits::kWarpgroups> turns(wg, n_count + 1);
#endif

    // Tile 0: S, softmax, P (o is still zero: nothing to rescale).
    const int first = kv_count % kStages;
    turns.begin();
    ptx::mbarrier_wait(&smem.k_full[first], full_parity(kv_count));
    issue_qk(first);
    turns.end();
    ptx::wgmma_wait<0>();
    ptx::fence_operand(s_flat);
    if (lane == 0) ptx::mbarrier_arrive(&smem.k_empty[first]);
    zero_v_past_end();
    if (n_count == 1) release_q();
    softmax_step(n_last, correction);
    pack_p();

    // Intra-warpgroup overlap: S of tile `it` runs on the tensor cores behind O += P V of tile it - 1, and the
    // softmax of tile it runs while that P V is still in flight. Only then is o rescaled (it is an operand of
    // the in-flight MMA until wait_group 0).
    for (int it = 1; it < n_count; ++it) {
      const int use = kv_count + it;
      const int stage = use % kStages, prev = (use - 1) % kStages;
      turns.begin();
      ptx::mbarrier_wait(&smem.k_full[stage], full_parity(use));
      issue_qk(stage);
      ptx::mbarrier_wait(&smem.v_full[prev], full_parity(use - 1));
      issue_pv(prev);
      turns.end();
      ptx::wgmma_wait<1>();  // groups retire in order: S of tile it is ready
      ptx::fence_operand(s_flat);
      if (lane == 0) ptx::mbarrier_arrive(&smem.k_empty[stage]);
      if (it == n_count - 1) release_q();
      const bool moved = softmax_step(n_last - it, correction);
      wait_pv_then_rescale(std::integral_constant<int, 0>{}, correction, moved);  // P V of tile it - 1
      if (lane == 0) ptx::mbarrier_arrive(&smem.v_empty[prev]);
      pack_p();
    }

    const int last_use = kv_count + n_count - 1, last = last_use % kStages;
    turns.begin();
    ptx::mbarrier_wait(&smem.v_full[last], full_parity(last_use));
    issue_pv(last);
    turns.end();
    ptx::wgmma_wait<0>();
    ptx::fence_operand(o_flat);
    ptx::fence_operand(pa_flat);
    if (lane == 0) ptx::mbarrier_arrive(&smem.v_empty[last]);
  } else {
    release_q();
  }

  const cuda::FwdBlock<Element> wblk = warp_block<Traits>(blk, p, warp_row0);  // its query head (pack-GQA)
  float lse[2];
  // A key split's sink is counted once, by rank 0 (the merge adds the other slices to it).
  softmax.finalize(o, lse, blk.split_rank == 0 ? cuda::sink_log2(p, wblk.h) : -INFINITY);
  if constexpr (Traits::kSplitKeys) {
    if (blk.num_splits > 1 && !merge_key_splits<Traits>(o_flat, lse, smem, blk)) return;
  }
  // The staging buffer is free: with kSeparateO, once the previous tile's TMA store has read it (only thread 0,
  // which issued that store, can wait for it); otherwise (O staged in Q) once every consumer's wgmma reads of Q
  // have retired (wait_group 0 above). The barrier makes either true for all consumers.
  if constexpr (Traits::kSeparateO) {
    if (threadIdx.x == 0) ptx::bulk_wait_group_read<0>();
  }
  ptx::named_barrier_sync(kConsumerBarrier, Traits::kConsumerThreads);
  // The compact variant writes its LSE after the proxy fence below (a MEMBAR.ALL.CTA in SASS, which would wait
  // for these global stores) and the TMA store's issue; the others here, where their registers allow (head dim
  // 256's one-warpgroup variant spilled 196 B with the LSE held past the staging).
  if constexpr (Traits::kCompact)
    cuda::stage_output_tile<typename Traits::QTile>(o, smem.o, warp_row0, lane);
  else
    cuda::stage_output<typename Traits::QTile>(o, lse, smem.o, wblk, p, warp_row0, lane);
  // The staged O (generic-proxy writes) is made visible to TMA (async proxy) by each writer's fence and the
  // barrier; then one thread stores the tile, one 64-column box a span (rows past seqlen_q and columns past
  // head_dim are clipped by TMA). Without kSeparateO the Q/O buffer goes back to the producer's next Q load only
  // once TMA has read it: that thread's warp arrives on q_empty after the bulk group's reads completed.
  if constexpr (Traits::kVarlen) {
    // Bounded 16-byte stores of the sequence's rows (a TMA store would write past its end, into the next one).
    // Each warp stores the 16 rows it staged, so only its own writes precede its reads (a block-wide handoff
    // through the consumers' barrier drew intermittent racecheck reports); then the staging buffer (Q's, without
    // kSeparateO) goes back to the producer once every warp has arrived on q_empty.
    cuda::store_warp_rows<typename Traits::QTile, 16>(smem.o, wblk.out, p.out_stride.seq, wblk.m0, warp_row0,
                                                      blk.seqlen_q, (int)p.head_dim, lane);
    if constexpr (!Traits::kSeparateO) {
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(smem.q_empty);
    }
    return;
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(kConsumerBarrier, Traits::kConsumerThreads);
  if (threadIdx.x == 0) {
    const int b = blk.b, h = blk.h;
#pragma unroll
    for (int span = 0; span < Traits::kSpans; ++span)
      ptx::tma_store_4d(tm_o, smem.o + span * kBlockM * 64, span * 64, m0, h, b);
    ptx::bulk_commit_group();
    if constexpr (!Traits::kSeparateO) ptx::bulk_wait_group_read<0>();
  }
  if constexpr (Traits::kCompact) cuda::write_lse<1>(lse, blk, p, warp_row0, lane);
  if constexpr (!Traits::kSeparateO) {
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(smem.q_empty);
  }
}

// After the block's last tile: its shared memory must outlive the reads of the last TMA store. Not the global
// writes: they are visible once the grid completes, and waiting for them here kept each block of a one-tile
// grid resident longer (H100, 4x16x8192x128 bf16: 3-4 % slower).
__device__ __forceinline__ void finish_output_stores() {
  if (threadIdx.x == 0) ptx::bulk_wait_group_read<0>();
}

}  // namespace flashcore::sm90
