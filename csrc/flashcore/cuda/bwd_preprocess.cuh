// Backward pre-pass shared by the fused backward kernels: dsum[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]
// in fp32 (the row term of dS = P * (dP - dsum)). One warp per row; each lane reads 16-byte chunks.
#pragma once

#include <cuda_runtime_api.h>

#include "../params.h"

namespace flashcore::cuda {

// p.dout, p.out and their strides, p.batch, p.heads_q, p.seqlen_q and p.head_dim are read; dsum is contiguous
// (batch, heads_q, seqlen_q). Both 16-bit dtypes; `bf16` picks the element type.
void launch_bwd_dsum(const BwdParams& p, bool bf16, float* dsum, cudaStream_t stream);

}  // namespace flashcore::cuda
