// Producer of the Hopper forward kernel: one thread issues every TMA load of the block.
// Q (kBlockM rows) once; then, for each key tile in the consumers' order (last tile first), K and V into ring
// stage it % kStages after the consumers have released it. A load of rows past the sequence end is zero-filled
// by TMA and still counts its full box bytes, so expect_tx is always the whole tile.
#pragma once

#include <cuda.h>

#include "../fwd_block.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/tma.cuh"
#include "fwd_sm90_traits.cuh"

namespace flashcore::sm90 {

template <typename Traits>
__device__ __forceinline__ void produce(const FwdParams& p, const cuda::FwdBlock<typename Traits::Element>& blk,
                                        const SharedStorage<Traits>& smem, const CUtensorMap* tm_q,
                                        const CUtensorMap* tm_k, const CUtensorMap* tm_v) {
  if (blk.n_blocks <= 0) return;
  const int b = (int)(blk.bh / p.heads_q);
  const int h = (int)(blk.bh % p.heads_q);
  const int h_kv = (int)(h / p.group);
  ptx::tma_prefetch_descriptor(tm_q);
  ptx::tma_prefetch_descriptor(tm_k);
  ptx::tma_prefetch_descriptor(tm_v);

  ptx::mbarrier_arrive_expect_tx(smem.q_full, Traits::kQBytes);
#pragma unroll
  for (int span = 0; span < Traits::kSpans; ++span)
    ptx::tma_load_4d(smem.q + span * Traits::kBlockM * 64, tm_q, smem.q_full, span * 64, blk.m0, h, b);

  for (int it = 0; it < blk.n_blocks; ++it) {
    const int stage = it % Traits::kStages;
    const uint32_t empty_parity = ((it / Traits::kStages) & 1) ^ 1;  // the first round passes at once
    const int row0 = (blk.n_blocks - 1 - it) * Traits::kBlockN;

    ptx::mbarrier_wait(&smem.k_empty[stage], empty_parity);
    ptx::mbarrier_arrive_expect_tx(&smem.k_full[stage], Traits::kKVBytes);
#pragma unroll
    for (int span = 0; span < Traits::kSpans; ++span)
      ptx::tma_load_4d(smem.k_stage(stage) + span * Traits::kBlockN * 64, tm_k, &smem.k_full[stage], span * 64,
                       row0, h_kv, b);

    ptx::mbarrier_wait(&smem.v_empty[stage], empty_parity);
    ptx::mbarrier_arrive_expect_tx(&smem.v_full[stage], Traits::kKVBytes);
#pragma unroll
    for (int span = 0; span < Traits::kSpans; ++span)
      ptx::tma_load_4d(smem.v_stage(stage) + span * Traits::kBlockN * 64, tm_v, &smem.v_full[stage], span * 64,
                       row0, h_kv, b);
  }
}

}  // namespace flashcore::sm90
