// Whether an L2 prefetch-size hint on the KV-cache kernel's cp.async copies, or register loads instead of cp.async,
// stream the decode caches faster (docs/PERFORMANCE.md, KV-cache decoding). Same caches and order as
// decode_stream_ceiling.cu (8 x 8192 keys x 8 kv heads x 128 dims, bf16, BSHD, 268 MB; block = (entry, kv head,
// split), split s takes 64-key tiles s, s + S, ...; a stage = one K and one V tile of 64 rows of 256 bytes, 2 KB
// apart), and pages of 16 / 256 keys scattered by a fixed permutation. Loaders:
//   cp.async      cp.async.cg 16 B (the kernel's)
//   +L2::128B     cp.async.cg.shared.global.L2::128B
//   +L2::256B     cp.async.cg.shared.global.L2::256B
//   ld.global     ld.global.nc.L1::no_allocate.v4 of a whole stage into registers, then st.shared (register stages)
// Median of 40 timed launches, TB/s, as decode_stream_ceiling.cu.
//   nvcc -arch=sm_90a -O3 -std=c++17 -o dlp docs/experiments/decode_l2_prefetch.cu && ./dlp
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#define CK(x)                                                          \
  do {                                                                 \
    cudaError_t e = (x);                                               \
    if (e != cudaSuccess) {                                            \
      printf("CUDA %s at line %d\n", cudaGetErrorString(e), __LINE__); \
      return 1;                                                        \
    }                                                                  \
  } while (0)

constexpr int kBatch = 8, kKeys = 8192, kHeads = 8, kRowBytes = kHeads * 256;
constexpr int kTilesPerPair = kKeys / 64;
enum Hint { kNone, kL2_128, kL2_256, kRegisters };

template <int kHint>
__device__ __forceinline__ void cp16(unsigned smem, const void* gmem) {
  if constexpr (kHint == kL2_128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(smem), "l"(gmem));
  else if constexpr (kHint == kL2_256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(smem), "l"(gmem));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem));
}

// Byte offset in K (or V) of chunk c (16 B) of a stage's tile i: 64 rows x 16 chunks.
__device__ __forceinline__ long chunk_src(long first, long i, int splits, int c, int page_rows) {
  const long g = first + i * splits;
  const int t = g % kTilesPerPair, h = (g / kTilesPerPair) % kHeads, b = g / kTilesPerPair / kHeads;
  long row = (long)b * kKeys + t * 64 + (c >> 4);
  if (page_rows) {
    const long pages = (long)kBatch * kKeys / page_rows, page = row / page_rows;
    row = ((page * 2481) & (pages - 1)) * page_rows + row % page_rows;
  }
  return row * kRowBytes + h * 256 + (c & 15) * 16;
}

template <int kStages, int kHint, int kThreads>
__global__ void __launch_bounds__(kThreads) stream(const char* K, const char* V, int splits, int page_rows,
                                                   unsigned* sink) {
  extern __shared__ __align__(128) char smem[];
  const unsigned base = (unsigned)__cvta_generic_to_shared(smem);
  const int pair = blockIdx.x / splits, s = blockIdx.x % splits;
  const long first = (long)pair * kTilesPerPair + s;
  const long n = (kTilesPerPair - s + splits - 1) / splits;
  constexpr int kPer = 1024 / kThreads;  // chunks a thread copies of each of K and V
  unsigned acc = 0;
  if constexpr (kHint != kRegisters) {
    auto load = [&](long i) {
      const unsigned stage = base + (i % kStages) * 32768;
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int c = threadIdx.x + u * kThreads;
        const long src = chunk_src(first, i, splits, c, page_rows);
        cp16<kHint>(stage + c * 16, K + src);
        cp16<kHint>(stage + 16384 + c * 16, V + src);
      }
    };
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < n) load(i);
      asm volatile("cp.async.commit_group;");
    }
    for (long i = 0; i < n; ++i) {
      if (i + kStages - 1 < n) load(i + kStages - 1);
      asm volatile("cp.async.commit_group;");
      asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1));
      __syncthreads();
      acc ^= *(volatile unsigned*)(smem + (i % kStages) * 32768 + threadIdx.x * 4);
      __syncthreads();
    }
  } else {
    // kStages - 1 stages in registers, one stage in shared memory: load stage i + kStages - 1 while storing i.
    constexpr int kRegStages = kStages - 1;
    uint4 r[kRegStages][2 * kPer];
    auto load = [&](long i, uint4 (&dst)[2 * kPer]) {
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int c = threadIdx.x + u * kThreads;
        const long src = chunk_src(first, i, splits, c, page_rows);
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(dst[u].x), "=r"(dst[u].y), "=r"(dst[u].z), "=r"(dst[u].w)
                     : "l"(K + src));
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(dst[kPer + u].x), "=r"(dst[kPer + u].y), "=r"(dst[kPer + u].z), "=r"(dst[kPer + u].w)
                     : "l"(V + src));
      }
    };
#pragma unroll
    for (int j = 0; j < kRegStages; ++j)
      if (j < n) load(j, r[j]);
    for (long i = 0; i < n; i += kRegStages) {
#pragma unroll
      for (int j = 0; j < kRegStages; ++j) {
        if (i + j < n) {
          uint4* st = reinterpret_cast<uint4*>(smem);
#pragma unroll
          for (int u = 0; u < 2 * kPer; ++u) st[threadIdx.x + u * kThreads] = r[j][u];
          if (i + j + kRegStages < n) load(i + j + kRegStages, r[j]);
          __syncthreads();
          acc ^= *(volatile unsigned*)(smem + threadIdx.x * 4);
          __syncthreads();
        }
      }
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

int main() {
  const size_t half = (size_t)kBatch * kKeys * kRowBytes, bytes = 2 * half;
  char *K, *V;
  unsigned* sink;
  CK(cudaMalloc(&K, half));
  CK(cudaMalloc(&V, half));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(K, 1, half));
  CK(cudaMemset(V, 1, half));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto tbps = [&](auto launch) {
    std::vector<float> ms;
    for (int r = 0; r < 45; ++r) {
      cudaEventRecord(a);
      launch();
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float t;
      cudaEventElapsedTime(&t, a, b);
      if (r >= 5) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return bytes / ms[ms.size() / 2] / 1e9;
  };
  auto run = [&](auto kernel, int stages, int threads, int splits, int page_rows) {
    const int smem = stages * 32768;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    return tbps([&] { kernel<<<kBatch * kHeads * splits, threads, smem>>>(K, V, splits, page_rows, sink); });
  };
  printf("%-12s %-9s %6s | cp.async 2/3/4 stages | +L2::128B 2/3/4 | +L2::256B 2/3/4 | ld.global 2/3/4 (256 thr)\n",
         "cache", "splits", "blocks");
  for (int page_rows : {0, 16, 256})
    for (int splits : {2, 4}) {
      printf("%-12s %-9d %6d | %.3f %.3f %.3f | %.3f %.3f %.3f | %.3f %.3f %.3f | %.3f %.3f %.3f\n",
             page_rows ? (page_rows == 16 ? "pages 16" : "pages 256") : "dense", splits, kBatch * kHeads * splits,
             run(stream<2, kNone, 128>, 2, 128, splits, page_rows), run(stream<3, kNone, 128>, 3, 128, splits, page_rows),
             run(stream<4, kNone, 128>, 4, 128, splits, page_rows),
             run(stream<2, kL2_128, 128>, 2, 128, splits, page_rows),
             run(stream<3, kL2_128, 128>, 3, 128, splits, page_rows),
             run(stream<4, kL2_128, 128>, 4, 128, splits, page_rows),
             run(stream<2, kL2_256, 128>, 2, 128, splits, page_rows),
             run(stream<3, kL2_256, 128>, 3, 128, splits, page_rows),
             run(stream<4, kL2_256, 128>, 4, 128, splits, page_rows),
             run(stream<2, kRegisters, 256>, 1, 256, splits, page_rows),
             run(stream<3, kRegisters, 256>, 1, 256, splits, page_rows),
             run(stream<4, kRegisters, 256>, 1, 256, splits, page_rows));
    }
  CK(cudaGetLastError());
  return 0;
}
