// wgmma shared-memory descriptors of the tiles the sm90 kernels keep in shared memory: SmemTile's 64-element
// spans, each exactly wgmma's 128-byte-swizzle canonical layout (ptx/wgmma_sm90.cuh).
#pragma once

#include <cstdint>

#include "../ptx/wgmma_sm90.cuh"

namespace flashcore::sm90 {

// Descriptor of k-step ks (16 columns) of a K-major tile with `rows` rows starting at tile_addr + row0 * 128.
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t tile_addr, int rows, int row0, int ks) {
  const uint32_t addr = tile_addr + (ks / 4) * rows * 128 + row0 * 128 + (ks % 4) * 32;
  return ptx::make_smem_desc_sw128(addr, /*leading (unused)=*/16, /*stride=*/1024);
}

// Descriptor of keys [16 kk, 16 kk + 16) of a V tile (rows = keys) read as the MN-major B operand;
// also any tile whose rows are the K dimension of an MN-major A or B operand (64 M/N elements a span).
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t tile_addr, int rows, int kk) {
  return ptx::make_smem_desc_sw128(tile_addr + kk * 16 * 128, /*leading=*/rows * 128, /*stride=*/1024);
}

}  // namespace flashcore::sm90
