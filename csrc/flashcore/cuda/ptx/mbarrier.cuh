// Shared-memory transaction barriers (mbarrier, sm_90), wrapped once.
// PTX ISA "Parallel synchronization: mbarrier" (section 9.7.13.15): mbarrier.init, mbarrier.arrive,
// mbarrier.arrive.expect_tx, mbarrier.try_wait.parity; fence.mbarrier_init (9.7.13.4).
//
// Protocol used by the kernels: a barrier completes a phase when its expected arrivals have arrived and its
// expected transaction bytes (TMA copies signal them with complete_tx) have landed. Waiters track the phase
// parity they wait for; a fresh barrier counts as having completed the phase of parity 1, so a producer's first
// wait on an "empty" barrier with parity 1 passes at once.
#pragma once

#include <cstdint>

#include "ldmatrix.cuh"  // smem_addr

namespace flashcore::ptx {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes initialized barriers visible to the async proxy (TMA) and the other threads of the block.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrives once and adds `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Acquire scope of a wait: kCta for phases completed by this block's threads and its TMA copies, kCluster for
// phases completed by other blocks of the cluster (remote arrivals, st.async bytes), whose writes the waiter reads.
enum class Scope { kCta, kCluster };

// Blocks until the phase with parity `parity` has completed (try_wait suspends in hardware for a while between
// polls, so the loop does not spin hot). `bar` is a shared::cta address.
template <Scope kScope = Scope::kCta>
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  if constexpr (kScope == Scope::kCta) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
  } else {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
  }
}
template <Scope kScope = Scope::kCta>
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  mbarrier_wait<kScope>(smem_addr(bar), parity);
}

// Phase parity to wait for on an "empty" barrier before use number `use` of the resource it guards (a fresh
// barrier counts as having completed the phase of parity 1, so use 0 passes at once).
__device__ __forceinline__ uint32_t empty_parity(int use) { return (use & 1) ^ 1; }

}  // namespace flashcore::ptx
