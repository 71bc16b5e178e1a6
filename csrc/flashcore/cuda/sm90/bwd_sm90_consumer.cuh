// Consumer warpgroups of the Hopper backward kernel. Warpgroup w owns keys [n0 + 64 w, +64) of the block and keeps
// their dK and dV in registers. A step (kBlockM = 64, 80 or 128 query rows of one head) works transposed, keys as the
// M dimension, so that P^T and dS^T come out of the accumulators already in the A-operand layout of the dV and dK
// GEMMs:
//   S^T  = K_w Q^T,  dP^T = V_w dO^T                (wgmma, both operands in shared memory)
//   P^T  = exp2(S^T * scale_log2 - lse_log2[query])  (masked entries -> 0; rows past the end have lse = +inf)
//   dS^T = P^T * (dP^T - dsum[query])
//   dV_w += P^T dO                                   (wgmma, A from registers, B = the dO tile read MN-major;
//                                                     issued before dS is computed where registers allow)
//   dQ   = dS K                                      (wgmma, dS^T staged in shared memory and read M-major; the
//                                                     warpgroups split it, bwd_sm90_config.cuh kDqSplit;
//                                                     80-row steps: dQ^T = K^T dS^T, dS stored query-major)
//   dK_w += dS^T Q                                   (like dV; issued last, so it hides dQ's staging)
// dQ is staged in shared memory for the dQ writer (bwd_sm90_producer.cuh), which adds it to the fp32 accumulator
// in global memory with TMA reductions. The per-query lse/dsum of the next step are loaded from global memory
// during this one and staged in shared memory at the step's barrier.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../params.h"
#include "../common/fragment_mask.cuh"
#include "../common/fragment_score_mod.cuh"
#include "../common/pack.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/stmatrix.cuh"
#include "../ptx/tma.cuh"
#include "../ptx/warpgroup.cuh"
#include "../ptx/wgmma_sm90.cuh"
#include "bwd_sm90_dq.cuh"
#include "bwd_sm90_traits.cuh"
#include "smem_desc.cuh"

namespace flashcore::sm90 {

// Hardware barrier of the consumer threads (the producer never uses it); 0 is __syncthreads.
constexpr uint32_t kBwdConsumerBarrier = 1;
// The TMA epilogue's barrier of both consumer warpgroups: its own id, since with dQ split by keys barriers 1 and 2
// are the warpgroups' private step barriers, and one warpgroup may reach the epilogue steps ahead of the other.
constexpr uint32_t kBwdEpilogueBarrier = 3;

// Packs an m64nN fp32 accumulator (this thread's N / 2 values) into the N / 16 k16 A fragments of the next GEMM.
template <typename Element, int kVals>
__device__ __forceinline__ void pack_a_fragments(const float (&acc)[kVals], uint32_t (&frag)[kVals / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kVals / 8; ++kk) {
    frag[kk][0] = cuda::pack2<Element>(acc[8 * kk + 0], acc[8 * kk + 1]);
    frag[kk][1] = cuda::pack2<Element>(acc[8 * kk + 2], acc[8 * kk + 3]);
    frag[kk][2] = cuda::pack2<Element>(acc[8 * kk + 4], acc[8 * kk + 5]);
    frag[kk][3] = cuda::pack2<Element>(acc[8 * kk + 6], acc[8 * kk + 7]);
  }
}

// The per-query lse and dsum of a step, staged in shared memory for the consumers: values [0, kBlockM) are lse
// (log2 units; +inf past the end and for rows that saw no key, so P = 0 there), [kBlockM, 2 kBlockM) dsum (0 past
// the end), of query row m0 + v % kBlockM. Split keys, each warpgroup stages its own copy; else the consumers
// stage one. The loads are issued a step ahead and converted only when staged, so no warp waits on them
// (converting at once would).
template <typename Traits>
struct BwdRowStats {
  static constexpr int kBlockM = Traits::kBlockM, kValues = 2 * kBlockM;
  static constexpr bool kPerWarpgroup = Traits::kDqSplitKeys;
  static constexpr int kGroup = kPerWarpgroup ? 128 : Traits::kConsumerThreads;  // threads staging one copy
  static constexpr int kPer = (kValues + kGroup - 1) / kGroup;                    // values a thread stages
  const BwdParams& p;
  const BwdBlock& blk;
  const BwdSharedStorage<Traits>& smem;
  const float* __restrict__ dsum;
  int local, copy;

  __device__ __forceinline__ BwdRowStats(const BwdParams& p_, const BwdBlock& blk_,
                                         const BwdSharedStorage<Traits>& smem_, const float* __restrict__ dsum_,
                                         int tid)
      : p(p_), blk(blk_), smem(smem_), dsum(dsum_), local(tid % kGroup), copy(kPerWarpgroup ? tid / 128 : 0) {}

  __device__ __forceinline__ const float* buffer(int parity) const { return smem.row_stats_buffer(parity, copy); }
  __device__ __forceinline__ void load(const BwdStepCursor& step, float (&raw)[kPer]) const {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int v = local + j * kGroup;
      const int row = step.m0(kBlockM) + v % kBlockM;
      raw[j] = 0.f;
      if (v >= kValues) continue;
      int64_t idx;
      if constexpr (Traits::kVarlen) {
        if (row >= blk.seqlen_q) {
          raw[j] = v < kBlockM ? -INFINITY : 0.f;
          continue;
        }
        idx = step.head * p.varlen.total_q + blk.q_begin + row;
      } else {
        if (row >= (int)p.seqlen_q) {
          raw[j] = v < kBlockM ? -INFINITY : 0.f;
          continue;
        }
        idx = (blk.b * p.heads_q + step.head) * p.seqlen_q + row;
      }
      raw[j] = v < kBlockM ? p.lse[idx] : dsum[idx];
    }
  }
  __device__ __forceinline__ void stage(int parity, const float (&raw)[kPer]) const {
    float* out = smem.row_stats_buffer(parity, copy);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int v = local + j * kGroup;
      if (v < kValues) out[v] = v >= kBlockM ? raw[j] : raw[j] == -INFINITY ? INFINITY : raw[j] * 1.4426950408889634f;
    }
  }
};

// This thread's per-query values of a step (query columns col0 + 8 ni + 2t and + 1) from a staged row-stat array.
// Loaded into registers before the wgmma wait they follow: read after it, their shared-memory latency (behind the
// wgmma operand traffic) stalled the first exp2 of every step (ncu source counters).
template <int kQTiles>
__device__ __forceinline__ void load_query_pairs(const float* values, int col0, int t, float2 (&out)[kQTiles]) {
#pragma unroll
  for (int ni = 0; ni < kQTiles; ++ni) out[ni] = *reinterpret_cast<const float2*>(values + col0 + ni * 8 + 2 * t);
}

// The same pairs read from shared memory where they are used (pairs[ni]), for code that has no registers to hold
// them all ahead.
struct StagedQueryPairs {
  const float2* first;  // this thread's pair of n8 tile 0
  __device__ __forceinline__ StagedQueryPairs(const float* values, int col0, int t)
      : first(reinterpret_cast<const float2*>(values + col0 + 2 * t)) {}
  __device__ __forceinline__ float2 operator[](int ni) const { return first[4 * ni]; }
};

// P^T in place of S^T (kQTiles n8 tiles of this thread's accumulator rows, keys key_lo and key_lo + 8; query
// columns col0 + 8 ni + 2t (+1) of the step, their lse in log2 units from load_query_pairs): masked entries -> 0.
// Scale, mask and exp2 are three passes: with the mask inside the exp2 loop, every element carried a branch and a
// 64-bit compare (SASS: FFMA, BRA, PLOP3, MUFU per element) and the exp2s issued one at a time. The mask comes
// after the scaling, so that a zero or negative scale cannot turn a hidden -inf into NaN or +inf.
// kScoreMod (the score-mod variant, score_mod.h): the scores become logits first (softcap, ALiBi), and dtanh
// receives each element's 1 - tanh^2 for dscores_t, packed as fp16 pairs (in [0, 1], 2^-11 relative: below the
// rounding of dS itself; fp32 would cost the consumers 2 x kQTiles registers they do not have and spill); otherwise
// the scale is one FFMA with the lse. LsePairs: load_query_pairs' registers, or StagedQueryPairs.
template <int kQTiles, bool kScoreMod, typename LsePairs>
__device__ __forceinline__ void probabilities_t(float (&s)[4 * kQTiles], uint32_t (&dtanh)[2 * kQTiles],
                                                const LsePairs& lse_log2, const BwdParams& p,
                                                const ScoreMod& mod, const Band& band, int m0, int col0, int key_lo,
                                                bool needs_mask, int t) {
  if constexpr (kScoreMod) cuda::apply_score_mod_transposed<kQTiles>(s, dtanh, key_lo, m0 + col0 + 2 * t, mod);
#pragma unroll
  for (int ni = 0; ni < kQTiles; ++ni) {
    const float2 lse = lse_log2[ni];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float l = (e & 1) ? lse.y : lse.x;
      s[4 * ni + e] = kScoreMod ? s[4 * ni + e] - l : s[4 * ni + e] * p.scale_log2 - l;
    }
  }
  if (needs_mask) cuda::apply_mask_transposed<kQTiles>(s, key_lo, m0 + col0 + 2 * t, band);
#pragma unroll
  for (int i = 0; i < 4 * kQTiles; ++i) s[i] = exp2f(s[i]);
}

// x[4 ni + e] *= the fp16 pair dtanh[2 ni + e / 2]'s element e % 2 (probabilities_t's packing).
template <int kQTiles>
__device__ __forceinline__ void scale_by_fp16_pairs(float (&x)[4 * kQTiles], const uint32_t (&dtanh)[2 * kQTiles]) {
#pragma unroll
  for (int ni = 0; ni < kQTiles; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const __half2 h = *reinterpret_cast<const __half2*>(&dtanh[2 * ni + (e >> 1)]);
      x[4 * ni + e] *= __half2float((e & 1) ? h.y : h.x);
    }
}

// dS^T = P^T * (dP^T - dsum[query]) in place of dP^T, for the same columns as probabilities_t; times the
// softcap's derivative where kScoreMod (the consumers that did not fold it into P's copy already).
template <int kQTiles, bool kScoreMod>
__device__ __forceinline__ void dscores_t(float (&dp)[4 * kQTiles], const float (&pt)[4 * kQTiles],
                                          const float2 (&dsum)[kQTiles], const uint32_t (&dtanh)[2 * kQTiles]) {
#pragma unroll
  for (int ni = 0; ni < kQTiles; ++ni) {
    const float2 d = dsum[ni];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dp[4 * ni + e] = pt[4 * ni + e] * (dp[4 * ni + e] - ((e & 1) ? d.y : d.x));
    }
  }
  if constexpr (kScoreMod) scale_by_fp16_pairs<kQTiles>(dp, dtanh);
}

// Epilogue: dK (scaled) and dV of this thread's two keys (key_lo, key_lo + 8), columns col0 + 8 ni + 2t (+1),
// straight from the accumulators. Varlen: keys of the sequence from its first row (the batch stride is 0).
template <typename Element, int kCols, bool kVarlen>
__device__ __forceinline__ void write_dk_dv(const float (&dk)[kCols / 2], const float (&dv)[kCols / 2],
                                            const BwdParams& p, const BwdBlock& blk, int key_lo, int col0, int t) {
  Element* dk_out = static_cast<Element*>(p.dk) + blk.b * p.dk_stride.batch + blk.h_kv * p.dk_stride.head;
  Element* dv_out = static_cast<Element*>(p.dv) + blk.b * p.dv_stride.batch + blk.h_kv * p.dv_stride.head;
  if constexpr (kVarlen) {
    dk_out += (int64_t)blk.k_begin * p.dk_stride.seq;
    dv_out += (int64_t)blk.k_begin * p.dv_stride.seq;
  }
  const int head_dim = (int)p.head_dim;
  const int seqlen_k = kVarlen ? blk.seqlen_k : (int)p.seqlen_k;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key_lo + 8 * half;
    if (key >= seqlen_k) continue;
#pragma unroll
    for (int ni = 0; ni < kCols / 8; ++ni) {
      const int col = col0 + ni * 8 + 2 * t;
      if (col >= head_dim) continue;
      *reinterpret_cast<uint32_t*>(dk_out + key * p.dk_stride.seq + col) =
          cuda::pack2<Element>(dk[4 * ni + 2 * half] * p.scale, dk[4 * ni + 2 * half + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dv_out + key * p.dv_stride.seq + col) =
          cuda::pack2<Element>(dv[4 * ni + 2 * half], dv[4 * ni + 2 * half + 1]);
    }
  }
}

// Epilogue through shared memory and TMA: each warpgroup packs its dK (scaled) and dV to 16 bits and writes them
// with stmatrix into its 64 rows of the K and V tiles, in the layout they were loaded in (free once both
// warpgroups' last GEMMs retired: dQ reads every row of K); then one thread a warpgroup stores 64 x 64 boxes, which
// TMA writes as whole 128-byte lines, dropping columns past head_dim (and, dense, rows past seqlen_k). The direct
// stores (write_dk_dv) write 16 bytes of a row per instruction. Varlen: the tensor maps cover the packed rows, so
// a box past the sequence's last key would write the next sequence's rows; a warpgroup whose 64 keys are not all
// the sequence's stores directly, after the same two barriers (the other warpgroup waits at them).
template <typename Traits>
__device__ __forceinline__ void write_dk_dv_tma(float (&dk)[Traits::kHeadDim / 2], float (&dv)[Traits::kHeadDim / 2],
                                                const BwdParams& p, const BwdBlock& blk,
                                                const BwdSharedStorage<Traits>& smem, const CUtensorMap* tm_dk,
                                                const CUtensorMap* tm_dv, int key_lo, int tid) {
  using Element = typename Traits::Element;
  constexpr int kFrags = Traits::kHeadDim / 16;
  const int lane = tid & 31, wg = ptx::warpgroup_index(tid), warp_row = ((tid >> 5) & 3) * 16;
  const int key0 = blk.n0 + 64 * wg;  // the warpgroup's first key
  const bool whole = !Traits::kVarlen || key0 + 64 <= blk.seqlen_k;  // warpgroup-uniform
  ptx::named_barrier_sync(kBwdEpilogueBarrier, Traits::kConsumerThreads);  // every GEMM reading K and V retired
  if (whole) {
#pragma unroll
    for (int i = 0; i < Traits::kHeadDim / 2; ++i) dk[i] *= p.scale;
    uint32_t frag[kFrags][4];
    // Lane l addresses row l % 8 + 8 ((l / 8) % 2) of the warp's 16 keys, 8-column half l / 16 of block kk (the
    // stmatrix.x4 order of an A fragment, as for dS^T in bwd_sm90_dq.cuh).
    const int row = 64 * wg + warp_row + (lane & 7) + (lane & 8);
    pack_a_fragments<Element>(dk, frag);
#pragma unroll
    for (int kk = 0; kk < kFrags; ++kk)
      ptx::stmatrix_x4(ptx::smem_addr(smem.k + Traits::KVTile::chunk_offset(row, 2 * kk + (lane >> 4))), frag[kk]);
    pack_a_fragments<Element>(dv, frag);
#pragma unroll
    for (int kk = 0; kk < kFrags; ++kk)
      ptx::stmatrix_x4(ptx::smem_addr(smem.v + Traits::KVTile::chunk_offset(row, 2 * kk + (lane >> 4))), frag[kk]);
    ptx::fence_proxy_async_shared();  // the stores, visible to TMA
  }
  ptx::named_barrier_sync(kBwdEpilogueBarrier, Traits::kConsumerThreads);
  if (!whole) {
    write_dk_dv<Element, Traits::kHeadDim, Traits::kVarlen>(dk, dv, p, blk, key_lo, 0, tid & 3);
  } else if (tid % 128 == 0) {
    // Varlen: the packed tensors are one batch entry; the sequence's keys start at k_begin.
    const int row0 = Traits::kVarlen ? blk.k_begin + key0 : key0, b = Traits::kVarlen ? 0 : (int)blk.b;
#pragma unroll
    for (int span = 0; span < Traits::kSpans; ++span) {
      const int offset = span * Traits::kBlockN * 64 + 64 * wg * 64;
      ptx::tma_store_4d(tm_dk, smem.k + offset, span * 64, row0, (int)blk.h_kv, b);
      ptx::tma_store_4d(tm_dv, smem.v + offset, span * 64, row0, (int)blk.h_kv, b);
    }
    ptx::bulk_commit_group();
    ptx::bulk_wait_group_read<0>();  // shared memory stays valid until TMA has read it
  }
}

// Varlen: the band the consumers mask with, their sequence's, which the first thread of each warpgroup copies to
// the warpgroup's shared slot (the consumers have no registers to hold it across their loop). The copy is read
// only after the warpgroup's first barrier; until then (the block's unmasked tiles) blk.band serves. Dense
// kernels read the call's band from the parameters instead (no registers either).
template <typename Traits>
__device__ __forceinline__ const Band& varlen_consumer_band(const BwdBlock& blk, const BwdSharedStorage<Traits>& smem,
                                                            int tid) {
  Band* slot = smem.seq_band + tid / 128;
  if (tid % 128 == 0) *slot = blk.band;
  return *slot;
}

// The score transform of a step's head; varlen: ALiBi's distance from the sequence's own aligned diagonal.
template <typename Traits>
__device__ __forceinline__ ScoreMod step_score_mod(const BwdParams& p, const BwdBlock& blk, int head) {
  ScoreMod mod = ScoreMod::make(p.score, p.scale_log2, blk.b, head);
  if constexpr (Traits::kVarlen) mod.alibi_offset = blk.seqlen_k - blk.seqlen_q;
  return mod;
}

// Varlen: the K and V rows of a sequence's last key block past its keys lie inside the packed tensors (the next
// sequence's rows, or past seqused_k whatever the caller's buffer holds, a KV cache's unwritten slots). P and dS
// are 0 there, but 0 x NaN is NaN in dP = dO V^T and dQ = dS K, so the consumers zero those rows of
// [row_begin, row_end) once K and V have landed (thread `thread` of `threads`), then fence them for the wgmma's
// reads; the caller syncs the threads that read the rows. Dense blocks need none of it: TMA zero-fills past Sk.
template <typename Traits>
__device__ __forceinline__ void zero_kv_past_end(const BwdBlock& blk, const BwdSharedStorage<Traits>& smem, int thread,
                                                 int threads, int row_begin, int row_end) {
  const int from = max(row_begin, blk.seqlen_k - blk.n0);
  Traits::KVTile::zero_rows(smem.k, from, row_end, thread, threads);
  Traits::KVTile::zero_rows(smem.v, from, row_end, thread, threads);
  ptx::fence_proxy_async_shared();
}

// tm_dk / tm_dv: dK and dV's tensor maps for the TMA epilogue, or nullptr for the direct stores (tensors TMA
// cannot describe, or FLASHCORE_BWD_TMA_EPILOGUE=0).
template <typename Traits>
__device__ __forceinline__ void consume_bwd(const BwdParams& p, const BwdBlock& blk,
                                            const BwdSharedStorage<Traits>& smem, const float* __restrict__ dsum,
                                            const CUtensorMap* tm_dk, const CUtensorMap* tm_dv) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim, kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages, kKSteps = kHeadDim / 16;
  constexpr int kSVals = kBlockM / 2, kQTiles = kBlockM / 8, kQSteps = kBlockM / 16;  // S^T: n8 tiles, k16 steps
  using MmaS = ptx::Wgmma<Element, kBlockM>;     // S^T, dP^T: m64 (keys) x n kBlockM (queries)
  using MmaKV = ptx::Wgmma<Element, kHeadDim>;   // dK, dV: m64 (keys) x n kHeadDim

  const int tid = threadIdx.x;  // 0 .. kConsumerThreads - 1
  const int lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = ptx::warpgroup_index(tid);
  const int warp_row = ((tid >> 5) & 3) * 16;  // this warp's first row inside the warpgroup's 64
  const uint32_t k_addr = ptx::smem_addr(smem.k), v_addr = ptx::smem_addr(smem.v);
  const Band& band = Traits::kVarlen ? varlen_consumer_band<Traits>(blk, smem, tid) : p.band;
  const TileRange unmasked =  // steps the mask can skip
      Traits::kVarlen ? blk.band.unmasked_query_tiles(blk.n0, kBlockN, kBlockM)
                      : p.band.unmasked_query_tiles(blk.n0, kBlockN, kBlockM);
  const int key_lo = blk.n0 + 64 * wg + warp_row + g;  // keys of this thread's accumulator rows: key_lo, key_lo + 8
  // dS to shared memory, dQ's GEMM and its staging (bwd_sm90_dq.cuh).
  const BwdDqStep<Traits> dq_step(wg, lane, warp_row, k_addr, smem.dq_staging(wg));

  float dk[kHeadDim / 2], dv[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dk[i] = dv[i] = 0.f;

  const BwdRowStats<Traits> row_stats(p, blk, smem, dsum, tid);

  // Split keys, a warpgroup reads only the dS^T rows and the row-stat copy it wrote: it syncs its own threads.
  auto consumers_sync = [&] {
    if constexpr (Traits::kDqSplitKeys)
      ptx::named_barrier_sync(kBwdConsumerBarrier + wg, 128);
    else
      ptx::named_barrier_sync(kBwdConsumerBarrier, Traits::kConsumerThreads);
  };

  if (blk.steps > 0) {
    float first[BwdRowStats<Traits>::kPer];
    row_stats.load(BwdStepCursor(blk), first);
    row_stats.stage(0, first);
    consumers_sync();
    ptx::mbarrier_wait(smem.kv_full, 0);
    if constexpr (Traits::kVarlen) {
      if (blk.n0 + kBlockN > blk.seqlen_k) {  // block-uniform: the sequence's last key block
        // Split keys: a warpgroup reads only its own 64 keys' rows; else dQ = dS K reads every row.
        if constexpr (Traits::kDqSplitKeys)
          zero_kv_past_end<Traits>(blk, smem, tid & 127, 128, 64 * wg, 64 * wg + 64);
        else
          zero_kv_past_end<Traits>(blk, smem, tid, Traits::kConsumerThreads, 0, kBlockN);
        consumers_sync();
      }
    }
  }

  // The staged dQ of the previous step goes to the dQ writer (dq_full) only once this step's first GEMMs are
  // queued: the proxy fence waits for the staging stores, and done at the end of the step (ncu: FENCE.VIEW.ASYNC
  // and WARPSYNC, ~10 % of the consumers' stall samples) it held back the next step's wgmma, so the tensor cores
  // idled once dK had retired. Here it still stalls the warp, but behind queued S^T/dP^T work (docs/PERFORMANCE.md,
  // ablation; handing off after dK retires instead measured no faster).
  auto hand_off_dq = [&] {
    ptx::fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&smem.dq_full[wg]);
  };

  BwdStepCursor cursor(blk);
  for (int step = 0; step < blk.steps; ++step, cursor = cursor.next()) {
    const int stage = step % kStages;
    const uint32_t q_addr = ptx::smem_addr(smem.q_stage(stage));
    const uint32_t do_addr = ptx::smem_addr(smem.dout_stage(stage));
    ptx::mbarrier_wait(&smem.qdo_full[stage], (step / kStages) & 1);

    float s[kSVals], dp[kSVals];
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      MmaS::ss(s, kmajor_desc(k_addr, kBlockN, 64 * wg, ks), kmajor_desc(q_addr, kBlockM, 0, ks), ks > 0);
    ptx::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      MmaS::ss(dp, kmajor_desc(v_addr, kBlockN, 64 * wg, ks), kmajor_desc(do_addr, kBlockM, 0, ks), ks > 0);
    ptx::wgmma_commit();
    if (step > 0) hand_off_dq();

    const int m0 = cursor.m0(kBlockM);
    float next_stat[BwdRowStats<Traits>::kPer];
    if (step + 1 < blk.steps) row_stats.load(cursor.next(), next_stat);
    const float* stats = row_stats.buffer(step & 1);
    // dV needs only P: with 64-row steps it goes to the tensor cores behind dP^T and runs while dS is computed.
    // With 80- and 128-row steps P, dP and P's fragments would not fit in registers together: dV waits for dS.
    constexpr bool kDvBeforeDs = kBlockM == 64;
    // The lse loaded before the wait for S^T, so that its shared-memory latency runs under the GEMM (ncu, loaded
    // after it: short-scoreboard stalls on the exp2 FFMAs, ~5 % of the 80-row kernel's samples; the 128-row
    // kernels 4-5 % slower at 2k head dim 64). dsum waits for dP^T: loaded before that wait, the 80- and 128-row
    // kernels spill 20-28 B. The score-mod variant's steps wider than 64 rows read the lse pairs from shared
    // memory where they are used, after the score transform: held across it beside P, dP^T and the softcap
    // derivative's fp16 pairs, they spilled (docs/PERFORMANCE.md, ablation).
    constexpr bool kStagedLse = Traits::kScoreMod && !kDvBeforeDs;
    float2 lse[kQTiles], dsum_q[kQTiles];
    if constexpr (!kStagedLse) load_query_pairs<kQTiles>(stats, 0, t, lse);
    ptx::wgmma_wait<1>();
    ptx::fence_operand(s);
    const bool needs_mask = !unmasked.contains(cursor.m_index);
    uint32_t dtanh[kSVals / 2];  // score-mod variant only: 1 - tanh^2, fp16 pairs
    ScoreMod mod;
    if constexpr (Traits::kScoreMod) mod = step_score_mod<Traits>(p, blk, cursor.head);
    if constexpr (kStagedLse)
      probabilities_t<kQTiles, true>(s, dtanh, StagedQueryPairs(stats, 0, t), p, mod, band, m0, 0, key_lo,
                                     needs_mask, t);
    else
      probabilities_t<kQTiles, Traits::kScoreMod>(s, dtanh, lse, p, mod, band, m0, 0, key_lo, needs_mask, t);
    uint32_t pa[kQSteps][4], dsa[kQSteps][4];
    auto issue_dv = [&] {
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk) MmaKV::rs(dv, pa[kk], mnmajor_desc(do_addr, kBlockM, kk), true);
      ptx::wgmma_commit();
    };
    if constexpr (kDvBeforeDs) {
      pack_a_fragments<Element>(s, pa);
      issue_dv();
      // Score-mod variant: P's copy for dS takes the softcap's derivative now (dS = P dtanh (dP - dsum)), so the
      // derivative's registers are free before dP^T lands (they would spill at hdim 128 otherwise).
      if constexpr (Traits::kScoreMod) scale_by_fp16_pairs<kQTiles>(s, dtanh);
      load_query_pairs<kQTiles>(stats + kBlockM, 0, t, dsum_q);
      ptx::wgmma_wait<1>();  // groups retire in order: dP^T is done, dV may still run
    } else {
      ptx::wgmma_wait<0>();
      load_query_pairs<kQTiles>(stats + kBlockM, 0, t, dsum_q);
    }
    ptx::fence_operand(dp);
    dscores_t<kQTiles, Traits::kScoreMod && !kDvBeforeDs>(dp, s, dsum_q, dtanh);
    pack_a_fragments<Element>(dp, dsa);
    if constexpr (!kDvBeforeDs) {
      pack_a_fragments<Element>(s, pa);
      issue_dv();
    }

    // dS^T to shared memory (keys = rows), the next step's lse/dsum beside it; then every consumer's writes are
    // visible to every consumer's dQ wgmma (async proxy) through the fence and the barrier.
    Element* ds = smem.ds_buffer(step);
    const uint32_t ds_addr = ptx::smem_addr(ds);
    dq_step.store_ds(ds_addr, dsa);
    if (step + 1 < blk.steps) row_stats.stage((step + 1) & 1, next_stat);
    ptx::fence_proxy_async_shared();
    consumers_sync();

    if constexpr (!kDvBeforeDs) {
      ptx::wgmma_wait<0>();  // dV has retired (it ran during the barrier): P's fragments make room for dQ
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk) ptx::fence_operand(pa[kk]);
    }
    typename BwdDqStep<Traits>::Acc dq;
    dq_step.issue(dq, ds_addr);
    // dK next: it runs on the tensor cores while dQ is staged and handed to TMA below.
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) MmaKV::rs(dk, dsa[kk], mnmajor_desc(q_addr, kBlockM, kk), true);
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();  // groups retire in order: dV and dQ are done
#pragma unroll
    for (int mt = 0; mt < BwdDqStep<Traits>::kMTiles; ++mt) ptx::fence_operand(dq[mt]);
    ptx::fence_operand(dv);
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk) ptx::fence_operand(pa[kk]);

    // The staged tile: each warp signals dq_full, and the dQ writer (bwd_sm90_producer.cuh) adds the tile to the
    // accumulator through TMA: bulk transfers instead of 8192 atomics, and no consumer waits for another.
    ptx::mbarrier_wait(&smem.dq_empty[wg], ptx::empty_parity(step));  // the writer has read the previous step's
    dq_step.stage(dq);  // handed off at the next step's start (hand_off_dq)
    ptx::wgmma_wait<0>();
    ptx::fence_operand(dk);
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk) ptx::fence_operand(dsa[kk]);
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&smem.qdo_empty[stage]);  // Q and dO of this stage are no longer read
  }
  if (blk.steps > 0) hand_off_dq();  // the last step's

  if (tm_dk != nullptr)
    write_dk_dv_tma<Traits>(dk, dv, p, blk, smem, tm_dk, tm_dv, key_lo, tid);
  else
    write_dk_dv<Element, kHeadDim, Traits::kVarlen>(dk, dv, p, blk, key_lo, 0, t);
}

}  // namespace flashcore::sm90
