#include "bwd_dq_convert.cuh"

#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/pack.cuh"

namespace flashcore::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = 64;

// Block (blockIdx.x = b * heads + h, blockIdx.y = a run of kRowsPerBlock query rows). Thread i takes the 8-column
// chunk i % chunks of row i / chunks of each pass: the block's loads cover whole accumulator rows in order.
template <typename Element>
__global__ void __launch_bounds__(kThreads) bwd_dq_convert_kernel(const DqConvertArgs a) {
  const int chunks = a.head_dim / 8;
  const int rows_per_pass = kThreads / chunks;
  const int row_in_pass = threadIdx.x / chunks, chunk = threadIdx.x % chunks;
  if (row_in_pass >= rows_per_pass) return;
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / a.heads, h = bh % a.heads;
  const float* src = a.accum + bh * a.rows_per_head * a.cols + chunk * 8;
  Element* dst = static_cast<Element*>(a.out) + b * a.out_batch + h * a.out_head + chunk * 8;
  const int64_t s_begin = (int64_t)blockIdx.y * kRowsPerBlock;
  const int64_t s_end = s_begin + kRowsPerBlock < a.seqlen ? s_begin + kRowsPerBlock : a.seqlen;
  for (int64_t s = s_begin + row_in_pass; s < s_end; s += rows_per_pass) {
    const float4 lo = *reinterpret_cast<const float4*>(src + s * a.cols);
    const float4 hi = *reinterpret_cast<const float4*>(src + s * a.cols + 4);
    uint4 packed;
    packed.x = pack2<Element>(lo.x * a.scale, lo.y * a.scale);
    packed.y = pack2<Element>(lo.z * a.scale, lo.w * a.scale);
    packed.z = pack2<Element>(hi.x * a.scale, hi.y * a.scale);
    packed.w = pack2<Element>(hi.z * a.scale, hi.w * a.scale);
    *reinterpret_cast<uint4*>(dst + s * a.out_seq) = packed;
  }
}

// The same from a fragment-ordered accumulator (common/dq_fragment_order.cuh): block (blockIdx.x = b * heads + h,
// blockIdx.y = a tile of kRows query rows). The tile's float4s are read in order (coalesced) and scattered into a
// row-major copy in shared memory, whose padded rows (kCols + 4 floats) keep the scatter conflict-free (a warp's
// 32 vectors: rows 8 ni + 2t (+1), columns c0 + g (+8), banks 8t + g); then written out as in the kernel above.
template <typename Element, int kRows>
__global__ void __launch_bounds__(kThreads) bwd_dq_convert_fragments_kernel(const DqConvertArgs a) {
  using Tile = DqFragmentTile<kRows>;
  constexpr int kLd = Tile::kCols + 4;
  __shared__ __align__(16) float tile[kRows * kLd];
  const int64_t bh = blockIdx.x, s0 = (int64_t)blockIdx.y * kRows;
  const float4* src = reinterpret_cast<const float4*>(a.accum + (bh * a.rows_per_head + s0) * Tile::kCols);
  for (int vec = threadIdx.x; vec < Tile::kVectors; vec += kThreads) {
    const float4 x = src[vec];
    float* at = tile + Tile::query(vec) * kLd + Tile::column(vec);
    at[0] = x.x;
    at[kLd] = x.y;
    at[8] = x.z;
    at[kLd + 8] = x.w;
  }
  __syncthreads();
  const int chunks = a.head_dim / 8;
  const int rows = (int)(a.seqlen - s0 < kRows ? a.seqlen - s0 : kRows);
  const int64_t b = bh / a.heads, h = bh % a.heads;
  Element* dst = static_cast<Element*>(a.out) + b * a.out_batch + h * a.out_head + s0 * a.out_seq;
  for (int i = threadIdx.x; i < rows * chunks; i += kThreads) {
    const int r = i / chunks, c = i % chunks * 8;
    const float4 lo = *reinterpret_cast<const float4*>(tile + r * kLd + c);
    const float4 hi = *reinterpret_cast<const float4*>(tile + r * kLd + c + 4);
    uint4 packed;
    packed.x = pack2<Element>(lo.x * a.scale, lo.y * a.scale);
    packed.y = pack2<Element>(lo.z * a.scale, lo.w * a.scale);
    packed.z = pack2<Element>(hi.x * a.scale, hi.y * a.scale);
    packed.w = pack2<Element>(hi.z * a.scale, hi.w * a.scale);
    *reinterpret_cast<uint4*>(dst + r * a.out_seq + c) = packed;
  }
}

// The fragment-ordered tile heights the post-pass is built for: the Hopper backward's 80-row steps.
constexpr int kFragmentRows = 80;

}  // namespace

bool dq_convert_supported(const DqConvertArgs& a) {
  const bool aligned = reinterpret_cast<uintptr_t>(a.out) % 16 == 0 && reinterpret_cast<uintptr_t>(a.accum) % 16 == 0 &&
                       a.cols % 4 == 0 && a.out_batch % 8 == 0 && a.out_head % 8 == 0 && a.out_seq % 8 == 0;
  const int rows_per_block = a.fragment_rows > 0 ? a.fragment_rows : kRowsPerBlock;
  const int64_t row_blocks = (a.seqlen + rows_per_block - 1) / rows_per_block;
  const bool layout = a.fragment_rows == 0 || (a.fragment_rows == kFragmentRows && a.cols == kDqFragmentCols &&
                                               a.head_dim <= kDqFragmentCols && a.rows_per_head % kFragmentRows == 0);
  return aligned && layout && a.head_dim % 8 == 0 && a.head_dim <= 8 * kThreads && a.batch * a.heads <= INT32_MAX &&
         row_blocks <= 65535;
}

void launch_bwd_dq_convert(const DqConvertArgs& a, cudaStream_t stream) {
  if (a.batch * a.heads == 0 || a.seqlen == 0) return;
  const int rows_per_block = a.fragment_rows > 0 ? a.fragment_rows : kRowsPerBlock;
  const dim3 grid((unsigned)(a.batch * a.heads), (unsigned)((a.seqlen + rows_per_block - 1) / rows_per_block));
  if (a.fragment_rows > 0) {
    if (a.bf16)
      bwd_dq_convert_fragments_kernel<__nv_bfloat16, kFragmentRows><<<grid, kThreads, 0, stream>>>(a);
    else
      bwd_dq_convert_fragments_kernel<__half, kFragmentRows><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.bf16) {
    bwd_dq_convert_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a);
  } else {
    bwd_dq_convert_kernel<__half><<<grid, kThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashcore::cuda
