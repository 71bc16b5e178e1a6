// Throughput of the special-function (MUFU) forms the forward's softmax uses, per SM and clock (docs/PERFORMANCE.md,
// softcap): ex2.approx.f32, tanh.approx.f32, tanh.approx.f16x2 / bf16x2 (two results an instruction), and
// ex2 + tanh interleaved. Each thread runs 8 independent chains; 4 warps an SMSP; results per SM per clock.
//   nvcc -arch=sm_90a -O3 -o /tmp/mufu docs/experiments/mufu_rate.cu && /tmp/mufu
#include <cstdio>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)

constexpr int kIters = 4096, kChains = 8;

__device__ __forceinline__ float ex2(float x) { float y; asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float th(float x) { float y; asm volatile("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ unsigned th2h(unsigned x) { unsigned y; asm volatile("tanh.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x)); return y; }
__device__ __forceinline__ unsigned th2b(unsigned x) { unsigned y; asm volatile("tanh.approx.bf16x2 %0, %1;" : "=r"(y) : "r"(x)); return y; }

// mode 0: ex2 f32, 1: tanh f32, 2: tanh f16x2, 3: tanh bf16x2, 4: ex2 + tanh f32 alternating
template <int kMode>
__global__ void run(float* out, long long* clocks) {
  float f[kChains];
  unsigned u[kChains];
  for (int c = 0; c < kChains; ++c) { f[c] = -0.001f * (threadIdx.x + c); u[c] = 0x3c003c00u + c; }
  __syncthreads();
  long long t0 = clock64();
#pragma unroll 1
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (kMode == 0) f[c] = ex2(f[c]);
      if constexpr (kMode == 1) f[c] = th(f[c]);
      if constexpr (kMode == 2) u[c] = th2h(u[c]);
      if constexpr (kMode == 3) u[c] = th2b(u[c]);
      if constexpr (kMode == 4) f[c] = (c & 1) ? th(f[c]) : ex2(f[c]);
    }
  }
  __syncthreads();
  long long t1 = clock64();
  float acc = 0.f;
  for (int c = 0; c < kChains; ++c) acc += f[c] + __uint_as_float(u[c]);
  if (acc == 1234.5f) out[0] = acc;
  if (threadIdx.x == 0) clocks[blockIdx.x] = t1 - t0;
}

template <int kMode>
int measure(const char* name, int results_per_op) {
  float* out; long long* clocks;
  CK(cudaMalloc(&out, 4)); CK(cudaMalloc(&clocks, 8 * 132));
  const int threads = 512;  // 16 warps: 4 an SMSP
  run<kMode><<<132, threads>>>(out, clocks);
  CK(cudaDeviceSynchronize());
  run<kMode><<<132, threads>>>(out, clocks);
  CK(cudaGetLastError());
  long long c[132];
  CK(cudaMemcpy(c, clocks, sizeof c, cudaMemcpyDeviceToHost));
  long long mx = 0;
  for (int i = 0; i < 132; ++i) mx = c[i] > mx ? c[i] : mx;
  const double ops = (double)threads * kIters * kChains;
  printf("%-24s %6.2f instructions / SM / clock, %6.2f results / SM / clock\n", name, ops / mx,
         ops * results_per_op / mx);
  CK(cudaFree(out)); CK(cudaFree(clocks));
  return 0;
}

int main() {
  if (measure<0>("ex2.approx.f32", 1)) return 1;
  if (measure<1>("tanh.approx.f32", 1)) return 1;
  if (measure<2>("tanh.approx.f16x2", 2)) return 1;
  if (measure<3>("tanh.approx.bf16x2", 2)) return 1;
  if (measure<4>("ex2 + tanh alternating", 1)) return 1;
  return 0;
}
