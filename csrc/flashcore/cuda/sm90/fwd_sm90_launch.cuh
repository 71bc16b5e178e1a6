// Host-side launch of the Hopper (wgmma + TMA) forward kernel, included by the sm90 instantiation files only.
// The dispatcher (attention_cuda.cpp) sends only TMA-compatible tensors here (tma_desc.h).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "../../kernel_trace.h"
#include "../../params.h"
#include "../../switches.h"
#include "../launch_utils.cuh"
#include "fwd_sm90_kernel.cuh"
#include "fwd_sm90_pack_gqa.h"
#include "tma_desc.h"

namespace flashcore::sm90 {

// Key splits (fwd_sm90_split.cuh) for a one-warpgroup grid: s blocks a tile cut the longest key walk from T to
// ceil(T / s) key tiles, and cost, in key tiles of the walk, kSplitFixedTiles (the merge's hand-over and its cold
// code), kSplitPerRankTiles for each rank merged, and kSplitFullGpuTiles more where the split grid takes more than
// half of the SMs. Fitted on the H100 at head dim 64 (graph us, unsplit -> split; docs/PERFORMANCE.md):
// 1x4x512x64 (T = 4, s = 2, 64 blocks) 5.18 -> 4.72, 1x8x512x64 (s = 2, 128 blocks) 5.27 -> 5.41, 1x4x1024x64
// (T = 8, s = 4, 128 blocks) 8.67 -> 7.18, 1x8x64/4096x64 (T = 32, s = 8, 64 blocks) 27.1 -> 8.8. Taken: the s, up
// to kMaxKeySplits, that saves the most by that estimate, among those whose clusters all fit on the GPU at once
// (max_clusters(s): resident clusters of s blocks); 1 if none saves. FLASHCORE_KEY_SPLITS=n caps s (1: no split;
// switches.h), so benchmarks and tests can compare.
constexpr double kSplitFixedTiles = 1.0, kSplitPerRankTiles = 0.5, kSplitFullGpuTiles = 1.5;

// Keys a query tile of block_m rows can see through the mask's band (its width plus the tile's rows), or
// INT64_MAX where the band is unbounded on either side.
inline int64_t band_keys(const FwdParams& p, int block_m) {
  const Band& band = p.band;
  if (band.lo <= -kUnboundedDiagonal || band.hi >= kUnboundedDiagonal) return INT64_MAX;
  return band.hi - band.lo + block_m;
}

// Key tiles of block_n keys in a tile's longest walk (at most): the keys any query sees, and no more than one
// query tile of block_m rows can see through the mask's band.
inline int64_t longest_walk_tiles(const FwdParams& p, int block_m, int block_n) {
  int64_t keys = p.band.keys_of_queries(0, p.seqlen_q).size();
  const int64_t band = band_keys(p, block_m);
  if (band < keys) keys = band;
  return (keys + block_n - 1) / block_n;
}

// Whether the plain multi-warpgroup kernels take a persistent grid (one block an SM walking tiles gridDim.x apart,
// so that the next tile's Q/K/V loads overlap this tile's epilogue; docs/PERFORMANCE.md, ablation). It pays where a
// tile's key walk is short, so that its prologue and epilogue are a large share (16x16x2048x128: +8-15 %; a
// window (1024, 0) at 2x16x16384x128 bf16, 9 tiles a walk: 427 -> 485 TFLOP/s, H200), and only where tiles cost
// alike, since a static split of unequal tiles is unbalanced (4x16x8192x256 causal: -20 %; causal 2x16x16384x128:
// -13 %), while the hardware gives the next tile, heaviest first, to the SM that frees. So: no mask, or a
// window of bounded width on both sides that at least half of the keys lie outside (its tiles differ only at the
// sequence's start), and a longest walk whose K/V take at most 1 MiB (8k head dim 128 unmasked: no gain; a
// window (4096, 0) at 16k: -2 %). FLASHCORE_FWD_PERSISTENT=0/1 forces it (switches.h).
inline bool take_persistent_grid(const FwdParams& p, int block_m) {
  if (const int forced = fwd_persistent_forced(); forced >= 0) return forced == 1;
  int64_t walk_keys = p.seqlen_k;
  if (p.mask.banded()) {
    walk_keys = band_keys(p, block_m);
    if (walk_keys > p.seqlen_k / 2) return false;
  }
  return walk_keys * p.head_dim * 4 <= (int64_t(1) << 20);
}

template <typename Traits, typename MaxClusters>
int pick_key_splits(const FwdParams& p, int64_t num_tiles, int num_sms, MaxClusters&& max_clusters) {
  int cap = Traits::kMaxKeySplits;
  if (const int n = key_split_cap(); n > 0 && n < cap) cap = n;
  const int64_t key_tiles = longest_walk_tiles(p, Traits::kBlockM, Traits::kBlockN);
  int best = 1;
  double best_saving = 0.0;
  for (int s = 2; s <= cap; ++s) {
    const double saving = (double)(key_tiles - (key_tiles + s - 1) / s) - kSplitFixedTiles -
                          kSplitPerRankTiles * (s - 1) - (num_tiles * s > num_sms / 2 ? kSplitFullGpuTiles : 0.0);
    if (saving > best_saving && num_tiles <= max_clusters(s)) {
      best = s;
      best_saving = saving;
    }
  }
  return best;
}

// The Traits kernel, its dynamic shared memory opted in on the current device: before a launch and before an
// occupancy query (without it, cudaOccupancyMaxActiveClusters fails, which pick_key_splits reads as "no split").
template <typename Traits>
auto configured_fwd_kernel() {
  auto kernel = &fwd_sm90_kernel<Traits>;
  static std::atomic<uint64_t> configured_devices{0};
  cuda::set_max_dynamic_smem_once(kernel, Traits::kSmemBytes, configured_devices);
  return kernel;
}

// Launches the Traits kernel over the tiles of p, in clusters of `splits` blocks a tile (1: no key split).
template <typename Traits>
void launch_fwd_grid(const FwdParams& p, int num_sms, cudaStream_t stream, int splits) {
  using Element = typename Traits::Element;
  auto kernel = configured_fwd_kernel<Traits>();
  constexpr int kSmem = Traits::kSmemBytes;
  // Ranks past kMaxKeySplits would write their partial results beyond rank 0's K/V ring.
  TORCH_CHECK(splits >= 1 && splits <= Traits::kMaxKeySplits, "flashcore: internal error: ", splits,
              " key splits for a kernel built for at most ", Traits::kMaxKeySplits);

  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  const CUtensorMap tm_q = make_tensor_map_bhsd(p.q, p.q_stride, p.batch, p.heads_q, p.seqlen_q, p.head_dim,
                                                Traits::kBlockM, kBf16);
  const CUtensorMap tm_k = make_tensor_map_bhsd(p.k, p.k_stride, p.batch, p.heads_kv, p.seqlen_k, p.head_dim,
                                                Traits::kBlockN, kBf16);
  const CUtensorMap tm_v = make_tensor_map_bhsd(p.v, p.v_stride, p.batch, p.heads_kv, p.seqlen_k, p.head_dim,
                                                Traits::kBlockN, kBf16);
  // out is empty_like(query): fresh, and dense with a contiguous last dim, so TMA can always describe it.
  const CUtensorMap tm_o = make_tensor_map_bhsd(p.out, p.out_stride, p.batch, p.heads_q, p.seqlen_q, p.head_dim,
                                                Traits::kBlockM, kBf16);

  const int num_m_blocks = (int)((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM);
  const int64_t num_tiles = (int64_t)num_m_blocks * p.batch * p.heads_q;  // host checked <= INT32_MAX
  const bool persistent = Traits::kPersistent && take_persistent_grid(p, Traits::kBlockM);
  const int64_t grid = (persistent && num_tiles > num_sms) ? num_sms : num_tiles * splits;
  record_kernel(Pass::kFwd, KernelTrace{"sm90", Traits::kHeadDim, Traits::kWarpgroups, splits, Traits::kCompact,
                                        Traits::kScoreMod});
  static cuda::PdlSupport pdl;
  cuda::launch_kernel(kernel, pdl, dim3((unsigned)grid), dim3(Traits::kNThreads), kSmem, stream, (unsigned)splits, p,
                      tm_q, tm_k, tm_v, tm_o, num_m_blocks, (int)num_tiles);
}

// One-warpgroup grids: the key split (pick_key_splits) is chosen for the full kernel; an unsplit grid whose walks
// are shorter than the two-buffer loop's threshold runs the compact variant (FwdSm90Traits::kCompact).
template <typename Traits>
void launch_fwd_tiles(const FwdParams& p, int num_sms, cudaStream_t stream) {
  if constexpr (Traits::kSplitKeys) {
    using Element = typename Traits::Element;
    constexpr int kSmem = Traits::kSmemBytes;
    static cuda::ClusterOccupancy occupancy;
    const int64_t num_tiles = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM * p.batch * p.heads_q;
    auto kernel = configured_fwd_kernel<Traits>();
    const int splits = pick_key_splits<Traits>(p, num_tiles, num_sms, [&](int s) {
      return cuda::max_active_clusters(kernel, dim3(Traits::kNThreads), kSmem, (unsigned)s, occupancy);
    });
    if constexpr (!Traits::kScoreMod) {  // the score-mod variants leave the compact kernel out (build time)
      if (splits == 1 && longest_walk_tiles(p, Traits::kBlockM, Traits::kBlockN) < Traits::kDeepMinTiles) {
        using Compact = FwdSm90Traits<Traits::kHeadDim, Element, 1, Traits::kBlockN, true>;
        launch_fwd_grid<Compact>(p, num_sms, stream, 1);
        return;
      }
    }
    launch_fwd_grid<Traits>(p, num_sms, stream, splits);
  } else {
    launch_fwd_grid<Traits>(p, num_sms, stream, 1);
  }
}

// A block's time per K/V tile grows with its query rows: its warpgroups share one SM's tensor cores and SFU
// (exp2). When the configured (wide) blocks cannot fill the GPU, blocks of fewer warpgroups spread the same rows
// over more SMs. Taken: the fewest warpgroups whose grid still fits in one wave (1x8x512x64 fp16 on H100: 10.1 us
// with 192-row blocks, 6.6 us in a graph with 64-row ones). If none does and no mask makes the blocks' work
// unequal, the blocks run in waves of num_sms, and the wide grid's last, partial wave can cost more than the mid
// width's lower rate (a mid-width row costs kMidRowCost wide-block rows): the mid width where its waves times rows
// come out fewer (1x8x4096x64: 176 blocks of 192 rows in 2 waves against 256 of 128 in 2). docs/PERFORMANCE.md
// has both measurements. FLASHCORE_FWD_WARPGROUPS=n forces n (at most the wide width; switches.h).
constexpr double kMidRowCost = 1.2;

inline int pick_consumer_warpgroups(const FwdParams& p, int wide, int mid, int num_sms) {
  if (const int n = fwd_warpgroups_forced(); n > 0) return n < wide ? n : wide;
  const int64_t bh = p.batch * p.heads_q;
  auto blocks = [&](int w) { return bh * ((p.seqlen_q + 64 * w - 1) / (64 * w)); };
  for (int w = 1; w < wide; ++w) {
    if (blocks(w) <= num_sms) return w;
  }
  if (mid < wide && !p.mask.banded()) {
    auto waves = [&](int w) { return (blocks(w) + num_sms - 1) / num_sms; };
    if ((double)(waves(mid) * mid) * kMidRowCost < (double)(waves(wide) * wide)) return mid;
  }
  return wide;
}

// Keys per tile: the configured causal width, or kBlockNNonCausal where no mask is applied and there are at
// least kWideMinKeys keys; with kWideUnderMasks, kBlockNNonCausal always (the causal width is then never built
// for the plain kernels).
template <int kHeadDim, typename Element, int kWarpgroups>
void launch_fwd_width(const FwdParams& p, int num_sms, cudaStream_t stream) {
  using Config = FwdSm90Config<kHeadDim>;
  using Wide = FwdSm90Traits<kHeadDim, Element, kWarpgroups, Config::kBlockNNonCausal>;
  if constexpr (Config::kWideUnderMasks) {
    static_assert(Config::kWideMinKeys == 0, "kWideUnderMasks takes the wide tile for every call");
    launch_fwd_tiles<Wide>(p, num_sms, stream);
  } else {
    if constexpr (Config::kBlockNNonCausal != Config::kBlockN) {
      if (!p.mask.banded() && p.seqlen_k >= Config::kWideMinKeys) {
        launch_fwd_tiles<Wide>(p, num_sms, stream);
        return;
      }
    }
    launch_fwd_tiles<FwdSm90Traits<kHeadDim, Element, kWarpgroups>>(p, num_sms, stream);
  }
}

// A variable-length batch (seqlen.h): the configured width's plain or score-mod variant built for varlen, one block
// per (sequence, head, query tile) (a cluster of two where its keys are split), the batch in its given order (the
// backward's launch schedule measured 3 % slower here: docs/PERFORMANCE.md); a packed grid of the sequences' tiles
// where lengths differ (cuda/common/varlen_tile_scan.cuh), else ceil(max_seqlen_q / rows) tiles for every sequence.
// The descriptors cover the packed tensors as one (1, heads, total, dim) entry each; the dispatcher checks that TMA
// can describe them (tma_compatible with batch 1). Where it computes fewer padded rows, a block packs the query heads
// of a group (pick_pack_gqa; params.h: PackGqa): Q's box then spans them, and the grid has heads_q / pack head groups
// of ceil(max_seqlen_q / rows) blocks.
template <int kHeadDim, typename Element, bool kScoreMod>
void launch_fwd_varlen(const FwdParams& p, cudaStream_t stream) {
  using Config = FwdSm90Config<kHeadDim>;
  using Traits = FwdSm90Traits<kHeadDim, Element, Config::kWarpgroups, Config::kBlockN, /*kCompact=*/false,
                               kScoreMod, /*kVarlen=*/true>;
  auto kernel = configured_fwd_kernel<Traits>();
  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  const int64_t total_q = p.varlen.total_q, total_k = p.varlen.total_k;
  static_assert(varlen_fwd_block_m(kHeadDim) == Traits::kBlockM, "the router's grid estimate is this grid");
  static_assert(varlen_fwd_max_key_splits(kHeadDim) == Traits::kMaxKeySplits, "the router's split estimate");
  FwdParams params = p;
  const VarlenFwdPack grid = varlen_fwd_pack(p.heads_q, p.heads_kv, p.seqlen_q, kHeadDim, pack_gqa_mode());
  const int pack = grid.heads;
  params.pack.heads = pack;
  params.pack.rows = (int)grid.rows;
  params.pack.groups_div = FastDiv(p.heads_q / pack);
  const CUtensorMap tm_q = make_tensor_map_bhsd(p.q, p.q_stride, 1, p.heads_q, total_q, p.head_dim,
                                                params.pack.rows, kBf16, pack);
  // Paged keys (seqlen.h): k and v as (pages, heads_kv, page_size, dim), boxes of a power of two of keys dividing
  // both the page and the tile (a box never crosses a page; the host takes pages of a multiple of 16 keys).
  const bool paged = p.varlen.block_table != nullptr;
  const int64_t page = paged ? p.varlen.page_size : total_k;
  const int64_t pages = paged ? total_k / page : 1;
  const int box = paged ? (int)std::min<int64_t>(page & -page, Traits::kBlockN & -Traits::kBlockN) : Traits::kBlockN;
  params.varlen.page_box_rows = box;
  // The producer parks at most kMaxPageBoxes page numbers a tile (fwd_sm90_producer.cuh): fewer boxes than the tile
  // needs would leave its stage's expect_tx short, and the consumers waiting forever.
  TORCH_CHECK(!paged || (int64_t)box * Traits::kMaxPageBoxes >= Traits::kBlockN, "flashcore: internal error: pages of ",
              page, " keys make TMA boxes of ", box, " keys, under the 16 the paged producer takes");
  auto paged_strides = [&](const Strides& s) { return paged ? Strides{page * s.seq, s.head, s.seq} : s; };
  const CUtensorMap tm_k = make_tensor_map_bhsd(p.k, paged_strides(p.k_stride), pages, p.heads_kv, page, p.head_dim,
                                                box, kBf16);
  const CUtensorMap tm_v = make_tensor_map_bhsd(p.v, paged_strides(p.v_stride), pages, p.heads_kv, page, p.head_dim,
                                                box, kBf16);
  const int num_m_blocks = (int)((p.seqlen_q + params.pack.rows - 1) / params.pack.rows);
  // At most the unpacked grid's tiles, which the host checked <= INT32_MAX.
  const int64_t num_tiles = grid.blocks(p.batch, p.heads_q, p.seqlen_q);
  // The packed grid (cuda/common/varlen_tile_scan.cuh) where its bound leaves out an eighth of the blocks or more.
  const int64_t packed_tiles = (p.heads_q / pack) * packed_grid_tiles(p.batch, p.seqlen_q, total_q, grid.rows);
  params.varlen.scan_grid = p.batch <= cuda::kVarlenScanMaxBatch && 8 * packed_tiles <= 7 * num_tiles &&
                            varlen_fwd_packed_grid_enabled();
  const int64_t launched = params.varlen.scan_grid ? packed_tiles : num_tiles;
  // A grid of few tiles with long key walks (a chunked prefill of a few sequences) splits their keys over clusters,
  // as the one-warpgroup dense grids do (pick_key_splits: only where every cluster is resident at once).
  int splits = 1;
  if constexpr (Traits::kSplitKeys) {
    static cuda::ClusterOccupancy occupancy;
    const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    splits = pick_key_splits<Traits>(params, launched, num_sms, [&](int s) {
      return cuda::max_active_clusters(kernel, dim3(Traits::kNThreads), Traits::kSmemBytes, (unsigned)s, occupancy);
    });
  }
  KernelTrace trace{"sm90", Traits::kHeadDim, Traits::kWarpgroups, splits, false, kScoreMod, true};
  trace.pack_gqa = pack;
  trace.packed_grid = params.varlen.scan_grid;
  record_kernel(Pass::kFwd, trace);
  static cuda::PdlSupport pdl;
  // tm_o: unused by the varlen epilogue (bounded stores), passed to fill the parameter.
  cuda::launch_kernel(kernel, pdl, dim3((unsigned)(launched * splits)), dim3(Traits::kNThreads), Traits::kSmemBytes,
                      stream, (unsigned)splits, params, tm_q, tm_k, tm_v, tm_q, num_m_blocks, (int)num_tiles);
}

// kScoreMod: the score-mod variants (FwdSm90Traits), built for two block widths only (one warpgroup, with key
// splits, and the configured width) and the causal key tile, to bound the build: softcap and ALiBi are rarer
// calls, and the plain kernels' other variants buy a few percent at their shapes.
template <int kHeadDim, typename Element, bool kScoreMod>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  constexpr int kWide = FwdSm90Config<kHeadDim>::kWarpgroups;
  constexpr int kMid = kWide > 2 ? 2 : kWide;  // a third variant only where the wide block has 3 warpgroups
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int w = pick_consumer_warpgroups(p, kWide, kMid, num_sms);
  if constexpr (kScoreMod) {
    if (w == 1)
      launch_fwd_tiles<FwdSm90Traits<kHeadDim, Element, 1, FwdSm90Config<kHeadDim>::kBlockN, false, true>>(
          p, num_sms, stream);
    else
      launch_fwd_tiles<FwdSm90Traits<kHeadDim, Element, kWide, FwdSm90Config<kHeadDim>::kBlockN, false, true>>(
          p, num_sms, stream);
    return;
  }
  if (w == 1) {
    launch_fwd_width<kHeadDim, Element, 1>(p, num_sms, stream);
  } else if (w == kMid) {
    launch_fwd_width<kHeadDim, Element, kMid>(p, num_sms, stream);
  } else {
    launch_fwd_width<kHeadDim, Element, kWide>(p, num_sms, stream);
  }
}

}  // namespace flashcore::sm90
