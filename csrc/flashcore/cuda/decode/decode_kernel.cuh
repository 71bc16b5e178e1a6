// The KV-cache ("decode") kernel, mma.sync (sm_80 .. sm_90): new query rows against a dense or paged cache
// (paged_kv.h), split over the keys so that a small batch still fills the GPU (flash-decoding).
//
// Grid: x = (batch entry, kv head), y = key split, z = block of packed query rows; a decode step of several waves
// takes its entries longest first (entry_of_rank). Rows are packed GQA-first:
// row R of an entry's kv head is query position R / group of query head kv_head * group + R % group, so the
// group's heads share each K/V tile read from memory (one read per kv head, not per query head).
// Two warp layouts (kRowsMode): a decode step has few rows (group x new tokens <= 16), so the four warps share one
// m16 tile of rows and split each 64-key tile into 16-key quarters, merging their softmax states at the end; a
// chunked prefill has many rows, so each warp owns 16 rows and walks the whole tile (the prefill kernels' layout).
// Pipeline: kStages K/V stages; tiles i + 1 .. i + kStages - 1 stream in while tile i is computed, through one of
// the two loaders of decode_loaders.cuh (cp.async on every arch, two or three stages; TMA on Hopper, ~96 KiB of
// stages).
// Hazard: a stage is refilled only after the __syncthreads that ends the step that read it.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../paged_kv.h"
#include "../common/online_softmax.cuh"
#include "../common/smem_tile.cuh"
#include "../ptx/cluster.cuh"
#include "../ptx/cp_async.cuh"
#include "../ptx/grid_dependency.cuh"
#include "../ptx/math.cuh"
#include "../ptx/mbarrier.cuh"
#include "../sm80/fwd_sm80_mainloop.cuh"
#include "decode.h"
#include "decode_loaders.cuh"

namespace flashcore::decode {

template <int kHeadDim_, typename Element_, bool kRowsMode_, bool kTma_ = false, int kCpAsyncStages_ = 2>
struct DecodeTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // the tile: head dims up to it are zero-padded in shared memory
  static constexpr bool kRowsMode = kRowsMode_;
  static constexpr int kNThreads = 128;
  static constexpr int kBlockN = 64;                   // keys a tile
  static constexpr int kWarpsM = kRowsMode ? 4 : 1;    // warps along the rows
  static constexpr int kWarpsN = 4 / kWarpsM;          // warps along a tile's keys
  static constexpr int kBlockM = 16 * kWarpsM;         // packed query rows a block
  static constexpr int kWarpKeys = kBlockN / kWarpsN;  // keys of a tile one warp multiplies
  static constexpr int kNTiles = kWarpKeys / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr bool kTma = kTma_;
  // Q's fragments stay in registers up to head dim 128; at 256 they would take 64 of the thread's registers beside
  // O's 128, so the QK product reads them from shared memory each tile.
  static constexpr bool kQInRegs = kHeadDim <= 128;
  using QTile = cuda::SmemTile<kBlockM, kHeadDim>;
  using KVTile = cuda::SmemTile<kBlockN, kHeadDim>;
  static_assert(QTile::kSpanChunks == 8, "head-dim tiles are multiples of 64 (128-byte rows)");
  static constexpr int kStageElems = 2 * KVTile::kElems;  // K, then V
  static constexpr int kStagesForBytes = 98304 / (kStageElems * (int)sizeof(Element));  // TMA: ~96 KiB of stages
  // TMA: 3 stages at head dim 128 measured best (2 stages with 3 blocks an SM, or 4 with one, were slower).
  // cp.async: kCpAsyncStages_ (2 or 3: decode.h's DecodePlan::stages).
  static_assert(kCpAsyncStages_ == 2 || kCpAsyncStages_ == 3, "cp.async pipelines of 2 or 3 stages");
  static constexpr int kStages =
      !kTma ? kCpAsyncStages_ : kStagesForBytes < 2 ? 2 : kStagesForBytes > 4 ? 4 : kStagesForBytes;
  // The epilogue's merge buffers reuse the stages: per warp, 16 rows of O (float) and (max, sum) a row.
  static constexpr int kMergeBytes = 4 * 16 * kHeadDim * 4 + 4 * 16 * 2 * 4;
  // A decode step whose splits form a cluster (DecodeParams::cluster_merge) keeps its partial result there too,
  // behind the merge buffers: the block's rows of output (float) and their lse.
  static constexpr bool kClusterMerge = !kRowsMode && !kTma;
  static constexpr int kClusterPartBytes = kClusterMerge ? kBlockM * (kHeadDim + 1) * 4 : 0;
  static constexpr int kStageBytes = kStages * kStageElems * (int)sizeof(Element);
  static_assert(kMergeBytes + kClusterPartBytes <= kStageBytes, "merge buffers fit in the stages");
  // TMA: the 128-byte swizzle is a function of address bits, so tiles start on 1024-byte boundaries (slack to align
  // the dynamic base); the stages' full barriers follow the stages.
  static constexpr int kAlignSlack = kTma ? 1024 : 0;
  static constexpr int kBarrierBytes = kTma ? 8 * kStages : 0;
  static constexpr int kSmemBytes = kAlignSlack + QTile::kElems * (int)sizeof(Element) + kStageBytes + kBarrierBytes;
  // Blocks an SM the registers must allow (__launch_bounds__): the two-stage cp.async decode steps at head-dim
  // tiles 64 and 128 are held to four and three (128 and 168 registers), the residency the one-wave plan counts on
  // (decode_launch.cu: 64 x 2k at head dim 64 is 512 blocks, one wave of four an SM on 132 SMs; their shared memory
  // would allow more). Unbounded, ptxas gives them 150 and 213 (the loader's copy forms in one kernel), which cost
  // that row its one wave (65.6 -> 67.3 us on the H200).
  static constexpr int kMinBlocksPerSm =
      kRowsMode || kTma || kStages != 2 ? 1 : kHeadDim == 64 ? 4 : kHeadDim == 128 ? 3 : 1;
};

// cp.async of a (Tile::kNumRows x head-dim tile) tile whose rows lie anywhere (the packed query rows): row_ptr(r) gives row r's address,
// or nullptr for a row to zero-fill; chunks at or past dim_limit are zero-filled too.
template <typename Tile, int kNThreads, typename Element, typename RowPtr>
__device__ __forceinline__ void gather_rows_async(Element* smem, const Element* any_valid, int dim_limit,
                                                  RowPtr row_ptr) {
  constexpr int kCpr = Tile::kChunksPerRow;
  static_assert(kNThreads % kCpr == 0, "whole rows per pass");
  constexpr int kRowStep = kNThreads / kCpr;
  const uint32_t base = ptx::smem_addr(smem);
  const int c = threadIdx.x % kCpr;
  const bool col_ok = c * 8 < dim_limit;
#pragma unroll
  for (int r = threadIdx.x / kCpr; r < Tile::kNumRows; r += kRowStep) {
    const Element* src = row_ptr(r);
    const bool valid = col_ok && src != nullptr;
    ptx::cp_async_16(base + Tile::chunk_offset(r, c) * (int)sizeof(Element), valid ? src + c * 8 : any_valid, valid);
  }
}

// Merges the splits' partial outputs of one row (b, hq, pos) through their log-sum-exp (and adds the sink): one
// warp. The lanes turn the splits' lse into weights (kept in `weight`, kMaxSplits floats of shared memory), then
// each lane sums its float4 columns over the splits, four splits' loads in flight at a time (a serial chain of
// dependent loads here cost 16 us of a 100 us decode step).
constexpr int kMaxSplits = 256;

template <typename Element>
__device__ __forceinline__ void combine_row(const DecodeParams& p, int64_t row, float* weight, int lane) {
  const FwdParams& f = p.f;
  const int64_t rows_total = f.batch * f.heads_q * f.seqlen_q;
  const int pos = (int)(row % f.seqlen_q);
  const int64_t bh = row / f.seqlen_q;
  const int hq = (int)(bh % f.heads_q), b = (int)(bh / f.heads_q);
  const int S = p.num_splits;
  const float* lse_s = p.lse_partial + row;  // split s at lse_s[s * rows_total]
  float m = f.score.sinks ? f.score.sinks[hq] : -INFINITY;  // natural-log units here
  for (int s = lane; s < S; s += 32) m = fmaxf(m, lse_s[s * rows_total]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  float l = 0.f;
  for (int s = lane; s < S; s += 32) {
    const float e = m == -INFINITY ? 0.f : __expf(lse_s[s * rows_total] - m);
    weight[s] = e;
    l += e;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
  if (f.score.sinks && m != -INFINITY) l += __expf(f.score.sinks[hq] - m);
  const bool empty = !(l > 0.f);
  const float inv = empty ? 0.f : 1.f / l;
  __syncwarp();

  const int head_dim = (int)f.head_dim;  // a multiple of 8 (CUDA's rule): float4 columns
  Element* dst = static_cast<Element*>(f.out) + b * f.out_stride.batch + hq * f.out_stride.head + pos * f.out_stride.seq;
  for (int d = 4 * lane; d < head_dim; d += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const float* src = p.o_partial + row * head_dim + d;
    auto add = [&](float w, const float4& x) {
      acc.x = fmaf(w, x.x, acc.x);
      acc.y = fmaf(w, x.y, acc.y);
      acc.z = fmaf(w, x.z, acc.z);
      acc.w = fmaf(w, x.w, acc.w);
    };
    int s = 0;
    for (; s + 4 <= S; s += 4) {
      float4 x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] = *reinterpret_cast<const float4*>(src + (s + u) * rows_total * head_dim);
#pragma unroll
      for (int u = 0; u < 4; ++u) add(weight[s + u], x[u]);
    }
    for (; s < S; ++s) add(weight[s], *reinterpret_cast<const float4*>(src + s * rows_total * head_dim));
    dst[d] = static_cast<Element>(acc.x * inv);
    dst[d + 1] = static_cast<Element>(acc.y * inv);
    dst[d + 2] = static_cast<Element>(acc.z * inv);
    dst[d + 3] = static_cast<Element>(acc.w * inv);
  }
  if (lane == 0) f.lse[p.lse_index(b, hq, pos)] = empty ? -INFINITY : m + __logf(l);
}

// The splits of a cluster (DecodeParams::cluster_merge) merged through distributed shared memory: split s left its
// normalized rows of output (part_o, kBlockM x kHeadDim floats) and their lse (part_lse, natural log, -inf for an
// empty split) in its own shared memory; after the cluster barrier the block of rank r merges rows r, r + S, ...
// from every split's memory and writes the output and lse (the sink joins here, once). A thread issues all its
// loads (kRowsPerRank x S lse values and outputs) before it uses any: one round trip of distributed shared memory.
// The arithmetic is combine_row's, operation for operation (its weights' sum in the order of its warp's butterfly
// over lanes that hold one split each), so a call's result does not depend on which of the two merges its plan
// takes (the residency can change that). The second barrier keeps every block's shared memory alive until the
// others have read it.
template <int kSplits>
__device__ __forceinline__ float butterfly_sum(const float (&e)[kSplits]) {
  static_assert(kSplits <= 8, "lanes 8 .. 31 of combine_row's warp hold zeros");
  float v[8];
#pragma unroll
  for (int s = 0; s < 8; ++s) v[s] = s < kSplits ? e[s < kSplits ? s : 0] : 0.f;
  // combine_row's xor-shuffle sum: offsets 16 and 8 add zeros, then 4, 2, 1.
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

template <typename Traits, int kSplits>
__device__ __forceinline__ void merge_splits_in_cluster(const DecodeParams& p, const float* part_o,
                                                        const float* part_lse, int b, int kvh, int m0) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim, kBlockM = Traits::kBlockM, kNThreads = Traits::kNThreads;
  constexpr int kRowsPerRank = (kBlockM + kSplits - 1) / kSplits;
  constexpr int kCols = (kHeadDim + kNThreads - 1) / kNThreads;  // columns a thread
  const FwdParams& f = p.f;
  const int group = (int)f.group, head_dim = (int)f.head_dim, rows = (int)f.seqlen_q * group;
  const int rank = (int)ptx::cluster_rank();
  ptx::cluster_arrive();
  ptx::cluster_wait();  // every split's part_o / part_lse written

  float lse[kRowsPerRank][kSplits], val[kRowsPerRank][kSplits][kCols], sink[kRowsPerRank];
#pragma unroll
  for (int s = 0; s < kSplits; ++s) {
    const float* o_s = ptx::map_generic_to_rank(part_o, (uint32_t)s);
    const float* lse_s = ptx::map_generic_to_rank(part_lse, (uint32_t)s);
#pragma unroll
    for (int k = 0; k < kRowsPerRank; ++k) {
      const int row = rank + k * kSplits;
      const bool ok = row < kBlockM && m0 + row < rows;
      lse[k][s] = ok ? lse_s[row] : -INFINITY;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = (int)threadIdx.x + c * kNThreads;
        val[k][s][c] = ok && col < head_dim ? o_s[row * kHeadDim + col] : 0.f;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kRowsPerRank; ++k) {
    const int R = m0 + min(rank + k * kSplits, kBlockM - 1);
    const int hq = kvh * group + min(R, rows - 1) % group;
    sink[k] = f.score.sinks ? f.score.sinks[hq] : -INFINITY;  // natural-log units, as in combine_row
  }
#pragma unroll
  for (int k = 0; k < kRowsPerRank; ++k) {
    const int row = rank + k * kSplits, R = m0 + row;
    if (row >= kBlockM || R >= rows) continue;
    const int pos = R / group, hq = kvh * group + R % group;
    float m = sink[k];
#pragma unroll
    for (int s = 0; s < kSplits; ++s) m = fmaxf(m, lse[k][s]);
    float w[kSplits];
#pragma unroll
    for (int s = 0; s < kSplits; ++s) w[s] = m == -INFINITY ? 0.f : __expf(lse[k][s] - m);
    float l = butterfly_sum<kSplits>(w);
    if (f.score.sinks && m != -INFINITY) l += __expf(sink[k] - m);
    const bool empty = !(l > 0.f);
    const float inv = empty ? 0.f : 1.f / l;
    Element* dst = static_cast<Element*>(f.out) + b * f.out_stride.batch + hq * f.out_stride.head + pos * f.out_stride.seq;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = (int)threadIdx.x + c * kNThreads;
      if (col >= head_dim) continue;
      float acc = 0.f;
#pragma unroll
      for (int s = 0; s < kSplits; ++s) acc = fmaf(w[s], val[k][s][c], acc);
      dst[col] = static_cast<Element>(acc * inv);
    }
    if (threadIdx.x == 0) f.lse[p.lse_index(b, hq, pos)] = empty ? -INFINITY : m + __logf(l);
  }
  ptx::cluster_arrive();
  ptx::cluster_wait();  // no block leaves while another reads its shared memory
}

template <typename Traits>
__device__ __forceinline__ void merge_splits_in_cluster(const DecodeParams& p, const float* part_o,
                                                        const float* part_lse, int b, int kvh, int m0) {
  switch (p.num_splits) {  // launch_decode: clusters of 2 .. 8 splits
    case 2: merge_splits_in_cluster<Traits, 2>(p, part_o, part_lse, b, kvh, m0); break;
    case 3: merge_splits_in_cluster<Traits, 3>(p, part_o, part_lse, b, kvh, m0); break;
    case 4: merge_splits_in_cluster<Traits, 4>(p, part_o, part_lse, b, kvh, m0); break;
    case 5: merge_splits_in_cluster<Traits, 5>(p, part_o, part_lse, b, kvh, m0); break;
    case 6: merge_splits_in_cluster<Traits, 6>(p, part_o, part_lse, b, kvh, m0); break;
    case 7: merge_splits_in_cluster<Traits, 7>(p, part_o, part_lse, b, kvh, m0); break;
    default: merge_splits_in_cluster<Traits, 8>(p, part_o, part_lse, b, kvh, m0); break;
  }
}

// The end of a block: the warps that share rows (kWarpsN of them) merge their softmax states and outputs through
// shared memory (the stages, free by now), normalize, and write the output and lse directly (one split), this
// split's partial output and lse for the combine kernel, or (a cluster of splits) for merge_splits_in_cluster.
template <typename Traits, typename Softmax>
__device__ __forceinline__ void store_block_result(const DecodeParams& p, float* merge_o, const Softmax& softmax,
                                                   const float (&o)[1][Traits::kDTiles][4], int b, int kvh, int m0,
                                                   int split) {
  using Element = typename Traits::Element;
  constexpr int kWarpsN = Traits::kWarpsN, kHeadDim = Traits::kHeadDim;
  const FwdParams& f = p.f;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = (int)f.group, head_dim = (int)f.head_dim, rows = (int)f.seqlen_q * group;
  float* const merge_ml = merge_o + 4 * 16 * kHeadDim;  // merge_o: [warp][16][kHeadDim]; merge_ml: [warp][16][2]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = (lane >> 2) + 8 * h;
    const float sum = cuda::quad_sum(softmax.row_sum[h]);
    if ((lane & 3) == 0) {
      merge_ml[(warp * 16 + r) * 2] = softmax.row_max[h];
      merge_ml[(warp * 16 + r) * 2 + 1] = sum;
    }
#pragma unroll
    for (int di = 0; di < Traits::kDTiles; ++di) {
      const int col = di * 8 + 2 * (lane & 3);
      merge_o[(warp * 16 + r) * kHeadDim + col] = o[0][di][2 * h];
      merge_o[(warp * 16 + r) * kHeadDim + col + 1] = o[0][di][2 * h + 1];
    }
  }
  __syncthreads();

  const bool direct = p.num_splits == 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool in_cluster = Traits::kClusterMerge && p.cluster_merge && !direct;
#else
  constexpr bool in_cluster = false;  // clusters are sm_90 (launch_decode asks for them only there)
#endif
  float* const part_o = merge_ml + 4 * 16 * 2;  // in_cluster: [kBlockM][kHeadDim], then part_lse [kBlockM]
  float* const part_lse = part_o + Traits::kBlockM * kHeadDim;
  const int64_t rows_total = f.batch * f.heads_q * f.seqlen_q;
  for (int idx = threadIdx.x; idx < Traits::kBlockM * kHeadDim; idx += Traits::kNThreads) {
    const int row = idx / kHeadDim, col = idx % kHeadDim;
    const int R = m0 + row;
    if (R >= rows || col >= head_dim) continue;
    const int w0 = (row / 16) * kWarpsN, r = row % 16;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarpsN; ++w) m = fmaxf(m, merge_ml[((w0 + w) * 16 + r) * 2]);
    const int pos = R / group, hq = kvh * group + R % group;
    const float sink = direct && f.score.sinks ? f.score.sinks[hq] * kLog2e : -INFINITY;
    m = fmaxf(m, sink);
    float l = m == -INFINITY ? 0.f : exp2f(sink - m), acc = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsN; ++w) {
      const float mw = merge_ml[((w0 + w) * 16 + r) * 2];
      const float scale = mw == -INFINITY ? 0.f : exp2f(mw - m);
      l += merge_ml[((w0 + w) * 16 + r) * 2 + 1] * scale;
      acc += merge_o[((w0 + w) * 16 + r) * kHeadDim + col] * scale;
    }
    const bool empty = !(l > 0.f);
    const float out = empty ? 0.f : acc / l;
    const float lse = empty ? -INFINITY : (m + __log2f(l)) * 0.69314718055994531f;
    const int64_t lse_row = ((int64_t)b * f.heads_q + hq) * f.seqlen_q + pos;
    if (direct) {
      Element* dst = static_cast<Element*>(f.out) + b * f.out_stride.batch + hq * f.out_stride.head +
                     pos * f.out_stride.seq + col;
      *dst = static_cast<Element>(out);
      if (col == 0) f.lse[p.lse_index(b, hq, pos)] = lse;
    } else if (in_cluster) {
      part_o[row * kHeadDim + col] = out;
      if (col == 0) part_lse[row] = lse;  // what the combine kernel would read from lse_partial
    } else {
      const int64_t prow = split * rows_total + lse_row;
      p.o_partial[prow * head_dim + col] = out;
      if (col == 0) p.lse_partial[prow] = lse;
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (Traits::kClusterMerge)
    if (in_cluster) merge_splits_in_cluster<Traits>(p, part_o, part_lse, b, kvh, m0);
#endif
}

// Longest entries first. The hardware starts a grid's blocks in about blockIdx order, so where the grid has more
// blocks than resident slots and the entries differ in length, an entry taken late and long runs on alone at the
// end while the memory idles. Blocks then take their entries by rank of work (key tiles, longest first, ties by
// index, so equal lengths keep the identity order): the longest-processing-time rule. The host asks for it
// (DecodeParams::longest_first) only for decode steps whose grid has more than one wave, of up to
// kMaxRankedEntries entries (decode.h). Every block ranks the batch itself: one round of loads of the lengths,
// then, unless all are equal, batch / 4 vector reads of shared memory a thread. Cost and gain: docs/PERFORMANCE.md.
__device__ __forceinline__ int entry_key_tiles(const DecodeParams& p, int e, int block_n) {
  const Band band = p.f.mask.band(p.f.seqlen_q, kv_seq(p.kv, e).seqlen_k);
  return (int)Band::tiles(band.keys_of_queries(0, p.f.seqlen_q), block_n).size();
}

template <int kBlockN>
__device__ __noinline__ int entry_of_rank(const DecodeParams& p, int rank) {
  __shared__ __align__(16) int work[kMaxRankedEntries];
  __shared__ int found;
  const int batch = (int)p.f.batch, padded = (batch + 3) & ~3;
  const int work0 = entry_key_tiles(p, 0, kBlockN);
  if (threadIdx.x == 0) found = rank;  // overwritten below; never read unset
  bool uniform = true;
  for (int e = threadIdx.x; e < padded; e += blockDim.x) {
    const int w = e < batch ? entry_key_tiles(p, e, kBlockN) : -1;  // -1: padding, never ahead of an entry
    work[e] = w;
    uniform &= e >= batch || w == work0;
  }
  if (__syncthreads_and(uniform)) return rank;  // equal work: the identity order (the barrier publishes `work`)
  for (int e = threadIdx.x; e < batch; e += blockDim.x) {
    const int w = work[e];
    int ahead[4] = {0, 0, 0, 0};
    for (int o = 0; o < padded; o += 4) {
      const int4 wo = *reinterpret_cast<const int4*>(&work[o]);
      ahead[0] += wo.x > w || (wo.x == w && o < e);
      ahead[1] += wo.y > w || (wo.y == w && o + 1 < e);
      ahead[2] += wo.z > w || (wo.z == w && o + 2 < e);
      ahead[3] += wo.w > w || (wo.w == w && o + 3 < e);
    }
    if (ahead[0] + ahead[1] + ahead[2] + ahead[3] == rank) found = e;  // ranks are a permutation: one writer
  }
  __syncthreads();
  return found;
}

// One block of the grid described at the top; maps are read by the TMA loader only.
template <typename Traits>
__device__ __forceinline__ void decode_block(const DecodeParams& p, const DecodeTmaMaps& maps) {
  using Element = typename Traits::Element;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kNThreads = Traits::kNThreads;
  constexpr int kNTiles = Traits::kNTiles, kDTiles = Traits::kDTiles, kKSteps = Traits::kKSteps;
  constexpr int kStages = Traits::kStages;
  const FwdParams& f = p.f;
  // Launched with programmatic dependent launch where the code is sm_90 (decode_launch.cu): nothing global is read
  // before the previous kernel of the stream has completed; the combine kernel may launch behind the last wave.
  ptx::wait_for_prior_grids();
  ptx::allow_dependent_grids();

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* const smem_base =
      Traits::kTma ? smem_raw + ((1024u - (ptx::smem_addr(smem_raw) & 1023u)) & 1023u) : smem_raw;
  Element* const sQ = reinterpret_cast<Element*>(smem_base);
  Element* const sStages = sQ + QTile::kElems;
  uint64_t* const full = reinterpret_cast<uint64_t*>(sStages + kStages * Traits::kStageElems);  // kTma
  auto stage_ptr = [&](int stage) { return sStages + stage * Traits::kStageElems; };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / Traits::kWarpsN, wn = warp % Traits::kWarpsN;
  // Grid x = (entry, kv head), y = split; or, with the splits in clusters (cluster_merge), x = (entry, kv head) x
  // split, one cluster an (entry, kv head), the split its rank.
  uint32_t pair = blockIdx.x;
  int split = blockIdx.y;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster_merge) {
    pair = ptx::cluster_id_x();
    split = (int)ptx::cluster_rank();
  }
#endif
  uint32_t kvh_u = 0;
  const int entry_rank = (int)f.heads_kv_div.divmod(pair, kvh_u);
  int b = entry_rank;
  if constexpr (!Traits::kRowsMode) {  // decode steps (a chunked prefill's grid keeps the index order)
    // The batch bound again here: it keeps entry_of_rank's shared array in range whatever the host asked.
    if (p.longest_first && f.batch > 1 && f.batch <= kMaxRankedEntries)
      b = entry_of_rank<Traits::kBlockN>(p, entry_rank);
  }
  const int kvh = (int)kvh_u;
  const int group = (int)f.group, seqlen_q = (int)f.seqlen_q, head_dim = (int)f.head_dim;
  const int rows = seqlen_q * group;  // packed rows of this (entry, kv head)
  const int m0 = blockIdx.z * kBlockM;

  const EntryKeys<Element> entry{static_cast<const Element*>(f.k) + kvh * f.k_stride.head,
                                 static_cast<const Element*>(f.v) + kvh * f.v_stride.head, kv_seq(p.kv, b), b};
  const int seqlen_k = (int)entry.seq.seqlen_k;
  const Band band = f.mask.band(seqlen_q, seqlen_k);
  const int pos_first = m0 / group, pos_last = (min(m0 + kBlockM, rows) - 1) / group;
  const IndexRange tiles = Band::tiles(band.keys_of_queries(pos_first, pos_last + 1), kBlockN);
  const int n_all = (int)tiles.size();
  // Split `split` takes every num_splits-th tile from tiles.begin + split: the splits of an entry then read
  // neighbouring tiles at any moment (one front through the cache, not num_splits of them), which measured 0-2.5 %
  // faster than contiguous runs (docs/PERFORMANCE.md), and a band's partly masked tiles spread over the splits.
  const int n_tiles = max(0, (n_all - split + p.num_splits - 1) / p.num_splits);
  auto tile_of = [&](int i) { return (int)tiles.begin + split + i * p.num_splits; };

  const Element* const q = static_cast<const Element*>(f.q) + b * f.q_stride.batch;
  auto q_row = [&](int r) -> const Element* {
    const int R = m0 + r;
    if (R >= rows) return nullptr;
    const int pos = R / group, hq = kvh * group + R % group;
    return q + hq * f.q_stride.head + pos * f.q_stride.seq;
  };

  // This thread's two rows (g and g + 8 of its warp's m16 tile): query position, ALiBi slope.
  int pos_of[2];
  float alibi_log2[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int R = min(m0 + wm * 16 + (lane >> 2) + 8 * h, rows - 1);
    pos_of[h] = R / group;
    const int hq = kvh * group + R % group;
    alibi_log2[h] = f.score.alibi_slopes
                        ? f.score.alibi_slopes[b * f.score.alibi_stride_batch + hq * f.score.alibi_stride_head] * kLog2e
                        : 0.f;
  }
  const bool softcap = f.score.softcap > 0.f, alibi = f.score.alibi_slopes != nullptr;
  // Scores that need only the scale (positive: OnlineSoftmax folds it into its exp2) on unmasked tiles skip the
  // per-score transform; the compiler had turned its softcap, ALiBi and mask branches into predicated code that
  // every tile ran (~90 instructions a warp a tile; docs/PERFORMANCE.md). The same test that sends the
  // prefill kernels to their score-mod variants.
  const bool plain_scores = !f.score.transforms(f.scale);
  const int alibi_offset = seqlen_k - seqlen_q;
  // The band in 32 bits (clamped: |j - i| < 2^31 here) and the tiles every row of the block sees whole.
  const int band_lo = (int)Band::max64(band.lo, -(int64_t(1) << 31) + 1);
  const int band_hi = (int)Band::min64(band.hi, (int64_t(1) << 31) - 1);
  const TileRange unmasked = band.unmasked_key_tiles(pos_first, pos_last - pos_first + 1, kBlockN);

  float o[1][kDTiles][4];
#pragma unroll
  for (int di = 0; di < kDTiles; ++di)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][di][e] = 0.f;
  cuda::OnlineSoftmax<1, kNTiles, kDTiles> softmax;

  // Prologue: Q and tiles 0 .. kStages - 2, one commit group each (Q joins tile 0's; with TMA, Q's group alone).
  gather_rows_async<QTile, kNThreads>(sQ, q, head_dim, q_row);
  CpAsyncLoader<Traits> cp_loader(p, entry);
  TmaLoader<Traits> tma_loader(p, maps, entry, kvh);
  if constexpr (Traits::kTma) {
    ptx::cp_async_commit();
    if (threadIdx.x == 0) {
#pragma unroll
      for (int st = 0; st < kStages; ++st) ptx::mbarrier_init(&full[st], 1);
      ptx::fence_barrier_init();
    }
    __syncthreads();  // the barriers are initialized before any thread waits on them
    if (threadIdx.x == 0 && n_tiles > 0) {
      tma_loader.locate(tile_of(0));
#pragma unroll
      for (int i = 0; i < kStages - 1; ++i) {
        if (i < n_tiles) {
          tma_loader.load(tile_of(i), stage_ptr(i), &full[i]);
          if (i + 1 < n_tiles) tma_loader.locate(tile_of(i + 1));
        }
      }
    }
  } else {
    if (n_tiles > 0) cp_loader.locate(tile_of(0));
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < n_tiles) {
        cp_loader.load(tile_of(i), ptx::smem_addr(stage_ptr(i)));
        if (i + 1 < n_tiles) cp_loader.locate(tile_of(i + 1));
      }
      ptx::cp_async_commit();
    }
  }

  uint32_t q_regs[1][Traits::kQInRegs ? kKSteps : 1][4];  // a placeholder where Q is read from shared memory
  const sm80::LaneOffsets a_off = sm80::lane_offsets_a(lane), b_off = sm80::lane_offsets_b(lane);
  for (int i = 0; i < n_tiles; ++i) {
    const int t = tile_of(i), stage = i % kStages;
    // Into the stage read at step i - 1 (released by that step's closing barrier).
    const int ahead = i + kStages - 1;
    if constexpr (Traits::kTma) {
      if (threadIdx.x == 0 && ahead < n_tiles) {
        tma_loader.load(tile_of(ahead), stage_ptr(ahead % kStages), &full[ahead % kStages]);
        if (ahead + 1 < n_tiles) tma_loader.locate(tile_of(ahead + 1));
      }
      if (i == 0) {  // Q
        ptx::cp_async_wait<0>();
        __syncthreads();
      }
      ptx::mbarrier_wait(&full[stage], (uint32_t)((i / kStages) & 1));
      if ((t + 1) * kBlockN > seqlen_k)  // block-uniform: the entry's last tile
        TmaLoader<Traits>::zero_v_past_end(t, stage_ptr(stage), seqlen_k);
    } else {
      if (ahead < n_tiles) {
        cp_loader.load(tile_of(ahead), ptx::smem_addr(stage_ptr(ahead % kStages)));
        if (ahead + 1 < n_tiles) cp_loader.locate(tile_of(ahead + 1));
      }
      ptx::cp_async_commit();
      ptx::cp_async_wait<kStages - 1>();  // Q and tile i have landed
      __syncthreads();
    }
    if constexpr (Traits::kQInRegs)
      if (i == 0) sm80::load_q_fragments<QTile>(q_regs, sQ, wm * 16, lane);

    const Element* sK = stage_ptr(stage) + wn * Traits::kWarpKeys * 64;
    const Element* sV = sK + KVTile::kElems;
    float s[1][kNTiles][4];
    sm80::gemm_qk<QTile, KVTile, 1, kNTiles, kKSteps, Traits::kQInRegs>(s, q_regs, sQ, sK, wm * 16, lane, a_off,
                                                                         b_off);
    float correction[2];
    bool moved;
    if (plain_scores && unmasked.contains(t)) {  // block-uniform: most tiles of a long cache
      moved = softmax.step(s, f.scale_log2, correction);  // the scale folded into the exp2's FFMA
    } else {
      // Logits in log2 units (scale, softcap, ALiBi: score_mod.h), then the mask (mask.h) in the entry's positions.
      const int col0 = t * kBlockN + wn * Traits::kWarpKeys + 2 * (lane & 3);
      const bool mask_tile = !unmasked.contains(t);
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1, j = col0 + ni * 8 + (e & 1);
          const int d = j - pos_of[h];
          float x = softcap ? f.score.softcap_log2 * ptx::tanh_approx(s[0][ni][e] * f.score.softcap_inv)
                            : s[0][ni][e] * f.scale_log2;
          if (alibi) x = fmaf(-alibi_log2[h], fabsf((float)(d - alibi_offset)), x);
          if (mask_tile && !(j < seqlen_k && d >= band_lo && d <= band_hi)) x = -INFINITY;
          s[0][ni][e] = x;
        }
      moved = softmax.step(s, 1.f, correction);
    }
    // The deferred rescale: a decode row's max settles within a few tiles, after which the O multiplies are skipped.
    softmax.rescale(o, correction, moved);
    sm80::gemm_pv<KVTile, 1, kNTiles, kDTiles>(o, s, sV, lane, a_off);
    __syncthreads();  // every warp is done with this stage before the next step refills it
  }
  ptx::cp_async_wait<0>();
  __syncthreads();
  store_block_result<Traits>(p, reinterpret_cast<float*>(sStages), softmax, o, b, kvh, m0, split);
}

template <typename Traits>
__device__ __forceinline__ void decode_kernel_body(const DecodeParams& p, const DecodeTmaMaps& maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  // TMA is sm_90 code: below it the variant is an empty kernel the host never launches (decode_launch.cu takes it
  // only where the kernel's code was compiled for sm_90).
  if constexpr (Traits::kTma) {
    __trap();
  } else {
    decode_block<Traits>(p, maps);
  }
#else
  decode_block<Traits>(p, maps);
#endif
}

// Two definitions, one per form of __launch_bounds__: a minimum of one block an SM is not the same request to
// ptxas as none (it gave every variant more registers: the chunked-prefill ones 151 -> 208 at head dim 64), so
// only the variants with a residency to keep (DecodeTraits::kMinBlocksPerSm) name one.
template <typename Traits, std::enable_if_t<Traits::kMinBlocksPerSm == 1, int> = 0>
__global__ void __launch_bounds__(Traits::kNThreads)
    decode_kernel(const __grid_constant__ DecodeParams p, const __grid_constant__ DecodeTmaMaps maps) {
  decode_kernel_body<Traits>(p, maps);
}

template <typename Traits, std::enable_if_t<(Traits::kMinBlocksPerSm > 1), int> = 0>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocksPerSm)
    decode_kernel(const __grid_constant__ DecodeParams p, const __grid_constant__ DecodeTmaMaps maps) {
  decode_kernel_body<Traits>(p, maps);
}

// The split-KV merge: one warp a row.
template <typename Element>
__global__ void __launch_bounds__(128) decode_combine_kernel(const __grid_constant__ DecodeParams p) {
  __shared__ float weight[4][kMaxSplits];
  ptx::wait_for_prior_grids();  // the decode kernel's partials (a programmatic dependent launch where sm_90 code)
  ptx::allow_dependent_grids();
  const int64_t row = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
  if (row < p.f.batch * p.f.heads_q * p.f.seqlen_q) combine_row<Element>(p, row, weight[threadIdx.x >> 5], threadIdx.x & 31);
}

}  // namespace flashcore::decode
