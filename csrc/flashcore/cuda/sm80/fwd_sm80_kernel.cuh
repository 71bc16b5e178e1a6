// The mma.sync forward kernel (sm_80 .. sm_90): one thread block computes kBlockM query rows of one
// (batch, head), walking the key/value blocks that the mask leaves visible, last block first.
//
// Pipeline (cp.async, two buffers each for K and V): while the warps compute S = Q K^T on K[n], V[n] is in
// flight; while they compute O += P V[n], K[n-1] is in flight. Each loop step commits exactly one group after
// each wait, so `cp_async_wait<1>` always means "all but the newest group have landed".
// Hazard: a buffer is refilled only after the __syncthreads that follows its last reader's step.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "../../params.h"
#include "../common/fragment_mask.cuh"
#include "../common/fragment_score_mod.cuh"
#include "../common/fwd_block.cuh"
#include "../common/online_softmax.cuh"
#include "../common/smem_tile.cuh"
#include "../common/tile_io.cuh"
#include "../ptx/grid_dependency.cuh"
#include "fwd_sm80_config.cuh"
#include "fwd_sm80_mainloop.cuh"

namespace flashcore::sm80 {

// kBlockM_ x kBlockN_: the configured tile, or FwdConfig's small-grid tile for grids that would not fill the GPU.
template <int kHeadDim_, typename Element_, int kBlockM_ = FwdConfig<kHeadDim_>::kBlockM,
          int kBlockN_ = FwdConfig<kHeadDim_>::kBlockN>
struct FwdKernelTraits {
  using Element = Element_;
  using Config = FwdConfig<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = Config::kNWarps;
  static constexpr bool kQInRegs = Config::kQInRegs;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kWarpRows = kBlockM / kNWarps;
  static constexpr int kMTiles = kWarpRows / 16;
  static constexpr int kNTiles = kBlockN / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kKSteps = kHeadDim / 16;
  static_assert(kWarpRows % 16 == 0 && kNTiles % 2 == 0 && kDTiles % 2 == 0, "tile shape");

  using QTile = cuda::SmemTile<kBlockM, kHeadDim>;
  using KVTile = cuda::SmemTile<kBlockN, kHeadDim>;
  static constexpr int kSmemBytes = (QTile::kElems + 4 * KVTile::kElems) * (int)sizeof(Element);
  static_assert(kSmemBytes <= 96 * 1024, "one binary for sm_80..sm_90: sm_86/sm_89 give a block 99 KiB");
  // Two blocks a multiprocessor where registers allow (128 threads); one for 8 warps.
  static constexpr int kMinBlocksPerSm = kNThreads <= 128 ? 2 : 1;
};

// kScoreMod: the score-mod variant (softcap, ALiBi, or a scale that is not positive; score_mod.h), which turns each
// tile's scores into logits before the mask and runs the softmax with scale 1.
// kVarlen: a variable-length batch (seqlen.h): each block reads its sequence's lengths, band and first rows, and a
// block whose query rows all lie past its sequence's end exits at once.
template <typename Traits, bool kScoreMod, bool kVarlen = false>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocksPerSm)
    fwd_sm80_kernel(const __grid_constant__ FwdParams p, const int num_m_blocks) {
  using Element = typename Traits::Element;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kNThreads = Traits::kNThreads;
  constexpr int kMTiles = Traits::kMTiles, kNTiles = Traits::kNTiles, kDTiles = Traits::kDTiles;
  constexpr int kKSteps = Traits::kKSteps;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  Element* sQ = reinterpret_cast<Element*>(smem_raw);
  // Buffers K0, K1, V0, V1 follow Q; buffer b of K is sK + b * KVTile::kElems (pointer arithmetic, not a
  // pointer array, which a run-time index would put in local memory).
  Element* const sK = sQ + QTile::kElems;
  Element* const sV = sK + 2 * KVTile::kElems;

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warp_row0 = warp * Traits::kWarpRows;  // first row of this warp inside the block
  // Varlen: the offsets and the launch order (seqlen.h) are global memory the previous grid may have written.
  if constexpr (kVarlen) ptx::wait_for_prior_grids();
  const cuda::FwdBlock<Element> blk = cuda::fwd_block<Element, kBlockM, kBlockN, kVarlen>(p, num_m_blocks);
  if (kVarlen && blk.m0 >= blk.seqlen_q) return;
  const int seqlen_q = kVarlen ? blk.seqlen_q : (int)p.seqlen_q;
  const int seqlen_k = kVarlen ? blk.seqlen_k : (int)p.seqlen_k;
  const int head_dim = (int)p.head_dim;
  const int m0 = blk.m0, n_end = blk.n_blocks, n_count = blk.n_blocks - blk.n_first;
  const Band& band = kVarlen ? blk.band : p.band;
  const TileRange unmasked = band.unmasked_key_tiles(m0, kBlockM, kBlockN);  // key tiles the mask can skip

  float o[kMTiles][kDTiles][4];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int di = 0; di < kDTiles; ++di)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mi][di][e] = 0.f;
  // Tree row reductions where a row's chain is long (128-key blocks: the small-grid tile up to head dim 64); with
  // 64-key blocks they gain nothing measurable and made head dim 96 spill 24 B more.
  cuda::OnlineSoftmax<kMTiles, kNTiles, kDTiles, /*kTreeReduce=*/(kBlockN >= 128)> softmax;

  // This thread's first row (g of m-tile 0) and first column (2t of n-tile 0) in fragment coordinates.
  const int frag_row0 = m0 + warp_row0 + (lane >> 2);
  const int frag_col_in_tile = 2 * (lane & 3);

  // Launched with programmatic dependent launch (ptx/grid_dependency.cuh): nothing above touches global memory
  // (but the varlen offsets, read after the wait above).
  if constexpr (!kVarlen) ptx::wait_for_prior_grids();

  if (n_count > 0) {
    cuda::load_tile_async<QTile, kNThreads>(sQ, blk.q, p.q_stride.seq, m0, seqlen_q, head_dim);
    cuda::load_tile_async<KVTile, kNThreads>(sK, blk.k, p.k_stride.seq, (n_end - 1) * kBlockN, seqlen_k, head_dim);
    ptx::cp_async_commit();
    cuda::load_tile_async<KVTile, kNThreads>(sV, blk.v, p.v_stride.seq, (n_end - 1) * kBlockN, seqlen_k, head_dim);
    ptx::cp_async_commit();

    uint32_t q_regs[kMTiles][Traits::kQInRegs ? kKSteps : 1][4];
    const LaneOffsets a_off = lane_offsets_a(lane), b_off = lane_offsets_b(lane);
    // The plain kernel folds the (positive) scale into the softmax's exp2; the score-mod one transforms first.
    ScoreMod mod;
    if constexpr (kScoreMod) mod = ScoreMod::make(p.score, p.scale_log2, blk.b, blk.h);
    if constexpr (kVarlen) mod.alibi_offset = seqlen_k - seqlen_q;  // the sequence's, not the max lengths'

    const float softmax_scale = kScoreMod ? cuda::folded_softmax_scale(mod) : p.scale_log2;

    for (int it = 0; it < n_count; ++it) {
      const int n_block = n_end - 1 - it;
      const int buf = it & 1;

      ptx::cp_async_wait<1>();  // Q (first step) and K[n_block] have landed
      __syncthreads();
      if (it + 1 < n_count)
        cuda::load_tile_async<KVTile, kNThreads>(sK + (buf ^ 1) * KVTile::kElems, blk.k, p.k_stride.seq,
                                           (n_block - 1) * kBlockN, seqlen_k, head_dim);
      ptx::cp_async_commit();

      if constexpr (Traits::kQInRegs) {
        if (it == 0) load_q_fragments<QTile>(q_regs, sQ, warp_row0, lane);
      }

      float s[kMTiles][kNTiles][4];
      gemm_qk<QTile, KVTile, kMTiles, kNTiles, kKSteps, Traits::kQInRegs>(s, q_regs, sQ, sK + buf * KVTile::kElems,
                                                                         warp_row0, lane, a_off, b_off);

      // Logits before the mask, so that hidden keys stay -inf whatever the transform.
      if constexpr (kScoreMod)
        cuda::apply_score_mod</*kFoldSoftcap=*/true>(s, frag_row0, n_block * kBlockN + frag_col_in_tile, mod);
      if (!unmasked.contains(n_block))
        cuda::apply_mask(s, frag_row0, n_block * kBlockN + frag_col_in_tile, band);

      // Wait for V before the softmax, not after it, and rescale o unconditionally (no warp-uniform branch on
      // whether a row max moved): the softmax and P V then form one basic block, and the compiler interleaves the
      // exp2 of later key columns with the MMAs of earlier ones, as FlashAttention-2's SASS does.
      ptx::cp_async_wait<1>();  // V[n_block] has landed
      __syncthreads();
      if (it + 1 < n_count)
        cuda::load_tile_async<KVTile, kNThreads>(sV + (buf ^ 1) * KVTile::kElems, blk.v, p.v_stride.seq,
                                           (n_block - 1) * kBlockN, seqlen_k, head_dim);
      ptx::cp_async_commit();

      {
        float correction[2 * kMTiles];
        softmax.step(s, softmax_scale, correction);
        softmax.rescale(o, correction, true);
      }
      gemm_pv<KVTile, kMTiles, kNTiles, kDTiles>(o, s, sV + buf * KVTile::kElems, lane, a_off);
    }
    ptx::cp_async_wait<0>();
  }

  // The next kernel may launch once every block is past its key loop, not earlier: several of these blocks fit
  // on one SM, so blocks of the next grid launched at our start would share SMs with ours and finish unevenly
  // (4x8x512x64 on H100: 11.5 -> 13.6 us a call in a graph with the trigger at the start).
  ptx::allow_dependent_grids();
  float lse[2 * kMTiles];
  softmax.finalize(o, lse, cuda::sink_log2(p, blk.h));
  __syncthreads();  // every warp is done reading sQ before the epilogue reuses it for O
  cuda::write_output<QTile, kNThreads>(o, lse, sQ, blk, p, warp_row0, lane);
}

}  // namespace flashcore::sm80
