// Flags and counters in global memory between blocks (of one grid, or of two overlapping grids), wrapped once:
//   a turn-taking flag: a thread waits (acquire, GPU scope) until the flag holds its turn, and later hands the turn
//   on (release, GPU scope); the deterministic backwards order their dQ additions with it
//   (sm90/bwd_sm90_producer.cuh, sm80/bwd_sm80_kernel.cuh);
//   a countdown: writers subtract one once their part is done and released, a reader waits for zero (acquire);
//   the Hopper backward's dQ tiles tell the overlapping post-pass they are whole (bwd_dq_convert.cu).
// PTX ISA "Data movement: ld" / "st" with .acquire / .release and .gpu scope (9.7.9.8, 9.7.9.10; memory consistency
// model, section 8; sm_70+), "red" (9.7.13.6, sm_70+), "nanosleep" (9.7.13.12, sm_70+), %globaltimer (10.31), and
// "membar/fence" (9.7.13.4): fence.proxy.async (sm_90) orders these generic-proxy accesses with the thread's bulk
// (async-proxy) reductions on either side.
#pragma once

#include <cstdint>
#include <cstdio>

namespace flashcore::ptx {

__device__ __forceinline__ int load_acquire_gpu(const int* flag) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void store_release_gpu(int* flag, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(value) : "memory");
}

// Spins until *flag == turn; the thread's later accesses follow what the flag's writer did before its release.
__device__ __forceinline__ void wait_until_equal(const int* flag, int turn) {
  while (load_acquire_gpu(flag) != turn) {
  }
}

// sm_90 (a no-op elsewhere: only the Hopper kernels, built for sm_90a, call these three).
__device__ __forceinline__ void fence_proxy_async_global() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// The same for a thread whose additions are bulk reductions (async proxy): wait, then order them after the flag.
__device__ __forceinline__ void wait_for_turn(const int* flag, int turn) {
  wait_until_equal(flag, turn);
  fence_proxy_async_global();
}

// Hands the turn on: the thread's completed bulk reductions (bulk_wait_group<0> first) happen before the store.
__device__ __forceinline__ void pass_turn(int* flag, int next) {
  fence_proxy_async_global();
  store_release_gpu(flag, next);
}

// Orders everything this thread did before, its completed bulk reductions included (bulk_wait_group<0> first),
// before its later relaxed writes at GPU scope (a release pattern: proxy fence, then fence.acq_rel.gpu).
__device__ __forceinline__ void release_bulk_writes_gpu() {
  fence_proxy_async_global();
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}

// Subtracts one from a countdown (relaxed: release_bulk_writes_gpu before it orders what it announces).
__device__ __forceinline__ void count_down_relaxed(int* counter) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], -1;\n" ::"l"(counter) : "memory");
}

// The GPU's global nanosecond timer (PTX ISA "Special registers: %globaltimer", 10.31).
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
  return t;
}

// Spins (backing off with nanosleep: the writers may be a whole block's lifetime away) until *counter == 0; the
// thread's later accesses follow what every writer did before its count_down. After kCountdownTimeoutNs of real
// time (%globaltimer: nanosleep's length is only a hint) it reports and traps: a counter that never reaches zero is
// a bug, and a launch failure that says so is better than a hung process. The limit is far above any block's
// lifetime (tens of ms at 512k keys), also under compute-sanitizer's slowdown.
constexpr uint64_t kCountdownTimeoutNs = 120ull * 1000 * 1000 * 1000;

__device__ __forceinline__ void wait_until_zero(const int* counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  if (load_acquire_gpu(counter) == 0) return;
  const uint64_t start = global_timer_ns();
  for (uint32_t spins = 0; load_acquire_gpu(counter) != 0; ++spins) {
    __nanosleep(spins < 64 ? 32 : 1024);
    if ((spins & 1023) == 0 && global_timer_ns() - start > kCountdownTimeoutNs) {
      printf("flashcore: a countdown at %p still reads %d after 120 s; a kernel that should count it down did not\n",
             counter, load_acquire_gpu(counter));
      __trap();
    }
  }
#endif
}

}  // namespace flashcore::ptx
