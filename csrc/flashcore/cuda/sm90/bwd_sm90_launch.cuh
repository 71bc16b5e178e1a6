// Host-side launch of the Hopper (wgmma + TMA) backward kernel, included by the sm90 instantiation files only.
// The dispatcher (attention_cuda.cpp) sends only TMA-compatible tensors here (tma_desc.h).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "../../params.h"
#include "../launch_utils.cuh"
#include "bwd_sm90_kernel.cuh"
#include "tma_desc.h"

namespace flashcore::sm90 {

// dq_accum has exactly head_dim columns: the TMA reductions drop the tile's columns past it (a padded head dim,
// e.g. 96 in the 128 tile, so the accumulator is no larger than the mma.sync family's).
constexpr bool kBwdDqColsExact = true;

template <int kHeadDim, typename Element, bool kScoreMod>
constexpr int bwd_smem_bytes() {
  return BwdSm90Traits<kHeadDim, Element, kScoreMod>::kSmemBytes;
}

template <int kHeadDim, typename Element, bool kScoreMod>
constexpr int bwd_block_m() {
  return BwdSm90Traits<kHeadDim, Element, kScoreMod>::kBlockM;
}

template <int kHeadDim, typename Element, bool kScoreMod>
void launch_bwd(const BwdParams& p, const float* dsum, float* dq_accum, cudaStream_t stream) {
  using Traits = BwdSm90Traits<kHeadDim, Element, kScoreMod>;
  auto kernel = &bwd_sm90_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemBytes;
  static std::atomic<uint64_t> configured_devices{0};
  cuda::set_max_dynamic_smem_once(kernel, kSmem, configured_devices);

  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  const CUtensorMap tm_q = make_tensor_map_bhsd(p.q, p.q_stride, p.batch, p.heads_q, p.seqlen_q, p.head_dim,
                                                Traits::kBlockM, kBf16);
  const CUtensorMap tm_do = make_tensor_map_bhsd(p.dout, p.dout_stride, p.batch, p.heads_q, p.seqlen_q,
                                                 p.head_dim, Traits::kBlockM, kBf16);
  const CUtensorMap tm_k = make_tensor_map_bhsd(p.k, p.k_stride, p.batch, p.heads_kv, p.seqlen_k, p.head_dim,
                                                Traits::kBlockN, kBf16);
  const CUtensorMap tm_v = make_tensor_map_bhsd(p.v, p.v_stride, p.batch, p.heads_kv, p.seqlen_k, p.head_dim,
                                                Traits::kBlockN, kBf16);

  const int64_t dq_rows = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM * Traits::kBlockM;
  const CUtensorMap tm_dq = make_tensor_map_f32_2d(dq_accum, p.batch * p.heads_q * dq_rows, p.head_dim,
                                                   Traits::kDqBoxCols, Traits::kDqBoxRows);
  const int num_n_blocks = (int)((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN);
  const int64_t grid = (int64_t)num_n_blocks * p.batch * p.heads_kv;  // the dispatcher checked grid <= INT32_MAX
  kernel<<<dim3((unsigned)grid), dim3(Traits::kNThreads), kSmem, stream>>>(p, tm_q, tm_k, tm_v, tm_do, tm_dq,
                                                                            dsum, num_n_blocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashcore::sm90
