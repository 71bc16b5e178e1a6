// Special-function unit (MUFU) approximations, wrapped once.
// PTX ISA, "Floating Point Instructions: tanh" (tanh.approx.f32, PTX 7.0, sm_75+): one MUFU.TANH, maximum relative
// error about 2^-11, which is below the rounding of the bf16/fp16 probabilities it feeds.
#pragma once

namespace flashcore::ptx {

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flashcore::ptx
