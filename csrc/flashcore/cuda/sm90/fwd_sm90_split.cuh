// Key splits of the Hopper forward kernel: the blocks of one cluster compute one query tile, each over a slice of
// its key blocks (fwd_sm90_kernel.cuh's for_each_tile), and rank 0 merges their results through distributed
// shared memory, so a grid that would leave SMs idle (few heads, long keys) spreads one tile's key walk over
// several SMs without a second kernel or a global workspace.
//
// Each block ends its walk with its slice's normalized O_r and log-sum-exp L_r per row (softmax finalize). Then
//   L = log sum_r exp(L_r),   O = sum_r exp(L_r - L) O_r,
// which is the softmax over all keys (a row no slice saw keeps L = -inf and O = 0, as without a split).
// Protocol (one tile per block, one phase per barrier):
//   rank 0's producer thread, after its last load: waits until the consumers have released the K ring (their last
//           Q K^T has retired), opens the slots that lie in it (a remote arrive on each such rank's split_go), then
//           waits for the V ring and opens the rest. So the hand-over overlaps rank 0's last softmax and P V
//           (opened by rank 0's consumers after their walk, it cost 0.5 us more at 2 ranks: 1x8x512x64, H100).
//   rank r > 0: after its walk waits on its split_go, then st.async's its O fragment and LSEs into rank 0's ring,
//           slot r - 1, each 16-byte store signalling its bytes on rank 0's split_full; then exits. Its data leave
//           from registers, so nothing of its own shared memory must outlive it.
//   rank 0's consumers: wait on split_full, which expects (splits - 1) x kPartialBytes (armed at kernel start),
//           and merge.
// Layout of slot r - 1: kSplitVecs float4 per consumer thread, vector j of thread t at (j * kConsumerThreads + t) * 16
// bytes, so a warp's stores and loads cover 512 contiguous bytes (no bank conflicts). Vectors 0..kHeadDim/8 - 1 hold
// the O fragment in register order; the last holds the thread's two row LSEs. Each thread merges its own rows, so
// the protocol is the same for one warpgroup or several.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/fwd_block.cuh"
#include "../ptx/cluster.cuh"
#include "../ptx/ldmatrix.cuh"  // smem_addr
#include "../ptx/mbarrier.cuh"
#include "fwd_sm90_traits.cuh"

namespace flashcore::sm90 {

// Rank 0's producer thread, after issuing its `uses` K/V loads (ring uses 0..uses-1 of a one-tile block) and its
// cluster_wait: opens the other ranks' slots in its ring as the consumers release it, K first.
template <typename Traits>
__device__ __forceinline__ void open_split_slots(const SharedStorage<Traits>& smem, int uses, int num_splits) {
  constexpr int kStages = Traits::kStages;
  const uint32_t go = ptx::smem_addr(smem.split_go);
  // The consumers' release of a stage's last use u completes the empty barrier's phase u / kStages: the wait the
  // producer would make before a use u + kStages.
  auto wait_released = [&](uint64_t* empty) {
    for (int s = 0; s < kStages && s < uses; ++s) {
      const int last = s + (uses - 1 - s) / kStages * kStages;
      ptx::mbarrier_wait(&empty[s], ptx::empty_parity(last / kStages + 1));
    }
  };
  wait_released(smem.k_empty);
  int r = 1;
  for (; r < num_splits && r * Traits::kPartialBytes <= kStages * Traits::kKVBytes; ++r)
    ptx::mbarrier_arrive_remote(ptx::map_to_rank(go, (uint32_t)r));
  if (r < num_splits) {
    wait_released(smem.v_empty);
    for (; r < num_splits; ++r) ptx::mbarrier_arrive_remote(ptx::map_to_rank(go, (uint32_t)r));
  }
}

// o_flat: this thread's O fragment (element i belongs to row half (i >> 1) & 1 of the m16n8 C layout); lse: its
// two rows' LSEs. Returns whether this block writes the merged tile (rank 0).
template <typename Traits, int kOValues, typename Element>
__device__ __forceinline__ bool merge_key_splits(float (&o_flat)[kOValues], float (&lse)[2],
                                                 const SharedStorage<Traits>& smem,
                                                 const cuda::FwdBlock<Element>& blk) {
  static_assert(kOValues % 4 == 0 && kOValues / 4 + 1 == Traits::kSplitVecs, "slot layout");
  constexpr int kOVecs = kOValues / 4;
  constexpr uint32_t kThreads = Traits::kConsumerThreads;
  const uint32_t t = threadIdx.x;  // consumer thread, < kThreads
  const uint32_t ring = ptx::smem_addr(smem.k);
  ptx::cluster_wait();  // every block's barriers are initialized (the kernel arrived after init)
  if (blk.split_rank != 0) {
    ptx::mbarrier_wait<ptx::Scope::kCluster>(smem.split_go, 0);
    const uint32_t slot = ring + (uint32_t)(blk.split_rank - 1) * Traits::kPartialBytes + t * 16;
    const uint32_t dst = ptx::map_to_rank(slot, 0);
    const uint32_t bar = ptx::map_to_rank(ptx::smem_addr(smem.split_full), 0);
#pragma unroll
    for (int j = 0; j < kOVecs; ++j) {
      const float v[4] = {o_flat[4 * j], o_flat[4 * j + 1], o_flat[4 * j + 2], o_flat[4 * j + 3]};
      ptx::st_async_v4(dst + j * kThreads * 16, v, bar);
    }
    const float tail[4] = {lse[0], lse[1], 0.f, 0.f};
    ptx::st_async_v4(dst + kOVecs * kThreads * 16, tail, bar);
    return false;
  }

  ptx::mbarrier_wait<ptx::Scope::kCluster>(smem.split_full, 0);

  auto slot_vec = [&](int r, int j) {
    const unsigned char* base = reinterpret_cast<const unsigned char*>(smem.k);
    return *reinterpret_cast<const float4*>(base + (size_t)(r - 1) * Traits::kPartialBytes + (j * kThreads + t) * 16);
  };
  constexpr float kLog2e = 1.4426950408889634f;
  float base[2] = {lse[0], lse[1]};
  for (int r = 1; r < blk.num_splits; ++r) {
    const float4 l = slot_vec(r, kOVecs);
    base[0] = fmaxf(base[0], l.x);
    base[1] = fmaxf(base[1], l.y);
  }
  float sum[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    base[h] = base[h] == -INFINITY ? 0.f : base[h];  // every slice empty: all weights 0, no NaN
    sum[h] = exp2f((lse[h] - base[h]) * kLog2e);
  }
#pragma unroll
  for (int i = 0; i < kOValues; ++i) o_flat[i] *= sum[(i >> 1) & 1];
  for (int r = 1; r < blk.num_splits; ++r) {
    const float4 l = slot_vec(r, kOVecs);
    const float w[2] = {exp2f((l.x - base[0]) * kLog2e), exp2f((l.y - base[1]) * kLog2e)};
    sum[0] += w[0];
    sum[1] += w[1];
#pragma unroll
    for (int j = 0; j < kOVecs; ++j) {
      const float4 v = slot_vec(r, j);
      o_flat[4 * j] = fmaf(w[0], v.x, o_flat[4 * j]);
      o_flat[4 * j + 1] = fmaf(w[0], v.y, o_flat[4 * j + 1]);
      o_flat[4 * j + 2] = fmaf(w[1], v.z, o_flat[4 * j + 2]);
      o_flat[4 * j + 3] = fmaf(w[1], v.w, o_flat[4 * j + 3]);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool empty = !(sum[h] > 0.f);
    lse[h] = empty ? -INFINITY : base[h] + __logf(sum[h]);
    sum[h] = empty ? 0.f : 1.f / sum[h];
  }
#pragma unroll
  for (int i = 0; i < kOValues; ++i) o_flat[i] *= sum[(i >> 1) & 1];
  return true;
}

}  // namespace flashcore::sm90
