// Warp-level products of the mma.sync backward kernel: one warp computes a 16 x (8 * kNT) fp32 tile of
//   C  = A . B^T   (A rows x K, B rows x K: both stored with K along the columns)  S = Q K^T, dP = dO V^T
//   C += A^T . B   (A stored K x M, B stored K x N)                                 dV += P^T dO, dK += dS^T Q
//   C  = A . B     (A stored M x K, B stored K x N)                                 dQ = dS K
// on swizzled shared-memory tiles (smem_tile.cuh). Operands stored with K along the rows reach the MMA through
// ldmatrix.trans, so no product needs a transposed copy. Fragment layouts: ../ptx/mma_sm80.cuh.
#pragma once

#include <cstdint>

#include "../ptx/ldmatrix.cuh"
#include "../ptx/mma_sm80.cuh"
#include "fwd_sm80_mainloop.cuh"  // a_frag_offset

namespace flashcore::sm80 {

template <int kNT>
__device__ __forceinline__ void zero(float (&c)[kNT][4]) {
#pragma unroll
  for (int i = 0; i < kNT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[i][e] = 0.f;
}

// B fragments of n8 tiles (2np, 2np + 1) at k-step ks from a tile stored K x N (rows = k), columns from b_col0:
// matrices (k 0-7 | 8-15) x (n chunk 2np | 2np + 1), so b[0..1] feed n-tile 2np and b[2..3] n-tile 2np + 1.
template <typename TB>
__device__ __forceinline__ void ldmatrix_b_kn(uint32_t (&b)[4], uint32_t base, int ks, int b_col0, int np,
                                              int lane) {
  const int k = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
  ptx::ldmatrix_x4_trans(b, base + TB::chunk_offset(k, b_col0 / 8 + 2 * np + (lane >> 4)) * 2);
}

template <typename Element, int kNT>
__device__ __forceinline__ void mma_pair(float (&c)[kNT][4], int np, const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  const uint32_t b_lo[2] = {b[0], b[1]};
  const uint32_t b_hi[2] = {b[2], b[3]};
  ptx::mma_m16n8k16<Element>(c[2 * np], a, b_lo);
  ptx::mma_m16n8k16<Element>(c[2 * np + 1], a, b_hi);
}

// C = A[a_row0 : +16, :] . op(B) over kKSteps k16 steps, A stored m x k. kBStoredNK: B stored n x k and op(B) = B^T
// (rows b_off.. of B); otherwise B stored k x n and op(B) = B (columns b_off..).
template <bool kBStoredNK, typename TA, typename TB, int kNT, int kKSteps, typename Element>
__device__ __forceinline__ void warp_gemm_a_mk(float (&c)[kNT][4], const Element* sA, int a_row0, const Element* sB,
                                               int b_off, int lane) {
  zero(c);
  const uint32_t a_base = ptx::smem_addr(sA);
  const uint32_t b_base = ptx::smem_addr(sB);
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a[4];
    ptx::ldmatrix_x4(a, a_base + a_frag_offset<TA>(a_row0, ks, lane) * 2);
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      uint32_t b[4];
      if constexpr (kBStoredNK) {
        // Matrices (rows 0-7 | 8-15 of this pair) x (k 0-7 | 8-15), stored with k along the columns.
        const int row = b_off + np * 16 + (lane & 7) + (lane >> 4) * 8;
        ptx::ldmatrix_x4(b, b_base + TB::chunk_offset(row, 2 * ks + ((lane >> 3) & 1)) * 2);
      } else {
        ldmatrix_b_kn<TB>(b, b_base, ks, b_off, np, lane);
      }
      mma_pair<Element>(c, np, a, b);
    }
  }
}

// C = A[a_row0 : +16, :] . B[b_row0 : +8 kNT, :]^T (S = Q K^T, dP = dO V^T).
template <typename TA, typename TB, int kNT, int kKSteps, typename Element>
__device__ __forceinline__ void warp_gemm_abt(float (&c)[kNT][4], const Element* sA, int a_row0, const Element* sB,
                                              int b_row0, int lane) {
  warp_gemm_a_mk<true, TA, TB, kNT, kKSteps>(c, sA, a_row0, sB, b_row0, lane);
}

// C = A[a_row0 : +16, :] . B[:, b_col0 : +8 kNT] (dQ = dS K).
template <typename TA, typename TB, int kNT, int kKSteps, typename Element>
__device__ __forceinline__ void warp_gemm_ab(float (&c)[kNT][4], const Element* sA, int a_row0, const Element* sB,
                                             int b_col0, int lane) {
  warp_gemm_a_mk<false, TA, TB, kNT, kKSteps>(c, sA, a_row0, sB, b_col0, lane);
}

// C += A[:, a_col0 : +16]^T . B[:, b_col0 : +8 kNT] over kKSteps k16 steps (both stored with k along the rows).
template <typename TA, typename TB, int kNT, int kKSteps, typename Element>
__device__ __forceinline__ void warp_gemm_atb(float (&c)[kNT][4], const Element* sA, int a_col0, const Element* sB,
                                              int b_col0, int lane) {
  const uint32_t a_base = ptx::smem_addr(sA);
  const uint32_t b_base = ptx::smem_addr(sB);
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    // A^T fragment from a k x m store, transposed by ldmatrix: a0..a3 = (m 0-7, k 0-7), (m 8-15, k 0-7),
    // (m 0-7, k 8-15), (m 8-15, k 8-15); lane l addresses matrix l / 8 at k row l % 8.
    uint32_t a[4];
    const int k = ks * 16 + (lane & 7) + ((lane >> 4) & 1) * 8;
    ptx::ldmatrix_x4_trans(a, a_base + TA::chunk_offset(k, a_col0 / 8 + ((lane >> 3) & 1)) * 2);
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_b_kn<TB>(b, b_base, ks, b_col0, np, lane);
      mma_pair<Element>(c, np, a, b);
    }
  }
}

}  // namespace flashcore::sm80
