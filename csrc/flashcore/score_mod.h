// How a raw score s = q.k becomes the logit the softmax takes, and what joins the softmax's denominator: one
// description shared by the host, the CPU kernels and both CUDA families (the kernels' element-wise code applies
// it: cuda/common/fragment_score_mod.cuh, cpu/microkernel_cpu.h).
//   logit = scale * s                                          (every call)
//   logit = softcap * tanh(scale * s / softcap)                (softcap > 0: Gemma 2's cap, flash-attn's order)
//   logit -= slope[b, h] * |j - i - (seqlen_k - seqlen_q)|     (ALiBi, flash-attn 2's bottom-right distance)
// then the mask (mask.h) hides keys. Attention sinks: each row's denominator gains exp(sink[h]), a probability
// mass with no value (GPT-OSS, transformers' s_aux, FlashAttention-4's learnable_sink). The kernels work in log2
// units (exp2), so the fields below carry log2(e) where a kernel needs it.
#pragma once

#include <cstdint>

#include "macros.h"

namespace flashcore {

constexpr float kLog2e = 1.4426950408889634f;

struct ScoreParams {
  float softcap = 0.f;       // 0: no cap
  float softcap_inv = 0.f;   // scale / softcap: the raw score's factor inside tanh
  float softcap_log2 = 0.f;  // softcap * log2(e): the factor outside it, in log2 units
  double softcap_fp64 = 0.0;  // the cap unrounded, for float64 inputs (the CPU kernels; cf. scale_fp64)
  const float* alibi_slopes = nullptr;  // slope of (b, h) at b * alibi_stride_batch + h * alibi_stride_head
  int64_t alibi_stride_batch = 0, alibi_stride_head = 0;
  int64_t alibi_offset = 0;       // seqlen_k - seqlen_q
  const float* sinks = nullptr;   // (heads_q,) float32, natural-log units; nullptr: none

  // Whether scores must be transformed before the softmax: a softcap, ALiBi, or a scale that is not positive (the
  // plain kernels take the row max of raw scores and fold a positive scale into their exp2). Such calls run the
  // kernels' score-mod variants.
  FLASHCORE_HOST_DEVICE bool transforms(float scale) const {
    return softcap > 0.f || alibi_slopes != nullptr || !(scale > 0.f);
  }
};

// One (batch, head)'s transform, resolved once per block: logit2 = transform(s) in log2 units.
struct ScoreMod {
  float scale_log2;     // no softcap: logit2 = s * scale_log2
  float softcap_inv;    // softcap: logit2 = softcap_log2 * tanh(s * softcap_inv)
  float softcap_log2;
  float alibi_log2;     // logit2 -= alibi_log2 * |j - i - alibi_offset|; 0: no ALiBi
  int64_t alibi_offset;
  bool softcap;

  FLASHCORE_HOST_DEVICE static ScoreMod make(const ScoreParams& sp, float scale_log2, int64_t b, int64_t h) {
    ScoreMod m;
    m.scale_log2 = scale_log2;
    m.softcap = sp.softcap > 0.f;
    m.softcap_inv = sp.softcap_inv;
    m.softcap_log2 = sp.softcap_log2;
    m.alibi_log2 = sp.alibi_slopes ? sp.alibi_slopes[b * sp.alibi_stride_batch + h * sp.alibi_stride_head] * kLog2e
                                   : 0.f;
    m.alibi_offset = sp.alibi_offset;
    return m;
  }
};

}  // namespace flashcore
