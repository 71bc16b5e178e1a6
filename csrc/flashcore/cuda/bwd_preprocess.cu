#include "bwd_preprocess.cuh"

#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

namespace flashcore::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerThread = 2;  // rows of one iteration: their loads are issued together

// Block (x, y): query rows [x * kRowsPerBlock, +kRowsPerBlock) of (batch, head) pairs y, y + gridDim.y, ... (the
// pair is divided once per block, not per row: the old one-warp-a-row kernel spent most of its instructions on
// 64-bit row / dq_rows divisions). kThreadsPerRow lanes share a row, 8 elements (16 bytes) of O and dO each, and
// zero its dq_cols floats as float4s; their partial dot products meet by shuffles within the lane group.
template <typename Element, int kThreadsPerRow>
__global__ void __launch_bounds__(kThreads)
    bwd_prepass_kernel(const BwdParams p, float* __restrict__ dsum, float* __restrict__ dq_accum, int64_t dq_rows,
                       int dq_cols, const DqTileShape tiles) {
  constexpr int kSlots = kThreads / kThreadsPerRow, kRowsPerBlock = kSlots * kRowsPerThread;
  const int sub = threadIdx.x % kThreadsPerRow, slot = threadIdx.x / kThreadsPerRow;
  const int col = sub * 8;
  const int64_t pairs = p.batch * p.heads_q;
  for (int64_t bh = blockIdx.y; bh < pairs; bh += gridDim.y) {
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const Element* o = static_cast<const Element*>(p.out) + b * p.out_stride.batch + h * p.out_stride.head + col;
    const Element* d = static_cast<const Element*>(p.dout) + b * p.dout_stride.batch + h * p.dout_stride.head + col;
    float* dq = dq_accum + bh * dq_rows * dq_cols;
    float* ds = dsum + bh * p.seqlen_q;
    for (int64_t first = (int64_t)blockIdx.x * kRowsPerBlock; first < dq_rows;
         first += (int64_t)gridDim.x * kRowsPerBlock) {
      float acc[kRowsPerThread];
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) {
        const int64_t i = first + r * kSlots + slot;
        acc[r] = 0.f;
        // head_dim is a multiple of 8 and the host guarantees 16-byte alignment: one chunk a lane.
        if (i < p.seqlen_q && col < p.head_dim) {
          const uint4 ov = *reinterpret_cast<const uint4*>(o + i * p.out_stride.seq);
          const uint4 dv = *reinterpret_cast<const uint4*>(d + i * p.dout_stride.seq);
          const Element* oe = reinterpret_cast<const Element*>(&ov);
          const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r] += static_cast<float>(oe[e]) * static_cast<float>(de[e]);
        }
        if (i < dq_rows) {
          float4* zero = reinterpret_cast<float4*>(dq + i * dq_cols);
          for (int c = sub; c < dq_cols / 4; c += kThreadsPerRow) zero[c] = make_float4(0.f, 0.f, 0.f, 0.f);
          // A tile's first row (< seqlen_q: dq_rows pads seqlen_q to whole tiles) sets its countdown.
          if (p.dq_tiles_pending != nullptr && sub == 0 && i % tiles.rows == 0) {
            const int64_t end = i + tiles.rows < p.seqlen_q ? i + tiles.rows : p.seqlen_q;
            const int64_t key_blocks = Band::tiles(p.band.keys_of_queries(i, end), tiles.keys).size();
            p.dq_tiles_pending[bh * (dq_rows / tiles.rows) + i / tiles.rows] = (int)key_blocks;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) {
#pragma unroll
        for (int off = kThreadsPerRow / 2; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
        const int64_t i = first + r * kSlots + slot;
        if (sub == 0 && i < p.seqlen_q) ds[i] = acc[r];
      }
    }
  }
}

template <typename Element, int kThreadsPerRow>
void launch(const BwdParams& p, float* dsum, float* dq_accum, int64_t dq_rows, int dq_cols, DqTileShape tiles,
            cudaStream_t stream) {
  constexpr int64_t kRowsPerBlock = kThreads / kThreadsPerRow * kRowsPerThread;
  const int64_t row_blocks = (dq_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t pairs = p.batch * p.heads_q;
  // Grid-stride in both dimensions: the grid stays within CUDA's limits for any row count.
  const dim3 grid((unsigned)std::min<int64_t>(row_blocks, INT32_MAX), (unsigned)std::min<int64_t>(pairs, 65535));
  bwd_prepass_kernel<Element, kThreadsPerRow><<<grid, kThreads, 0, stream>>>(p, dsum, dq_accum, dq_rows, dq_cols,
                                                                         tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Element>
void launch_for_head_dim(const BwdParams& p, float* dsum, float* dq_accum, int64_t dq_rows, int dq_cols,
                         DqTileShape tiles, cudaStream_t stream) {
  // The smallest power-of-two lane group whose 16-byte chunks cover the head dim (<= 256).
  if (p.head_dim <= 32)
    launch<Element, 4>(p, dsum, dq_accum, dq_rows, dq_cols, tiles, stream);
  else if (p.head_dim <= 64)
    launch<Element, 8>(p, dsum, dq_accum, dq_rows, dq_cols, tiles, stream);
  else if (p.head_dim <= 128)
    launch<Element, 16>(p, dsum, dq_accum, dq_rows, dq_cols, tiles, stream);
  else
    launch<Element, 32>(p, dsum, dq_accum, dq_rows, dq_cols, tiles, stream);
}

}  // namespace

void launch_bwd_prepass(const BwdParams& p, bool bf16, float* dsum, float* dq_accum, int64_t dq_rows, int dq_cols,
                        DqTileShape tiles, cudaStream_t stream) {
  if (p.batch * p.heads_q == 0 || dq_rows == 0) return;
  TORCH_INTERNAL_ASSERT(p.dq_tiles_pending == nullptr ||
                        (tiles.rows > 0 && tiles.keys > 0 && dq_rows % tiles.rows == 0));
  if (bf16)
    launch_for_head_dim<__nv_bfloat16>(p, dsum, dq_accum, dq_rows, dq_cols, tiles, stream);
  else
    launch_for_head_dim<__half>(p, dsum, dq_accum, dq_rows, dq_cols, tiles, stream);
}

}  // namespace flashcore::cuda
