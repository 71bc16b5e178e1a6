#include "attention_host.h"

#include "switches.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace flashcore {

namespace {

// All argument errors are RuntimeError (TORCH_CHECK), as SDPA's are, so `except RuntimeError` catches every one;
// features the schema has room for but no kernel implements yet are NotImplementedError (a RuntimeError subclass).

const char* dtype_name(at::ScalarType t) { return c10::toString(t); }

void check_one(const at::Tensor& t, const char* name, const BackendLimits& limits) {
  TORCH_CHECK(t.defined(), "flashcore: ", name, " is undefined (None)");
  TORCH_CHECK(t.dim() == 4, "flashcore: ", name, " must be 4-D (batch, heads, seq_len, head_dim); got ", t.dim(),
              "-D with shape ", t.sizes());
  const auto dt = t.scalar_type();
  const bool low = dt == at::kHalf || dt == at::kBFloat16;
  const bool high = dt == at::kFloat || dt == at::kDouble;
  TORCH_CHECK(low || (high && limits.allow_fp32_fp64), "flashcore: ", name, " has dtype ", dtype_name(dt),
              "; the ", limits.name, " kernels support ",
              limits.allow_fp32_fp64 ? "float16, bfloat16, float32 and float64" : "float16 and bfloat16");
  TORCH_CHECK(t.numel() == 0 || t.stride(3) == 1, "flashcore: ", name,
              " must have a contiguous last dimension (stride 1); got strides ", t.strides(),
              ". Call .contiguous() on it first.");
}

void check_common(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const MaskOptions& o,
                  const BackendLimits& limits) {
  check_one(query, "query", limits);
  check_one(key, "key", limits);
  check_one(value, "value", limits);
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "flashcore: key has dtype ", dtype_name(key.scalar_type()),
              " but query has dtype ", dtype_name(query.scalar_type()), "; all inputs must share one dtype");
  TORCH_CHECK(value.scalar_type() == query.scalar_type(), "flashcore: value has dtype ",
              dtype_name(value.scalar_type()), " but query has dtype ", dtype_name(query.scalar_type()),
              "; all inputs must share one dtype");
  TORCH_CHECK(key.device() == query.device(), "flashcore: key is on ", key.device(), " but query is on ",
              query.device(), "; all inputs must be on one device");
  TORCH_CHECK(value.device() == query.device(), "flashcore: value is on ", value.device(), " but query is on ",
              query.device(), "; all inputs must be on one device");

  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(3);
  TORCH_CHECK(key.size(0) == B, "flashcore: key batch size ", key.size(0), " does not match query batch size ", B);
  TORCH_CHECK(value.size(0) == B, "flashcore: value batch size ", value.size(0), " does not match query batch size ",
              B);
  TORCH_CHECK(value.size(1) == key.size(1), "flashcore: value has ", value.size(1), " heads but key has ",
              key.size(1), "; key and value must have the same number of heads");
  TORCH_CHECK(value.size(2) == key.size(2), "flashcore: value has sequence length ", value.size(2),
              " but key has ", key.size(2), "; key and value must have the same length");
  TORCH_CHECK(key.size(3) == D, "flashcore: key head_dim ", key.size(3), " does not match query head_dim ", D);
  TORCH_CHECK(value.size(3) == D, "flashcore: value head_dim ", value.size(3), " does not match query head_dim ", D,
              " (a different value head_dim is not supported)");
  const int64_t Hkv = key.size(1);
  TORCH_CHECK(Hkv > 0 || Hq == 0, "flashcore: key has 0 heads but query has ", Hq);
  TORCH_CHECK(Hkv == 0 || Hq % Hkv == 0, "flashcore: query heads (", Hq, ") must be a multiple of key/value heads (",
              Hkv, ") for grouped-query attention");
  TORCH_CHECK(D >= 1 && D <= limits.max_head_dim && D % limits.head_dim_multiple == 0, "flashcore: head_dim ", D,
              " (query.size(-1)) is not supported by the ", limits.name, " kernels; supported: ",
              limits.head_dim_multiple > 1 ? "multiples of " + std::to_string(limits.head_dim_multiple) + " "
                                           : std::string("any value "),
              "up to ", limits.max_head_dim);

  TORCH_CHECK(std::isfinite(o.softmax_scale), "flashcore: scale must be finite; got ", o.softmax_scale);
  TORCH_CHECK(!(o.causal_bottom_right && !o.is_causal),
              "flashcore: causal_bottom_right=True needs is_causal=True");
  TORCH_CHECK_NOT_IMPLEMENTED(o.window_left < 0 && o.window_right < 0,
                              "flashcore: sliding-window attention (window_left/window_right) is not implemented yet");
  TORCH_CHECK_NOT_IMPLEMENTED(o.softcap == 0.0, "flashcore: softcap is not implemented yet");
}

void check_same_shape(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.defined(), "flashcore: ", name, " is undefined (None)");
  TORCH_CHECK(t.sizes() == ref.sizes(), "flashcore: ", name, " has shape ", t.sizes(), " but ", ref_name,
              " has shape ", ref.sizes());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "flashcore: ", name, " has dtype ",
              dtype_name(t.scalar_type()), " but ", ref_name, " has dtype ", dtype_name(ref.scalar_type()));
  TORCH_CHECK(t.device() == ref.device(), "flashcore: ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device());
  TORCH_CHECK(t.numel() == 0 || t.stride(-1) == 1, "flashcore: ", name,
              " must have a contiguous last dimension (stride 1); got strides ", t.strides());
}

Strides strides_of(const at::Tensor& t) {
  return Strides{t.stride(0), t.stride(1), t.stride(2)};
}

}  // namespace

void check_fwd_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const MaskOptions& opts, const BackendLimits& limits) {
  check_common(query, key, value, opts, limits);
}

void check_bwd_inputs(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                      const MaskOptions& opts, const BackendLimits& limits) {
  check_common(query, key, value, opts, limits);
  check_same_shape(grad_out, query, "grad_out", "query");
  check_same_shape(out, query, "out", "query");
  TORCH_CHECK(lse.defined(), "flashcore: lse is undefined (None)");
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "flashcore: lse must be float32; got ", dtype_name(lse.scalar_type()));
  TORCH_CHECK(lse.device() == query.device(), "flashcore: lse is on ", lse.device(), " but query is on ",
              query.device());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == query.size(0) && lse.size(1) == query.size(1) &&
                  lse.size(2) == query.size(2),
              "flashcore: lse must have shape (batch, heads_q, seq_len_q) = (", query.size(0), ", ", query.size(1),
              ", ", query.size(2), "); got ", lse.sizes());
  TORCH_CHECK(lse.is_contiguous(), "flashcore: lse must be contiguous");
}

void poison_if_enabled(std::initializer_list<at::Tensor> tensors) {
  if (!poison_outputs()) return;
  for (const at::Tensor& t : tensors)
    if (t.defined() && t.numel() > 0) const_cast<at::Tensor&>(t).fill_(std::numeric_limits<double>::quiet_NaN());
}

std::tuple<at::Tensor, at::Tensor> alloc_fwd_outputs(const at::Tensor& query) {
  // empty_like keeps query's strides when query is dense (so BSHD in gives BSHD out), else gives contiguous.
  // The fake (meta) implementation in flashcore/ops.py uses the same rule.
  at::Tensor out = at::empty_like(query);
  at::Tensor lse = at::empty({query.size(0), query.size(1), query.size(2)}, query.options().dtype(at::kFloat));
  poison_if_enabled({out, lse});
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> alloc_bwd_outputs(const at::Tensor& query, const at::Tensor& key,
                                                                 const at::Tensor& value) {
  at::Tensor grad_query = at::empty_like(query), grad_key = at::empty_like(key), grad_value = at::empty_like(value);
  poison_if_enabled({grad_query, grad_key, grad_value});
  return {grad_query, grad_key, grad_value};
}

FwdParams make_fwd_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& out, const at::Tensor& lse, const MaskOptions& opts) {
  FwdParams p;
  p.q = query.data_ptr();
  p.k = key.data_ptr();
  p.v = value.data_ptr();
  p.out = out.defined() ? out.data_ptr() : nullptr;
  p.lse = lse.defined() ? lse.data_ptr<float>() : nullptr;
  p.q_stride = strides_of(query);
  p.k_stride = strides_of(key);
  p.v_stride = strides_of(value);
  if (out.defined()) p.out_stride = strides_of(out);
  p.batch = query.size(0);
  p.heads_q = query.size(1);
  p.heads_kv = key.size(1);
  p.group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
  p.heads_q_div = FastDiv(p.heads_q);
  p.heads_kv_div = FastDiv(p.heads_kv);
  p.group_div = FastDiv(p.group);
  p.seqlen_q = query.size(2);
  p.seqlen_k = key.size(2);
  p.head_dim = query.size(3);
  p.scale = static_cast<float>(opts.softmax_scale);
  p.scale_fp64 = opts.softmax_scale;
  p.scale_log2 = static_cast<float>(opts.softmax_scale * 1.4426950408889634);  // log2(e)
  p.mask.causal = opts.is_causal;
  p.mask.bottom_right = opts.causal_bottom_right;
  p.mask.window_left = opts.window_left;
  p.mask.window_right = opts.window_right;
  p.band = p.mask.band(p.seqlen_q, p.seqlen_k);
  return p;
}

BwdParams make_bwd_params(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                          const at::Tensor& grad_query, const at::Tensor& grad_key, const at::Tensor& grad_value,
                          const MaskOptions& opts, bool deterministic) {
  BwdParams p;
  static_cast<FwdParams&>(p) = make_fwd_params(query, key, value, out, lse, opts);
  p.dout = grad_out.data_ptr();
  p.dq = grad_query.defined() ? grad_query.data_ptr() : nullptr;  // undefined: a kernel that writes dQ elsewhere
  p.dk = grad_key.data_ptr();
  p.dv = grad_value.data_ptr();
  p.dout_stride = strides_of(grad_out);
  if (grad_query.defined()) p.dq_stride = strides_of(grad_query);
  p.dk_stride = strides_of(grad_key);
  p.dv_stride = strides_of(grad_value);
  p.deterministic = deterministic;
  return p;
}

bool fwd_is_trivial(const FwdParams& p, at::Tensor& out, at::Tensor& lse) {
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0 || p.head_dim == 0) return true;
  if (p.seqlen_k == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return true;
  }
  return false;
}

bool bwd_is_trivial(const at::Tensor& query, const at::Tensor& key, at::Tensor& grad_query, at::Tensor& grad_key,
                    at::Tensor& grad_value) {
  if (query.numel() == 0 || key.numel() == 0) {
    grad_query.zero_();
    grad_key.zero_();
    grad_value.zero_();
    return true;
  }
  return false;
}

}  // namespace flashcore
