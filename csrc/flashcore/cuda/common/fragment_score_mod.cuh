// The score transform of score_mod.h on a warp's score fragments (the m16n8 / wgmma accumulator layout, as
// fragment_mask.cuh): raw scores q.k become logits in log2 units, scale, then softcap, then ALiBi. The kernels'
// score-mod variants apply it to every tile before the mask, and then run the softmax with scale 1; the plain
// variants fold a positive scale into the exp2 instead and never include this file's work.
//
// Softcap's tanh is one MUFU.TANH an element (ptx::tanh_approx). The backward also needs d logit / d(scale q.k) =
// 1 - tanh^2 (the `dtanh` outputs), which multiplies dS.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../mask.h"
#include "../../score_mod.h"
#include "../ptx/math.cuh"
#include "pack.cuh"

namespace flashcore::cuda {

// logit2 of one raw score (kSoftcap, kAlibi: the call's features, fixed per loop so that the loop holds no
// per-element branch); `dist` = |j - i - alibi_offset|; *dtanh = d logit2 / d(scale s) / (softcap_log2 / softcap)
// = 1 - tanh^2 with a softcap.
template <bool kSoftcap, bool kAlibi>
__device__ __forceinline__ float logit2(float s, const ScoreMod& mod, int dist, float* dtanh = nullptr) {
  float x;
  if constexpr (kSoftcap) {
    const float t = ptx::tanh_approx(s * mod.softcap_inv);
    if (dtanh) *dtanh = 1.f - t * t;
    x = mod.softcap_log2 * t;
  } else {
    if (dtanh) *dtanh = 1.f;
    x = s * mod.scale_log2;
  }
  if constexpr (kAlibi) x = fmaf(-mod.alibi_log2, (float)dist, x);
  return x;
}

// Calls body(softcap, alibi), each a std::bool_constant of the call's features: four copies of the element loop,
// each without branches, behind two uniform ones.
template <typename Body>
__device__ __forceinline__ void with_score_features(const ScoreMod& mod, Body&& body) {
  if (mod.softcap) {
    if (mod.alibi_log2 != 0.f)
      body(std::true_type{}, std::true_type{});
    else
      body(std::true_type{}, std::false_type{});
  } else {
    if (mod.alibi_log2 != 0.f)
      body(std::false_type{}, std::true_type{});
    else
      body(std::false_type{}, std::false_type{});
  }
}

// The ALiBi distance |(col0 - row0 - offset) + dc - dr| of an element at compile-time offsets (dr, dc), from one
// per-thread value clamped to 32 bits (dr, dc < 256 cannot cross the clamp; farther distances are all huge).
__device__ __forceinline__ int alibi_base(int row0, int col0, const ScoreMod& mod) {
  constexpr int64_t kClamp = int64_t(1) << 30;
  return (int)Band::max64(Band::min64((int64_t)col0 - row0 - mod.alibi_offset, kClamp), -kClamp);
}

// The scale the online softmax applies to apply_score_mod's output in the forward (kFoldSoftcap): with a softcap
// and no ALiBi the scores keep tanh(s * softcap_inv), and softcap * log2(e) rides in the softmax's exp2 FFMA as a
// plain scale would (one multiply an element fewer: the softcap's tanh is what costs, a second MUFU op an
// element); otherwise the scores are whole log2 logits and the scale is 1.
__device__ __forceinline__ float folded_softmax_scale(const ScoreMod& mod) {
  return mod.softcap && mod.alibi_log2 == 0.f ? mod.softcap_log2 : 1.f;
}

// s[mi][ni][2 half + e]: row row0 + 16 mi + 8 half, column col0 + 8 ni + e. dtanh (the backward's; nullptr in
// the forward): 1 - tanh^2 of each element, 1 without a softcap. kFoldSoftcap (the forward): a softcap alone
// leaves tanh in s, its factor for the softmax (folded_softmax_scale).
template <bool kFoldSoftcap = false, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_score_mod(float (&s)[kMTiles][kNTiles][4], int row0, int col0,
                                                const ScoreMod& mod, float (*dtanh)[kMTiles][kNTiles][4] = nullptr) {
  const int base = alibi_base(row0, col0, mod);
  with_score_features(mod, [&](auto softcap, auto alibi) {
    constexpr bool kSoftcap = decltype(softcap)::value, kAlibi = decltype(alibi)::value;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = 2 * half + e;
            if constexpr (kFoldSoftcap && kSoftcap && !kAlibi) {
              s[mi][ni][i] = ptx::tanh_approx(s[mi][ni][i] * mod.softcap_inv);
            } else {
              const int dist = kAlibi ? abs(base + ni * 8 + e - mi * 16 - half * 8) : 0;
              s[mi][ni][i] =
                  logit2<kSoftcap, kAlibi>(s[mi][ni][i], mod, dist, dtanh ? &(*dtanh)[mi][ni][i] : nullptr);
            }
          }
  });
}

// The same for the backward's transposed fragment (fragment_mask.cuh's apply_mask_transposed layout: value
// 4 ni + e is key key0 + 8 (e / 2), query query0 + 8 ni + e % 2), with 1 - tanh^2 of values 2i and 2i + 1 packed
// in dtanh[i] as an fp16 pair (1 without a softcap): in [0, 1], 2^-11 relative, below the rounding of the dS it
// multiplies; packed as each pair is produced, so no fp32 copy of the tile is ever live (the Hopper consumers have
// no registers for one).
template <int kQTiles>
__device__ __forceinline__ void apply_score_mod_transposed(float (&s)[4 * kQTiles], uint32_t (&dtanh)[2 * kQTiles],
                                                           int key0, int query0, const ScoreMod& mod) {
  const int base = alibi_base(query0, key0, mod);
  with_score_features(mod, [&](auto softcap, auto alibi) {
    constexpr bool kSoftcap = decltype(softcap)::value, kAlibi = decltype(alibi)::value;
#pragma unroll
    for (int ni = 0; ni < kQTiles; ++ni)
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        float d[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int e = 2 * pair + j;
          const int dist = kAlibi ? abs(base + 8 * (e >> 1) - 8 * ni - (e & 1)) : 0;
          s[4 * ni + e] = logit2<kSoftcap, kAlibi>(s[4 * ni + e], mod, dist, &d[j]);
        }
        dtanh[2 * ni + pair] = pack2<__half>(d[0], d[1]);
      }
  });
}

}  // namespace flashcore::cuda
