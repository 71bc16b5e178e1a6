// Producer of the Hopper backward kernel: one thread issues every TMA load of the block. K and V of the block's
// keys once (they stay for the whole block), then Q and dO of each step into the next stage of a kStages ring,
// once the consumers have released it (with kSeparateDo, dO has its own kDoStages ring and barriers: the
// consumers release it earlier in the step than Q). Rows past a sequence end are zero-filled by TMA and still count their
// bytes, so expect_tx is always whole tiles.
#pragma once

#include <cuda.h>

#include "../ptx/global_flag.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/tma.cuh"
#include "bwd_sm90_traits.cuh"

namespace flashcore::sm90 {

template <typename Traits>
__device__ __forceinline__ void produce_bwd(const BwdBlock& blk, const BwdSharedStorage<Traits>& smem,
                                            const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                            const CUtensorMap* tm_v, const CUtensorMap* tm_do) {
  if (blk.steps == 0) return;
  // Varlen: the packed tensors are one batch entry; the sequence's rows start at q_begin / k_begin.
  const int b = Traits::kVarlen ? 0 : (int)blk.b, h_kv = (int)blk.h_kv;
  const int k_row0 = Traits::kVarlen ? blk.k_begin + blk.n0 : blk.n0;
  ptx::mbarrier_arrive_expect_tx(smem.kv_full, 2 * Traits::kKVBytes);
#pragma unroll
  for (int span = 0; span < Traits::kSpans; ++span) {
    ptx::tma_load_4d(smem.k + span * Traits::kBlockN * 64, tm_k, smem.kv_full, span * 64, k_row0, h_kv, b);
    ptx::tma_load_4d(smem.v + span * Traits::kBlockN * 64, tm_v, smem.kv_full, span * 64, k_row0, h_kv, b);
  }
  // The step's head and query block are walked (BwdStepCursor): a division by m_count and 64-bit products do
  // not fit in this thread's kProducerRegs registers (they spilled on every step). No unrolling for the same
  // reason.
  BwdStepCursor cursor(blk);
#pragma unroll 1
  for (int step = 0; step < blk.steps; ++step, cursor = cursor.next()) {
    const int stage = step % Traits::kStages;
    const int m0 = cursor.m0(Traits::kBlockM) + (Traits::kVarlen ? blk.q_begin : 0), h = cursor.head;
    ptx::mbarrier_wait(&smem.qdo_empty[stage], ptx::empty_parity(step / Traits::kStages));
    ptx::mbarrier_arrive_expect_tx(&smem.qdo_full[stage], (Traits::kSeparateDo ? 1 : 2) * Traits::kQBytes);
#pragma unroll
    for (int span = 0; span < Traits::kSpans; ++span) {
      ptx::tma_load_4d(smem.q_stage(stage) + span * Traits::kBlockM * 64, tm_q, &smem.qdo_full[stage], span * 64,
                       m0, h, b);
      if constexpr (!Traits::kSeparateDo)
        ptx::tma_load_4d(smem.dout_stage(stage) + span * Traits::kBlockM * 64, tm_do, &smem.qdo_full[stage],
                         span * 64, m0, h, b);
    }
    if constexpr (Traits::kSeparateDo) {
      const int do_stage = step % Traits::kDoStages;
      ptx::mbarrier_wait(&smem.do_empty[do_stage], ptx::empty_parity(step / Traits::kDoStages));
      ptx::mbarrier_arrive_expect_tx(&smem.do_full[do_stage], Traits::kQBytes);
#pragma unroll
      for (int span = 0; span < Traits::kSpans; ++span)
        ptx::tma_load_4d(smem.dout_stage(do_stage) + span * Traits::kBlockM * 64, tm_do, &smem.do_full[do_stage],
                         span * 64, m0, h, b);
    }
  }
}

// The deterministic flag of the dense accumulator tile at `row` (in the dQ writer's units): (batch, head) pair
// times the query tiles a head, plus the tile, since a head's accumulator rows are its query tiles' (padded).
template <typename Traits>
__device__ __forceinline__ int* dq_turn(const BwdParams& p, int row) {
  constexpr int kUnit = Traits::kDqRowsInterleaved ? 8 : 1;
  return p.dq_turns + (int64_t)row * kUnit / Traits::kBlockM;
}

// The dQ writer (one thread of the producer warpgroup's second warp): per step, dQ chunk and consumer warpgroup,
// once the warpgroup's 4 warps have staged their dQ (dq_full), adds the staging tile (32-column boxes) to the
// fp32 accumulator with TMA reductions, and releases the tile (dq_empty) once TMA has read it.
// Fragment order (Traits::kDqFragmentOrder): each warpgroup's staged share is contiguous in the accumulator, one
// bulk reduction without a tensor map (dq_accum: the accumulator's base).
// Deterministic (p.dq_turns, dense kernels): the key blocks that visit a query tile add to it in descending
// key-block order, so every element of dQ is summed in one fixed order. A tile's visitors are consecutive key
// blocks (the band's query range of a key block moves monotonically with it), so block n waits only where block
// n + 1 visits the tile too (the same Band computation as bwd_block, hence the same answer), until the tile's flag
// reads n + 2; it adds (each reduction completed before the next: split by keys, both warpgroups add to the same
// elements) and sets n + 1. Block n + 1 has the lower block index (bwd_block), so it is resident or done: the
// chain cannot deadlock. Descending, because the steps walk query tiles upwards: under a causal mask block n + 1
// meets a tile one step earlier in its walk than block n, so in the steady state nobody waits (ascending, each
// block started a step behind the previous one and a causal backward ran at ~0.56x the unordered one).
template <typename Traits>
__device__ __forceinline__ void write_dq_bwd(const BwdParams& p, const BwdBlock& blk,
                                             const BwdSharedStorage<Traits>& smem, const CUtensorMap* tm_dq,
                                             float* dq_accum) {
  constexpr int kBlockM = Traits::kBlockM, kW = Traits::kWarpgroups;
  // The accumulator row of the step's first query, walked incrementally (this thread has 24 registers): the
  // steps run over the query blocks of one head, then the next head of the group. Dense: (batch, head, padded
  // seqlen_q) rows. Varlen: (head, total_q) rows like lse, the sequence's from q_begin (the host keeps
  // heads_q * total_q below 2^31); a box past the sequence's end adds zeros to the next rows.
  const int dq_rows_per_head =
      Traits::kVarlen ? (int)p.varlen.total_q : (int)((p.seqlen_q + kBlockM - 1) / kBlockM * kBlockM);
  const int head_row0 = Traits::kVarlen
                            ? (int)(blk.h_kv * blk.group * dq_rows_per_head + blk.q_begin)
                            : (int)((blk.b * p.heads_q + blk.h_kv * blk.group) * dq_rows_per_head);
  // Interleaved staging rows (Traits::kDqRowsInterleaved): the tensor map addresses groups of 8 rows, and every
  // dense tile starts at a multiple of 8 (dq_rows_per_head and kBlockM are), so rows are counted in eights.
  constexpr int kUnit = Traits::kDqRowsInterleaved ? 8 : 1;
  static_assert(kBlockM % kUnit == 0 && Traits::dq_row0(1) % kUnit == 0);
  int row = (head_row0 + blk.m_begin * kBlockM) / kUnit, m_left = blk.m_count;
  // Deterministic: little is kept across steps (this thread has 24 registers): block n_block + 1's query tiles
  // wait in shared memory (none past the last key block: the band's query range of keys past seqlen_k is empty),
  // the flag's index is recomputed from the row each step.
  const bool ordered = !Traits::kVarlen && p.dq_turns != nullptr;
  if constexpr (!Traits::kVarlen) {
    if (ordered) {
      const int64_t next0 = blk.n0 + Traits::kBlockN;
      const IndexRange next =
          p.band.query_tiles_of_keys(next0, next0 + Traits::kBlockN, p.seqlen_q, kBlockM);
      smem.next_tiles[0] = (int)next.begin;
      smem.next_tiles[1] = (int)next.end;
    }
  }
  for (int step = 0; step < blk.steps; ++step) {
    if (ordered) {
      const int m = blk.m_begin + blk.m_count - m_left;
      if (m >= smem.next_tiles[0] && m < smem.next_tiles[1])
        ptx::wait_for_turn(dq_turn<Traits>(p, row), blk.n_block + 2);
    }
#pragma unroll
    for (int chunk = 0; chunk < Traits::kDqChunks; ++chunk) {
#pragma unroll
      for (int wg = 0; wg < kW; ++wg) {
        ptx::mbarrier_wait(&smem.dq_full[wg], (step * Traits::kDqChunks + chunk) & 1);
        const int col0 = Traits::dq_col0(wg, chunk);
        if constexpr (Traits::kDqFragmentOrder) {
          // The tile of rows [row, row + kBlockM) is 128 kBlockM floats at row * 128 (dq_fragment_order.cuh).
          ptx::bulk_reduce_add_f32(dq_accum + (int64_t)row * 128 + wg * (Traits::kDqWgBytes / 4),
                                   smem.dq_staging(wg), Traits::kDqWgBytes);
        } else {
#pragma unroll
          for (int box = 0; box < Traits::kDqBoxes; ++box) {
            const float* src = smem.dq_staging(wg) + box * Traits::kDqRows * 32;
            const int wg_row = row + Traits::dq_row0(wg) / kUnit;
            if constexpr (Traits::kDqRowsInterleaved)
              ptx::tma_reduce_add_4d_at0(tm_dq, src, col0 + box * Traits::kDqBoxCols, wg_row);
            else
              ptx::tma_reduce_add_2d(tm_dq, src, col0 + box * Traits::kDqBoxCols, wg_row);
          }
        }
        ptx::bulk_commit_group();
        if (ordered) ptx::bulk_wait_group<0>();  // deterministic: one reduction at a time
      }
      // Groups complete in order: release each warpgroup's tile as soon as its reduction has read it.
      static_assert(kW == 2, "release order below is written for two consumer warpgroups");
      ptx::bulk_wait_group_read<1>();
      ptx::mbarrier_arrive(&smem.dq_empty[0]);
      ptx::bulk_wait_group_read<0>();
      ptx::mbarrier_arrive(&smem.dq_empty[1]);
    }
    if (ordered) ptx::pass_turn(dq_turn<Traits>(p, row), blk.n_block + 1);
    row += kBlockM / kUnit;
    if (--m_left == 0) {  // next head of the group
      m_left = blk.m_count;
      row += (dq_rows_per_head - blk.m_count * kBlockM) / kUnit;
    }
  }
  ptx::bulk_wait_group<0>();
  // Countdowns (p.dq_tiles_pending, dense): every tile of the block's steps, once all its reductions are complete
  // and released at GPU scope (one fence, then relaxed decrements). At the block's end, not per step: a release
  // per step cost the kernel ~1.3 % (it waited for the step's reductions just issued), and readiness matters
  // only in the grid's last wave, where the post-pass can run.
  if (!Traits::kVarlen && p.dq_tiles_pending != nullptr && blk.steps > 0) {
    ptx::release_bulk_writes_gpu();
    const int64_t tiles_per_head = dq_rows_per_head / kBlockM;
    int* tile = p.dq_tiles_pending + ((int64_t)blk.b * p.heads_q + blk.h_kv * blk.group) * tiles_per_head +
                blk.m_begin;
    for (int head = 0; head < blk.group; ++head, tile += tiles_per_head)
      for (int m = 0; m < blk.m_count; ++m) ptx::count_down_relaxed(tile + m);
  }
}

}  // namespace flashcore::sm90
