// Hopper forward kernel (sm_90a): warp-specialized, TMA-fed, wgmma FlashAttention, persistent.
//
// Block i computes tiles i, i + gridDim.x, ... of fwd_block's tile order (heads adjacent, heaviest causal query
// blocks first): several when the launcher makes the grid persistent (one block per SM), else exactly one. A tile is kBlockM = 64 x kWarpgroups query rows
// of one (batch, head); the block has kWarpgroups + 1 warpgroups:
//   producer (the last warpgroup, one elected thread, two for paged keys; setmaxnreg gives its registers away):
//     per tile, Q, then K and V tiles into a kStages-deep shared-memory ring through TMA (fwd_sm90_producer.cuh);
//   consumers (warpgroups 0..kWarpgroups-1, 64 rows each; fwd_sm90_consumer.cuh):
//     S = Q_wg K^T (wgmma, both operands in shared memory), mask, online softmax in registers,
//     O += P V (wgmma, P from registers), then the epilogue.
// Each ring stage has a "full" mbarrier (TMA signals the bytes) and an "empty" one (each consumer warp arrives
// once its wgmma reading the stage has retired), so loads run kStages tiles ahead, across tile boundaries too,
// and no __syncthreads() is needed after setup. The Q buffer has the same pair (q_full, q_empty): the next
// tile's Q is loaded once every consumer's last Q K^T has retired, while the epilogue stages O in a buffer of
// its own and stores it with TMA (where shared memory is short, O is staged in Q, and Q waits for that store).
// While one consumer warpgroup runs its softmax the other's GEMMs use the tensor cores (fwd_sm90_issue_turns.cuh).
//
// Shared tiles use SmemTile's 64-element spans: one TMA box (64 columns x rows, 128-byte swizzle) fills one span,
// and the span is exactly wgmma's 128-byte-swizzle canonical layout (16-byte chunk c of row r at c ^ (r % 8)).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../../params.h"
#include "../common/fwd_block.cuh"
#include "../common/varlen_tile_scan.cuh"
#include "../ptx/cluster.cuh"
#include "../ptx/grid_dependency.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/warpgroup.cuh"
#include "fwd_sm90_config.cuh"
#include "fwd_sm90_consumer.cuh"
#include "fwd_sm90_producer.cuh"
#include "fwd_sm90_split.cuh"
#include "fwd_sm90_traits.cuh"

namespace flashcore::sm90 {

// A key split (launched in clusters of num_splits blocks; 1: none): the block of rank r walks the r-th of num_splits
// near-equal slices of its tile's key blocks [n_first, n_blocks) (a slice may be empty).
template <typename Element>
__device__ __forceinline__ void take_key_slice(cuda::FwdBlock<Element>& blk) {
  const int splits = (int)ptx::cluster_size();
  if (splits > 1) {
    const int rank = (int)ptx::cluster_rank(), first = blk.n_first, n = blk.n_blocks - blk.n_first;
    blk.n_first = first + n * rank / splits;
    blk.n_blocks = first + n * (rank + 1) / splits;
    blk.split_rank = rank;
    blk.num_splits = splits;
  }
}

// Calls tile_fn(blk, tile_count, kv_count) for each tile this block computes, in order: tile_count tiles and
// kv_count K/V ring uses came before it. Producer and consumers both walk tiles through this, so their barrier
// phases agree. Without kPersistent the block has exactly one tile and no loop-carried state (registers).
// Waits for the previous grid (wait_for_prior_grids) before the first tile_fn call. varlen_tile: a varlen block's
// tile (its cluster's index, or the packed grid's scan of it), < 0 for none.
template <typename Traits, typename TileFn>
__device__ __forceinline__ void for_each_tile(const FwdParams& p, int num_m_blocks, int num_tiles, int varlen_tile,
                                              TileFn&& tile_fn) {
  using Element = typename Traits::Element;
  // The first tile's coordinates come from kernel parameters only, so they are computed before waiting for the
  // previous grid (programmatic dependent launch): their constant-cache misses then overlap that grid's tail.
  if constexpr (Traits::kPersistent) {
    int tile_count = 0, kv_count = 0;
    for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x, ++tile_count) {
      const auto blk = cuda::fwd_block<Element, Traits::kBlockM, Traits::kBlockN>(p, num_m_blocks, (int)tile);
      if (tile_count == 0) ptx::wait_for_prior_grids();
      tile_fn(blk, tile_count, kv_count);
      kv_count += blk.n_blocks - blk.n_first;  // >= 0 (fwd_block clamps)
    }
  } else if constexpr (Traits::kSplitKeys && !Traits::kVarlen) {
    // Cluster c computes tile c (a cluster of one block where the launcher does not split).
    auto blk = cuda::fwd_block<Element, Traits::kBlockM, Traits::kBlockN>(p, num_m_blocks, (int)ptx::cluster_id_x());
    take_key_slice(blk);
    ptx::wait_for_prior_grids();
    tile_fn(blk, 0, 0);
  } else {
    // Varlen: the offsets and the launch order (seqlen.h) are global memory the previous grid may have written.
    if constexpr (Traits::kVarlen) {
      ptx::wait_for_prior_grids();
      if (varlen_tile < 0) return;  // past the packed grid's last tile (every block of its cluster alike)
    }
    auto blk =
        cuda::fwd_block<Element, Traits::kBlockM, Traits::kBlockN, Traits::kVarlen, /*kPackGqa=*/Traits::kVarlen>(
            p, num_m_blocks, Traits::kVarlen ? varlen_tile : (int)blockIdx.x);
    if (Traits::kVarlen && blk.m0 >= blk.seqlen_q) return;  // past its sequence's end: the whole block skips it
    if constexpr (Traits::kSplitKeys) take_key_slice(blk);
    if constexpr (!Traits::kVarlen) ptx::wait_for_prior_grids();
    tile_fn(blk, 0, 0);
  }
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_sm90_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ CUtensorMap tm_q,
                    const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                    const __grid_constant__ CUtensorMap tm_o, const int num_m_blocks, const int num_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Traits::Element;
  extern __shared__ unsigned char smem_raw[];
  SharedStorage<Traits> smem(smem_raw);

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(smem.q_full, 1);
    ptx::mbarrier_init(smem.q_empty, Traits::kConsumerWarps);
#pragma unroll
    for (int s = 0; s < Traits::kStages; ++s) {
      ptx::mbarrier_init(&smem.k_full[s], 1);
      ptx::mbarrier_init(&smem.v_full[s], 1);
      ptx::mbarrier_init(&smem.k_empty[s], Traits::kConsumerWarps);
      ptx::mbarrier_init(&smem.v_empty[s], Traits::kConsumerWarps);
    }
    if constexpr (Traits::kSplitKeys) {
      ptx::mbarrier_init(smem.split_full, 1);
      ptx::mbarrier_init(smem.split_go, 1);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  // A key split's blocks write into rank 0's shared memory and signal each other's barriers: rank 0 expects the
  // other ranks' bytes, and no block touches another's barriers before all are initialized. Every thread arrives
  // on the cluster barrier here and waits on it only before its first remote access (fwd_sm90_split.cuh) or its
  // exit, so the blocks do not wait for each other at the start. Threads that never access another block (the
  // paged V producer, the blocks of a skipped varlen tile, which all return together) exit without waiting: an
  // exited thread no longer holds the barrier back.
  const bool split = Traits::kSplitKeys && ptx::cluster_size() > 1;
  if (split) {
    if (threadIdx.x == 0 && ptx::cluster_rank() == 0)
      ptx::mbarrier_arrive_expect_tx(smem.split_full, (ptx::cluster_size() - 1) * Traits::kPartialBytes);
    ptx::cluster_arrive();
  }
  // Launched with programmatic dependent launch: the setup above, the descriptor prefetches below and the first
  // tile's coordinates may overlap the previous kernel; every thread that touches global memory (TMA loads, O/LSE
  // stores) waits for it first, in for_each_tile.
  ptx::allow_dependent_grids();
  // A varlen block's tile: its index in the dense-shaped grid, or on a packed grid what every warp finds by the
  // same scan of the offsets (cuda/common/varlen_tile_scan.cuh), once they can be read. The scan's value passes
  // through a warp reduction (REDUX writes a uniform register), so that ptxas keeps the block's coordinates on the
  // uniform datapath as it does blockIdx's: in vector registers they spilled 128-132 B in the 160-register
  // consumers of the three-warpgroup kernels.
  // A key split's blocks share their cluster's tile.
  int varlen_tile = Traits::kSplitKeys ? (int)ptx::cluster_id_x() : (int)blockIdx.x;
  if constexpr (Traits::kVarlen) {
    if (p.varlen.scan_grid) {
      ptx::wait_for_prior_grids();
      varlen_tile = __reduce_min_sync(
          0xffffffffu, cuda::scan_varlen_tile(p, (int)p.pack.groups_div.divisor, p.pack.rows, num_m_blocks,
                                              varlen_tile));
    }
  }

  if (threadIdx.x >= Traits::kConsumerThreads) {
    ptx::setmaxnreg_dec<Traits::kProducerRegs>();
    // Paged keys (varlen): a second thread, in the producer's next warp, loads V (produce_paged_v).
    const int producer_thread = (int)threadIdx.x - Traits::kConsumerThreads;
    const bool two_producers = Traits::kTwoPagedProducers && p.varlen.block_table != nullptr;
    if (producer_thread == 0) {
      ptx::tma_prefetch_descriptor(&tm_q);
      ptx::tma_prefetch_descriptor(&tm_k);
      ptx::tma_prefetch_descriptor(&tm_v);
      for_each_tile<Traits>(p, num_m_blocks, num_tiles, varlen_tile,
                            [&](const auto& blk, int tile_count, int kv_count) {
        produce_tile<Traits>(p, blk, smem, &tm_q, &tm_k, &tm_v, tile_count, kv_count, !two_producers);
        if constexpr (Traits::kSplitKeys) {
          if (split) {
            ptx::cluster_wait();
            if (blk.split_rank == 0) open_split_slots<Traits>(smem, blk.n_blocks - blk.n_first, blk.num_splits);
          }
        }
      });
    } else if (two_producers && producer_thread == kVPagedProducerThread) {
      for_each_tile<Traits>(p, num_m_blocks, num_tiles, varlen_tile, [&](const auto& blk, int, int kv_count) {
        produce_paged_v<Traits>(p, blk, smem, &tm_v, kv_count);
      });
    } else if (split) {
      ptx::cluster_wait();
    }
  } else {
    ptx::setmaxnreg_inc<Traits::kConsumerRegs>();
    if (threadIdx.x == 0) ptx::tma_prefetch_descriptor(&tm_o);
    for_each_tile<Traits>(p, num_m_blocks, num_tiles, varlen_tile,
                          [&](const auto& blk, int tile_count, int kv_count) {
      consume_tile<Traits>(p, blk, smem, &tm_o, tile_count, kv_count);
    });
    finish_output_stores();
  }
#endif
}

}  // namespace flashcore::sm90
