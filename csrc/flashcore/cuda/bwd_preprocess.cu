#include "bwd_preprocess.cuh"

#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashcore::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

template <typename Element>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) bwd_dsum_kernel(const BwdParams p, float* dsum,
                                                                       int64_t rows) {
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t i = row % p.seqlen_q;
  const int64_t bh = row / p.seqlen_q;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const Element* o = static_cast<const Element*>(p.out) + b * p.out_stride.batch + h * p.out_stride.head +
                     i * p.out_stride.seq;
  const Element* d = static_cast<const Element*>(p.dout) + b * p.dout_stride.batch + h * p.dout_stride.head +
                     i * p.dout_stride.seq;
  float acc = 0.f;
  // head_dim <= 256 and a multiple of 8: at most one 16-byte chunk per lane; the host guarantees alignment.
  for (int c = lane * 8; c < p.head_dim; c += 32 * 8) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(d + c);
    const Element* oe = reinterpret_cast<const Element*>(&ov);
    const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += static_cast<float>(oe[e]) * static_cast<float>(de[e]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) dsum[row] = acc;
}

}  // namespace

void launch_bwd_dsum(const BwdParams& p, bool bf16, float* dsum, cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (bf16)
    bwd_dsum_kernel<__nv_bfloat16><<<dim3((unsigned)blocks), dim3(32 * kWarpsPerBlock), 0, stream>>>(p, dsum, rows);
  else
    bwd_dsum_kernel<__half><<<dim3((unsigned)blocks), dim3(32 * kWarpsPerBlock), 0, stream>>>(p, dsum, rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashcore::cuda
