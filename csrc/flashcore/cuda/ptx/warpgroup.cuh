// Warpgroup-level register reallocation and named barriers, wrapped once.
// PTX ISA "setmaxnreg" (section 9.7.17.1) and "bar.sync / barrier" (9.7.13.1).
#pragma once

#include <cstdint>

namespace flashcore::ptx {

// Every warp of a warpgroup must execute these together. The producer warpgroup gives registers back
// (dec) so that the consumer warpgroups, which hold the S and O accumulators, can take them (inc).
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Registers a thread of a `threads`-thread block gets at launch under __launch_bounds__(threads, 1): the 64K
// register file divided evenly, at most 255, in setmaxnreg's granularity of 8. setmaxnreg only moves registers
// within this allocation; a split asking for more makes setmaxnreg.inc wait forever.
constexpr int launch_regs_per_thread(int threads) {
  return (65536 / threads < 255 ? 65536 / threads : 255) / 8 * 8;
}

// This thread's warpgroup index (tid / 128), broadcast from lane 0 so that the compiler knows it is warp-uniform
// (shfl.sync with a constant source lane, PTX ISA 9.7.8.6). Plain tid >> 7 is a per-thread value: every wgmma
// descriptor offset by it was built in vector registers and moved to uniform registers (R2UR) before each
// wgmma; uniform, the descriptors stay in the uniform datapath (one UIADD3 a wgmma operand).
__device__ __forceinline__ int warpgroup_index(int tid) { return __shfl_sync(0xffffffffu, tid >> 7, 0); }

// Synchronizes `threads` threads (a multiple of 32) on hardware barrier `id` (1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Signals hardware barrier `id` without waiting: the barrier completes when `threads` threads have arrived or
// synced on it (bar.arrive, same section).
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Stores (a, b) to shared memory at smem_addr where pred holds (st.shared, PTX ISA 9.7.9.10), as a scheduling
// anchor: ptxas keeps a later wgmma.wait_group (WARPGROUP.DEPBAR) behind this memory operation, and the store
// behind the instructions that compute a and b. Without it ptxas hoists such a wait to the top of its basic
// block, above independent work it was meant to follow (fwd_sm90_consumer.cuh: the softmax under a P V).
__device__ __forceinline__ void store_before_wait(uint32_t smem_addr, float a, float b, bool pred) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.u32 p, %3, 0;\n"
      "@p st.shared.v2.f32 [%0], {%1, %2};\n"
      "}\n" ::"r"(smem_addr),
      "f"(a), "f"(b), "r"((uint32_t)pred)
      : "memory");
}

}  // namespace flashcore::ptx
