// Consumer warpgroups of the Hopper backward kernel above head dim 128 (BwdSm90Traits::kSplitHeadDim). A thread
// cannot hold dK and dV of 64 keys at head dim 256 (256 fp32 registers), so the two warpgroups share the block's
// 64 keys and split the head dim: warpgroup w keeps dK and dV of columns [kWgCols w, +kWgCols). A step (64 query
// rows of one head):
//   S^T_w  = K Q_w^T,  dP^T_w = V dO_w^T      (wgmma SS, n32: warpgroup w takes queries [32 w, +32) of the step,
//                                              all keys, the full head dim)
//   P^T_w, dS^T_w as in bwd_sm90_consumer.cuh, then written to shared memory: each warpgroup needs all 64 queries
//                                              of both for its columns
//   dV_w += P^T dO_w',  dK_w += dS^T Q_w'      (wgmma SS: A = P^T / dS^T K-major, B = the dO / Q columns of w
//                                              read MN-major)
//   dQ[:, chunk] = dS K[:, chunk]              (wgmma SS, both MN-major; kDqChunks 64-column chunks of w's
//                                              columns, staged one after the other for the dQ writer)
// P^T and dS^T are double-buffered by step parity: a warpgroup writes step i + 2's only after the step i + 1
// barrier, which the other passes only once its step-i GEMMs have retired. dO has one stage: it is released as
// soon as dV (its last reader) retires, so the next step's dO loads during dQ and dK.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../params.h"
#include "../common/pack.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/tma.cuh"
#include "../ptx/warpgroup.cuh"
#include "../ptx/wgmma_sm90.cuh"
#include "bwd_sm90_consumer.cuh"          // BwdRowStats, kBwdConsumerBarrier
#include "bwd_sm90_dq.cuh"                // dq_staging_offset, dq_staging_row
#include "bwd_sm90_traits.cuh"
#include "smem_desc.cuh"

namespace flashcore::sm90 {

template <typename Traits>
__device__ __forceinline__ void consume_bwd_wide(const BwdParams& p, const BwdBlock& blk,
                                                 const BwdSharedStorage<Traits>& smem,
                                                 const float* __restrict__ dsum) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim, kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages, kDoStages = Traits::kDoStages, kKSteps = kHeadDim / 16;
  constexpr int kWgCols = Traits::kWgCols, kDqChunks = Traits::kDqChunks;
  constexpr int kWgQueries = kBlockM / 2;  // queries of S^T / dP^T a warpgroup computes
  constexpr int kSVals = kWgQueries / 2, kQTiles = kWgQueries / 8;
  static_assert(kBlockN == 64 && kBlockM == 64, "one m64 key tile, 64-query steps");
  using MmaS = ptx::Wgmma<Element, kWgQueries>;  // S^T, dP^T: m64 (keys) x n32 (queries)
  using MmaKV = ptx::Wgmma<Element, kWgCols>;    // dK, dV: m64 (keys) x n kWgCols
  using MmaDQ = ptx::Wgmma<Element, 64>;         // dQ chunk: m64 (queries) x n64 (columns)

  const int tid = threadIdx.x;  // 0 .. kConsumerThreads - 1
  const int lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = ptx::warpgroup_index(tid);
  const int warp_row = ((tid >> 5) & 3) * 16;  // this warp's first key (and dQ query) inside the block's 64
  const uint32_t k_addr = ptx::smem_addr(smem.k), v_addr = ptx::smem_addr(smem.v);
  const Band& band = Traits::kVarlen ? varlen_consumer_band<Traits>(blk, smem, tid) : p.band;
  const TileRange unmasked =  // steps the mask can skip
      Traits::kVarlen ? blk.band.unmasked_query_tiles(blk.n0, kBlockN, kBlockM)
                      : p.band.unmasked_query_tiles(blk.n0, kBlockN, kBlockM);
  const int key_lo = blk.n0 + warp_row + g;  // keys of this thread's accumulator rows: key_lo, key_lo + 8
  const int q_lo = kWgQueries * wg;          // first query (in the step) of this warpgroup's S^T columns
  // Byte offset of this warpgroup's first column span in a Q/dO tile (spans of kBlockM rows x 128 bytes).
  const uint32_t col_span = (uint32_t)(kWgCols / 64 * wg) * kBlockM * 128;
  float* dq_stage = smem.dq_staging(wg);
  const BwdRowStats<Traits> row_stats(p, blk, smem, dsum, tid);

  float dk[kWgCols / 2], dv[kWgCols / 2];
#pragma unroll
  for (int i = 0; i < kWgCols / 2; ++i) dk[i] = dv[i] = 0.f;

  if (blk.steps > 0) {
    float first[BwdRowStats<Traits>::kPer];
    row_stats.load(BwdStepCursor(blk), first);
    row_stats.stage(0, first);
    ptx::named_barrier_sync(kBwdConsumerBarrier, Traits::kConsumerThreads);
    ptx::mbarrier_wait(smem.kv_full, 0);
    if constexpr (Traits::kVarlen) {
      if (blk.n0 + kBlockN > blk.seqlen_k) {  // block-uniform: the sequence's last key block
        zero_kv_past_end<Traits>(blk, smem, tid, Traits::kConsumerThreads, 0, kBlockN);
        ptx::named_barrier_sync(kBwdConsumerBarrier, Traits::kConsumerThreads);
      }
    }
  }

  BwdStepCursor cursor(blk);
  for (int step = 0; step < blk.steps; ++step, cursor = cursor.next()) {
    const int stage = step % kStages, do_stage = step % kDoStages;
    const int m0 = cursor.m0(kBlockM);
    float next_stat[BwdRowStats<Traits>::kPer];
    if (step + 1 < blk.steps) row_stats.load(cursor.next(), next_stat);
    const uint32_t q_addr = ptx::smem_addr(smem.q_stage(stage));
    const uint32_t do_addr = ptx::smem_addr(smem.dout_stage(do_stage));

    float s[kSVals], dp[kSVals];
    ptx::mbarrier_wait(&smem.qdo_full[stage], (step / kStages) & 1);
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      MmaS::ss(s, kmajor_desc(k_addr, kBlockN, 0, ks), kmajor_desc(q_addr, kBlockM, q_lo, ks), ks > 0);
    ptx::wgmma_commit();
    ptx::mbarrier_wait(&smem.do_full[do_stage], (step / kDoStages) & 1);
    ptx::wgmma_fence();  // else ptxas injects one (C7519): the wait sits between the fence above and dP's wgmma
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      MmaS::ss(dp, kmajor_desc(v_addr, kBlockN, 0, ks), kmajor_desc(do_addr, kBlockM, q_lo, ks), ks > 0);
    ptx::wgmma_commit();

    const float* stats = row_stats.buffer(step & 1);
    float2 lse[kQTiles], dsum_q[kQTiles];
    load_query_pairs<kQTiles>(stats, q_lo, t, lse);
    ptx::wgmma_wait<1>();
    ptx::fence_operand(s);
    const bool needs_mask = !unmasked.contains(cursor.m_index);
    uint32_t dtanh[kSVals / 2];  // score-mod variant only: 1 - tanh^2, fp16 pairs
    ScoreMod mod;
    if constexpr (Traits::kScoreMod) mod = step_score_mod<Traits>(p, blk, cursor.head);
    probabilities_t<kQTiles, Traits::kScoreMod>(s, dtanh, lse, p, mod, band, m0, q_lo, key_lo, needs_mask, t);
    load_query_pairs<kQTiles>(stats + kBlockM, q_lo, t, dsum_q);
    ptx::wgmma_wait<0>();
    ptx::fence_operand(dp);
    dscores_t<kQTiles, Traits::kScoreMod>(dp, s, dsum_q, dtanh);

    // This warpgroup's query columns of P^T and dS^T (rows = keys) to shared memory, the next step's lse/dsum
    // beside them; the fence and the barrier make every consumer's writes visible to every consumer's wgmma.
    Element* pt = smem.pt_buffer(step);
    Element* ds = smem.ds_buffer(step);
#pragma unroll
    for (int ni = 0; ni < kQTiles; ++ni) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int off = Traits::DsTile::elem_offset(warp_row + g + 8 * half, q_lo + ni * 8 + 2 * t);
        *reinterpret_cast<uint32_t*>(pt + off) =
            cuda::pack2<Element>(s[4 * ni + 2 * half], s[4 * ni + 2 * half + 1]);
        *reinterpret_cast<uint32_t*>(ds + off) =
            cuda::pack2<Element>(dp[4 * ni + 2 * half], dp[4 * ni + 2 * half + 1]);
      }
    }
    if (step + 1 < blk.steps) row_stats.stage((step + 1) & 1, next_stat);
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync(kBwdConsumerBarrier, Traits::kConsumerThreads);

    // dV, every dQ chunk, then dK: the dQ chunks are staged while the later GEMMs run.
    const uint32_t pt_addr = ptx::smem_addr(pt), ds_addr = ptx::smem_addr(ds);
    float dq[kDqChunks][32];
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      MmaKV::ss_bmn(dv, kmajor_desc(pt_addr, kBlockN, 0, kk), mnmajor_desc(do_addr + col_span, kBlockM, kk), true);
    ptx::wgmma_commit();
#pragma unroll
    for (int c = 0; c < kDqChunks; ++c) {
      const uint32_t k_chunk = k_addr + (uint32_t)(Traits::dq_col0(wg, c) / 64) * kBlockN * 128;
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        MmaDQ::ss_mn(dq[c], mnmajor_desc(ds_addr, kBlockN, kk), mnmajor_desc(k_chunk, kBlockN, kk), kk > 0);
      ptx::wgmma_commit();
    }
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      MmaKV::ss_bmn(dk, kmajor_desc(ds_addr, kBlockN, 0, kk), mnmajor_desc(q_addr + col_span, kBlockM, kk), true);
    ptx::wgmma_commit();

    static_assert(kDqChunks == 2, "the wait counts below are written for two dQ chunks");
    ptx::wgmma_wait<3>();  // groups retire in order: dV is done, so dO is no longer read
    ptx::fence_operand(dv);
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&smem.do_empty[do_stage]);

    // dQ chunk c (rows: queries m0 + warp_row + g (+ 8)) to the staging tile, then dq_full; the dQ writer
    // (bwd_sm90_producer.cuh) adds it to the accumulator through TMA and releases the tile (dq_empty).
    auto stage_dq = [&](float (&acc)[32], int chunk) {
      ptx::mbarrier_wait(&smem.dq_empty[wg], ptx::empty_parity(step * kDqChunks + chunk));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = dq_staging_row<Traits::kDqRowsInterleaved>(warp_row + g + 8 * half);
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
          *reinterpret_cast<float2*>(dq_stage + dq_staging_offset<kBlockM>(row, ni * 8 + 2 * t)) =
              make_float2(acc[4 * ni + 2 * half], acc[4 * ni + 2 * half + 1]);  // unscaled (kBwdDqAccum)
      }
      ptx::fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&smem.dq_full[wg]);
    };
    ptx::wgmma_wait<2>();
    ptx::fence_operand(dq[0]);
    stage_dq(dq[0], 0);
    ptx::wgmma_wait<1>();
    ptx::fence_operand(dq[1]);
    stage_dq(dq[1], 1);
    ptx::wgmma_wait<0>();
    ptx::fence_operand(dk);
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&smem.qdo_empty[stage]);  // Q of this stage is no longer read
  }

  write_dk_dv<Element, kWgCols, Traits::kVarlen>(dk, dv, p, blk, key_lo, kWgCols * wg, t);  // this warpgroup's columns
}

}  // namespace flashcore::sm90
