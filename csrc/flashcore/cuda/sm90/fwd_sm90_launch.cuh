// Host-side launch of the Hopper (wgmma) forward kernel, included by the sm90 instantiation files only.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "../../params.h"
#include "../launch_utils.cuh"
#include "fwd_sm90_kernel.cuh"

namespace flashcore::sm90 {

template <int kHeadDim, typename Element>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Traits = FwdSm90Traits<kHeadDim, Element>;
  auto kernel = &fwd_sm90_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemBytes;
  static std::atomic<uint64_t> configured_devices{0};
  cuda::set_max_dynamic_smem_once(kernel, kSmem, configured_devices);

  const int num_m_blocks = (int)((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM);
  const int64_t grid = (int64_t)num_m_blocks * p.batch * p.heads_q;  // host checked grid <= INT32_MAX
  kernel<<<dim3((unsigned)grid), dim3(Traits::kNThreads), kSmem, stream>>>(p, num_m_blocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashcore::sm90
