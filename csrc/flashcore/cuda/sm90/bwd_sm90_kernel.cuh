// Hopper backward kernel (sm_90a): warp-specialized, TMA-fed, wgmma FlashAttention backward.
//
// One block per (key block of kBlockN = 64 x kWarpgroups keys, batch, kv head), like the mma.sync backward: the
// block walks every step (query head of the group, query block of kBlockM rows) that can see its keys, so GQA's sum of
// dK/dV over the group happens in registers and dK/dV are written once, without atomics. Warpgroups:
//   producer (the last, one elected thread; setmaxnreg gives its registers away): K and V once, then Q and dO of
//     each step into a kStages ring guarded by full/empty mbarriers (bwd_sm90_producer.cuh);
//   consumers (64 keys each; above head dim 128 they share 64 keys and split the head dim): the five GEMMs of a
//     step on wgmma; dQ is staged in shared memory (bwd_sm90_consumer.cuh, bwd_sm90_consumer_wide.cuh);
//   dQ writer (one thread of the producer warpgroup's second warp): adds each staged dQ tile to the fp32
//     accumulator with TMA reductions (bwd_sm90_producer.cuh).
// The pre-pass (bwd_preprocess.cuh) computes dsum = rowsum(dO * O) first; dq_accum is converted to dQ after, by
// a post-pass that overlaps this grid's last wave, tile by tile (BwdParams::dq_tiles_pending).
// Variable-length batches (Traits::kVarlen): one block per (key block of max_seqlen_k, sequence, kv head), reading
// its sequence's rows of the packed tensors (seqlen.h).
#pragma once

#include <cuda.h>

#include "../../params.h"
#include "../ptx/grid_dependency.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/tma.cuh"
#include "../ptx/warpgroup.cuh"
#include "bwd_sm90_consumer.cuh"
#include "bwd_sm90_consumer_wide.cuh"
#include "bwd_sm90_producer.cuh"
#include "bwd_sm90_traits.cuh"

namespace flashcore::sm90 {

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    bwd_sm90_kernel(const __grid_constant__ BwdParams p, const __grid_constant__ CUtensorMap tm_q,
                    const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                    const __grid_constant__ CUtensorMap tm_do, const __grid_constant__ CUtensorMap tm_dq,
                    const __grid_constant__ CUtensorMap tm_dk, const __grid_constant__ CUtensorMap tm_dv,
                    const float* __restrict__ dsum, float* dq_accum, const int num_n_blocks,
                    const bool tma_epilogue) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  BwdSharedStorage<Traits> smem(smem_raw);

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(smem.kv_full, 1);
#pragma unroll
    for (int s = 0; s < Traits::kStages; ++s) {
      ptx::mbarrier_init(&smem.qdo_full[s], 1);
      ptx::mbarrier_init(&smem.qdo_empty[s], Traits::kConsumerWarps);
    }
    if constexpr (Traits::kSeparateDo) {
#pragma unroll
      for (int s = 0; s < Traits::kDoStages; ++s) {
        ptx::mbarrier_init(&smem.do_full[s], 1);
        ptx::mbarrier_init(&smem.do_empty[s], Traits::kConsumerWarps);
      }
    }
#pragma unroll
    for (int w = 0; w < Traits::kWarpgroups; ++w) {
      ptx::mbarrier_init(&smem.dq_full[w], 4);
      ptx::mbarrier_init(&smem.dq_empty[w], 1);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  // The dQ post-pass may launch once every block has started (programmatic dependent launch): its blocks take
  // the SMs this grid's last wave leaves idle and convert each dQ tile whose countdown reached zero
  // (BwdParams::dq_tiles_pending); no block of this grid is then still waiting for an SM, so none waits on them.
  ptx::allow_dependent_grids();

  const BwdBlock blk = bwd_block<Traits::kBlockM, Traits::kBlockN, Traits::kVarlen>(p, num_n_blocks);
  // Varlen: the grid covers max_seqlen_k; a block past its sequence's keys owns no dK/dV row (the whole block
  // leaves together, before any barrier but the one above).
  if (Traits::kVarlen && blk.n0 >= blk.seqlen_k) return;
  if (threadIdx.x >= Traits::kConsumerThreads) {
    ptx::setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x == Traits::kConsumerThreads) {
      ptx::tma_prefetch_descriptor(&tm_q);
      ptx::tma_prefetch_descriptor(&tm_k);
      ptx::tma_prefetch_descriptor(&tm_v);
      ptx::tma_prefetch_descriptor(&tm_do);
      produce_bwd<Traits>(blk, smem, &tm_q, &tm_k, &tm_v, &tm_do);
    } else if (threadIdx.x == Traits::kConsumerThreads + 32) {
      ptx::tma_prefetch_descriptor(&tm_dq);
      write_dq_bwd<Traits>(p, blk, smem, &tm_dq, dq_accum);
    }
  } else {
    ptx::setmaxnreg_inc<Traits::kConsumerRegs>();
    if constexpr (Traits::kSplitHeadDim)
      consume_bwd_wide<Traits>(p, blk, smem, dsum);
    else
      consume_bwd<Traits>(p, blk, smem, dsum, tma_epilogue ? &tm_dk : nullptr, tma_epilogue ? &tm_dv : nullptr);
  }
#endif
}

}  // namespace flashcore::sm90
