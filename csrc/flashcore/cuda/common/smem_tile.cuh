// Swizzled shared-memory layout of a (rows x cols) tile of 16-bit elements, addressed in 16-byte chunks.
//
// The tile is stored as column spans of 64 elements (128-byte rows) when cols is a multiple of 64, else 32
// elements (64-byte rows, head dims 32 and 96). Inside a span, chunk c of row r sits at c ^ swizzle(r). The
// invariant that matters: the 8 row addresses of one ldmatrix 8x8 matrix (8 consecutive rows, one logical chunk)
// land in 8 different 16-byte bank groups of a 128-byte line, so ldmatrix (plain and .trans) is conflict-free.
//   128-byte rows: swizzle(r) = r % 8 gives 8 distinct chunks.
//   64-byte rows : two rows share a line; (r % 2) picks the half, swizzle(r) = (r / 2) % 4 the chunk in it.
#pragma once

namespace flashcore::cuda {

template <int kRows, int kCols>
struct SmemTile {
  static_assert(kCols % 32 == 0, "tile width must be a multiple of 32 elements");
  static constexpr int kSpanCols = (kCols % 64 == 0) ? 64 : 32;
  static constexpr int kSpanChunks = kSpanCols / 8;
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kNumRows = kRows;
  static constexpr int kElems = kRows * kCols;

  // Element offset of 16-byte chunk `chunk` (8 elements) of row `row`.
  __device__ __forceinline__ static int chunk_offset(int row, int chunk) {
    const int span = chunk / kSpanChunks;
    const int c = chunk % kSpanChunks;
    const int swz = kSpanChunks == 8 ? (row & 7) : ((row >> 1) & 3);
    return span * (kRows * kSpanCols) + row * kSpanCols + ((c ^ swz) << 3);
  }

  // Element offset of (row, col), for scattered 4-byte writes of accumulator pairs.
  __device__ __forceinline__ static int elem_offset(int row, int col) {
    return chunk_offset(row, col >> 3) + (col & 7);
  }

  // Zeroes rows [row_begin, row_end) of the tile at `tile`, thread `thread` of `threads` taking every threads-th
  // 16-byte chunk: key rows past a sequence's end that a GEMM still reads (P = 0 there, but 0 x NaN is NaN).
  // Generic-proxy stores: a wgmma reading the rows needs a proxy fence and a barrier of the writers after them.
  template <typename Element>
  __device__ __forceinline__ static void zero_rows(Element* tile, int row_begin, int row_end, int thread,
                                                   int threads) {
    for (int i = thread; i < (row_end - row_begin) * kChunksPerRow; i += threads)
      *reinterpret_cast<uint4*>(tile + chunk_offset(row_begin + i / kChunksPerRow, i % kChunksPerRow)) =
          make_uint4(0, 0, 0, 0);
  }
};

}  // namespace flashcore::cuda
