// Hopper forward kernel (sm_90a): warp-specialized, TMA-fed, wgmma FlashAttention.
//
// A block computes kBlockM = 64 x kWarpgroups query rows of one (batch, head) with kWarpgroups + 1 warpgroups:
//   producer (the last warpgroup, one elected thread; setmaxnreg gives its registers away):
//     Q once, then K and V tiles into a kStages-deep shared-memory ring through TMA (fwd_sm90_producer.cuh);
//   consumers (warpgroups 0..kWarpgroups-1, 64 rows each; fwd_sm90_consumer.cuh):
//     S = Q_wg K^T (wgmma, both operands in shared memory), mask, online softmax in registers,
//     O += P V (wgmma, P from registers), then the epilogue.
// Each ring stage has a "full" mbarrier (TMA signals the bytes) and an "empty" one (each consumer warp arrives
// once its wgmma reading the stage has retired), so loads run kStages tiles ahead and no __syncthreads() is
// needed in the main loop. While one consumer warpgroup runs its softmax the other's GEMMs use the tensor cores.
//
// Shared tiles use SmemTile's 64-element spans: one TMA box (64 columns x rows, 128-byte swizzle) fills one span,
// and the span is exactly wgmma's 128-byte-swizzle canonical layout (16-byte chunk c of row r at c ^ (r % 8)).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../../params.h"
#include "../fwd_block.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/warpgroup.cuh"
#include "fwd_sm90_config.cuh"
#include "fwd_sm90_consumer.cuh"
#include "fwd_sm90_producer.cuh"
#include "fwd_sm90_traits.cuh"

namespace flashcore::sm90 {

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_sm90_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ CUtensorMap tm_q,
                    const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                    const int num_m_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Traits::Element;
  extern __shared__ unsigned char smem_raw[];
  SharedStorage<Traits> smem(smem_raw);

  const cuda::FwdBlock<Element> blk =
      cuda::fwd_block<Element, Traits::kBlockM, Traits::kBlockN>(p, num_m_blocks);

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(smem.q_full, 1);
#pragma unroll
    for (int s = 0; s < Traits::kStages; ++s) {
      ptx::mbarrier_init(&smem.k_full[s], 1);
      ptx::mbarrier_init(&smem.v_full[s], 1);
      ptx::mbarrier_init(&smem.k_empty[s], Traits::kConsumerWarps);
      ptx::mbarrier_init(&smem.v_empty[s], Traits::kConsumerWarps);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x >= Traits::kConsumerThreads) {
    ptx::setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x == Traits::kConsumerThreads) produce<Traits>(p, blk, smem, &tm_q, &tm_k, &tm_v);
  } else {
    ptx::setmaxnreg_inc<Traits::kConsumerRegs>();
    consume<Traits>(p, blk, smem);
  }
#endif
}

}  // namespace flashcore::sm90
