// Online softmax over the score fragments of one warp (FlashAttention's running max and sum), in base 2.
//
// A thread holds, for each m16 tile, two rows (g and g + 8 of the mma C layout) of kNTiles n8 tiles, two scores
// each, masked to -inf. `scale` must be positive: the max of the raw scores is then the max of the scaled ones, and
// each probability is one FFMA + one exp2. The plain kernels pass scale * log2(e); the score-mod kernels
// transform the scores into log2-unit logits first (fragment_score_mod.cuh) and pass 1. row_max is kept in scaled
// (log2) units. Invariant: after each tile, o = sum_j exp2(s_j - row_max) v_j and row_sum = sum_j exp2(s_j -
// row_max) over the keys seen so far, where row_sum is this thread's partial sum (the four threads of a row are
// reduced once, at the end).
#pragma once

#include <cmath>

namespace flashcore::cuda {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Pairwise (tree) reduction of v[0..N) into v[0]: log2(N) dependent steps instead of a running chain's N / 2.
template <int N, typename Op>
__device__ __forceinline__ float tree_reduce(float (&v)[N], Op op) {
#pragma unroll
  for (int stride = 1; stride < N; stride *= 2)
#pragma unroll
    for (int i = 0; i + stride < N; i += 2 * stride) v[i] = op(v[i], v[i + stride]);
  return v[0];
}

// kTreeReduce: the row max and sum of a tile as pairwise trees. The mma.sync kernel's 128-key tiles take them: its
// warps wait out each dependent FMNMX/FADD of a running chain (forced mma.sync 4x8x512x64 on the H100: 9.58 ->
// 9.47 us). The Hopper consumer keeps the chains, which were faster there (5.28 -> 5.37 us with trees at
// 1x8x512x64; docs/PERFORMANCE.md, ablation and "Tried and rejected").
template <int kMTiles, int kNTiles, int kDTiles, bool kTreeReduce = false>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMTiles;  // rows held by this thread
  float row_max[kRows];
  float row_sum[kRows];

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // Folds one tile of scores in: updates the running max and row_sum, overwrites s with
  // p = exp2(s * scale - new_max), and returns in `correction` the factor exp2(old_max - new_max) by which o must
  // still be rescaled (see rescale). Returns whether any row of the warp moved its max (warp-uniform).
  __device__ __forceinline__ bool step(float (&s)[kMTiles][kNTiles][4], const float scale,
                                       float (&correction)[kRows]) {
    bool any_moved = false;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mi + half;
        float mx = -INFINITY;
        float v[2 * kNTiles];  // kTreeReduce: the row's scores, then its probabilities
        if constexpr (kTreeReduce) {
#pragma unroll
          for (int ni = 0; ni < kNTiles; ++ni) {
            v[2 * ni] = s[mi][ni][2 * half];
            v[2 * ni + 1] = s[mi][ni][2 * half + 1];
          }
          mx = tree_reduce(v, [](float a, float b) { return fmaxf(a, b); });
        } else {
#pragma unroll
          for (int ni = 0; ni < kNTiles; ++ni) mx = fmaxf(mx, fmaxf(s[mi][ni][2 * half], s[mi][ni][2 * half + 1]));
        }
        mx = fmaxf(row_max[r], quad_max(mx) * scale);
        // A row that has seen only masked keys keeps max = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        const float base = (mx == -INFINITY) ? 0.f : mx;
        correction[r] = exp2f(row_max[r] - base);  // 0 when the old max was -inf, 1 when the max did not move
        any_moved |= mx != row_max[r];
        row_max[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) {
          s[mi][ni][2 * half] = exp2f(fmaf(s[mi][ni][2 * half], scale, -base));
          s[mi][ni][2 * half + 1] = exp2f(fmaf(s[mi][ni][2 * half + 1], scale, -base));
          if constexpr (kTreeReduce) {
            v[2 * ni] = s[mi][ni][2 * half];
            v[2 * ni + 1] = s[mi][ni][2 * half + 1];
          } else {
            sum += s[mi][ni][2 * half] + s[mi][ni][2 * half + 1];
          }
        }
        if constexpr (kTreeReduce) sum = tree_reduce(v, [](float a, float b) { return a + b; });
        row_sum[r] = row_sum[r] * correction[r] + sum;
      }
    }
    return __any_sync(0xffffffffu, any_moved);
  }

  // Deferred rescale: once the running maxima settle (most tiles of a long row), no row of the warp moves and
  // the kDTiles * 4 multiplies on o, which the next P.V MMAs would wait for, are skipped (warp-uniform branch).
  // The Hopper consumer uses it; the mma.sync kernel passes moved = true, because the branch would keep the
  // compiler from interleaving the exp2s with the P.V MMAs (fwd_sm80_kernel.cuh).
  __device__ __forceinline__ void rescale(float (&o)[kMTiles][kDTiles][4], const float (&correction)[kRows],
                                          bool moved) {
    if (!moved) return;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int di = 0; di < kDTiles; ++di) {
          o[mi][di][2 * half] *= correction[2 * mi + half];
          o[mi][di][2 * half + 1] *= correction[2 * mi + half];
        }
  }

  // Divides o by the row sums and returns each row's log-sum-exp in natural-log units (-inf, with o = 0, for a
  // row that saw no key). sink_log2: an attention sink's logit in log2 units (score_mod.h), or -inf for none: it
  // joins each row's sum (and its max, so that a row that saw no key gets lse = sink, o = 0).
  __device__ __forceinline__ void finalize(float (&o)[kMTiles][kDTiles][4], float (&lse)[kRows],
                                           float sink_log2 = -INFINITY) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mi + half;
        float sum = quad_sum(row_sum[r]);
        float o_scale = 1.f;  // o's rescale to the max that includes the sink
        if (sink_log2 != -INFINITY) {
          const float m = fmaxf(row_max[r], sink_log2);
          o_scale = exp2f(row_max[r] - m);  // 0 for a row that saw no key (row_max = -inf)
          sum = sum * o_scale + exp2f(sink_log2 - m);
          row_max[r] = m;
        }
        const bool empty = !(sum > 0.f);
        const float inv = empty ? 0.f : o_scale / sum;
        lse[r] = empty ? -INFINITY : (row_max[r] + __log2f(sum)) * 0.69314718055994531f;  // ln(2)
#pragma unroll
        for (int di = 0; di < kDTiles; ++di) {
          o[mi][di][2 * half] *= inv;
          o[mi][di][2 * half + 1] *= inv;
        }
      }
    }
  }
};

}  // namespace flashcore::cuda
