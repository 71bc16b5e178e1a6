// Programmatic dependent launch (PDL), device side, wrapped once.
// PTX ISA, "Parallel Synchronization and Communication Instructions: griddepcontrol" (PTX 7.8, sm_90+).
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization (cuda::launch_kernel) may start while
// the previous kernel of its stream is still running; its blocks then do their setup (barrier init, descriptor
// prefetch) in that kernel's shadow.
//
// Invariant of every kernel launched that way: no global memory access (read or write) before
// wait_for_prior_grids(), which returns once the previous grids have completed and their writes are visible.
// One exception, the dQ post-pass behind the Hopper backward (bwd_dq_convert.cu): it reads only what that kernel
// has published through countdowns (global_flag.cuh), writes only memory that kernel never touches, and keeps its
// own grid from completing before that kernel does. It relies on the backward kernel being launched plainly (its
// start, hence its trigger, then follows the pre-pass that sets the countdowns).
// Without a programmatic dependency (older GPUs' launch path, a plain launch) both calls are no-ops.
#pragma once

namespace flashcore::ptx {

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel of the stream begin launching once every block of this grid has called this (or exited).
// It orders nothing: the next kernel's own wait_for_prior_grids() still waits for this grid to complete.
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace flashcore::ptx
