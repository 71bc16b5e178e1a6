// Instantiations and launchers of the KV-cache kernel: head-dim tiles 64/128/256, fp16/bf16, both warp layouts.
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "../../switches.h"
#include "../launch_utils.cuh"
#include "../sm90/tma_desc.h"
#include "decode.h"
#include "decode_kernel.cuh"

namespace flashcore::decode {
namespace {

using KernelFn = void (*)(const DecodeParams, const DecodeTmaMaps);

struct Variant {
  KernelFn kernel;
  int smem_bytes;
  int block_m;
  std::atomic<uint64_t>* smem_configured;
  cuda::Sm90CodeCheck* sm90_code;  // whether its code on the device is sm_90 code (the TMA variant; PDL)
};

template <int kTile, typename Element, bool kRows, bool kTma>
Variant variant() {
  using Traits = DecodeTraits<kTile, Element, kRows, kTma>;
  static std::atomic<uint64_t> configured{0};
  static cuda::Sm90CodeCheck sm90_code;
  return Variant{&decode_kernel<Traits>, Traits::kSmemBytes, Traits::kBlockM, &configured, &sm90_code};
}

template <typename Element, bool kTma>
Variant pick(int tile, bool rows) {
  switch (tile) {
    case 64: return rows ? variant<64, Element, true, kTma>() : variant<64, Element, false, kTma>();
    case 128: return rows ? variant<128, Element, true, kTma>() : variant<128, Element, false, kTma>();
    default: return rows ? variant<256, Element, true, kTma>() : variant<256, Element, false, kTma>();
  }
}

Variant pick(int tile, bool rows, bool bf16, bool tma) {
  if (tma) return bf16 ? pick<__nv_bfloat16, true>(tile, rows) : pick<__half, true>(tile, rows);
  return bf16 ? pick<__nv_bfloat16, false>(tile, rows) : pick<__half, false>(tile, rows);
}

// Whether the TMA variant's code on this device is sm_90 code (a build without sm_90a runs the sm_80 code, JIT or
// not, where the variant is an empty kernel); cached per device.
bool tma_code_built(const Variant& v) { return cuda::runs_sm90_code(v.kernel, *v.sm90_code); }

// Whether the current device's memory is H200-class: peak DRAM bandwidth (double data rate x bus width) of
// 4.5 TB/s or more; read once per device.
bool h200_class_memory(const cudaDeviceProp& prop) {
  static std::atomic<uint64_t> checked{0}, fast{0};
  const uint64_t bit = cuda::current_device_bit();
  if (bit != 0 && (checked.load(std::memory_order_acquire) & bit))
    return (fast.load(std::memory_order_relaxed) & bit) != 0;
  int device = 0, clock_khz = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
  const bool is_fast = 2.0 * clock_khz * 1e3 * (prop.memoryBusWidth / 8.0) >= 4.5e12;
  if (bit != 0) {
    if (is_fast) fast.fetch_or(bit, std::memory_order_relaxed);
    checked.fetch_or(bit, std::memory_order_acq_rel);
  }
  return is_fast;
}

// Keys a TMA box for the call's cache, or 0 where the TMA loader cannot serve it (DecodePlan) or is not chosen.
// Chosen by default for paged caches where the memory is H200-class (peak 4.5 TB/s or more). Against the
// cp.async loader (same process, decode_bench):
//   H100: the cp.async loader is as fast or faster on every row (8 x 8k pages of 256: 98.5 vs 99.4 us, 1 x 128k
//     pages of 256: 186.8 vs 191.3, pages of 16: 3-8 % faster), so never taken there;
//   H200: 31-42 % faster with pages of 64-key multiples (75.7 vs 99.3 us; 142.8 vs 202.6) and 13-16 % with pages
//     of 16 (86.7 vs 100.5; 155.4 vs 175.1) against the cp.async loader that read the page table a row at a time:
//     it did not keep up with the H200's bandwidth;
//   dense caches: 1-9 % slower on both, never taken.
// FLASHCORE_DECODE_TMA=1 takes it wherever it can address the cache (the tests do), 0 never.
int tma_box_rows(const DecodeParams& p, const cudaDeviceProp& prop) {
  const int forced = decode_tma_forced();
  if (prop.major != 9 || forced == 0) return 0;
  const FwdParams& f = p.f;
  const int64_t extent = p.kv.rows_per_cache_row();
  if (!sm90::tma_compatible(f.k, f.k_stride, p.kv.cache_rows, f.heads_kv, extent) ||
      !sm90::tma_compatible(f.v, f.v_stride, p.kv.cache_rows, f.heads_kv, extent))
    return 0;
  int box = 0;
  if (!p.kv.paged()) {
    box = extent >= 64 ? 64 : 0;
  } else if (p.kv.cache_leftpad == nullptr && extent % 16 == 0) {
    box = (int)std::min<int64_t>(64, extent & -extent);  // the page size's largest power-of-two divisor
  }
  if (forced == 1 || box == 0) return box;
  return p.kv.paged() && h200_class_memory(prop) ? box : 0;
}

}  // namespace

DecodePlan plan_decode(const DecodeParams& p, int requested, bool bf16, const cudaDeviceProp& prop) {
  DecodePlan plan;
  const int64_t D = p.f.head_dim;
  plan.head_dim_tile = D <= 64 ? 64 : D <= 128 ? 128 : 256;
  const int64_t rows = p.f.seqlen_q * p.f.group;
  plan.rows_mode = rows > 16;
  plan.box_rows = tma_box_rows(p, prop);
  plan.tma = plan.box_rows > 0 && tma_code_built(pick(plan.head_dim_tile, plan.rows_mode, bf16, true));
  if (!plan.tma) plan.box_rows = 64;
  const Variant v = pick(plan.head_dim_tile, plan.rows_mode, bf16, plan.tma);
  plan.smem_bytes = v.smem_bytes;
  TORCH_CHECK(v.smem_bytes <= (int)prop.sharedMemPerBlockOptin, "flashcore: the KV-cache kernel for head_dim ", D,
              (plan.rows_mode ? " with more than 16 query rows per kv head" : ""), " needs ", v.smem_bytes / 1024,
              " KiB of shared memory a block; this GPU gives ", prop.sharedMemPerBlockOptin / 1024, " KiB");
  plan.m_blocks = (int)((rows + v.block_m - 1) / v.block_m);
  TORCH_CHECK(plan.m_blocks <= 65535, "flashcore: seqlen_q x (heads_q / heads_kv) = ", rows,
              " query rows per kv head exceed the KV-cache kernel's grid");
  int per_sm = 0;
  cuda::set_max_dynamic_smem_once(v.kernel, v.smem_bytes, *v.smem_configured);
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, v.kernel, 128, v.smem_bytes));
  const double blocks = (double)p.f.batch * p.f.heads_kv * plan.m_blocks;
  // Longest entries first (decode_kernel.cuh) where blocks wait for slots; a grid of one wave starts every block
  // at once and would only pay for the ranking.
  auto set_order = [&] {
    plan.longest_first = !plan.rows_mode && p.f.batch > 1 && p.f.batch <= kMaxRankedEntries &&
                         decode_longest_first_enabled() &&
                         blocks * plan.splits > (double)std::max(1, per_sm) * prop.multiProcessorCount;
  };
  if (requested > 0) {
    plan.splits = requested;
    set_order();
    return plan;
  }
  // Block slots of a wave. A decode step's block streams a dense cache or pages of 64 keys or more through the
  // cp.async loader at full rate alone on an SM, so its grid counts one slot an SM and takes the fewest splits
  // (fewer partials to merge; H100, µs: 8 x 8k 93.5 with 2 splits vs 96.3 with 4, pages of 256 95.8 vs 97.6,
  // 1 x 128k 180.5 with 16 vs 189.1 with 30). Smaller pages cost a block more issue work per byte, so their grid
  // (and the TMA loader's, and a chunked prefill's) fills every slot the occupancy allows (8 x 8k pages of 16:
  // 98.5 with 4 splits vs 100.8 with 2).
  const bool alone_at_full_rate =
      !plan.rows_mode && !plan.tma && (!p.kv.paged() || p.kv.page_size >= 64);
  const double slots = (alone_at_full_rate ? 1 : std::max(1, per_sm)) * (double)prop.multiProcessorCount;
  const int64_t tiles = (p.kv.capacity + 63) / 64;  // of the longest possible entry
  // Splits of at least 4 tiles, a bounded workspace (num_splits x rows x head_dim floats), at most 128.
  const double rows_total = (double)p.f.batch * p.f.heads_q * p.f.seqlen_q;
  const int64_t by_workspace = (int64_t)std::max(1.0, (1 << 26) / std::max(1.0, rows_total * D));
  const int max_splits = (int)std::max<int64_t>(1, std::min<int64_t>({128, tiles / 4, by_workspace}));
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

void launch_decode(const DecodeParams& p, const DecodePlan& plan, bool bf16, cudaStream_t stream) {
  const Variant v = pick(plan.head_dim_tile, plan.rows_mode, bf16, plan.tma);
  cuda::set_max_dynamic_smem_once(v.kernel, v.smem_bytes, *v.smem_configured);
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
  const dim3 grid((unsigned)(p.f.batch * p.f.heads_kv), (unsigned)p.num_splits, (unsigned)plan.m_blocks);
  cuda::launch_kernel(v.kernel, *v.sm90_code, grid, dim3(128), v.smem_bytes, stream, 1, p, maps);
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
