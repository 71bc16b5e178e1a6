// Ping-pong between the consumer warpgroups of a block (FlashAttention-3's inter-warpgroup overlap): only one
// warpgroup issues its wgmmas at a time, in round-robin order, so that while one runs its softmax (exp2 on the
// SFU, max/sum shuffles) the next one's GEMMs have the tensor cores to themselves.
//
// Warpgroup w waits on hardware barrier kFirstBarrier + w before issuing and, once issued, arrives on its
// successor's barrier (128 threads sync + 128 arrive = 256). The counts must match exactly, or a warpgroup hangs
// or an arrival is left pending at exit: every warpgroup of a block takes the same number of turns (one per GEMM
// issue point, n_blocks + 1), warpgroup 0's first turn is free, and the last warpgroup skips its final hand-over.
#pragma once

#include <cstdint>

#include "../ptx/warpgroup.cuh"

namespace flashcore::sm90 {

template <int kWarpgroups>
struct IssueTurns {
  static constexpr uint32_t kFirstBarrier = 2;  // 0: __syncthreads, 1: the consumers' epilogue barrier
  static_assert(kFirstBarrier + kWarpgroups <= 16, "16 hardware barriers per block");
  int wg;
  int turns;  // turns each warpgroup takes
  int turn = 0;

  __device__ __forceinline__ IssueTurns(int wg_, int turns_) : wg(wg_), turns(turns_) {}

  __device__ __forceinline__ void begin() const {
    if (kWarpgroups > 1 && !(wg == 0 && turn == 0)) ptx::named_barrier_sync(kFirstBarrier + wg, 256);
  }
  __device__ __forceinline__ void end() {
    if (kWarpgroups > 1 && !(wg == kWarpgroups - 1 && turn == turns - 1))
      ptx::named_barrier_arrive(kFirstBarrier + (wg + 1) % kWarpgroups, 256);
    ++turn;
  }
};

}  // namespace flashcore::sm90
