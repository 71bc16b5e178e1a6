// Asynchronous global -> shared copies (sm_80+), wrapped once.
// PTX ISA, "Data movement: cp.async" (section 9.7.9.25.3) and cp.async.commit_group / cp.async.wait_group.
#pragma once

#include <cstdint>

namespace flashcore::ptx {

// Copies 16 bytes, or writes 16 zero bytes when !valid (src-size 0: nothing is read from src, which must still
// be a mapped address; callers pass the tensor's base pointer then). .cg bypasses L1: K/V tiles are reused
// through shared memory, not L1.
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes));
}

// Closes the current group of cp.async operations (an empty group is legal and completes at once).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N committed groups are still in flight (this thread's copies only; a barrier is still
// needed before other threads read the data).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace flashcore::ptx
