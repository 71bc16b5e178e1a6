// Host-side launch of the mma.sync forward kernel for one (head-dim tile, dtype), included by the instantiation
// files only (one instantiation per file keeps builds parallel).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "../../params.h"
#include "fwd_sm80_kernel.cuh"

namespace flashcore::sm80 {

template <int kHeadDim, typename Element>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Traits = FwdKernelTraits<kHeadDim, Element>;
  auto kernel = &fwd_sm80_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemBytes;

  // The opt-in to more than 48 KiB of dynamic shared memory is per function and device; do it once per device.
  static std::atomic<uint64_t> configured_devices{0};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit == 0 || !(configured_devices.load(std::memory_order_acquire) & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    configured_devices.fetch_or(bit, std::memory_order_acq_rel);
  }

  const int num_m_blocks = (int)((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM);
  const int64_t grid = (int64_t)num_m_blocks * p.batch * p.heads_q;  // host checked grid <= INT32_MAX
  kernel<<<dim3((unsigned)grid), dim3(Traits::kNThreads), kSmem, stream>>>(p, num_m_blocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Largest query block of any sm80 configuration, for the host's grid-size check.
constexpr int kMaxFwdBlockM = 128;
constexpr int kMinFwdBlockM = 64;

}  // namespace flashcore::sm80
