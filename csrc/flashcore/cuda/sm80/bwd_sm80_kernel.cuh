// FlashAttention-2 backward on mma.sync (sm_80 .. sm_90): one block per (key block, batch, kv head).
//
// The block keeps its K and V tiles in shared memory and its dK, dV accumulators in registers while it walks
// every query block that can see its keys, for every query head of its group (so GQA's sum over the group
// happens in registers, and dK/dV are written once, without atomics). Per query block:
//   S  = Q K^T,  dP = dO V^T                      (warps: 4 along queries x kColWarps along keys)
//   P  = exp2(S * scale_log2 - lse_log2)           (recomputed from the forward's LSE; masked entries -> 0)
//   dS = P * (dP - rowsum(dO * O))                 (P and dS go to shared memory, as Element)
//   dV += P^T dO,  dK += dS^T Q                    (warps: kKVWarpsN along keys x kKVWarpsD along head dim)
//   dQ += scale * dS K                             (warps: 4 along queries x kColWarps along head dim), added to a
//                                                   fp32 workspace with atomics (the only cross-block traffic;
//                                                   pairs of floats per instruction on sm_90)
// Deterministic (p.dq_turns, dense): a block adds its dQ of a query tile only in its turn, in descending key-block
// order, as the Hopper kernel does (sm90/bwd_sm90_producer.cuh): thread 0 waits until block n_block + 1 has added
// (where it sees the tile), the block adds (one addition an element: its warps partition the tile), and thread 0
// passes the turn after every thread's fence; key blocks launch in reverse so the block waited for started first.
// dq_accum is (batch * heads_q, query blocks * kBlockM, kHeadDim) fp32. A variant that staged each dQ tile in
// shared memory and added it with one bulk reduction (cp.reduce.async.bulk) measured the same as the paired
// atomics (211 vs 209 TFLOP/s at head dim 128) and was dropped (docs/PERFORMANCE.md).
// No seqlen_q x seqlen_k buffer exists; the memory beyond the gradients is dq_accum and two fp32 rows per query.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../params.h"
#include "../common/fragment_mask.cuh"
#include "../common/fragment_score_mod.cuh"
#include "../common/pack.cuh"
#include "../common/tile_io.cuh"
#include "../ptx/cp_async.cuh"
#include "../ptx/global_flag.cuh"
#include "bwd_sm80_config.cuh"
#include "bwd_sm80_gemm.cuh"

namespace flashcore::sm80 {

// dst[0] += a, dst[1] += b in global memory (dst 8-byte aligned); one vector reduction on sm_90, which has them.
__device__ __forceinline__ void atomic_add_pair(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// kScoreMod: the score-mod variant (softcap, ALiBi, or a scale that is not positive; score_mod.h): P is rebuilt
// from the transformed logits, and dS gains the softcap's derivative 1 - tanh^2.
// kVarlen: a variable-length batch (seqlen.h): the block's keys and queries are its sequence's; dsum and dq_accum
// follow lse's (heads_q, total_q) layout (dq_accum: (heads_q, total_q, kHeadDim)); a key block past the sequence's
// end exits at once (its dK/dV rows, outside the sequence, are zeroed before the launch: varlen_rows.cuh).
template <typename Traits, bool kScoreMod, bool kVarlen = false>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocksPerSm)
    bwd_sm80_kernel(const BwdParams p, const float* __restrict__ dsum, float* __restrict__ dq_accum,
                    int num_n_blocks) {
  using Element = typename Traits::Element;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  using PTile = typename Traits::PTile;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kNThreads = Traits::kNThreads;
  constexpr int kSNT = Traits::kSNTiles;
  constexpr int kQDT = Traits::kQDTiles;
  constexpr int kKVDT = Traits::kKVDTiles;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  Element* smem = reinterpret_cast<Element*>(smem_raw);
  Element* sK = smem + Traits::kKOffset;
  Element* sV = smem + Traits::kVOffset;
  Element* sP = smem + Traits::kPOffset;
  Element* sdS = smem + Traits::kDsOffset;
  float* sLse = reinterpret_cast<float*>(smem + Traits::kElementsEnd);
  float* sDsum = sLse + kStages * kBlockM;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp % Traits::kRowWarps;   // S, dP, dQ: 16 query rows
  const int wc = warp / Traits::kRowWarps;   // S, dP: kSCols keys; dQ: kQDims dims
  const int wk = warp % Traits::kKVWarpsN;   // dK, dV: 16 keys
  const int wkd = warp / Traits::kKVWarpsN;  // dK, dV: kKVDims dims
  const int g = lane >> 2, t = lane & 3;

  // Heavier key blocks (the first ones, under a causal mask) have the smaller n_block and start first; deterministic,
  // the other way round (see above).
  const bool ordered = !kVarlen && p.dq_turns != nullptr;
  const int n_block = ordered ? num_n_blocks - 1 - (int)(blockIdx.x % num_n_blocks) : (int)(blockIdx.x % num_n_blocks);
  uint32_t h_kv32;
  const int64_t slot = p.heads_kv_div.divmod(blockIdx.x / num_n_blocks, h_kv32);  // < gridDim.x < 2^31
  const int64_t b = kVarlen ? p.varlen.sequence_of_slot(slot) : slot;
  const int64_t h_kv = h_kv32;
  const int n0 = n_block * kBlockN;
  const SeqInfo seq = p.seq(b);  // dense: (0, 0, seqlen_q, seqlen_k)
  if (kVarlen && n0 >= seq.seqlen_k) return;
  const int seqlen_q = kVarlen ? (int)seq.seqlen_q : (int)p.seqlen_q;
  const int seqlen_k = kVarlen ? (int)seq.seqlen_k : (int)p.seqlen_k;
  const int head_dim = (int)p.head_dim;
  const int64_t q_begin = kVarlen ? seq.q_begin : 0, k_begin = kVarlen ? seq.k_begin : 0;
  auto stage_q = [&](int stage) { return smem + stage * Traits::kStageElems; };
  auto stage_do = [&](int stage) { return smem + stage * Traits::kStageElems + QTile::kElems; };

  const Element* k =
      static_cast<const Element*>(p.k) + b * p.k_stride.batch + h_kv * p.k_stride.head + k_begin * p.k_stride.seq;
  const Element* v =
      static_cast<const Element*>(p.v) + b * p.v_stride.batch + h_kv * p.v_stride.head + k_begin * p.v_stride.seq;
  cuda::load_tile_async<KVTile, kNThreads>(sK, k, p.k_stride.seq, n0, seqlen_k, head_dim);
  cuda::load_tile_async<KVTile, kNThreads>(sV, v, p.v_stride.seq, n0, seqlen_k, head_dim);

  // Query blocks [m_begin, m_begin + m_count) see at least one key of this block (the mask's band).
  const Band seq_band = p.band_of(seq);
  const Band& band = kVarlen ? seq_band : p.band;
  const IndexRange m_tiles =
      band.query_tiles_of_keys(n0, (int64_t)n0 + kBlockN, seqlen_q, kBlockM);
  const int m_begin = (int)m_tiles.begin;
  const int m_count = (int)m_tiles.size();
  const TileRange unmasked = band.unmasked_query_tiles(n0, kBlockN, kBlockM);  // query tiles the mask can skip
  const int total = (int)p.group * m_count;  // iterations: (query head of the group, query block)

  // Issues the cp.async loads of iteration `it` (Q and dO tiles) into `stage`, and writes its per-row LSE (log2
  // units; +inf for rows past the end and for rows that saw no key, so their P is exactly 0) and dsum.
  auto load_query_block = [&](int it, int stage) {
    const int64_t h = h_kv * p.group + it / m_count;
    const int m0 = (m_begin + it % m_count) * kBlockM;
    const Element* q = static_cast<const Element*>(p.q) + b * p.q_stride.batch + h * p.q_stride.head +
                       q_begin * p.q_stride.seq;
    const Element* dout = static_cast<const Element*>(p.dout) + b * p.dout_stride.batch + h * p.dout_stride.head +
                          q_begin * p.dout_stride.seq;
    cuda::load_tile_async<QTile, kNThreads>(stage_q(stage), q, p.q_stride.seq, m0, seqlen_q, head_dim);
    cuda::load_tile_async<QTile, kNThreads>(stage_do(stage), dout, p.dout_stride.seq, m0, seqlen_q, head_dim);
    if (tid < kBlockM) {
      const int row = m0 + tid;
      const int64_t idx = kVarlen ? h * p.varlen.total_q + q_begin + row : (b * p.heads_q + h) * p.seqlen_q + row;
      float lse2 = INFINITY, d = 0.f;
      if (row < seqlen_q) {
        const float l = p.lse[idx];
        lse2 = l == -INFINITY ? INFINITY : l * 1.4426950408889634f;
        d = dsum[idx];
      }
      sLse[stage * kBlockM + tid] = lse2;
      sDsum[stage * kBlockM + tid] = d;
    }
  };

  float dk[kKVDT][4], dv[kKVDT][4];
  zero(dk);
  zero(dv);
  ScoreMod mod;  // the score-mod variant's transform of this step's (batch, query head), set per step

  if (total > 0) load_query_block(0, 0);
  ptx::cp_async_commit();
  const int64_t dq_rows_per_head = (int64_t)(seqlen_q + kBlockM - 1) / kBlockM * kBlockM;

  // Schedule per iteration (two stages): wait for this block's Q/dO -> S, dP, P, dS -> barrier -> prefetch the
  // next block's Q/dO into the other stage (free: every warp is past its last reads) -> dV, dK, dQ -> dQ atomics.
  // Two barriers an iteration. With one stage the next block's loads wait for the top of the next iteration.
  for (int it = 0; it < total; ++it) {
    const int stage = kStages == 2 ? (it & 1) : 0;
    if (kStages == 1 && it > 0) {
      __syncthreads();  // every warp is done with the stage
      load_query_block(it, 0);
      ptx::cp_async_commit();
    }
    ptx::cp_async_wait<0>();
    __syncthreads();

    const int64_t h = h_kv * p.group + it / m_count;
    const int m_block = m_begin + it % m_count;
    const int m0 = m_block * kBlockM;
    if constexpr (kScoreMod) mod = ScoreMod::make(p.score, p.scale_log2, b, h);
    if constexpr (kVarlen) mod.alibi_offset = seqlen_k - seqlen_q;
    const Element* sQs = stage_q(stage);
    const Element* sdOs = stage_do(stage);

    // S and dP for rows wm*16.. and keys wc*kSCols.. of the block.
    float s[1][kSNT][4], dp[kSNT][4];
    warp_gemm_abt<QTile, KVTile, kSNT, Traits::kHeadDim / 16>(s[0], sQs, wm * 16, sK, wc * Traits::kSCols, lane);
    warp_gemm_abt<QTile, KVTile, kSNT, Traits::kHeadDim / 16>(dp, sdOs, wm * 16, sV, wc * Traits::kSCols, lane);

    const int r_lo = wm * 16 + g;  // block rows of this thread's accumulator halves: r_lo, r_lo + 8
    const float lse_lo = sLse[stage * kBlockM + r_lo], lse_hi = sLse[stage * kBlockM + r_lo + 8];
    const float d_lo = sDsum[stage * kBlockM + r_lo], d_hi = sDsum[stage * kBlockM + r_lo + 8];
    float dtanh[1][kSNT][4];  // score-mod variant: d logit / d(scale q.k), which dS takes
    if constexpr (kScoreMod) {
      cuda::apply_score_mod<false>(s, m0 + r_lo, n0 + wc * Traits::kSCols + 2 * t, mod, &dtanh);
#pragma unroll
      for (int ni = 0; ni < kSNT; ++ni) {
        s[0][ni][0] -= lse_lo;
        s[0][ni][1] -= lse_lo;
        s[0][ni][2] -= lse_hi;
        s[0][ni][3] -= lse_hi;
      }
    } else {
#pragma unroll
      for (int ni = 0; ni < kSNT; ++ni) {
        s[0][ni][0] = s[0][ni][0] * p.scale_log2 - lse_lo;
        s[0][ni][1] = s[0][ni][1] * p.scale_log2 - lse_lo;
        s[0][ni][2] = s[0][ni][2] * p.scale_log2 - lse_hi;
        s[0][ni][3] = s[0][ni][3] * p.scale_log2 - lse_hi;
      }
    }
    // Masked after scaling, so that a negative scale cannot turn a -inf score into +inf.
    if (!unmasked.contains(m_block))
      cuda::apply_mask(s, m0 + r_lo, n0 + wc * Traits::kSCols + 2 * t, band);
#pragma unroll
    for (int ni = 0; ni < kSNT; ++ni) {
      const int col = wc * Traits::kSCols + ni * 8 + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float p0 = exp2f(s[0][ni][2 * half]), p1 = exp2f(s[0][ni][2 * half + 1]);
        const float d = half ? d_hi : d_lo;
        const int row = r_lo + 8 * half;
        float ds0 = p0 * (dp[ni][2 * half] - d), ds1 = p1 * (dp[ni][2 * half + 1] - d);
        if constexpr (kScoreMod) {
          ds0 *= dtanh[0][ni][2 * half];
          ds1 *= dtanh[0][ni][2 * half + 1];
        }
        *reinterpret_cast<uint32_t*>(sP + PTile::elem_offset(row, col)) = cuda::pack2<Element>(p0, p1);
        *reinterpret_cast<uint32_t*>(sdS + PTile::elem_offset(row, col)) = cuda::pack2<Element>(ds0, ds1);
      }
    }
    __syncthreads();
    if (kStages == 2 && it + 1 < total) {
      load_query_block(it + 1, stage ^ 1);
      ptx::cp_async_commit();
    }

    // dV += P^T dO and dK += dS^T Q for keys wk*16.. and dims wkd*kKVDims.. (k = the block's query rows).
    warp_gemm_atb<PTile, QTile, kKVDT, kBlockM / 16>(dv, sP, wk * 16, sdOs, wkd * Traits::kKVDims, lane);
    warp_gemm_atb<PTile, QTile, kKVDT, kBlockM / 16>(dk, sdS, wk * 16, sQs, wkd * Traits::kKVDims, lane);

    // dQ (rows wm*16.., dims wc*kQDims..) of this key block, added to the fp32 workspace.
    float dq[kQDT][4];
    warp_gemm_ab<PTile, KVTile, kQDT, kBlockN / 16>(dq, sdS, wm * 16, sK, wc * Traits::kQDims, lane);
    float* dq_tile = dq_accum + (kVarlen ? h * p.varlen.total_q + q_begin + m0
                                         : (b * p.heads_q + h) * dq_rows_per_head + m0) * Traits::kHeadDim;
    int* turn = nullptr;  // deterministic: the flag of this (batch, head, query tile)
    if (ordered) {
      turn = p.dq_turns + (b * p.heads_q + h) * (dq_rows_per_head / kBlockM) + m_block;
      const IndexRange next =
          band.query_tiles_of_keys((int64_t)n0 + kBlockN, (int64_t)n0 + 2 * kBlockN, seqlen_q, kBlockM);
      if (tid == 0 && m_block >= next.begin && m_block < next.end) ptx::wait_until_equal(turn, n_block + 2);
      __syncthreads();
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (m0 + r_lo + 8 * half < seqlen_q) {
        float* dst = dq_tile + (r_lo + 8 * half) * Traits::kHeadDim;
#pragma unroll
        for (int di = 0; di < kQDT; ++di) {
          const int col = wc * Traits::kQDims + di * 8 + 2 * t;
          atomic_add_pair(dst + col, dq[di][2 * half] * p.scale, dq[di][2 * half + 1] * p.scale);
        }
      }
    }
    if (ordered) {
      __threadfence();  // this thread's additions, visible GPU-wide before the turn passes
      __syncthreads();
      if (tid == 0) ptx::store_release_gpu(turn, n_block + 1);
    }
  }

  // Epilogue: dK (scaled) and dV through the K and V tiles, so the global stores are 16 bytes wide.
  ptx::cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = wk * 16 + g + 8 * half;
#pragma unroll
    for (int di = 0; di < kKVDT; ++di) {
      const int col = wkd * Traits::kKVDims + di * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(sK + KVTile::elem_offset(row, col)) =
          cuda::pack2<Element>(dk[di][2 * half] * p.scale, dk[di][2 * half + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(sV + KVTile::elem_offset(row, col)) =
          cuda::pack2<Element>(dv[di][2 * half], dv[di][2 * half + 1]);
    }
  }
  __syncthreads();
  Element* dk_out =
      static_cast<Element*>(p.dk) + b * p.dk_stride.batch + h_kv * p.dk_stride.head + k_begin * p.dk_stride.seq;
  Element* dv_out =
      static_cast<Element*>(p.dv) + b * p.dv_stride.batch + h_kv * p.dv_stride.head + k_begin * p.dv_stride.seq;
  cuda::store_tile<KVTile, kNThreads>(sK, dk_out, p.dk_stride.seq, n0, seqlen_k, head_dim);
  cuda::store_tile<KVTile, kNThreads>(sV, dv_out, p.dv_stride.seq, n0, seqlen_k, head_dim);
}

}  // namespace flashcore::sm80
