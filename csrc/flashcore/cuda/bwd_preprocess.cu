#include "bwd_preprocess.cuh"

#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashcore::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kRowsPerWarp = 2;  // rows of one iteration: their loads are issued together

template <typename Element>
__device__ __forceinline__ float row_dot(const BwdParams& p, int64_t bh, int64_t i, int lane) {
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const Element* o = static_cast<const Element*>(p.out) + b * p.out_stride.batch + h * p.out_stride.head +
                     i * p.out_stride.seq;
  const Element* d = static_cast<const Element*>(p.dout) + b * p.dout_stride.batch + h * p.dout_stride.head +
                     i * p.dout_stride.seq;
  float acc = 0.f;
  // head_dim <= 256 and a multiple of 8: at most one 16-byte chunk per lane; the host guarantees alignment.
  const int c = lane * 8;
  if (c < p.head_dim) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(d + c);
    const Element* oe = reinterpret_cast<const Element*>(&ov);
    const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += static_cast<float>(oe[e]) * static_cast<float>(de[e]);
  }
  return acc;
}

template <typename Element>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    bwd_prepass_kernel(const BwdParams p, float* dsum, float* dq_accum, int64_t dq_rows, int dq_cols) {
  const int lane = threadIdx.x & 31;
  const int64_t total = p.batch * p.heads_q * dq_rows;  // padded rows
  const int64_t warps = (int64_t)gridDim.x * kWarpsPerBlock;
  for (int64_t first = ((int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5)) * kRowsPerWarp; first < total;
       first += warps * kRowsPerWarp) {
    float acc[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t row = first + r;
      const int64_t bh = row / dq_rows, i = row % dq_rows;
      acc[r] = (row < total && i < p.seqlen_q) ? row_dot<Element>(p, bh, i, lane) : 0.f;
      if (row < total) {
        float4* zero = reinterpret_cast<float4*>(dq_accum + row * dq_cols);
        for (int c = lane; c < dq_cols / 4; c += 32) zero[c] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
      const int64_t row = first + r;
      const int64_t bh = row / dq_rows, i = row % dq_rows;
      if (lane == 0 && row < total && i < p.seqlen_q) dsum[bh * p.seqlen_q + i] = acc[r];
    }
  }
}

}  // namespace

void launch_bwd_prepass(const BwdParams& p, bool bf16, float* dsum, float* dq_accum, int64_t dq_rows, int dq_cols,
                        cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_q * dq_rows;
  const int64_t rows_per_block = (int64_t)kWarpsPerBlock * kRowsPerWarp;
  // Grid-stride: a few waves of blocks are enough to saturate memory bandwidth, and the grid never overflows.
  const int64_t blocks_needed = (rows + rows_per_block - 1) / rows_per_block;
  const unsigned blocks = (unsigned)(blocks_needed < 65536 ? blocks_needed : 65536);
  if (bf16)
    bwd_prepass_kernel<__nv_bfloat16><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(p, dsum, dq_accum, dq_rows, dq_cols);
  else
    bwd_prepass_kernel<__half><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(p, dsum, dq_accum, dq_rows, dq_cols);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashcore::cuda
