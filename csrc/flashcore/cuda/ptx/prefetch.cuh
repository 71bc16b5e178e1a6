// Cache prefetch of global memory, wrapped once.
// PTX ISA, "Data Movement and Conversion Instructions: prefetch, prefetchu" (section 9.7.9.15; sm_20+): brings the
// line holding the address into the named cache level, with no register result to wait for.
#pragma once

namespace flashcore::ptx {

__device__ __forceinline__ void prefetch_l1(const void* gmem) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(gmem));
}

}  // namespace flashcore::ptx
