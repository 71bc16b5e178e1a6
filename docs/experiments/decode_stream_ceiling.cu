// What the KV-cache kernel's loads can stream, with no attention around them (docs/PERFORMANCE.md, KV-cache
// decoding): the K and V caches of the 8 x 8k decode row (8 x 8192 keys x 8 kv heads x 128 dims, bf16, BSHD; 268 MB),
// read by blocks of 128 threads through cp.async stages of one 64-key K tile and one V tile of a kv head (64 rows of
// 256 bytes, 2 KB apart) -- the decode kernel's copies -- in several orders:
//   decode     block = (entry, kv head, split); split s takes tiles s, s + S, ...        (the kernel's order)
//   contiguous block = (entry, kv head, split); split s takes one contiguous run of tiles
//   stream-K   132 blocks, each an equal contiguous share of all (entry, kv head, tile)
//   one front  132 blocks; block c takes tiles c, c + 132, ... of the order (entry, tile, kv head)
// with 2, 3, 4 or 6 stages, one pipeline a block (__syncthreads a step) or one a warp (each warp its own 16 rows,
// __syncwarp); and the decode order through pages of 16 or 256 keys scattered over the cache (a fixed permutation
// computed by multiplication, no page-table reads). Median of 40 timed launches each, TB/s.
//   nvcc -arch=sm_90a -O3 -std=c++17 -o /tmp/dsc docs/experiments/decode_stream_ceiling.cu && /tmp/dsc
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      printf("CUDA %s at line %d\n", cudaGetErrorString(e), __LINE__);         \
      return 1;                                                                \
    }                                                                          \
  } while (0)

constexpr int kBatch = 8, kKeys = 8192, kHeads = 8, kRowBytes = kHeads * 256;  // a key row, every kv head
constexpr int kTilesPerPair = kKeys / 64;
enum Order { kDecode, kContiguous, kStreamK, kOneFront };

__device__ __forceinline__ void cp16(unsigned smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem));
}

// Byte offset of tile g's first row for its kv head: order (entry, kv head, tile) or (entry, tile, kv head).
__device__ __forceinline__ long tile_offset(long g, bool tile_major) {
  int b, h, t;
  if (!tile_major) {
    t = g % kTilesPerPair;
    h = (g / kTilesPerPair) % kHeads;
    b = g / kTilesPerPair / kHeads;
  } else {
    h = g % kHeads;
    t = (g / kHeads) % kTilesPerPair;
    b = g / kHeads / kTilesPerPair;
  }
  return ((long)b * kKeys + (long)t * 64) * kRowBytes + h * 256;
}

template <int kStages, bool kWarpPipelines>
__global__ void __launch_bounds__(128) stream(const char* K, const char* V, Order order, int splits, int page_rows,
                                              unsigned* sink) {
  extern __shared__ __align__(128) char smem[];
  const unsigned base = (unsigned)__cvta_generic_to_shared(smem);
  const long total = (long)kBatch * kHeads * kTilesPerPair;
  long first = 0, n = 0, step = 1;
  bool tile_major = false;
  if (order == kDecode || order == kContiguous) {
    const int pair = blockIdx.x / splits, s = blockIdx.x % splits;
    if (order == kDecode) {
      first = (long)pair * kTilesPerPair + s, step = splits, n = (kTilesPerPair - s + splits - 1) / splits;
    } else {
      first = (long)pair * kTilesPerPair + (long)s * kTilesPerPair / splits;
      n = (long)(s + 1) * kTilesPerPair / splits - (long)s * kTilesPerPair / splits;
    }
  } else if (order == kStreamK) {
    first = blockIdx.x * total / gridDim.x, n = (blockIdx.x + 1) * total / gridDim.x - first;
  } else {
    tile_major = true, first = blockIdx.x, step = gridDim.x, n = (total - blockIdx.x + gridDim.x - 1) / gridDim.x;
  }
  auto load = [&](long i) {
    const long off = tile_offset(first + i * step, tile_major);
    const long row0 = off / kRowBytes, head_bytes = off % kRowBytes;
    const unsigned stage = base + (i % kStages) * 32768;
    const int c0 = kWarpPipelines ? (threadIdx.x & ~31) * 8 : 0, c1 = kWarpPipelines ? c0 + 256 : 1024;
    for (int c = c0 + (kWarpPipelines ? threadIdx.x & 31 : threadIdx.x); c < c1; c += kWarpPipelines ? 32 : 128) {
      long row = row0 + (c >> 4);
      if (page_rows) {  // pages scattered by an odd multiplier modulo the (power-of-two) page count
        const long pages = (long)kBatch * kKeys / page_rows, page = row / page_rows;
        row = ((page * 2481) & (pages - 1)) * page_rows + row % page_rows;
      }
      const long src = row * kRowBytes + head_bytes + (c & 15) * 16;
      cp16(stage + c * 16, K + src);
      cp16(stage + 16384 + c * 16, V + src);
    }
  };
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < n) load(i);
    asm volatile("cp.async.commit_group;");
  }
  unsigned acc = 0;
  for (long i = 0; i < n; ++i) {
    if (i + kStages - 1 < n) load(i + kStages - 1);
    asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1));
    if (kWarpPipelines) __syncwarp(); else __syncthreads();
    acc ^= *(volatile unsigned*)(smem + (i % kStages) * 32768 + threadIdx.x * 4);
    if (kWarpPipelines) __syncwarp(); else __syncthreads();
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
  auto run = [&](auto kernel, int stages, int blocks, Order order, int splits, int page_rows) {
    const int smem = stages * 32768;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    return tbps([&] { kernel<<<blocks, 128, smem>>>(K, V, order, splits, page_rows, sink); });
  };
  struct Row { const char* name; Order order; int blocks, splits; };
  const Row rows[] = {{"decode, 2 splits", kDecode, 128, 2},   {"decode, 4 splits", kDecode, 256, 4},
                      {"contiguous, 2 splits", kContiguous, 128, 2}, {"stream-K", kStreamK, 132, 0},
                      {"one front", kOneFront, 132, 0}};
  printf("%-22s %6s | block pipeline, stages 2 / 3 / 4 / 6 | warp pipelines, stages 2 / 3 / 4 / 6\n", "order",
         "blocks");
  for (const Row& r : rows) {
    const bool six = r.blocks <= 132;  // 192 KiB of stages: one block an SM
    printf("%-22s %6d | %.3f %.3f %.3f %.3f | %.3f %.3f %.3f %.3f\n", r.name, r.blocks,
           run(stream<2, false>, 2, r.blocks, r.order, r.splits, 0), run(stream<3, false>, 3, r.blocks, r.order, r.splits, 0),
           run(stream<4, false>, 4, r.blocks, r.order, r.splits, 0),
           six ? run(stream<6, false>, 6, r.blocks, r.order, r.splits, 0) : 0.0,
           run(stream<2, true>, 2, r.blocks, r.order, r.splits, 0), run(stream<3, true>, 3, r.blocks, r.order, r.splits, 0),
           run(stream<4, true>, 4, r.blocks, r.order, r.splits, 0),
           six ? run(stream<6, true>, 6, r.blocks, r.order, r.splits, 0) : 0.0);
  }
  for (int page_rows : {0, 16, 256})
    printf("decode order, %s: 2 splits (128 blocks) %.3f, 4 splits (256 blocks) %.3f TB/s\n",
           page_rows ? (page_rows == 16 ? "pages of 16" : "pages of 256") : "dense",
           run(stream<2, false>, 2, 128, kDecode, 2, page_rows), run(stream<2, false>, 2, 256, kDecode, 4, page_rows));
  CK(cudaGetLastError());
  return 0;
}
