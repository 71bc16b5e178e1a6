// How fast can one SM pull tiles from L2 into shared memory with TMA, and how late does the first box land when
// several are in flight? A standalone probe (no torch, no flashcore code). It tells whether a small-grid forward
// (1x8x512x64: ~0.9 us per 32 KB key/value tile of one block, whatever the number of blocks, ~19 bytes a cycle if
// the loads set the pace) is bound by its loads; on the H100 it is not (docs/PERFORMANCE.md), and the first-box
// latency is why the compact forward throttles its loads (fwd_sm90_producer.cuh).
//
// Each block streams `tiles` boxes of (64 columns x box_rows rows) fp16, 128-byte swizzle (the forward kernel's
// K/V boxes), through a ring of `stages` shared-memory buffers: one thread keeps `stages` loads in flight, each
// completing on its own mbarrier, and re-issues a buffer as soon as its bytes have landed (nothing consumes them).
// All blocks read one 8 MB tensor (L2-resident after the warm-up launch) at offsets that depend on blockIdx.x / share
// (share 8: eight blocks read the same rows, like the query blocks of one head). Reported per
// configuration: bytes per cycle per SM (from the block's clock64 span, median over blocks) and the aggregate rate
// (bytes of all blocks over the kernel's event time).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a docs/experiments/tma_ingest.cu -o tma_ingest && ./tma_ingest
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));      \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

constexpr int kCols = 64;            // fp16 columns of a box: 128 bytes, one swizzle span
constexpr int kRows = 64 * 1024;     // rows of the source tensor: 8 MB
constexpr int kMaxStages = 8;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__global__ void __launch_bounds__(128, 1)
    ingest(const __grid_constant__ CUtensorMap map, int box_rows, int stages, int tiles, int share,
           long long* cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  // 128-byte-swizzled boxes need 1024-byte-aligned destinations; the launch adds 1024 bytes of slack.
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t box_bytes = (uint32_t)box_rows * kCols * 2;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int rows_per_block = tiles * box_rows;
  // `share` consecutive blocks read the same rows, as the query blocks of one head read its K/V.
  const long long group = blockIdx.x / share;
  const int row_base = (int)((group * 7919LL * box_rows) % (kRows - rows_per_block + 1)) / box_rows * box_rows;
  auto issue = [&](int tile) {
    const int s = tile % stages;
    const uint32_t bar = smem_u32(&full[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(box_bytes) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem_u32(smem + (size_t)s * box_bytes)), "l"(reinterpret_cast<uint64_t>(&map)), "r"(0),
        "r"(row_base + tile * box_rows), "r"(bar)
        : "memory");
  };
  auto wait = [&](int tile) {
    const uint32_t bar = smem_u32(&full[tile % stages]);
    const uint32_t parity = (uint32_t)((tile / stages) & 1);
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    }
  };
  const long long t0 = clock64();
  for (int t = 0; t < stages && t < tiles; ++t) issue(t);
  long long first = 0;
  for (int t = 0; t < tiles; ++t) {
    wait(t);
    if (t == 0) first = clock64() - t0;
    if (t + stages < tiles) issue(t + stages);
  }
  cycles[2 * blockIdx.x] = clock64() - t0;
  cycles[2 * blockIdx.x + 1] = first;
#endif
}

// One launch after a warm-up launch (which also fills L2); prints one row of the table.
void run_case(const CUtensorMap& map, int box_rows, int stages, int boxes, int blocks, int share, int smem,
              long long* cycles) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  ingest<<<blocks, 128, smem>>>(map, box_rows, stages, boxes, share, cycles);
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(a));
  ingest<<<blocks, 128, smem>>>(map, box_rows, stages, boxes, share, cycles);
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  CHECK(cudaGetLastError());
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  std::vector<long long> both(2 * blocks), c(blocks), f(blocks);
  CHECK(cudaMemcpy(both.data(), cycles, 2 * blocks * sizeof(long long), cudaMemcpyDeviceToHost));
  for (int i = 0; i < blocks; ++i) c[i] = both[2 * i], f[i] = both[2 * i + 1];
  std::sort(c.begin(), c.end());
  std::sort(f.begin(), f.end());
  const double bytes = (double)boxes * box_rows * kCols * 2;
  std::printf("%9d %7d %6d %6d %6d %12.1f %14.2f %10.1f %12lld\n", box_rows, stages, boxes, blocks, share,
              bytes / (double)c[blocks / 2], bytes * blocks / (ms * 1e-3) / 1e12, ms * 1e3, f[blocks / 2]);
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
}

int main() {
  int dev = 0, sms = 0, clock_khz = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  if (prop.major != 9) {
    std::printf("needs compute capability 9.x (TMA); this GPU is %d.%d\n", prop.major, prop.minor);
    return 0;
  }

  __half* src = nullptr;
  CHECK(cudaMalloc(&src, (size_t)kRows * kCols * sizeof(__half)));
  CHECK(cudaMemset(src, 0, (size_t)kRows * kCols * sizeof(__half)));
  long long* cycles = nullptr;
  CHECK(cudaMalloc(&cycles, 2048 * sizeof(long long)));

  using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (fn == nullptr || q != cudaDriverEntryPointSuccess) {
    std::printf("cuTensorMapEncodeTiled not found\n");
    return 1;
  }
  auto encode = reinterpret_cast<EncodeFn>(fn);

  std::printf("%s, %d SMs, %.2f GHz (nominal); TMA loads of 64 x rows fp16 boxes, 128-byte swizzle, from L2\n",
              prop.name, sms, clock_khz / 1e6);
  std::printf("%9s %7s %6s %6s %6s %12s %14s %10s %12s\n", "box rows", "stages", "boxes", "blocks", "share",
              "B/clk/SM", "aggregate TB/s", "kernel us", "1st box clk");
  for (int box_rows : {64, 128, 256}) {
    CUtensorMap map{};
    const cuuint64_t dims[2] = {(cuuint64_t)kCols, (cuuint64_t)kRows};
    const cuuint64_t strides[1] = {(cuuint64_t)kCols * sizeof(__half)};
    const cuuint32_t box[2] = {(cuuint32_t)kCols, (cuuint32_t)box_rows};
    const cuuint32_t elem_strides[2] = {1, 1};
    if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, src, dims, strides, box, elem_strides,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      std::printf("tensor map encoding failed for %d rows\n", box_rows);
      continue;
    }
    const int box_bytes = box_rows * kCols * 2;
    for (int stages : {1, 2, 4, 8}) {
      const int smem = stages * box_bytes + 1024;
      if (smem > 227 * 1024) continue;
      CHECK(cudaFuncSetAttribute(ingest, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      // 128 KB a block: what one 1x8x512x64 block loads (K and V, 4 tiles); 2 MB: the steady rate.
      // share 8: groups of 8 blocks read the same rows (1x8x512x64's 8 query blocks of a head).
      for (int block_kb : {128, 2048}) {
        for (int share : {1, 8}) {
          if (block_kb == 2048 && share == 8) continue;
          for (int blocks : {1, 8, 32, 64, sms}) {
            if (share > blocks) continue;
            run_case(map, box_rows, stages, block_kb * 1024 / box_bytes, blocks, share, smem, cycles);
          }
        }
      }
    }
  }
  CHECK(cudaFree(src));
  CHECK(cudaFree(cycles));
  return 0;
}
