// Backward post-pass: grad_query from the fp32 dQ accumulator that the fused backward kernels add into, times a
// scale (the softmax scale, where the kernel summed dS K without it: kernel_registry.h DqAccumLayout), rounded to
// grad_query's dtype and written in its layout. One pass instead of ATen's strided copy, which ran at ~1.8 TB/s
// (ncu: issue-bound) against this kernel's 16-byte loads and stores.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dq_fragment_order.cuh"

namespace flashcore::cuda {

// The accumulator's row (b, h, s) of `cols` floats sits at ((b * heads + h) * rows_per_head + s) * cols, or with
// fragment_rows > 0 (cols = kDqFragmentCols) in the tile of rows [s - s % fragment_rows, +fragment_rows) at that
// tile's first row, in fragment order (common/dq_fragment_order.cuh); grad_query's element (b, h, s, d) at
// out + b * out_batch + h * out_head + s * out_seq + d (elements; d contiguous).
struct DqConvertArgs {
  const float* accum;
  int64_t batch, heads, seqlen, rows_per_head, cols;
  void* out;
  int64_t out_batch, out_head, out_seq;
  int head_dim;
  float scale;
  bool bf16;
  int fragment_rows = 0;
  // The fused kernel's countdowns (BwdParams::dq_tiles_pending: (batch * heads, rows_per_head / tile_rows) int32),
  // or nullptr. Set, the post-pass is launched right behind that kernel (programmatic dependent launch) and
  // converts each tile once its countdown reads zero, overlapping the kernel's last wave; otherwise it waits for the
  // previous grid as a whole.
  const int* tiles_pending = nullptr;
  int tile_rows = 0;
};

// Whether the vectorized kernel applies: head_dim a multiple of 8, accumulator rows and grad_query's rows and
// base 16-byte aligned, and the grid within CUDA's limits. Otherwise the caller converts with ATen.
bool dq_convert_supported(const DqConvertArgs& a);
void launch_bwd_dq_convert(const DqConvertArgs& a, cudaStream_t stream);

}  // namespace flashcore::cuda
