// Thread-block clusters and distributed shared memory (sm_90), wrapped once.
// PTX ISA: special registers %clusterid, %cluster_ctarank, %cluster_nctarank (section 10); "barrier.cluster"
// (9.7.13.2); "mapa" (9.7.9.21); "st.async" (9.7.9.12); mbarrier.arrive / try_wait with .cluster scope and the
// shared::cluster state space (9.7.13.15).
//
// A kernel launched without a cluster dimension runs as clusters of one block: cluster_id_x() is blockIdx.x,
// cluster_rank() 0 and cluster_size() 1, so code that branches on cluster_size() > 1 works in both launches.
// Shared memory of another block of the cluster is addressed through a shared::cluster address (map_to_rank); a
// block may access it only while that block is running: each protocol below keeps the target resident (it waits
// for the data) and starts only after every block of the cluster has initialized its barriers (cluster_arrive,
// cluster_wait). The special registers are constant for a launch: plain (not volatile) asm lets the compiler read
// them once. Waits with cluster-scope acquire: mbarrier_wait<Scope::kCluster> (mbarrier.cuh).
#pragma once

#include <cstdint>

namespace flashcore::ptx {

__device__ __forceinline__ uint32_t cluster_id_x() {
  uint32_t v;
  asm("mov.u32 %0, %%clusterid.x;\n" : "=r"(v));
  return v;
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t v;
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(v));
  return v;
}

__device__ __forceinline__ uint32_t cluster_size() {
  uint32_t v;
  asm("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(v));
  return v;
}

// The cluster barrier, split: every thread of every block of the cluster arrives once (release: its earlier
// writes, e.g. barrier initialization) and later waits once (acquire), before it exits; between the two it may
// work. After its wait, a thread sees what every block did before arriving.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}

// The shared::cluster address of the variable at shared::cta address `addr` in the block of rank `rank`.
__device__ __forceinline__ uint32_t map_to_rank(uint32_t addr, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}

// The generic address of the object at generic address `ptr` (in this block's shared memory) in the block of rank
// `rank` ("mapa" without a state space: generic in, generic out). Plain loads through it read that block's shared
// memory (distributed shared memory), so the compiler schedules them like any other load; order them after a
// cluster_wait() that follows the owner's writes.
template <typename T>
__device__ __forceinline__ const T* map_generic_to_rank(const T* ptr, uint32_t rank) {
  uint64_t remote;
  asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(remote) : "l"(reinterpret_cast<uint64_t>(ptr)), "r"(rank));
  return reinterpret_cast<const T*>(remote);
}
// Arrives (release, cluster scope) on the mbarrier at shared::cluster address `remote_bar`, in another block.
__device__ __forceinline__ void mbarrier_arrive_remote(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}

// Stores 16 bytes into another block's shared memory and signals them (complete_tx, 16 bytes) on that block's
// mbarrier `remote_bar`; both addresses are shared::cluster addresses of the same block. The waiter sees the data
// once the barrier's phase completes, like a TMA load's.
__device__ __forceinline__ void st_async_v4(uint32_t remote_addr, const float (&v)[4], uint32_t remote_bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
          remote_addr),
      "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "r"(remote_bar)
      : "memory");
}

}  // namespace flashcore::ptx
