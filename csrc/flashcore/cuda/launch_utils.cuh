// Host helpers shared by the kernel launchers.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "../switches.h"

namespace flashcore::cuda {

// The current device's index (the runtime's, which the callers' CUDAGuard set).
inline int current_device_index() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// The current device's bit in the launchers' per-device bit sets (0 past device 63: not cached, redone per call).
inline uint64_t current_device_bit() {
  const int device = current_device_index();
  return device < 64 ? (uint64_t{1} << device) : 0;
}

// Opts `kernel` in to `smem_bytes` of dynamic shared memory (needed above 48 KiB). The setting is per function
// and device, so it is made once per device; `configured` is the launcher's own static bit set.
template <typename Kernel>
inline void set_max_dynamic_smem_once(Kernel kernel, int smem_bytes, std::atomic<uint64_t>& configured) {
  const uint64_t bit = current_device_bit();
  if (bit != 0 && (configured.load(std::memory_order_acquire) & bit)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  configured.fetch_or(bit, std::memory_order_acq_rel);
}

// Programmatic dependent launch (ptx/grid_dependency.cuh) is used for a kernel only where the code of it that
// runs on the current device holds the griddepcontrol instructions, i.e. was compiled for a compute_90+ virtual
// architecture (grid_dependency.cuh compiles them out below sm_90). A GPU newer than every cubin of the build runs
// the mma.sync kernels JIT-compiled from their compute_80 PTX, which has no wait: launched with programmatic
// serialization, it could read its inputs before the previous kernel's writes land. Checked once per kernel and
// device (cudaFuncGetAttributes), kept in the launcher's static PdlSupport; FLASHCORE_PDL=0 turns PDL off
// (switches.h), so benchmarks can measure what it buys.
// Sm90CodeCheck caches, per kernel and device, whether the kernel's code that runs there is sm_90 code (PDL's
// griddepcontrol, the KV-cache kernel's TMA variant).
struct Sm90CodeCheck {
  std::atomic<uint64_t> checked{0};  // bit d: device d was checked (current_device_bit)
  std::atomic<uint64_t> capable{0};  // bit d: the kernel's code on device d was compiled for compute_90+
};
using PdlSupport = Sm90CodeCheck;

template <typename... Params>
inline bool runs_sm90_code(void (*kernel)(Params...), Sm90CodeCheck& check) {
  const uint64_t bit = current_device_bit();
  if (bit != 0 && (check.checked.load(std::memory_order_acquire) & bit))
    return (check.capable.load(std::memory_order_relaxed) & bit) != 0;
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const bool capable = at::cuda::getCurrentDeviceProperties()->major >= 9 && attr.ptxVersion >= 90;
  if (bit != 0) {
    if (capable) check.capable.fetch_or(bit, std::memory_order_relaxed);
    check.checked.fetch_or(bit, std::memory_order_acq_rel);
  }
  return capable;
}

template <typename... Params>
inline bool pdl_enabled(void (*kernel)(Params...), PdlSupport& support) {
  return pdl_allowed() && runs_sm90_code(kernel, support);
}

// Launches `kernel` on `stream` with programmatic stream serialization where pdl_enabled(): the kernel may begin
// before the previous kernel of the stream ends. Only for kernels that keep grid_dependency.cuh's invariant (no
// global memory access before wait_for_prior_grids()). Inside CUDA graph capture the dependency becomes a
// programmatic graph edge.
// With cluster_x > 1 the grid is launched in clusters of cluster_x consecutive blocks (gridDim.x a multiple of it).
template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), PdlSupport& pdl, dim3 grid, dim3 block, int smem_bytes,
                          cudaStream_t stream, unsigned cluster_x, Args&&... args) {
  cudaLaunchAttribute attr[2];
  unsigned num_attrs = 0;
  if (pdl_enabled(kernel, pdl)) {
    attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[num_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  if (cluster_x > 1) {
    attr[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[num_attrs].val.clusterDim.x = cluster_x;
    attr[num_attrs].val.clusterDim.y = 1;
    attr[num_attrs].val.clusterDim.z = 1;
    ++num_attrs;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = (size_t)smem_bytes;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = num_attrs;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// How many clusters of `cluster_x` blocks of `kernel`, each block with `smem_bytes` of dynamic shared memory, can be
// resident on the current device at once (cudaOccupancyMaxActiveClusters: clusters live within one GPC, so this is
// not simply SMs / cluster_x). A device or configuration that cannot launch such clusters reports an error there:
// then none is resident, and the error is cleared so that it does not surface at a later check. Not cached: the
// callers keep their answers (max_active_clusters below; the KV-cache kernel's per residency). The kernel's dynamic
// shared memory limit must already be set.
template <typename... Params>
inline int query_max_active_clusters(void (*kernel)(Params...), dim3 block, int smem_bytes, unsigned cluster_x) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster_x;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(cluster_x);
  config.blockDim = block;
  config.dynamicSmemBytes = (size_t)smem_bytes;
  config.attrs = attr;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();
    clusters = 0;
  }
  return clusters;
}

// query_max_active_clusters for a launcher whose kernel always takes the same shared memory: queried once per
// device and cluster size, kept in the launcher's static ClusterOccupancy (devices 0..15; others are queried per
// call).
struct ClusterOccupancy {
  static constexpr int kMaxCluster = 8;
  std::atomic<int> clusters[16][kMaxCluster + 1] = {};  // 0: not queried yet
};

template <typename... Params>
inline int max_active_clusters(void (*kernel)(Params...), dim3 block, int smem_bytes, unsigned cluster_x,
                               ClusterOccupancy& cache) {
  TORCH_CHECK(cluster_x >= 1 && (int)cluster_x <= ClusterOccupancy::kMaxCluster, "flashcore: bad cluster size");
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 16) {
    const int known = cache.clusters[device][cluster_x].load(std::memory_order_relaxed);
    if (known > 0) return known - 1;
  }
  const int clusters = query_max_active_clusters(kernel, block, smem_bytes, cluster_x);
  if (device < 16) cache.clusters[device][cluster_x].store(clusters + 1, std::memory_order_relaxed);
  return clusters;
}

}  // namespace flashcore::cuda
