// Instantiations and launchers of the KV-cache kernel: head-dim tiles 64/128/256, fp16/bf16, both warp layouts.
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "../../switches.h"
#include "../launch_utils.cuh"
#include "../sm90/tma_desc.h"
#include "decode.h"
#include "decode_kernel.cuh"

namespace flashcore::decode {
namespace {

using KernelFn = void (*)(const DecodeParams, const DecodeTmaMaps);

constexpr int kMaxClusterResidency = 4;  // blocks an SM up to which clusters_resident caches its answer

struct Variant {
  KernelFn kernel;
  int smem_bytes;
  int block_m;
  int inflight_bytes;  // K/V bytes the pipeline keeps in flight: the stages ahead of the one computed
  std::atomic<uint64_t>* smem_configured;
  std::atomic<int>* occupancy;     // [64]: blocks an SM of device d at smem_bytes (0: not asked yet)
  cuda::Sm90CodeCheck* sm90_code;  // whether its code on the device is sm_90 code (the TMA variant; PDL; clusters)
  std::atomic<int> (*clusters)[kMaxClusterSplits + 1][kMaxClusterResidency + 1];  // [device]: clusters_resident
};

template <int kTile, typename Element, bool kRows, bool kTma, int kStages>
Variant variant() {
  using Traits = DecodeTraits<kTile, Element, kRows, kTma, kStages>;
  static std::atomic<uint64_t> configured{0};
  static std::atomic<int> occupancy[64];  // static storage: zero-initialised
  static cuda::Sm90CodeCheck sm90_code;
  static std::atomic<int> clusters[16][kMaxClusterSplits + 1][kMaxClusterResidency + 1];  // 0: not asked yet
  constexpr int kInflight = (Traits::kStages - 1) * Traits::kStageElems * (int)sizeof(Element);
  return Variant{&decode_kernel<Traits>, Traits::kSmemBytes, Traits::kBlockM, kInflight, &configured, occupancy,
                 &sm90_code, clusters};
}

template <typename Element, bool kTma, int kStages>
Variant pick(int tile, bool rows) {
  switch (tile) {
    case 64: return rows ? variant<64, Element, true, kTma, kStages>() : variant<64, Element, false, kTma, kStages>();
    case 128:
      return rows ? variant<128, Element, true, kTma, kStages>() : variant<128, Element, false, kTma, kStages>();
    default:
      return rows ? variant<256, Element, true, kTma, kStages>() : variant<256, Element, false, kTma, kStages>();
  }
}

// The TMA loader sizes its own stages (DecodeTraits), so it has one variant per tile, dtype and layout.
Variant pick(int tile, bool rows, bool bf16, bool tma, int stages) {
  if (tma) return bf16 ? pick<__nv_bfloat16, true, 2>(tile, rows) : pick<__half, true, 2>(tile, rows);
  if (stages == 3) return bf16 ? pick<__nv_bfloat16, false, 3>(tile, rows) : pick<__half, false, 3>(tile, rows);
  return bf16 ? pick<__nv_bfloat16, false, 2>(tile, rows) : pick<__half, false, 2>(tile, rows);
}

// Whether the TMA variant's code on this device is sm_90 code (a build without sm_90a runs the sm_80 code, JIT or
// not, where the variant is an empty kernel); cached per device.
bool tma_code_built(const Variant& v) { return cuda::runs_sm90_code(v.kernel, *v.sm90_code); }

// The device's peak DRAM bandwidth in bytes a second: double data rate x bus width. Cached per device (devices past
// 63 ask every call), as are the occupancies below: a decode step's host time is part of every generated token's.
double peak_dram_bytes_per_s(const cudaDeviceProp& prop) {
  static std::atomic<double> cached[64];  // 0: not asked yet
  const int device = cuda::current_device_index();
  if (device < 64)
    if (const double peak = cached[device].load(std::memory_order_relaxed); peak > 0.0) return peak;
  int clock_khz = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
  const double peak = 2.0 * clock_khz * 1e3 * (prop.memoryBusWidth / 8.0);
  if (device < 64) cached[device].store(peak, std::memory_order_relaxed);
  return peak;
}

// Blocks of the cp.async loader an SM needs to stream a dense cache (or pages of 64 keys or more) at the memory's
// full rate, by Little's law: a block streams its bytes in flight over the loaded memory latency. The latency is
// calibrated on an H200: one two-stage head-dim-128 block an SM (32 KiB in flight) streamed 3.60 TB/s over 132 SMs,
// 27 GB/s a block, 1.2 us. So an H100 (3.35 TB/s peak) needs one such block an SM (8 x 8k, µs: 2 splits 93.4, 4
// splits 95.7) and an H200 (4.9 TB/s) two (8 x 8k: 74.6 with one, 71.5 with two), or one of three stages (67.3;
// SDPA 68.2 in the same run). Within 5 % of the peak counts as full: the copies' own ceiling is below it.
int full_rate_blocks_per_sm(const cudaDeviceProp& prop, double peak_bytes_per_s, int inflight_bytes) {
  constexpr double kLoadedLatencyS = 1.2e-6;
  const double block_bytes_per_s = inflight_bytes / kLoadedLatencyS;
  const double need = 0.95 * peak_bytes_per_s / (block_bytes_per_s * prop.multiProcessorCount);
  return std::max(1, (int)std::ceil(need));
}

// The cp.async loader's stages for a call (DecodePlan::stages; the TMA loader sizes its own). A decode step's block
// streams a dense cache or pages of 64 keys or more at a rate set by its bytes in flight (full_rate_blocks_per_sm).
// Where two stages would take more than one block an SM to reach the memory's rate, a dense cache takes a third
// stage if it fits: one block of three stages an SM measured faster than two of two (H200, µs: 8 x 8k 67.3 vs
// 71.5, 1 x 128k 127.7 vs 131.4; 64 x 2k, a grid of several waves, 130.5 vs 129.6). Paged caches keep two stages
// and take more blocks: a block's page lookups slowed its stream (1 x 128k pages of 256: 145.3 with one three-stage
// block an SM, 130.3 with two of two stages; 8 x 8k pages of 256 71.3 vs 71.8, pages of 16 72.9 vs 71.8), and with
// pages of whole tiles copied strided they still do at 1 x 128k (pages of 256: 137.2 vs 126.4; 8 x 8k 66.9 vs 67.8).
// FLASHCORE_DECODE_STAGES forces the count (three only where it fits).
int cp_async_stages(const DecodeParams& p, const DecodePlan& plan, bool bf16, const cudaDeviceProp& prop,
                    bool streams_at_own_rate, double peak_bytes_per_s) {
  if (plan.tma) return 2;
  const bool three_fit =
      pick(plan.head_dim_tile, plan.rows_mode, bf16, false, 3).smem_bytes <= (int)prop.sharedMemPerBlockOptin;
  const int forced = decode_stages_forced();
  if (forced != 0) return forced == 3 && three_fit ? 3 : 2;
  if (!streams_at_own_rate || p.kv.paged() || !three_fit) return 2;
  const Variant two = pick(plan.head_dim_tile, plan.rows_mode, bf16, false, 2);
  return full_rate_blocks_per_sm(prop, peak_bytes_per_s, two.inflight_bytes) > 1 ? 3 : 2;
}

// Blocks an SM runs of a decode step through pages under 64 keys, which the loader gathers (a lookup and shuffles a
// row), whatever more the occupancy would allow. (Pages of 64+ keys that are not whole tiles, and entries whose
// left pad is not a multiple of 64, gather too; the host plans them as streams: a left pad is per entry, on the
// device.) H100, 8 x 8k pages of 16: 98.5 us with 4
// splits (two blocks an SM) vs 100.8 with 2 (one); H200, where the lighter step fits three: 8 x 8k pages of 16 68.9
// with 4 splits vs 71.9 with 6 (three an SM), 64 x 1k..2k pages of 16 105.1 at two an SM vs 112.7 at three.
constexpr int kGatherBlocksPerSm = 2;

// Dynamic shared memory to launch variant v with so that no more than `blocks` blocks fit on an SM (the kernel uses
// v.smem_bytes of it; the rest only caps residency): blocks + 1 blocks would need more than the SM has. The static
// shared memory (2.1 KiB on sm_90: entry_of_rank's ranks and more) is left out of that sum, which only keeps the cap
// safe, and bounds the dynamic part from above (the two together may not pass the opt-in).
constexpr int kStaticSmemBound = 8192;
int residency_capped_smem(const Variant& v, int blocks, const cudaDeviceProp& prop) {
  const int per_block = (int)(prop.sharedMemPerMultiprocessor / (blocks + 1)) + 1;
  const int dynamic = per_block - (int)prop.reservedSharedMemPerBlock;
  return std::max(v.smem_bytes, std::min(dynamic, (int)prop.sharedMemPerBlockOptin - kStaticSmemBound));
}

// Opts variant v in to the most dynamic shared memory any of its launches asks for (the padding of one block an
// SM), once per device, so that every residency cap plan_decode picks is a valid launch.
void opt_in_smem(const Variant& v, const cudaDeviceProp& prop) {
  cuda::set_max_dynamic_smem_once(v.kernel, std::max(v.smem_bytes, residency_capped_smem(v, 1, prop)),
                                  *v.smem_configured);
}

// Blocks of variant v an SM can run at its own shared memory (at least 1); cached per device. Opts v in first (a
// cached count means that was done on this device).
int occupancy_of(const Variant& v, const cudaDeviceProp& prop) {
  const int device = cuda::current_device_index();
  if (device < 64)
    if (const int n = v.occupancy[device].load(std::memory_order_acquire); n > 0) return n;  // opt-in visible
  opt_in_smem(v, prop);
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, v.kernel, 128, v.smem_bytes));
  n = std::max(1, n);
  if (device < 64) v.occupancy[device].store(n, std::memory_order_release);
  return n;
}

// Keys a TMA box for the call's cache, or 0 where the TMA loader cannot serve it (DecodePlan) or is not asked for
// (FLASHCORE_DECODE_TMA=1; the tests take it so). The cp.async loader is as fast or faster on every row measured:
//   H100 (decode_bench, same process): 8 x 8k pages of 256 98.5 vs 99.4 us, 1 x 128k pages of 256 186.8 vs 191.3,
//     pages of 16 3-8 % faster, dense caches 1-9 %;
//   H200 (one sweep of loaders and split counts, each loader at its best count): 8 x 8k 69.3 vs 71.2 us, pages of
//     16 71.2 vs 79.3, pages of 256 70.3 vs 74.8, 64 x 1k..2k pages of 16 105.8 vs 114.9, 1 x 128k 130.0 vs 133.4,
//     pages of 256 129.3 vs 140.8.
int tma_box_rows(const DecodeParams& p, const cudaDeviceProp& prop) {
  if (prop.major != 9 || decode_tma_forced() != 1) return 0;
  const FwdParams& f = p.f;
  const int64_t extent = p.kv.rows_per_cache_row();
  if (!sm90::tma_compatible(f.k, f.k_stride, p.kv.cache_rows, f.heads_kv, extent) ||
      !sm90::tma_compatible(f.v, f.v_stride, p.kv.cache_rows, f.heads_kv, extent))
    return 0;
  if (!p.kv.paged()) return extent >= 64 ? 64 : 0;
  if (p.kv.cache_leftpad == nullptr && extent % 16 == 0)
    return (int)std::min<int64_t>(64, extent & -extent);  // the page size's largest power-of-two divisor
  return 0;
}

// Whether a decode step can merge its splits in a cluster at all: a decode-step variant (cp.async loader) whose
// code here is sm_90, unless FLASHCORE_DECODE_CLUSTER=0.
bool cluster_capable(const Variant& v, const DecodePlan& plan, const cudaDeviceProp& prop) {
  return !plan.rows_mode && !plan.tma && decode_cluster_forced() != 0 && prop.major >= 9 &&
         cuda::runs_sm90_code(v.kernel, *v.sm90_code);
}

// Clusters of `splits` blocks of variant v that can be resident at once when a block takes `smem` bytes (at most
// `per_sm` blocks an SM): clusters live within one GPC, so this is not SMs x per_sm / splits. Cached per device,
// split count and residency.
int clusters_resident(const Variant& v, int splits, int smem, int per_sm) {
  const int device = cuda::current_device_index();
  const bool cached = device < 16 && per_sm >= 1 && per_sm <= kMaxClusterResidency;
  if (cached)
    if (const int n = v.clusters[device][splits][per_sm].load(std::memory_order_relaxed); n > 0) return n - 1;
  const int clusters = cuda::query_max_active_clusters(v.kernel, dim3(128), smem, (unsigned)splits);
  if (cached) v.clusters[device][splits][per_sm].store(clusters + 1, std::memory_order_relaxed);
  return clusters;
}

// Whether a decode step's splits are merged in clusters (DecodePlan::cluster_merge), and the launch's shared memory
// then: 2 .. kMaxClusterSplits splits of a cluster-capable variant whose clusters are all resident at once. Where
// the whole grid fits one block an SM, the launch is capped at one (the hardware places a cluster's blocks on
// neighbouring SMs, two an SM where it may, and a block's stream is bound by its SM's loads: 4 x 2048 with 4
// splits, 128 blocks, measured 14.6 us in clusters uncapped against 13.4 with the combine kernel). A grid of
// clusters that the GPCs cannot hold at once runs in two waves (8 x 8k through 16-key pages, 4 splits, 64
// clusters two an SM: 106.7 against 70.2 us), and one of 8-block clusters two an SM over 256 blocks likewise
// (4 x 576: 15.6 against 9.3 with 6 splits).
bool merge_in_clusters(const DecodeParams& p, const Variant& v, DecodePlan& plan, const cudaDeviceProp& prop) {
  if (plan.splits < 2 || plan.splits > kMaxClusterSplits || !cluster_capable(v, plan, prop)) return false;
  const double clusters = (double)p.f.batch * p.f.heads_kv * plan.m_blocks;
  if (clusters * plan.splits > (double)std::numeric_limits<int>::max()) return false;
  const bool one_an_sm = clusters * plan.splits <= prop.multiProcessorCount;
  const int per_sm = one_an_sm ? 1 : plan.resident;
  const int smem = one_an_sm ? residency_capped_smem(v, 1, prop) : plan.smem_bytes;
  if (clusters > clusters_resident(v, plan.splits, smem, per_sm)) return false;
  plan.smem_bytes = smem;
  return true;
}

// plan_decode without the cluster choice: the variant, its residency and the split count.
DecodePlan plan_splits(const DecodeParams& p, int requested, bool bf16, const cudaDeviceProp& prop) {
  DecodePlan plan;
  const int64_t D = p.f.head_dim;
  plan.head_dim_tile = D <= 64 ? 64 : D <= 128 ? 128 : 256;
  const int64_t rows = p.f.seqlen_q * p.f.group;
  plan.rows_mode = rows > 16;
  plan.box_rows = tma_box_rows(p, prop);
  plan.tma = plan.box_rows > 0 && tma_code_built(pick(plan.head_dim_tile, plan.rows_mode, bf16, true, 2));
  if (!plan.tma) plan.box_rows = 64;
  // A decode step through the cp.async loader (dense cache or pages of 64+ keys) streams at a rate its bytes in
  // flight set; its stages and slots follow the memory's peak, read once here.
  const bool streams_at_own_rate = !plan.rows_mode && !plan.tma && (!p.kv.paged() || p.kv.page_size >= 64);
  const double peak = streams_at_own_rate ? peak_dram_bytes_per_s(prop) : 0.0;
  plan.stages = cp_async_stages(p, plan, bf16, prop, streams_at_own_rate, peak);
  const Variant v = pick(plan.head_dim_tile, plan.rows_mode, bf16, plan.tma, plan.stages);
  plan.smem_bytes = v.smem_bytes;
  TORCH_CHECK(v.smem_bytes <= (int)prop.sharedMemPerBlockOptin, "flashcore: the KV-cache kernel for head_dim ", D,
              (plan.rows_mode ? " with more than 16 query rows per kv head" : ""), " needs ", v.smem_bytes / 1024,
              " KiB of shared memory a block; this GPU gives ", prop.sharedMemPerBlockOptin / 1024, " KiB");
  plan.m_blocks = (int)((rows + v.block_m - 1) / v.block_m);
  TORCH_CHECK(plan.m_blocks <= 65535, "flashcore: seqlen_q x (heads_q / heads_kv) = ", rows,
              " query rows per kv head exceed the KV-cache kernel's grid");
  const int per_sm = occupancy_of(v, prop);  // and v opted in to its largest launch
  const double blocks = (double)p.f.batch * p.f.heads_kv * plan.m_blocks;
  const bool decode_step = !plan.rows_mode && !plan.tma;
  // A decode step whose unsplit grid fills one wave of two-stage blocks at their full occupancy (within a tenth)
  // runs so: every block starts at once and none waits for a slot (H200, head dim 64, 64 x 2k: 65.1 us against 68.2
  // with three stages two an SM, two waves; SDPA 63.3). Not where the caller forces splits, stages or residency.
  if (decode_step && streams_at_own_rate && plan.stages == 3 && requested == 0 && decode_stages_forced() == 0 &&
      decode_blocks_per_sm_forced() == 0) {
    const Variant two = pick(plan.head_dim_tile, false, bf16, false, 2);
    const int per_sm_two = occupancy_of(two, prop);
    const double wave = (double)per_sm_two * prop.multiProcessorCount;
    if (blocks <= wave && blocks >= 0.9 * wave) {
      plan.stages = 2;
      plan.smem_bytes = two.smem_bytes;
      plan.splits = 1;
      return plan;  // one wave: the entries' order does not matter (longest_first stays off)
    }
  }
  // Longest entries first (decode_kernel.cuh) where blocks wait for slots and entries may differ in length; a grid
  // of one wave starts every block at once, and entries that are all full (no lengths or left pads: the dense op's
  // decode step) keep their order anyway, so those would only pay for the ranking (H200, 64 x 2k: 126.6 us
  // unranked against 128.7-130.0).
  int resident = 0;  // blocks an SM runs (set below)
  const bool lengths_differ = p.kv.cache_seqlens != nullptr || p.kv.cache_leftpad != nullptr;
  auto set_order = [&] {
    plan.longest_first = !plan.rows_mode && lengths_differ && p.f.batch > 1 && p.f.batch <= kMaxRankedEntries &&
                         decode_longest_first_enabled() &&
                         blocks * plan.splits > (double)resident * prop.multiProcessorCount;
  };
  // Block slots of a wave: a decode step streaming at its own rate counts the blocks an SM needs for the memory's
  // full rate (or fewer, where the occupancy allows fewer) and takes the fewest splits that fill them (fewer
  // partials to merge; H100, µs: 8 x 8k 93.5 with 2 splits vs 96.3 with 4, pages of 256 95.8 vs 97.6, 1 x 128k
  // 180.5 with 16 vs 189.1 with 30). A decode step through small pages counts kGatherBlocksPerSm; the TMA loader
  // and a chunked prefill fill every slot the occupancy allows.
  const int occupancy = per_sm;
  int slots_per_sm = occupancy;
  if (decode_step && streams_at_own_rate)
    slots_per_sm = std::min(occupancy, full_rate_blocks_per_sm(prop, peak, v.inflight_bytes));
  else if (decode_step)
    slots_per_sm = std::min(occupancy, kGatherBlocksPerSm);
  // Residency: a decode step's SM runs at most two blocks or its slots, whichever is more; the split model's waves
  // are then the hardware's (a third block an SM left the last wave a few blocks wide: 64 x 2k at head dim 64,
  // 512 blocks over 396 slots; a second one keeps a block's first loads and its merge under the other's stream).
  resident = decode_step ? std::max(2, slots_per_sm) : occupancy;
  if (const int forced = decode_blocks_per_sm_forced(); forced > 0 && decode_step) resident = slots_per_sm = forced;
  resident = std::min(resident, occupancy);
  slots_per_sm = std::min(slots_per_sm, resident);
  if (resident < occupancy) plan.smem_bytes = residency_capped_smem(v, resident, prop);
  plan.resident = resident;
  if (requested > 0) {
    plan.splits = requested;
    set_order();
    return plan;
  }
  const double slots = (double)slots_per_sm * prop.multiProcessorCount;
  const int64_t tiles = (p.kv.longest_entry() + 63) / 64;  // of the longest possible entry
  // Splits of at least 3 tiles, a bounded workspace (num_splits x rows x head_dim floats), at most 128; a cache of
  // at most 4 tiles a split at kMaxClusterSplits splits takes no more than those where a cluster can merge them
  // (the saved combine kernel is worth more there than more splits: 1 x 2048, H200, 9.2 us in clusters of 8
  // against 9.9 with 16 splits and the combine kernel; 4 x 576 with 3 splits 9.3 against 10.6 with 2).
  const double rows_total = (double)p.f.batch * p.f.heads_q * p.f.seqlen_q;
  const int64_t by_workspace = (int64_t)std::max(1.0, (1 << 26) / std::max(1.0, rows_total * D));
  int max_splits = (int)std::max<int64_t>(1, std::min<int64_t>({128, tiles / 3, by_workspace}));
  if (tiles <= 4 * kMaxClusterSplits && cluster_capable(v, plan, prop))
    max_splits = std::min(max_splits, kMaxClusterSplits);
  auto efficiency = [&](int s) {
    const double waves = blocks * s / slots;
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int s = 1; s <= max_splits; ++s) best = std::max(best, efficiency(s));
  for (int s = 1; s <= max_splits; ++s)
    if (efficiency(s) >= 0.9 * best) {
      plan.splits = s;
      break;
    }
  set_order();
  return plan;
}

}  // namespace

DecodePlan plan_decode(const DecodeParams& p, int requested, bool bf16, const cudaDeviceProp& prop) {
  DecodePlan plan = plan_splits(p, requested, bf16, prop);
  const Variant v = pick(plan.head_dim_tile, plan.rows_mode, bf16, plan.tma, plan.stages);
  plan.cluster_merge = merge_in_clusters(p, v, plan, prop);
  return plan;
}

void launch_decode(const DecodeParams& p, const DecodePlan& plan, bool bf16, cudaStream_t stream) {
  const Variant v = pick(plan.head_dim_tile, plan.rows_mode, bf16, plan.tma, plan.stages);
  // plan_decode opted the variant in to plan.smem_bytes and more (opt_in_smem).
  DecodeTmaMaps maps{};
  if (plan.tma) {
    const FwdParams& f = p.f;
    const int64_t extent = p.kv.rows_per_cache_row();
    maps.k = sm90::make_tensor_map_bhsd(f.k, f.k_stride, p.kv.cache_rows, f.heads_kv, extent, f.head_dim,
                                        plan.box_rows, bf16);
    maps.v = sm90::make_tensor_map_bhsd(f.v, f.v_stride, p.kv.cache_rows, f.heads_kv, extent, f.head_dim,
                                        plan.box_rows, bf16);
    maps.box_rows = plan.box_rows;
  }
  // Both kernels with programmatic dependent launch where their code is sm_90 (launch_utils.cuh): a kernel's blocks
  // become resident while the previous kernel of the stream finishes, and wait for it before reading anything.
  const unsigned pairs = (unsigned)(p.f.batch * p.f.heads_kv), splits = (unsigned)p.num_splits;
  if (p.cluster_merge) {  // one cluster of the splits an (entry, kv head): x = pair x splits + split
    cuda::launch_kernel(v.kernel, *v.sm90_code, dim3(pairs * splits, 1, (unsigned)plan.m_blocks), dim3(128),
                        plan.smem_bytes, stream, splits, p, maps);
    return;
  }
  cuda::launch_kernel(v.kernel, *v.sm90_code, dim3(pairs, splits, (unsigned)plan.m_blocks), dim3(128),
                      plan.smem_bytes, stream, 1, p, maps);
  if (p.num_splits > 1) {
    const unsigned blocks = (unsigned)((p.f.batch * p.f.heads_q * p.f.seqlen_q + 3) / 4);
    static cuda::PdlSupport pdl_bf16, pdl_fp16;
    if (bf16)
      cuda::launch_kernel(&decode_combine_kernel<__nv_bfloat16>, pdl_bf16, dim3(blocks), dim3(128), 0, stream, 1, p);
    else
      cuda::launch_kernel(&decode_combine_kernel<__half>, pdl_fp16, dim3(blocks), dim3(128), 0, stream, 1, p);
  }
}

}  // namespace flashcore::decode
