// Host-side launch of the mma.sync backward kernel for one (head-dim tile, dtype), included by the instantiation
// files only.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "../../params.h"
#include "../kernel_registry.h"
#include "../launch_utils.cuh"
#include "bwd_sm80_kernel.cuh"

namespace flashcore::sm80 {

// dq_accum has head_dim_tile columns (the kernel indexes it with kHeadDim) and dQ already scaled.
constexpr cuda::DqAccumLayout kBwdDqAccum = {/*cols_exact=*/false, /*unscaled=*/false};

template <int kHeadDim, typename Element, bool /*kScoreMod: the same tiles*/>
constexpr int bwd_smem_bytes() {
  return BwdKernelTraits<kHeadDim, Element>::kSmemBytes;
}

template <int kHeadDim, typename Element, bool /*kScoreMod*/>
constexpr int bwd_block_m() {
  return BwdKernelTraits<kHeadDim, Element>::kBlockM;
}

// kVarlen: a variable-length batch (seqlen.h), p.seqlen_k being max_seqlen_k.
template <int kHeadDim, typename Element, bool kScoreMod, bool kVarlen = false>
void launch_bwd(const BwdParams& p, const float* dsum, float* dq_accum, cudaStream_t stream) {
  using Traits = BwdKernelTraits<kHeadDim, Element>;
  auto kernel = &bwd_sm80_kernel<Traits, kScoreMod, kVarlen>;
  constexpr int kSmem = Traits::kSmemBytes;

  static std::atomic<uint64_t> configured_devices{0};
  cuda::set_max_dynamic_smem_once(kernel, kSmem, configured_devices);

  const int num_n_blocks = (int)((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN);
  const int64_t grid = (int64_t)num_n_blocks * p.batch * p.heads_kv;  // host checked grid <= INT32_MAX
  kernel<<<dim3((unsigned)grid), dim3(Traits::kNThreads), kSmem, stream>>>(p, dsum, dq_accum, num_n_blocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A variable-length batch (seqlen.h): key blocks over max_seqlen_k (p.seqlen_k) per sequence, the score-mod
// variant. dsum: (heads_q, total_q); dq_accum: (heads_q, total_q, kHeadDim), zeroed.
template <int kHeadDim, typename Element>
void launch_bwd_varlen(const BwdParams& p, const float* dsum, float* dq_accum, cudaStream_t stream) {
  launch_bwd<kHeadDim, Element, /*kScoreMod=*/true, /*kVarlen=*/true>(p, dsum, dq_accum, stream);
}

}  // namespace flashcore::sm80
