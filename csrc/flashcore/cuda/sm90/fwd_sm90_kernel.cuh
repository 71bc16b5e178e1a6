// Hopper forward kernel (sm_90a), first step: the two GEMMs on warpgroup MMA (wgmma), everything else shared
// with the mma.sync kernel (cp.async double-buffered K/V, online softmax, masking, epilogue).
//
// A block has kWarpgroups warpgroups (fwd_sm90_config.cuh), each owning 64 query rows:
//   S (64 x kBlockN)  = Q_wg . K^T  wgmma, A and B from shared memory (both K-major)
//   O (64 x kHeadDim) += P . V      wgmma, A = P from the S accumulators (registers), B = V from shared memory
//                                   read transposed (MN-major)
// The warpgroups interleave on the tensor cores: while one runs its softmax the other's GEMMs proceed.
// Not yet here (issue 4): TMA loads, a producer warp with setmaxnreg, intra-warpgroup overlap, persistence.
//
// Shared tiles use SmemTile's 64-element spans, which is exactly wgmma's 128-byte-swizzle canonical layout
// (16-byte chunk c of 128-byte row r at c ^ (r % 8)); tiles start 1024-byte aligned, as that layout requires.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "../../params.h"
#include "../fwd_block.cuh"
#include "../ptx/cp_async.cuh"
#include "../ptx/wgmma_sm90.cuh"
#include "../sm80/fwd_sm80_mainloop.cuh"
#include "../sm80/fwd_sm80_mask.cuh"
#include "../sm80/fwd_sm80_softmax.cuh"
#include "../sm80/smem_tile.cuh"
#include "../sm80/tile_io.cuh"
#include "fwd_sm90_config.cuh"

namespace flashcore::sm90 {

template <int kHeadDim_, typename Element_>
struct FwdSm90Traits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "wgmma tiles use 64-element swizzle spans");
  static constexpr int kWarpgroups = FwdSm90Config<kHeadDim>::kWarpgroups;
  static constexpr int kBlockM = 64 * kWarpgroups;
  static constexpr int kBlockN = FwdSm90Config<kHeadDim>::kBlockN;
  static constexpr int kNThreads = 128 * kWarpgroups;
  static constexpr int kNTiles = kBlockN / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kKSteps = kHeadDim / 16;
  using QTile = sm80::SmemTile<kBlockM, kHeadDim>;
  using KVTile = sm80::SmemTile<kBlockN, kHeadDim>;
  static constexpr int kSpanBytes = 64 * 2;  // one swizzle row
  static constexpr int kSmemBytes = (QTile::kElems + 4 * KVTile::kElems) * 2 + 1024;  // + alignment slack
};

// Descriptor of k-step ks (16 columns) of a K-major tile with `rows` rows starting at tile_addr + row0 * 128.
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t tile_addr, int rows, int row0, int ks) {
  const uint32_t addr = tile_addr + (ks / 4) * rows * 128 + row0 * 128 + (ks % 4) * 32;
  return ptx::make_smem_desc_sw128(addr, /*leading (unused)=*/16, /*stride=*/1024);
}

// Descriptor of keys [16 kk, 16 kk + 16) of a V tile (rows = keys) read as the MN-major B operand.
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t tile_addr, int rows, int kk) {
  return ptx::make_smem_desc_sw128(tile_addr + kk * 16 * 128, /*leading=*/rows * 128, /*stride=*/1024);
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_sm90_kernel(const __grid_constant__ FwdParams p, const int num_m_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Traits::Element;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kNThreads = Traits::kNThreads;
  constexpr int kNTiles = Traits::kNTiles, kDTiles = Traits::kDTiles, kKSteps = Traits::kKSteps;
  using Mma = ptx::Wgmma<Element, kBlockN>;  // S = Q K^T: n = kBlockN
  using MmaPV = ptx::Wgmma<Element, Traits::kHeadDim>;  // O += P V: n = head dim

  extern __shared__ unsigned char smem_raw[];
  Element* sQ = reinterpret_cast<Element*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  Element* const sK = sQ + QTile::kElems;
  Element* const sV = sK + 2 * KVTile::kElems;
  const uint32_t q_addr = ptx::smem_addr(sQ);
  const uint32_t k_addr = ptx::smem_addr(sK);
  const uint32_t v_addr = ptx::smem_addr(sV);
  constexpr uint32_t kKVTileBytes = KVTile::kElems * 2;

  const int lane = threadIdx.x & 31;
  const int wg = threadIdx.x >> 7;
  const int warp_row0 = wg * 64 + ((threadIdx.x >> 5) & 3) * 16;  // this warp's 16 rows inside the block
  const int seqlen_q = (int)p.seqlen_q, seqlen_k = (int)p.seqlen_k, head_dim = (int)p.head_dim;
  const cuda::FwdBlock<Element> blk = cuda::fwd_block<Element, kBlockM, kBlockN>(p, num_m_blocks);
  const int m0 = blk.m0, n_blocks = blk.n_blocks;

  float o[1][kDTiles][4];
#pragma unroll
  for (int di = 0; di < kDTiles; ++di)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][di][e] = 0.f;
  sm80::OnlineSoftmax<1, kNTiles, kDTiles> softmax;
  const int frag_row0 = m0 + warp_row0 + (lane >> 2);
  const int frag_col_in_tile = 2 * (lane & 3);

  if (n_blocks > 0) {
    sm80::load_tile_async<QTile, kNThreads>(sQ, blk.q, p.q_stride.seq, m0, seqlen_q, head_dim);
    sm80::load_tile_async<KVTile, kNThreads>(sK, blk.k, p.k_stride.seq, (n_blocks - 1) * kBlockN, seqlen_k,
                                             head_dim);
    ptx::cp_async_commit();
    sm80::load_tile_async<KVTile, kNThreads>(sV, blk.v, p.v_stride.seq, (n_blocks - 1) * kBlockN, seqlen_k,
                                             head_dim);
    ptx::cp_async_commit();

    const bool negative_scale = !(p.scale_log2 > 0.f);
    const float softmax_scale = negative_scale ? 1.f : p.scale_log2;

    for (int it = 0; it < n_blocks; ++it) {
      const int n_block = n_blocks - 1 - it;
      const int buf = it & 1;

      ptx::cp_async_wait<1>();          // Q (first step) and K[n_block] have landed (this thread's copies)
      ptx::fence_proxy_async_shared();  // cp.async wrote through the generic proxy; wgmma reads via the async one
      __syncthreads();
      if (it + 1 < n_blocks)
        sm80::load_tile_async<KVTile, kNThreads>(sK + (buf ^ 1) * KVTile::kElems, blk.k, p.k_stride.seq,
                                                 (n_block - 1) * kBlockN, seqlen_k, head_dim);
      ptx::cp_async_commit();

      float s[1][kNTiles][4];
      float(&s_flat)[kBlockN / 2] = *reinterpret_cast<float(*)[kBlockN / 2]>(&s[0][0][0]);
      ptx::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks)
        Mma::ss(s_flat, kmajor_desc(q_addr, kBlockM, wg * 64, ks),
                kmajor_desc(k_addr + buf * kKVTileBytes, kBlockN, 0, ks), ks > 0);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();

      if (negative_scale) {
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[0][ni][e] *= p.scale_log2;
      }
      if (cuda::tile_needs_mask<kBlockN>(p, m0, n_block))
        sm80::apply_mask(s, frag_row0, n_block * kBlockN + frag_col_in_tile, seqlen_k, p.causal, p.causal_offset);
      softmax.update(s, o, softmax_scale);

      ptx::cp_async_wait<1>();  // V[n_block] has landed
      ptx::fence_proxy_async_shared();
      __syncthreads();
      if (it + 1 < n_blocks)
        sm80::load_tile_async<KVTile, kNThreads>(sV + (buf ^ 1) * KVTile::kElems, blk.v, p.v_stride.seq,
                                                 (n_block - 1) * kBlockN, seqlen_k, head_dim);
      ptx::cp_async_commit();

      // P as wgmma A fragments, all packed before the fence so the MMAs issue back to back.
      uint32_t pa[kBlockN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        pa[kk][0] = sm80::pack2<Element>(s[0][2 * kk][0], s[0][2 * kk][1]);
        pa[kk][1] = sm80::pack2<Element>(s[0][2 * kk][2], s[0][2 * kk][3]);
        pa[kk][2] = sm80::pack2<Element>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
        pa[kk][3] = sm80::pack2<Element>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
      }
      float(&o_flat)[Traits::kHeadDim / 2] = *reinterpret_cast<float(*)[Traits::kHeadDim / 2]>(&o[0][0][0]);
      ptx::wgmma_fence();  // o was rescaled and P written by ordinary instructions
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        MmaPV::rs(o_flat, pa[kk], mnmajor_desc(v_addr + buf * kKVTileBytes, kBlockN, kk), true);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
    }
    ptx::cp_async_wait<0>();
  }

  float lse[2];
  softmax.finalize(o, lse);
  __syncthreads();  // every warpgroup's wgmma reads of sQ are complete (wait_group 0 above)
  cuda::write_output<QTile, kNThreads>(o, lse, sQ, blk, p, warp_row0, lane);
#endif
}

}  // namespace flashcore::sm90
