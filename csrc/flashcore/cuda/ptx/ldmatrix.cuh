// Shared-memory matrix fragment loads (sm_75+), wrapped once.
// PTX ISA, "Warp-level matrix load instruction: ldmatrix" (section 9.7.14.5.15).
//
// .x4 loads four 8x8 b16 matrices; lane i supplies the shared address of row (i % 8) of matrix (i / 8). Result
// register j holds, in lane l, matrix j's elements (row l / 4, cols 2 (l % 4) .. +1); with .trans the matrix is
// transposed first, i.e. elements (rows 2 (l % 4) .. +1, col l / 4).
#pragma once

#include <cstdint>

namespace flashcore::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

}  // namespace flashcore::ptx
