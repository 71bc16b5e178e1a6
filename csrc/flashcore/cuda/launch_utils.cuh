// Host helpers shared by the kernel launchers.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

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

// Programmatic dependent launch (ptx/grid_dependency.cuh) on compute capability 9.0 and newer, unless
// FLASHCORE_PDL=0 (read per call, like the other switches, so benchmarks can measure what it buys).
inline bool pdl_enabled() {
  const char* env = std::getenv("FLASHCORE_PDL");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  return at::cuda::getCurrentDeviceProperties()->major >= 9;
}

// Launches `kernel` on `stream` with programmatic stream serialization where pdl_enabled(): the kernel may begin
// before the previous kernel of the stream ends. Only for kernels that keep grid_dependency.cuh's invariant (no
// global memory access before wait_for_prior_grids()). Inside CUDA graph capture the dependency becomes a
// programmatic graph edge.
template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, int smem_bytes, cudaStream_t stream,
                          Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = (size_t)smem_bytes;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashcore::cuda
