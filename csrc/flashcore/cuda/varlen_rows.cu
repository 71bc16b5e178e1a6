#include "varlen_rows.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>

namespace flashcore::cuda {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ int64_t clamp_row(int32_t offset, int64_t total) {
  return offset < 0 ? 0 : (offset > total ? total : (int64_t)offset);
}

// Warp w of the grid takes rows w, w + warps, ... of [0, cu[0]) and of [cu[batch], total): nothing when every row
// belongs to a sequence (the usual case), so the launch is the whole cost.
__global__ void __launch_bounds__(kThreads)
    zero_rows_kernel(uint16_t* out, int64_t total, int64_t heads, int64_t head_dim, int64_t stride_row,
                     int64_t stride_head, const int32_t* __restrict__ cu, int64_t batch) {
  const int64_t first = clamp_row(cu[0], total), last = clamp_row(cu[batch], total);
  const int64_t before = first, after = total - (last > first ? last : first);
  const int64_t warps = (int64_t)gridDim.x * (kThreads / 32);
  const int lane = threadIdx.x & 31;
  for (int64_t i = (int64_t)blockIdx.x * (kThreads / 32) + threadIdx.x / 32; i < before + after; i += warps) {
    const int64_t row = i < before ? i : total - after + (i - before);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = lane; d < head_dim; d += 32) out[row * stride_row + h * stride_head + d] = 0;
  }
}

// Block g of the grid (striding by gridDim.x) zeroes gap g of batch + 1: rows [end of sequence g - 1's used keys,
// start of sequence g), the first gap starting at row 0 and the last ending at total_k. Gaps are empty in the usual
// packed batch without seqused_k, so the launch and the offsets' reads are the whole cost.
__global__ void __launch_bounds__(kThreads)
    zero_key_rows_kernel(uint16_t* dk, uint16_t* dv, int64_t heads, int64_t head_dim, int64_t dk_row, int64_t dk_head,
                         int64_t dv_row, int64_t dv_head, VarlenParams v, int64_t batch, int64_t max_seqlen_q,
                         int64_t max_seqlen_k) {
  const int64_t total = v.total_k, per_row = heads * head_dim;
  for (int64_t g = blockIdx.x; g <= batch; g += gridDim.x) {
    int64_t first = 0, last = total;
    if (g > 0) {
      const SeqInfo s = varlen_seq_info(v, g - 1, max_seqlen_q, max_seqlen_k);
      first = s.k_begin + s.seqlen_k;  // <= total_k: both clamped
    }
    if (g < batch) last = clamp64(v.cu_seqlens_k[g], 0, total);
    for (int64_t i = threadIdx.x; i < (last - first) * per_row; i += kThreads) {
      const int64_t row = first + i / per_row, h = i % per_row / head_dim, d = i % head_dim;
      dk[row * dk_row + h * dk_head + d] = 0;
      dv[row * dv_row + h * dv_head + d] = 0;
    }
  }
}

}  // namespace

void zero_key_rows_outside_sequences(at::Tensor& grad_key, at::Tensor& grad_value, const VarlenParams& varlen,
                                     int64_t batch, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  const int64_t total = grad_key.size(0);
  if (total == 0 || grad_key.size(1) == 0 || grad_key.size(2) == 0 || batch < 0) return;
  TORCH_INTERNAL_ASSERT(grad_key.element_size() == 2 && grad_key.stride(2) == 1 && grad_value.stride(2) == 1 &&
                        grad_value.sizes() == grad_key.sizes() && varlen.total_k == total &&
                        varlen.cu_seqlens_k != nullptr && varlen.block_table == nullptr);
  const int blocks = (int)std::min<int64_t>(batch + 1, 1024);
  zero_key_rows_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<uint16_t*>(grad_key.data_ptr()), static_cast<uint16_t*>(grad_value.data_ptr()), grad_key.size(1),
      grad_key.size(2), grad_key.stride(0), grad_key.stride(1), grad_value.stride(0), grad_value.stride(1), varlen,
      batch, max_seqlen_q, max_seqlen_k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void zero_rows_outside_sequences(at::Tensor& out, const at::Tensor& cu_seqlens_q) {
  const int64_t total = out.size(0), batch = cu_seqlens_q.numel() - 1;
  if (total == 0 || out.size(1) == 0 || out.size(2) == 0 || batch < 0) return;
  TORCH_INTERNAL_ASSERT(out.element_size() == 2 && out.stride(2) == 1 && cu_seqlens_q.is_contiguous());
  const int blocks = (int)std::min<int64_t>((total + 3) / 4, 64);
  zero_rows_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<uint16_t*>(out.data_ptr()), total, out.size(1), out.size(2), out.stride(0), out.stride(1),
      cu_seqlens_q.data_ptr<int32_t>(), batch);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashcore::cuda
