// Shared-memory matrix fragment stores (sm_90), wrapped once.
// PTX ISA, "Warp-level matrix store instruction: stmatrix" (section 9.7.14.5.16).
//
// .x4 stores four 8x8 b16 matrices; lane i supplies the shared address of row (i % 8) of matrix (i / 8). Register
// j holds, in lane l, matrix j's elements (row l / 4, cols 2 (l % 4) .. +1): the layout of an mma/wgmma
// accumulator row pair packed to 16 bits, so a 16 x 16 block of a fragment goes out in one instruction instead of
// four 32-bit stores.
// .trans stores each matrix transposed: register j's elements (row l / 4, cols 2 (l % 4) .. +1) land in rows
// 2 (l % 4) and 2 (l % 4) + 1 at column l / 4, so a fragment with keys as rows goes out with keys along a row.
#pragma once

#include <cstdint>

namespace flashcore::ptx {

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

}  // namespace flashcore::ptx
