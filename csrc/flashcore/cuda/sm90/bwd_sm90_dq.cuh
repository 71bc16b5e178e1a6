// dS and dQ of one backward step, for one consumer warpgroup of the Hopper backward kernel (bwd_sm90_consumer.cuh):
// where the warpgroup's dS fragments go in shared memory, the dQ GEMM of its share (bwd_sm90_config.cuh kDqSplit)
// and the staging of its dQ for the dQ writer (bwd_sm90_producer.cuh). Two layouts:
//   64- and 128-row steps: dS^T stored key-major (stmatrix), dQ = dS K as m64n64 GEMMs (dS^T and K read MN-major);
//   80-row steps (BwdSm90Traits::kDqTransposed): dS stored query-major (stmatrix.trans), dQ^T = K^T dS^T as one
//   m64n80 GEMM (K read M-major as A, dS K-major as B), 64 head-dim columns a warpgroup.
// dQ is staged without the softmax scale (the post-pass applies it: bwd_sm90_launch.cuh kBwdDqAccum); dense 80-row
// steps stage it in the accumulator's fragment order (BwdSm90Traits::kDqFragmentOrder).
#pragma once

#include <cstdint>

#include "../common/dq_fragment_order.cuh"
#include "../ptx/stmatrix.cuh"
#include "../ptx/wgmma_sm90.cuh"
#include "bwd_sm90_traits.cuh"
#include "smem_desc.cuh"

namespace flashcore::sm90 {

// Offset (floats) of (row, col) in a warpgroup's dQ staging tile (kRows rows x 64 columns): two boxes of 32
// columns, rows of 128 bytes whose 16-byte chunks are swizzled as TMA's 128-byte mode expects (chunk c of row r
// at c ^ (r % 8)). `row` is the staging row (dq_staging_row).
template <int kRows>
__device__ __forceinline__ int dq_staging_offset(int row, int col) {
  const int box = col >> 5, chunk = (col & 31) >> 2;
  return box * (kRows * 32) + row * 32 + ((chunk ^ (row & 7)) << 2) + (col & 3);
}

// The staging row of query row `row` of a tile. A warp's float2 stores cover 8 rows g x 4 column pairs; in the
// swizzle, row g's two chunks are (2 ni, 2 ni + 1) ^ g, so rows g and g ^ 1 of a half-warp meet in the same banks
// (4 wavefronts a store instead of 2). Interleaved (Traits::kDqRowsInterleaved), row 8k + g is staged at
// 8k + 2 (g % 4) + g / 4: a half-warp's four rows XOR their chunks with 0, 2, 4, 6 (or 1, 3, 5, 7), eight
// distinct chunks; the dQ writer's tensor map (make_tensor_map_f32_rows_interleaved) reads them back in order.
// (Unswizzled 8-column boxes also avoid the conflict but made the TMA reductions slower: docs/PERFORMANCE.md.)
template <bool kInterleaved>
__device__ __forceinline__ int dq_staging_row(int row) {
  return kInterleaved ? (row & ~7) | ((row & 3) << 1) | ((row >> 2) & 1) : row;
}

// The same for this thread's accumulator pairs of n8 tile ni, rows r0 + 8 h (r0 % 8 = g), columns 8 ni + 2t, from
// the offset of ni = 0, h = 0: chunk (2 (ni % 4) + t / 2) ^ g is that of ni = 0 XOR 2 (ni % 4) (disjoint bits),
// and the tile's rows are 128-byte aligned, so bits 3-4 of a float offset hold only the chunk. Four address
// computations a step instead of one per store.
template <int kRows>
__device__ __forceinline__ int dq_pair_offset(int offset0, int ni, int h) {
  return (offset0 ^ ((ni & 3) << 3)) + (ni >> 2) * (kRows * 32) + h * 8 * 32;
}

template <typename Traits>
struct BwdDqStep {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kQSteps = kBlockM / 16;
  static constexpr bool kTransposed = Traits::kDqTransposed;
  // Accumulators: kMTiles m64 query tiles (a 64-query span of dS^T each) of 64 columns; transposed, one m64
  // (columns) x n kBlockM (queries) tile.
  static constexpr int kMTiles = kTransposed ? 1 : Traits::kDqRows / 64;
  static constexpr int kVals = kTransposed ? kBlockM / 2 : 32;
  static_assert(Traits::kDqCols == 64, "one 64-column dQ GEMM a warpgroup and step");
  using Mma = ptx::Wgmma<Element, kTransposed ? kBlockM : 64>;
  using Acc = float[kMTiles][kVals];

  int wg, lane, g, t, warp_row;
  uint32_t k_addr;
  float* stage_tile;

  __device__ __forceinline__ BwdDqStep(int wg_, int lane_, int warp_row_, uint32_t k_addr_, float* stage_tile_)
      : wg(wg_), lane(lane_), g(lane_ >> 2), t(lane_ & 3), warp_row(warp_row_), k_addr(k_addr_),
        stage_tile(stage_tile_) {}

  // Byte offset in the dS tile of this lane's stmatrix row for fragment block kk (16 keys x 16 queries).
  // Key-major (stmatrix.x4: dsa[kk]'s four registers are its four 8 x 8 matrices, keys g / g + 8 by query columns
  // 2t / 8 + 2t): lane l addresses row l % 8 + 8 ((l / 8) % 2) of the warp's 16 keys, 8-column half l / 16 of
  // block kk. In the 128-byte swizzle, block kk's chunk is (2 (kk % 4) + half) ^ (row % 8) = ((half ^ (row % 8)) ^
  // 2 (kk % 4)): the kk = 0 offset XOR a constant (the tile is 1024-byte aligned and rows are 128 bytes, so bits 4-6
  // hold only the chunk), plus kk / 4 spans.
  // Query-major (stmatrix.trans): lane l addresses query 16 kk + l % 8 + 8 (l / 16), key chunk (l / 8) % 2 of the
  // warp's 16; block kk is 16 rows (2048 bytes) further.
  __device__ __forceinline__ uint32_t ds_offset(int kk) const {
    if constexpr (kTransposed) {
      const int chunk = (64 * wg + warp_row) / 8 + ((lane >> 3) & 1);
      return 2u * Traits::DsTile::chunk_offset((lane & 7) + ((lane >> 4) << 3), chunk) + kk * 16 * 128;
    } else {
      const uint32_t base =
          2u * Traits::DsTile::chunk_offset(64 * wg + warp_row + (lane & 7) + (lane & 8), lane >> 4);
      return (kk / 4) * (uint32_t)(kBlockN * 64 * 2) + (base ^ (uint32_t)((kk % 4) << 5));
    }
  }

  // This warpgroup's dS fragments (keys of its 64 rows, dK's A operand) to the step's dS tile.
  __device__ __forceinline__ void store_ds(uint32_t ds_addr, const uint32_t (&dsa)[kQSteps][4]) const {
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk) {
      if constexpr (kTransposed)
        ptx::stmatrix_x4_trans(ds_addr + ds_offset(kk), dsa[kk]);
      else
        ptx::stmatrix_x4(ds_addr + ds_offset(kk), dsa[kk]);
    }
  }

  // Queues this warpgroup's dQ GEMM (one commit group) once every consumer's dS is in shared memory: split by
  // columns, all kBlockN keys and span wg of K; by rows, all keys and the warpgroup's query span wg of dS^T; by
  // keys, this warpgroup's 64 keys, every query and column; transposed, K's span wg (rows = keys) as A and dS as B.
  __device__ __forceinline__ void issue(Acc& dq, uint32_t ds_addr) const {
    ptx::wgmma_fence();
    if constexpr (kTransposed) {
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        Mma::ss_amn(dq[0], mnmajor_desc(k_addr + wg * kBlockN * 128, kBlockN, kk),
                    kmajor_desc(ds_addr, kBlockM, 0, kk), kk > 0);
    } else {
      const uint32_t ds_a = Traits::kDqSplitKeys   ? ds_addr + 64 * wg * 128
                            : Traits::kDqSplitRows ? ds_addr + wg * kBlockN * 128
                                                   : ds_addr;
      const uint32_t k_b = Traits::kDqSplitKeys   ? k_addr + 64 * wg * 128
                           : Traits::kDqSplitRows ? k_addr
                                                  : k_addr + wg * kBlockN * 128;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int kk = 0; kk < Traits::kDqKeys / 16; ++kk)
          Mma::ss_mn(dq[mt], mnmajor_desc(ds_a + mt * kBlockN * 128, kBlockN, kk), mnmajor_desc(k_b, kBlockN, kk),
                     kk > 0);
      }
    }
    ptx::wgmma_commit();
  }

  // dQ (rows: queries m0 + dq_row0(wg) + 64 mt + warp_row + g (+ 8)) to the staging tile. Transposed (varlen; the
  // dense kernel stages fragment order), dq[0][4 ni + 2 h + e] is dQ of query 8 ni + 2t + e, column
  // warp_row + g + 8 h (of the chunk): scalar stores,
  // conflict-free (the 8 g's take two chunks, XORed with the four rows 2t + e: 8 distinct chunks); n8 tile ni is 8
  // rows (256 floats) further with the same swizzle.
  __device__ __forceinline__ void stage(const Acc& dq) const {
    if constexpr (Traits::kDqFragmentOrder) {
      // The accumulator's own order (common/dq_fragment_order.cuh): dq[0][4 ni .. 4 ni + 3] is one float4.
      using Tile = cuda::DqFragmentTile<kBlockM>;
      float4* dst = reinterpret_cast<float4*>(stage_tile + Tile::wg_offset(warp_row / 16, 0, lane));
#pragma unroll
      for (int ni = 0; ni < kBlockM / 8; ++ni)
        dst[ni * 32] = make_float4(dq[0][4 * ni], dq[0][4 * ni + 1], dq[0][4 * ni + 2], dq[0][4 * ni + 3]);
    } else if constexpr (kTransposed) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int offset = dq_staging_offset<Traits::kDqRows>(2 * t + e, warp_row + g + 8 * h);
#pragma unroll
          for (int ni = 0; ni < kBlockM / 8; ++ni) stage_tile[offset + ni * 8 * 32] = dq[0][4 * ni + 2 * h + e];
        }
      }
    } else {
      // ni = 0, h = 0, mt = 0 (interleaving keeps rows + 8 and + 64 at + 8 and + 64)
      const int offset0 =
          dq_staging_offset<Traits::kDqRows>(dq_staging_row<Traits::kDqRowsInterleaved>(warp_row + g), 2 * t);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int ni = 0; ni < 8; ++ni)
            *reinterpret_cast<float2*>(stage_tile + mt * 64 * 32 + dq_pair_offset<Traits::kDqRows>(offset0, ni, half)) =
                make_float2(dq[mt][4 * ni + 2 * half], dq[mt][4 * ni + 2 * half + 1]);
        }
      }
    }
  }
};

}  // namespace flashcore::sm90
