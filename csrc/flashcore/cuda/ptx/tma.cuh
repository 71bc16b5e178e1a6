// Tensor memory accelerator (TMA) loads, stores and reductions, sm_90, wrapped once.
// PTX ISA "Data movement: cp.async.bulk.tensor" (section 9.7.9.25.5.1) and "prefetch.tensormap" (9.7.9.15).
// A 4-D tiled load copies one box of the tensor described by a CUtensorMap (built on the host, passed as a
// __grid_constant__ kernel parameter) into shared memory and signals the bytes on an mbarrier (complete_tx).
// Elements outside the tensor are written as zeros, so tails need no predication.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "ldmatrix.cuh"  // smem_addr

namespace flashcore::ptx {

// Coordinates are element indices, innermost first: (column, row, head, batch).
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Stores one box from shared memory (in the tensor map's swizzle) into the tensor, as one bulk-group operation
// of this thread; elements outside the tensor are not written. PTX ISA "cp.async.bulk.tensor" (9.7.9.25.5.1),
// shared::cta to global direction; completion through the bulk async-group (bulk_commit_group / wait below).
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* smem_src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// Adds a box of fp32 elements from shared memory into a 2-D tensor in global memory (element-wise atomic in L2),
// as one bulk-group operation of this thread. PTX ISA "cp.reduce.async.bulk.tensor" (9.7.9.25.5.2) and the
// bulk async-group commit/wait (9.7.9.25.6.2-3). The shared source uses the tensor map's swizzle.
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap* map, const void* smem_src, int c0, int c1) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(smem_src)), "r"(c0), "r"(c1)
      : "memory");
}
// The same into a 4-D tensor at (c0, 0, 0, c3): the dQ accumulator's interleaved-row view
// (sm90::make_tensor_map_f32_rows_interleaved), whose middle coordinates are always 0. Immediate coordinates keep
// the dQ writer (24 registers) from spilling.
__device__ __forceinline__ void tma_reduce_add_4d_at0(const CUtensorMap* map, const void* smem_src, int c0, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, 0, 0, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(smem_src)), "r"(c0), "r"(c3)
      : "memory");
}
// Adds `bytes` (a multiple of 16; both addresses 16-byte aligned) of contiguous fp32 values from shared memory to
// global memory (element-wise, in L2), as one bulk-group operation of this thread, no tensor map. PTX ISA
// "cp.reduce.async.bulk" (9.7.9.25.4.2), .global.shared::cta.bulk_group.add.f32.
__device__ __forceinline__ void bulk_reduce_add_f32(float* global_dst, const float* smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(global_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's bulk groups are incomplete (their global writes done).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy (TMA) accesses to
// the same addresses, once a barrier has ordered the threads. PTX ISA "membar/fence" (9.7.13.4), fence.proxy.async.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Pulls the descriptor into the TMA unit's cache before the first load that uses it.
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

}  // namespace flashcore::ptx
