// Instantiations and launchers of the KV-cache kernel: head-dim tiles 64/128/256, fp16/bf16, both warp layouts.
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "../launch_utils.cuh"
#include "decode.h"
#include "decode_kernel.cuh"

namespace flashcore::decode {
namespace {

using KernelFn = void (*)(const DecodeParams);

struct Variant {
  KernelFn kernel;
  int smem_bytes;
  int block_m;
  std::atomic<uint64_t>* smem_configured;
};

template <int kTile, typename Element, bool kRows, int kStages = 2>
Variant variant() {
  using Traits = DecodeTraits<kTile, Element, kRows, kStages>;
  static std::atomic<uint64_t> configured{0};
  return Variant{&decode_kernel<Traits>, Traits::kSmemBytes, Traits::kBlockM, &configured};
}

template <typename Element>
Variant pick(int tile, bool rows) {
  switch (tile) {
    case 64: return rows ? variant<64, Element, true>() : variant<64, Element, false>();
    case 128: return rows ? variant<128, Element, true>() : variant<128, Element, false>();
    default: return rows ? variant<256, Element, true>() : variant<256, Element, false>();
  }
}

Variant pick(int tile, bool rows, bool bf16) {
  return bf16 ? pick<__nv_bfloat16>(tile, rows) : pick<__half>(tile, rows);
}

}  // namespace

DecodePlan plan_decode(const DecodeParams& p, int requested, bool bf16, const cudaDeviceProp& prop) {
  DecodePlan plan;
  const int64_t D = p.f.head_dim;
  plan.head_dim_tile = D <= 64 ? 64 : D <= 128 ? 128 : 256;
  const int64_t rows = p.f.seqlen_q * p.f.group;
  plan.rows_mode = rows > 16;
  const Variant v = pick(plan.head_dim_tile, plan.rows_mode, bf16);
  plan.smem_bytes = v.smem_bytes;
  TORCH_CHECK(v.smem_bytes <= (int)prop.sharedMemPerBlockOptin, "flashcore: the KV-cache kernel for head_dim ", D,
              (plan.rows_mode ? " with more than 16 query rows per kv head" : ""), " needs ", v.smem_bytes / 1024,
              " KiB of shared memory a block; this GPU gives ", prop.sharedMemPerBlockOptin / 1024, " KiB");
  plan.m_blocks = (int)((rows + v.block_m - 1) / v.block_m);
  TORCH_CHECK(plan.m_blocks <= 65535, "flashcore: seqlen_q x (heads_q / heads_kv) = ", rows,
              " query rows per kv head exceed the KV-cache kernel's grid");
  if (requested > 0) {
    plan.splits = requested;
    return plan;
  }
  int per_sm = 0;
  cuda::set_max_dynamic_smem_once(v.kernel, v.smem_bytes, *v.smem_configured);
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, v.kernel, 128, v.smem_bytes));
  const double slots = std::max(1, per_sm) * (double)prop.multiProcessorCount;
  const double blocks = (double)p.f.batch * p.f.heads_kv * plan.m_blocks;
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
  return plan;
}

void launch_decode(const DecodeParams& p, const DecodePlan& plan, bool bf16, cudaStream_t stream) {
  const Variant v = pick(plan.head_dim_tile, plan.rows_mode, bf16);
  cuda::set_max_dynamic_smem_once(v.kernel, v.smem_bytes, *v.smem_configured);
  const dim3 grid((unsigned)(p.f.batch * p.f.heads_kv), (unsigned)p.num_splits, (unsigned)plan.m_blocks);
  v.kernel<<<grid, 128, v.smem_bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.num_splits > 1) {
    const unsigned blocks = (unsigned)((p.f.batch * p.f.heads_q * p.f.seqlen_q + 3) / 4);
    if (bf16)
      decode_combine_kernel<__nv_bfloat16><<<blocks, 128, 0, stream>>>(p);
    else
      decode_combine_kernel<__half><<<blocks, 128, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace flashcore::decode
