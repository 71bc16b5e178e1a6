// Global <-> shared copies of (rows x head_dim) tiles for the mma.sync kernels.
//
// Global tensors are addressed as (seq, dim) rows of one (batch, head) with an element row stride; the caller
// guarantees 16-byte alignment of the base pointer and of every row (host code copies misaligned inputs). Rows
// at or past `row_limit` and chunks at or past `dim_limit` (head dims padded up to the tile width) are
// zero-filled in shared memory, so padded rows/columns contribute nothing to the products.
#pragma once

#include <cstdint>

#include "../ptx/cp_async.cuh"
#include "../ptx/ldmatrix.cuh"
#include "smem_tile.cuh"

namespace flashcore::cuda {

// Asynchronous (cp.async) load; the caller commits the group. Consecutive threads take consecutive 16-byte
// chunks of a row, so each warp's global reads are coalesced.
template <typename Tile, int kNThreads, typename Element>
__device__ __forceinline__ void load_tile_async(Element* smem, const Element* gmem, int64_t row_stride, int row0,
                                                int row_limit, int dim_limit) {
  constexpr int kChunks = Tile::kElems / 8;
  constexpr int kCpr = Tile::kChunksPerRow;
  const uint32_t smem_base = ptx::smem_addr(smem);
  if constexpr (kNThreads % kCpr == 0) {
    // Each thread keeps one chunk column and steps down the rows: one pointer, advanced by a constant stride.
    constexpr int kRowStep = kNThreads / kCpr;
    const int c = threadIdx.x % kCpr;
    const int r0 = threadIdx.x / kCpr;
    const bool col_ok = c * 8 < dim_limit;
    const Element* src = gmem + (int64_t)(row0 + r0) * row_stride + c * 8;
    const int64_t step = (int64_t)kRowStep * row_stride;
#pragma unroll
    for (int it = 0; it < (kChunks + kNThreads - 1) / kNThreads; ++it) {
      const int r = r0 + it * kRowStep;
      if (kChunks % kNThreads != 0 && r >= Tile::kNumRows) break;
      const bool valid = col_ok && (row0 + r < row_limit);
      ptx::cp_async_16(smem_base + Tile::chunk_offset(r, c) * (int)sizeof(Element), valid ? src : gmem, valid);
      src += step;
    }
  } else {
#pragma unroll
    for (int it = 0; it < (kChunks + kNThreads - 1) / kNThreads; ++it) {
      const int i = it * kNThreads + threadIdx.x;
      if (kChunks % kNThreads != 0 && i >= kChunks) break;
      const int r = i / kCpr;
      const int c = i % kCpr;
      const bool valid = (row0 + r < row_limit) && (c * 8 < dim_limit);
      const Element* src = valid ? gmem + (int64_t)(row0 + r) * row_stride + c * 8 : gmem;
      ptx::cp_async_16(smem_base + Tile::chunk_offset(r, c) * (int)sizeof(Element), src, valid);
    }
  }
}

// Synchronous store of a shared tile to global with 16-byte stores; rows >= row_limit and chunks >= dim_limit
// are skipped.
template <typename Tile, int kNThreads, typename Element>
__device__ __forceinline__ void store_tile(const Element* smem, Element* gmem, int64_t row_stride, int row0,
                                           int row_limit, int dim_limit) {
  constexpr int kChunks = Tile::kElems / 8;
#pragma unroll
  for (int it = 0; it < (kChunks + kNThreads - 1) / kNThreads; ++it) {
    const int i = it * kNThreads + threadIdx.x;
    if (kChunks % kNThreads != 0 && i >= kChunks) break;
    const int r = i / Tile::kChunksPerRow;
    const int c = i % Tile::kChunksPerRow;
    if (row0 + r < row_limit && c * 8 < dim_limit) {
      const uint4 v = *reinterpret_cast<const uint4*>(smem + Tile::chunk_offset(r, c));
      *reinterpret_cast<uint4*>(gmem + (int64_t)(row0 + r) * row_stride + c * 8) = v;
    }
  }
}

// One warp's rows [tile_row0, tile_row0 + kRows) of a shared tile to global memory with 16-byte stores (lanes take
// consecutive chunks, so each store instruction covers whole rows). For rows the warp staged itself: __syncwarp
// orders its reads after its own writes and no other warp's rows are read, so no block barrier is needed. Rows at
// or past row_limit (row0 + tile row) and chunks at or past dim_limit are skipped.
template <typename Tile, int kRows, typename Element>
__device__ __forceinline__ void store_warp_rows(const Element* smem, Element* gmem, int64_t row_stride, int row0,
                                                int tile_row0, int row_limit, int dim_limit, int lane) {
  constexpr int kChunks = kRows * Tile::kChunksPerRow;
  static_assert(kChunks % 32 == 0, "whole rounds of the warp's lanes");
  __syncwarp();
#pragma unroll
  for (int i = lane; i < kChunks; i += 32) {
    const int r = tile_row0 + i / Tile::kChunksPerRow;
    const int c = i % Tile::kChunksPerRow;
    if (row0 + r < row_limit && c * 8 < dim_limit) {
      const uint4 v = *reinterpret_cast<const uint4*>(smem + Tile::chunk_offset(r, c));
      *reinterpret_cast<uint4*>(gmem + (int64_t)(row0 + r) * row_stride + c * 8) = v;
    }
  }
}

}  // namespace flashcore::cuda
