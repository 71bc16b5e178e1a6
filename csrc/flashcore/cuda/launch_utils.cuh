// Host helpers shared by the kernel launchers.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

namespace flashcore::cuda {

// Opts `kernel` in to `smem_bytes` of dynamic shared memory (needed above 48 KiB). The setting is per function
// and device, so it is made once per device; `configured` is the launcher's own static bit set.
template <typename Kernel>
inline void set_max_dynamic_smem_once(Kernel kernel, int smem_bytes, std::atomic<uint64_t>& configured) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (configured.load(std::memory_order_acquire) & bit)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  configured.fetch_or(bit, std::memory_order_acq_rel);
}

}  // namespace flashcore::cuda
