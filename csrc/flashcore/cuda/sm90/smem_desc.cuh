// wgmma shared-memory descriptors of the tiles the sm90 kernels keep in shared memory: SmemTile's 64-element
// spans, each exactly wgmma's 128-byte-swizzle canonical layout (ptx/wgmma_sm90.cuh).
#pragma once

#include <cstdint>

#include "../ptx/wgmma_sm90.cuh"

namespace flashcore::sm90 {

// A descriptor moved by `bytes` (a multiple of 16) within shared memory: the start address is its low 14 bits
// in 16-byte units, and every shared address of a block is below 2^18 bytes, so the field cannot carry into
// the leading-offset bits. Offsetting the descriptor of a tile's base, not rebuilding it from base + offset, lets
// the compiler build one descriptor per tile and add constants for the k-steps (one integer add per wgmma
// operand instead of the add, mask, shift and or of a fresh descriptor).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  // A 32-bit add on the low word: no carry can reach the high word (bits 14-15 are 0, see above).
  return (desc & 0xFFFFFFFF00000000ull) | (uint32_t)((uint32_t)desc + (bytes >> 4));
}

// Descriptor of k-step ks (16 columns) of a K-major tile with `rows` rows starting at tile_addr + row0 * 128.
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t tile_addr, int rows, int row0, int ks) {
  const uint64_t base = ptx::make_smem_desc_sw128(tile_addr, /*leading (unused)=*/16, /*stride=*/1024);
  return desc_advance(base, (ks / 4) * rows * 128 + row0 * 128 + (ks % 4) * 32);
}

// Descriptor of keys [16 kk, 16 kk + 16) of a V tile (rows = keys) read as the MN-major B operand;
// also any tile whose rows are the K dimension of an MN-major A or B operand (64 M/N elements a span).
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t tile_addr, int rows, int kk) {
  const uint64_t base = ptx::make_smem_desc_sw128(tile_addr, /*leading=*/rows * 128, /*stride=*/1024);
  return desc_advance(base, kk * 16 * 128);
}

}  // namespace flashcore::sm90
