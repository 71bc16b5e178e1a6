#include "bwd_composite_cuda.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

namespace flashcore::cuda {

void bwd_composite(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                   const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse, const BwdParams& p,
                   at::Tensor& grad_query, at::Tensor& grad_key, at::Tensor& grad_value) {
  const int64_t B = p.batch, Hkv = p.heads_kv, G = p.group, Sq = p.seqlen_q, Sk = p.seqlen_k, D = p.head_dim;
  const auto f32 = at::kFloat;
  const at::Tensor k = key.to(f32);    // (B, Hkv, Sk, D)
  const at::Tensor v = value.to(f32);
  at::Tensor dk = at::zeros({B, Hkv, Sk, D}, k.options());
  at::Tensor dv = at::zeros({B, Hkv, Sk, D}, k.options());
  // delta_i = rowsum(dO_i * O_i), the softmax-gradient correction of FlashAttention-2.
  const at::Tensor delta = (grad_out.to(f32) * out.to(f32)).sum(-1);  // (B, Hq, Sq)
  // A row that saw no key has lse = -inf and zero probabilities: +inf makes exp(s - lse) exactly 0.
  const at::Tensor lse_safe = at::where(lse == -std::numeric_limits<float>::infinity(),
                                        at::full({}, std::numeric_limits<float>::infinity(), lse.options()), lse);

  constexpr int64_t kChunkBudget = int64_t{1} << 27;  // float32 elements of one score chunk (512 MiB)
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(Sq, kChunkBudget / std::max<int64_t>(1, B * Hkv * G * Sk)));
  const at::Tensor key_idx = at::arange(Sk, k.options().dtype(at::kLong));
  const Band& band = p.band;
  const ScoreParams& sp = p.score;
  // ALiBi slopes as (B, Hq) float32 (broadcast from (Hq,)), from the call's strided vector.
  at::Tensor alibi;
  if (sp.alibi_slopes != nullptr) {
    alibi = at::from_blob(const_cast<float*>(sp.alibi_slopes), {B, Hkv * G}, {sp.alibi_stride_batch, sp.alibi_stride_head},
                          k.options()).clone();
  }

  for (int64_t r0 = 0; r0 < Sq; r0 += rows) {
    const int64_t r1 = std::min(Sq, r0 + rows), n = r1 - r0;
    // Query heads of one group share a key/value head: fold them into the row dimension, (B, Hkv, G * n, D).
    auto fold = [&](const at::Tensor& t) { return t.slice(2, r0, r1).to(f32).reshape({B, Hkv, G * n, t.size(-1)}); };
    const at::Tensor q = fold(query);
    const at::Tensor dout = fold(grad_out);
    const at::Tensor lse_c = lse_safe.slice(2, r0, r1).reshape({B, Hkv, G * n, 1});
    const at::Tensor delta_c = delta.slice(2, r0, r1).reshape({B, Hkv, G * n, 1});

    // Logits (score_mod.h): scale, softcap, ALiBi; dtanh = d logit / d(scale q.k) with a softcap.
    at::Tensor s = at::matmul(q, k.transpose(-1, -2)).mul_(p.scale_fp64);  // (B, Hkv, G * n, Sk)
    at::Tensor dtanh;
    if (sp.softcap > 0.f) {
      const at::Tensor t = s.mul_(1.0 / sp.softcap).tanh_();
      dtanh = 1.0 - t * t;
      s = t.mul(sp.softcap);
    }
    const at::Tensor row_idx = at::arange(r0, r1, key_idx.options());
    const at::Tensor diag = key_idx.view({1, Sk}) - row_idx.view({n, 1});  // (n, Sk): j - i
    if (alibi.defined()) {  // -slope[b, h] * |j - i - (Sk - Sq)|, per query head of the group
      const at::Tensor dist = (diag - sp.alibi_offset).abs_().to(f32);
      const at::Tensor slopes = alibi.view({B, Hkv, G, 1, 1});
      s = (s.view({B, Hkv, G, n, Sk}) - slopes * dist).view({B, Hkv, G * n, Sk});
    }
    at::Tensor prob = (s - lse_c).exp_();
    if (band.banded()) {  // key j hidden from query i unless lo <= j - i <= hi (mask.h)
      const at::Tensor hidden = (diag > band.hi).logical_or_(diag < band.lo);
      prob = prob.view({B, Hkv, G, n, Sk}).masked_fill_(hidden, 0.0).view({B, Hkv, G * n, Sk});
    }
    dv.add_(at::matmul(prob.transpose(-1, -2), dout));
    at::Tensor ds = at::matmul(dout, v.transpose(-1, -2)).sub_(delta_c).mul_(prob);
    if (dtanh.defined()) ds.mul_(dtanh);
    ds.mul_(p.scale_fp64);
    dk.add_(at::matmul(ds.transpose(-1, -2), q));
    const at::Tensor dq = at::matmul(ds, k).view({B, Hkv, G, n, D}).reshape({B, Hkv * G, n, D});
    grad_query.slice(2, r0, r1).copy_(dq);
  }
  grad_key.copy_(dk);
  grad_value.copy_(dv);
}

}  // namespace flashcore::cuda
