// Does compute-sanitizer racecheck model the Hopper forward's barrier pattern? Warpgroups 0-2 (384 threads) take
// turns on barriers 2..4 as the consumers' issue turns do (fwd_sm90_issue_turns.cuh: bar.sync by the owner,
// bar.arrive by its predecessor, 256 threads), then sync on barrier 1 around their shared-memory writes and read
// other warps' words, as the varlen epilogue does (stage O, bar.sync 1, bounded stores). Warpgroup 3 exits at once.
// The program is correct (it checks its output). Run it with and without `turns` (argument: 0 = no turn barriers):
// racecheck reports a hazard with the turns and none without (H100, CUDA 13.0), the same kind it reports on the
// varlen epilogue: its model of bar.arrive, not a race.
#include <cstdio>
#include <cstdlib>
__global__ void probe(int* out, int turns) {
  __shared__ int buf[384];
  const int t = threadIdx.x, wg = t / 128;
  if (t >= 384) return;
  for (int turn = 0; turn < turns; ++turn) {
    if (!(wg == 0 && turn == 0)) asm volatile("bar.sync %0, 256;" ::"r"(2 + wg) : "memory");
    if (!(wg == 2 && turn == turns - 1)) asm volatile("bar.arrive %0, 256;" ::"r"(2 + (wg + 1) % 3) : "memory");
  }
  asm volatile("bar.sync 1, 384;" ::: "memory");
  buf[t] = t * 3;
  asm volatile("bar.sync 1, 384;" ::: "memory");
  out[blockIdx.x * 384 + t] = buf[(t + 200) % 384];
}
int main(int argc, char** argv) {
  const int turns = argc > 1 ? atoi(argv[1]) : 3;
  int* d;
  cudaMalloc(&d, 4 * 384 * sizeof(int));
  probe<<<4, 512>>>(d, turns);
  cudaError_t e = cudaDeviceSynchronize();
  int h[4 * 384];
  cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
  int bad = 0;
  for (int i = 0; i < 4 * 384; ++i) bad += h[i] != (((i % 384) + 200) % 384) * 3;
  printf("probe2: %s, %d wrong\n", cudaGetErrorString(e), bad);
  return 0;
}
