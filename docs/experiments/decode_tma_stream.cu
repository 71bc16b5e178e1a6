// What TMA streams of the 8 x 8k decode caches (K, V: (8, 8192, 8, 128) bf16, BSHD; 268 MB) in the KV-cache
// kernel's order (block = (entry, kv head, split), split s taking tiles s, s + S, ...), with no attention around the
// loads: the companion of decode_stream_ceiling.cu (cp.async) for docs/PERFORMANCE.md. Thread 0 keeps `stages`
// tiles of box_rows keys in flight (K and V, two 64-column boxes each, 128-byte swizzle), warp 0 waits for each
// tile's mbarrier and touches it, the block steps together. Boxes of 64 and 128 keys, 2-6 stages, 2/4/8 splits, with
// and without 256-byte L2 promotion; median TB/s of 30 launches.
//   nvcc -arch=sm_90a -O3 -std=c++17 -o /tmp/dts docs/experiments/decode_tma_stream.cu && /tmp/dts   (sm_90)
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%d %s\n", __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
constexpr int B = 8, S = 8192, H = 8, D = 128;
__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__global__ void __launch_bounds__(128) stream(const __grid_constant__ CUtensorMap mk, const __grid_constant__ CUtensorMap mv,
                                              int box_rows, int stages, int splits, int warps_consume, unsigned* sink) {
  extern __shared__ unsigned char raw[];
  __shared__ __align__(8) uint64_t full[8];
  unsigned char* sm = raw + ((1024 - (sa(raw) & 1023)) & 1023);
  const int pair = blockIdx.x / splits, s = blockIdx.x % splits, b = pair / H, h = pair % H;
  const int tiles = S / box_rows, n = (tiles - s + splits - 1) / splits;
  const uint32_t tile_bytes = box_rows * D * 2 * 2;
  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&full[i])));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  auto issue = [&](int i) {
    const int st = i % stages, t = s + i * splits;
    const uint32_t bar = sa(&full[st]);
    unsigned char* dst = sm + (size_t)st * tile_bytes;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(tile_bytes) : "memory");
    for (int kv = 0; kv < 2; ++kv)
      for (int span = 0; span < 2; ++span) {
        const CUtensorMap* m = kv ? &mv : &mk;
        asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                     ::"r"(sa(dst + kv * box_rows * 256 + span * box_rows * 128)), "l"((uint64_t)m), "r"(span * 64), "r"(t * box_rows), "r"(h), "r"(b), "r"(bar) : "memory");
      }
  };
  auto wait = [&](int i) {
    const uint32_t bar = sa(&full[i % stages]), par = (i / stages) & 1;
    uint32_t done = 0;
    while (!done) asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(par) : "memory");
  };
  unsigned acc = 0;
  if (threadIdx.x == 0) for (int i = 0; i < stages && i < n; ++i) issue(i);
  for (int i = 0; i < n; ++i) {
    if (threadIdx.x < 32 * warps_consume) {
      wait(i);
      acc ^= *(volatile unsigned*)(sm + (size_t)(i % stages) * tile_bytes + threadIdx.x * 4);
    }
    __syncthreads();
    if (threadIdx.x == 0 && i + stages < n) issue(i + stages);
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
int main() {
  using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* fn = nullptr; cudaDriverEntryPointQueryResult q{};
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  auto encode = reinterpret_cast<EncodeFn>(fn);
  const size_t half = (size_t)B * S * H * D * 2, bytes = 2 * half;
  void *K, *V; unsigned* sink;
  CHECK(cudaMalloc(&K, half)); CHECK(cudaMalloc(&V, half)); CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(K, 1, half)); CHECK(cudaMemset(V, 1, half));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int promo : {0, 2})
  for (int box_rows : {64, 128, 256}) {
    CUtensorMap mk, mv;
    const cuuint64_t dims[4] = {D, S, H, B};
    const cuuint64_t strides[3] = {(cuuint64_t)H * D * 2, (cuuint64_t)D * 2, (cuuint64_t)S * H * D * 2};
    const cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1}, es[4] = {1, 1, 1, 1};
    auto pr = promo == 0 ? CU_TENSOR_MAP_L2_PROMOTION_NONE : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
    if (encode(&mk, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, K, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, pr, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ||
        encode(&mv, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, V, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, pr, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)) { printf("encode failed\n"); return 1; }
    for (int stages : {2, 3, 4, 6}) {
      const int smem = stages * box_rows * D * 4 + 1024;
      if (smem > 227 * 1024) continue;
      CHECK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      printf("promo %d box %3d stages %d (%3d KiB):", promo, box_rows, stages, smem / 1024);
      for (int splits : {2, 4, 8}) {
        const int blocks = B * H * splits;
        std::vector<float> v;
        for (int r = 0; r < 35; ++r) { cudaEventRecord(a); stream<<<blocks, 128, smem>>>(mk, mv, box_rows, stages, splits, 1, sink); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); if (r >= 5) v.push_back(ms); }
        CHECK(cudaGetLastError());
        std::sort(v.begin(), v.end());
        printf("  %d splits %.3f", splits, bytes / v[v.size() / 2] / 1e9);
      }
      printf("\n");
    }
  }
  return 0;
}
