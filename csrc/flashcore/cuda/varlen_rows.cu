#include "varlen_rows.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
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

// A 16-bit (rows, heads, head_dim) tensor with a unit-stride last dim; vec: every head's span of a row starts on a
// 16-byte boundary and head_dim is a multiple of 8, so a row is zeroed with 16-byte stores.
struct RowsOf16Bit {
  uint16_t* data;
  int64_t stride_row, stride_head;
  bool vec;
};

// Lane `lane` of a warp's share of zeroing row `row` of t.
__device__ __forceinline__ void zero_row(const RowsOf16Bit& t, int64_t row, int64_t heads, int64_t head_dim,
                                         int lane) {
  uint16_t* base = t.data + row * t.stride_row;
  if (t.vec) {
    const int64_t chunks = head_dim / 8;
    for (int64_t i = lane; i < heads * chunks; i += 32)
      reinterpret_cast<uint4*>(base + i / chunks * t.stride_head)[i % chunks] = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = lane; d < head_dim; d += 32) base[h * t.stride_head + d] = 0;
  }
}

// The key rows outside every sequence's used keys (varlen_seq_info's k_begin + seqlen_k). Without seqused_k (the
// host fills the tensors whole with it) they are rows before the first sequence and after the last, which every
// warp of the grid shares (one row a warp at a time), and for invalid offsets only (a sequence longer than
// max_seqlen_k, offsets out of order) gaps between sequences, which the blocks take in turn. Offsets are clamped,
// so no row outside [0, total_k) is written.
__global__ void __launch_bounds__(kThreads)
    zero_key_rows_kernel(RowsOf16Bit dk, RowsOf16Bit dv, int64_t heads, int64_t head_dim, VarlenParams v,
                         int64_t batch, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t total = v.total_k;
  auto used_end = [&](int64_t b) {  // in [0, total]: both terms clamped
    const SeqInfo s = varlen_seq_info(v, b, max_seqlen_q, max_seqlen_k);
    return s.k_begin + s.seqlen_k;
  };
  const int64_t before = clamp64(v.cu_seqlens_k[0], 0, total), after = total - used_end(batch - 1);
  for (int64_t i = (int64_t)blockIdx.x * kWarps + warp; i < before + after; i += (int64_t)gridDim.x * kWarps) {
    const int64_t row = i < before ? i : total - after + (i - before);
    zero_row(dk, row, heads, head_dim, lane);
    zero_row(dv, row, heads, head_dim, lane);
  }
  for (int64_t g = 1 + blockIdx.x; g < batch; g += gridDim.x) {
    const int64_t last = clamp64(v.cu_seqlens_k[g], 0, total);
    for (int64_t row = used_end(g - 1) + warp; row < last; row += kWarps) {
      zero_row(dk, row, heads, head_dim, lane);
      zero_row(dv, row, heads, head_dim, lane);
    }
  }
}

}  // namespace

void zero_key_rows_outside_sequences(at::Tensor& grad_key, at::Tensor& grad_value, const VarlenParams& varlen,
                                     int64_t batch, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  const int64_t total = grad_key.size(0), heads = grad_key.size(1), head_dim = grad_key.size(2);
  if (total == 0 || heads == 0 || head_dim == 0) return;
  if (batch <= 0 || varlen.seqused_k != nullptr) {  // no sequence, or each may end in a gap: fills at full bandwidth
    grad_key.zero_();
    grad_value.zero_();
    return;
  }
  TORCH_INTERNAL_ASSERT(grad_key.element_size() == 2 && grad_key.stride(2) == 1 && grad_value.stride(2) == 1 &&
                        grad_value.sizes() == grad_key.sizes() && varlen.total_k == total &&
                        varlen.cu_seqlens_k != nullptr && varlen.block_table == nullptr);
  auto rows = [&](at::Tensor& t) {
    const bool vec = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && head_dim % 8 == 0 &&
                     t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0;
    return RowsOf16Bit{static_cast<uint16_t*>(t.data_ptr()), t.stride(0), t.stride(1), vec};
  };
  const int blocks = (int)std::clamp<int64_t>(std::max(total, batch) / 32, 1, 128);
  zero_key_rows_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      rows(grad_key), rows(grad_value), heads, head_dim, varlen, batch, max_seqlen_q, max_seqlen_k);
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
