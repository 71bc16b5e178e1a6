// Host-side launch of the mma.sync forward kernel for one (head-dim tile, dtype), included by the instantiation
// files only (one instantiation per file keeps builds parallel).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "../../params.h"
#include "../launch_utils.cuh"
#include "fwd_sm80_kernel.cuh"

namespace flashcore::sm80 {

// kVarlen: a variable-length batch (seqlen.h), p.seqlen_q being max_seqlen_q.
template <int kHeadDim, typename Element, bool kScoreMod, int kBlockM, int kBlockN, bool kVarlen = false>
void launch_fwd_tile(const FwdParams& p, cudaStream_t stream) {
  using Traits = FwdKernelTraits<kHeadDim, Element, kBlockM, kBlockN>;
  auto kernel = &fwd_sm80_kernel<Traits, kScoreMod, kVarlen>;
  constexpr int kSmem = Traits::kSmemBytes;

  static std::atomic<uint64_t> configured_devices{0};
  cuda::set_max_dynamic_smem_once(kernel, kSmem, configured_devices);

  const int num_m_blocks = (int)((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM);
  const int64_t grid = (int64_t)num_m_blocks * p.batch * p.heads_q;  // host checked grid <= INT32_MAX
  static cuda::PdlSupport pdl;
  cuda::launch_kernel(kernel, pdl, dim3((unsigned)grid), dim3(Traits::kNThreads), kSmem, stream, 1, p, num_m_blocks);
}

// A variable-length batch (seqlen.h): the configured tile over max_seqlen_q (p.seqlen_q) rows per sequence, the
// score-mod variant (it applies any scale, softcap and ALiBi).
template <int kHeadDim, typename Element>
void launch_fwd_varlen(const FwdParams& p, cudaStream_t stream) {
  using Config = FwdConfig<kHeadDim>;
  launch_fwd_tile<kHeadDim, Element, /*kScoreMod=*/true, Config::kBlockM, Config::kBlockN, /*kVarlen=*/true>(p, stream);
}

// A grid of kBlockM-row blocks that leaves multiprocessors idle runs the small-grid tile instead. kScoreMod: the
// score-mod variant (fwd_sm80_kernel.cuh).
template <int kHeadDim, typename Element, bool kScoreMod>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Config = FwdConfig<kHeadDim>;
  if constexpr (Config::kBlockMSmallGrid != Config::kBlockM || Config::kBlockNSmallGrid != Config::kBlockN) {
    const int64_t blocks = (p.seqlen_q + Config::kBlockM - 1) / Config::kBlockM * p.batch * p.heads_q;
    if (blocks < at::cuda::getCurrentDeviceProperties()->multiProcessorCount) {
      launch_fwd_tile<kHeadDim, Element, kScoreMod, Config::kBlockMSmallGrid, Config::kBlockNSmallGrid>(p, stream);
      return;
    }
  }
  launch_fwd_tile<kHeadDim, Element, kScoreMod, Config::kBlockM, Config::kBlockN>(p, stream);
}

}  // namespace flashcore::sm80
