// Producer of the Hopper backward kernel: one thread issues every TMA load of the block. K and V of the block's
// keys once (they stay for the whole block), then Q and dO of each step into the next stage of a kStages ring,
// once the consumers have released it. Rows past a sequence end are zero-filled by TMA and still count their
// bytes, so expect_tx is always whole tiles.
#pragma once

#include <cuda.h>

#include "../ptx/mbarrier.cuh"
#include "../ptx/tma.cuh"
#include "bwd_sm90_traits.cuh"
#include "fwd_sm90_producer.cuh"  // empty_parity

namespace flashcore::sm90 {

template <typename Traits>
__device__ __forceinline__ void produce_bwd(const BwdBlock& blk, const BwdSharedStorage<Traits>& smem,
                                            const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                            const CUtensorMap* tm_v, const CUtensorMap* tm_do) {
  if (blk.steps == 0) return;
  const int b = (int)blk.b, h_kv = (int)blk.h_kv;
  ptx::mbarrier_arrive_expect_tx(smem.kv_full, 2 * Traits::kKVBytes);
#pragma unroll
  for (int span = 0; span < Traits::kSpans; ++span) {
    ptx::tma_load_4d(smem.k + span * Traits::kBlockN * 64, tm_k, smem.kv_full, span * 64, blk.n0, h_kv, b);
    ptx::tma_load_4d(smem.v + span * Traits::kBlockN * 64, tm_v, smem.kv_full, span * 64, blk.n0, h_kv, b);
  }
  for (int step = 0; step < blk.steps; ++step) {
    const int stage = step % Traits::kStages;
    const int h = (int)blk.head(step), m0 = blk.m0(step, Traits::kBlockM);
    ptx::mbarrier_wait(&smem.qdo_empty[stage], empty_parity(step / Traits::kStages));
    ptx::mbarrier_arrive_expect_tx(&smem.qdo_full[stage], 2 * Traits::kQBytes);
#pragma unroll
    for (int span = 0; span < Traits::kSpans; ++span) {
      ptx::tma_load_4d(smem.q_stage(stage) + span * Traits::kBlockM * 64, tm_q, &smem.qdo_full[stage], span * 64,
                       m0, h, b);
      ptx::tma_load_4d(smem.dout_stage(stage) + span * Traits::kBlockM * 64, tm_do, &smem.qdo_full[stage],
                       span * 64, m0, h, b);
    }
  }
}

}  // namespace flashcore::sm90
