#include "bwd_dq_convert.cuh"

#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/pack.cuh"
#include "launch_utils.cuh"
#include "ptx/global_flag.cuh"
#include "ptx/grid_dependency.cuh"

namespace flashcore::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = 64;

// The block's (batch * heads + head, first row): a 1-D grid, heads outermost, so blocks start in the order the
// fused kernel finishes its heads (its grid walks them in order too) and a block waiting for a late head's tiles
// holds an SM slot as briefly as the order allows.
struct ConvertBlock {
  int64_t bh, s0;
};

__device__ __forceinline__ ConvertBlock convert_block(int rows_per_block, int64_t seqlen) {
  const int64_t row_blocks = (seqlen + rows_per_block - 1) / rows_per_block;
  return {(int64_t)blockIdx.x / row_blocks, (int64_t)blockIdx.x % row_blocks * rows_per_block};
}

// Before the block reads the accumulator's rows [s0, s0 + rows): with countdowns, thread 0 waits until every tile
// they touch reads zero (every key block's reductions into it are complete and visible, global_flag.cuh), and the
// block's barrier passes that on; without, the whole previous grid (the fused kernel) must have completed. The
// accumulator is then read through L2 (ld.global.cg): its lines may be newer than anything L1 could hold.
__device__ __forceinline__ void wait_for_rows(const DqConvertArgs& a, const ConvertBlock& blk, int rows) {
  if (a.tiles_pending == nullptr) {
    ptx::wait_for_prior_grids();
    return;
  }
  if (threadIdx.x == 0) {
    const int64_t tiles_per_head = a.rows_per_head / a.tile_rows;
    for (int64_t t = blk.s0 / a.tile_rows; t <= (blk.s0 + rows - 1) / a.tile_rows; ++t)
      ptx::wait_until_zero(a.tiles_pending + blk.bh * tiles_per_head + t);
  }
  __syncthreads();
}

// With countdowns the grid must not complete before the fused kernel does (its dK/dV epilogues may still run after
// its last dQ tile): the last block to start waits for it, so whatever follows in the stream sees both.
__device__ __forceinline__ void finish_after_prior_grid(const DqConvertArgs& a) {
  if (a.tiles_pending != nullptr && blockIdx.x == gridDim.x - 1) ptx::wait_for_prior_grids();
}

// Block: kRowsPerBlock query rows of one (batch, head) (convert_block). Thread i takes the 8-column chunk
// i % chunks of row i / chunks of each pass: the block's loads cover whole accumulator rows in order.
template <typename Element>
__global__ void __launch_bounds__(kThreads) bwd_dq_convert_kernel(const DqConvertArgs a) {
  const ConvertBlock blk = convert_block(kRowsPerBlock, a.seqlen);
  const int64_t s_end = blk.s0 + kRowsPerBlock < a.seqlen ? blk.s0 + kRowsPerBlock : a.seqlen;
  wait_for_rows(a, blk, (int)(s_end - blk.s0));
  const int chunks = a.head_dim / 8;
  const int rows_per_pass = kThreads / chunks;
  const int row_in_pass = threadIdx.x / chunks, chunk = threadIdx.x % chunks;
  const int64_t b = blk.bh / a.heads, h = blk.bh % a.heads;
  const float* src = a.accum + blk.bh * a.rows_per_head * a.cols + chunk * 8;
  Element* dst = static_cast<Element*>(a.out) + b * a.out_batch + h * a.out_head + chunk * 8;
  for (int64_t s = blk.s0 + row_in_pass; row_in_pass < rows_per_pass && s < s_end; s += rows_per_pass) {
    const float4 lo = __ldcg(reinterpret_cast<const float4*>(src + s * a.cols));
    const float4 hi = __ldcg(reinterpret_cast<const float4*>(src + s * a.cols + 4));
    uint4 packed;
    packed.x = pack2<Element>(lo.x * a.scale, lo.y * a.scale);
    packed.y = pack2<Element>(lo.z * a.scale, lo.w * a.scale);
    packed.z = pack2<Element>(hi.x * a.scale, hi.y * a.scale);
    packed.w = pack2<Element>(hi.z * a.scale, hi.w * a.scale);
    *reinterpret_cast<uint4*>(dst + s * a.out_seq) = packed;
  }
  finish_after_prior_grid(a);
}

// The same from a fragment-ordered accumulator (common/dq_fragment_order.cuh): block = a tile of kRows query rows
// (convert_block). The tile's float4s are read in order (coalesced) and scattered into a
// row-major copy in shared memory, whose padded rows (kCols + 4 floats) keep the scatter conflict-free (a warp's
// 32 vectors: rows 8 ni + 2t (+1), columns c0 + g (+8), banks 8t + g); then written out as in the kernel above.
template <typename Element, int kRows>
__global__ void __launch_bounds__(kThreads) bwd_dq_convert_fragments_kernel(const DqConvertArgs a) {
  using Tile = DqFragmentTile<kRows>;
  constexpr int kLd = Tile::kCols + 4;
  __shared__ __align__(16) float tile[kRows * kLd];
  const ConvertBlock blk = convert_block(kRows, a.seqlen);
  const int64_t bh = blk.bh, s0 = blk.s0;
  const int rows = (int)(a.seqlen - s0 < kRows ? a.seqlen - s0 : kRows);
  wait_for_rows(a, blk, rows);
  const float4* src = reinterpret_cast<const float4*>(a.accum + (bh * a.rows_per_head + s0) * Tile::kCols);
  for (int vec = threadIdx.x; vec < Tile::kVectors; vec += kThreads) {
    const float4 x = __ldcg(src + vec);
    float* at = tile + Tile::query(vec) * kLd + Tile::column(vec);
    at[0] = x.x;
    at[kLd] = x.y;
    at[8] = x.z;
    at[kLd + 8] = x.w;
  }
  __syncthreads();
  const int chunks = a.head_dim / 8;
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
  finish_after_prior_grid(a);
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
  const bool countdowns = a.tiles_pending == nullptr ||
                          (a.tile_rows > 0 && a.rows_per_head % a.tile_rows == 0 &&
                           (a.fragment_rows == 0 || a.fragment_rows == a.tile_rows));
  return aligned && layout && countdowns && a.head_dim % 8 == 0 && a.head_dim <= 8 * kThreads &&
         a.batch * a.heads * row_blocks <= INT32_MAX;
}

void launch_bwd_dq_convert(const DqConvertArgs& a, cudaStream_t stream) {
  if (a.batch * a.heads == 0 || a.seqlen == 0) return;
  const int rows_per_block = a.fragment_rows > 0 ? a.fragment_rows : kRowsPerBlock;
  const dim3 grid((unsigned)(a.batch * a.heads * ((a.seqlen + rows_per_block - 1) / rows_per_block)));
  // Programmatic dependent launch (launch_utils.cuh) in either mode: the blocks wait in wait_for_rows. One PDL check
  // cache a kernel (fragment order x dtype).
  using Kernel = void (*)(DqConvertArgs);
  static const Kernel kernels[4] = {&bwd_dq_convert_kernel<__half>, &bwd_dq_convert_kernel<__nv_bfloat16>,
                                    &bwd_dq_convert_fragments_kernel<__half, kFragmentRows>,
                                    &bwd_dq_convert_fragments_kernel<__nv_bfloat16, kFragmentRows>};
  static PdlSupport pdl[4];
  const int which = (a.fragment_rows > 0 ? 2 : 0) + (a.bf16 ? 1 : 0);
  launch_kernel(kernels[which], pdl[which], grid, dim3(kThreads), 0, stream, 1, a);
}

}  // namespace flashcore::cuda
