// Warp-level products of the mma.sync forward kernel, on swizzled shared-memory tiles:
//   S (kWarpRows x kBlockN) = Q_warp . K^T   operands by ldmatrix (K rows are the "col" B operand as stored)
//   O (kWarpRows x kHeadDim) += P . V        P from the S accumulators (registers), V by ldmatrix.trans
// Fragment layouts: see ../ptx/mma_sm80.cuh and ../ptx/ldmatrix.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../common/pack.cuh"
#include "../ptx/ldmatrix.cuh"
#include "../ptx/mma_sm80.cuh"

namespace flashcore::sm80 {

using cuda::pack2;

// Lane address of an A fragment (16 rows x 16 cols at `row_base`, k-step `ks`) in an ldmatrix.x4:
// matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15) in the order a0, a1, a2, a3.
template <typename Tile>
__device__ __forceinline__ int a_frag_offset(int row_base, int ks, int lane) {
  return Tile::chunk_offset(row_base + (lane & 7) + ((lane >> 3) & 1) * 8, 2 * ks + (lane >> 4));
}

// ldmatrix lane addresses with no arithmetic per load, for tiles of 64-column spans (128-byte rows). The byte
// offset of (row, chunk) is span * kRows * 128 + row * 128 + 16 * (c ^ (row & 7)), c = chunk % 8. A lane reads
// row R + lr of a fragment (R a multiple of 16, lr < 16) and chunk 2 ks + b (b its half of the k16 step); with
// k = ks % 4, 16 * ((2 k + b) ^ (lr & 7)) = (32 k) ^ (16 * (b ^ (lr & 7))). So four offsets per lane, one per k,
// serve every fragment of the main loop, R and the span adding compile-time (or per-warp) constants.
struct LaneOffsets {
  uint32_t k[4];
};

__device__ __forceinline__ LaneOffsets lane_offsets(int lr, int b) {
  LaneOffsets o;
#pragma unroll
  for (int k = 0; k < 4; ++k) o.k[k] = (uint32_t)(lr * 128 + ((32 * k) ^ (16 * (b ^ (lr & 7)))));
  return o;
}
// The A operand (Q) and the transposed B operand (V) of the forward: lane rows (lane & 7) + 8 * bit 3, half bit 4.
__device__ __forceinline__ LaneOffsets lane_offsets_a(int lane) {
  return lane_offsets((lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4);
}
// The B operand (K, keys as rows): lane rows (lane & 7) + 8 * bit 4, half bit 3.
__device__ __forceinline__ LaneOffsets lane_offsets_b(int lane) {
  return lane_offsets((lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1);
}
// Byte offset, in a tile of 64-column spans, of this lane's ldmatrix address for the fragment at rows
// row0 + [0, 16) and chunk pair kk (columns 16 kk .. 16 kk + 15): span and row from constants, the swizzled
// column from the lane's precomputed offsets.
template <typename Tile>
__device__ __forceinline__ uint32_t wide_span_offset(int row0, int kk, const LaneOffsets& off) {
  static_assert(Tile::kSpanChunks == 8, "LaneOffsets describe 128-byte rows");
  return (kk / 4) * Tile::kNumRows * 128 + row0 * 128 + off.k[kk % 4];
}

template <typename QTile, int kMTiles, int kKSteps, typename Element>
__device__ __forceinline__ void load_q_fragments(uint32_t (&q)[kMTiles][kKSteps][4], const Element* sQ,
                                                 int warp_row0, int lane) {
  const uint32_t base = ptx::smem_addr(sQ);
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      ptx::ldmatrix_x4(q[mi][ks], base + a_frag_offset<QTile>(warp_row0 + mi * 16, ks, lane) * 2);
}

// S = Q K^T for this warp's rows. `q_regs` is used when kQInRegs, else Q fragments are read from sQ per k-step.
// q_regs is [kMTiles][kKSteps][4] when kQInRegs, else a [kMTiles][1][4] placeholder.
template <typename QTile, typename KTile, int kMTiles, int kNTiles, int kKSteps, bool kQInRegs, int kQRegSteps,
          typename Element>
__device__ __forceinline__ void gemm_qk(float (&s)[kMTiles][kNTiles][4],
                                        const uint32_t (&q_regs)[kMTiles][kQRegSteps][4],
                                        const Element* sQ, const Element* sK, int warp_row0, int lane,
                                        const LaneOffsets& a_off, const LaneOffsets& b_off) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.f;

  const uint32_t q_base = ptx::smem_addr(sQ);
  const uint32_t k_base = ptx::smem_addr(sK);
  constexpr bool kWideSpans = QTile::kSpanChunks == 8 && KTile::kSpanChunks == 8;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      if constexpr (kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[mi][e] = q_regs[mi][kQRegSteps > 1 ? ks : 0][e];
      } else {
        if constexpr (kWideSpans)
          ptx::ldmatrix_x4(a[mi], q_base + wide_span_offset<QTile>(warp_row0 + mi * 16, ks, a_off));
        else
          ptx::ldmatrix_x4(a[mi], q_base + a_frag_offset<QTile>(warp_row0 + mi * 16, ks, lane) * 2);
      }
    }
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      // Matrices (keys 0-7 | 8-15 of this pair) x (k cols 0-7 | 8-15): b0/b1 of n-tile 2np, then of 2np + 1.
      uint32_t b[4];
      if constexpr (kWideSpans) {
        ptx::ldmatrix_x4(b, k_base + wide_span_offset<KTile>(np * 16, ks, b_off));
      } else {
        const int key = np * 16 + (lane & 7) + (lane >> 4) * 8;
        ptx::ldmatrix_x4(b, k_base + KTile::chunk_offset(key, 2 * ks + ((lane >> 3) & 1)) * 2);
      }
      const uint32_t b_lo[2] = {b[0], b[1]};
      const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        ptx::mma_m16n8k16<Element>(s[mi][2 * np], a[mi], b_lo);
        ptx::mma_m16n8k16<Element>(s[mi][2 * np + 1], a[mi], b_hi);
      }
    }
  }
}

// O += P V for this warp's rows; p holds probabilities in the C layout of S (two n8 tiles form one k16 A tile).
template <typename VTile, int kMTiles, int kNTiles, int kDTiles, typename Element>
__device__ __forceinline__ void gemm_pv(float (&o)[kMTiles][kDTiles][4], const float (&p)[kMTiles][kNTiles][4],
                                        const Element* sV, int lane, const LaneOffsets& v_off) {
  const uint32_t v_base = ptx::smem_addr(sV);
#pragma unroll
  for (int kk = 0; kk < kNTiles / 2; ++kk) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      a[mi][0] = pack2<Element>(p[mi][2 * kk][0], p[mi][2 * kk][1]);
      a[mi][1] = pack2<Element>(p[mi][2 * kk][2], p[mi][2 * kk][3]);
      a[mi][2] = pack2<Element>(p[mi][2 * kk + 1][0], p[mi][2 * kk + 1][1]);
      a[mi][3] = pack2<Element>(p[mi][2 * kk + 1][2], p[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < kDTiles / 2; ++dp) {
      // Transposed matrices (keys 0-7 | 8-15) x (dims 0-7 | 8-15 of this pair): b0/b1 of d-tile 2dp, then 2dp + 1.
      uint32_t b[4];
      if constexpr (VTile::kSpanChunks == 8) {
        ptx::ldmatrix_x4_trans(b, v_base + wide_span_offset<VTile>(kk * 16, dp, v_off));
      } else {
        const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        ptx::ldmatrix_x4_trans(b, v_base + VTile::chunk_offset(key, 2 * dp + (lane >> 4)) * 2);
      }
      const uint32_t b_lo[2] = {b[0], b[1]};
      const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        ptx::mma_m16n8k16<Element>(o[mi][2 * dp], a[mi], b_lo);
        ptx::mma_m16n8k16<Element>(o[mi][2 * dp + 1], a[mi], b_hi);
      }
    }
  }
}

}  // namespace flashcore::sm80
