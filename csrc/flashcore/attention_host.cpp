#include "attention_host.h"

#include "switches.h"

#include <ATen/ATen.h>

#include <algorithm>
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
  // A last dim of size 1 has no stride to speak of (PyTorch calls such tensors contiguous whatever it is).
  TORCH_CHECK(t.numel() == 0 || t.stride(3) == 1 || t.size(3) == 1, "flashcore: ", name,
              " must have a contiguous last dimension (stride 1); got strides ", t.strides(),
              ". Call .contiguous() on it first.");
}

// An optional per-head float32 vector of the call: (heads_q,), or (batch, heads_q) when allow_batch.
// batch: the call's batch size (query.size(0) for dense inputs, the number of sequences for varlen ones).
void check_head_vector(const at::Tensor& t, const char* name, const at::Tensor& query, int64_t B, bool allow_batch) {
  if (!t.defined()) return;
  const int64_t Hq = query.size(1);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "flashcore: ", name, " must be float32; got ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.device() == query.device(), "flashcore: ", name, " is on ", t.device(), " but query is on ",
              query.device());
  const bool per_head = t.dim() == 1 && t.size(0) == Hq;
  const bool per_batch_head = allow_batch && t.dim() == 2 && t.size(0) == B && t.size(1) == Hq;
  TORCH_CHECK(per_head || per_batch_head, "flashcore: ", name, " must have shape (heads_q,) = (", Hq, ",)",
              allow_batch ? " or (batch, heads_q) = (" + std::to_string(B) + ", " + std::to_string(Hq) + ")" : "",
              "; got ", t.sizes());
}

// batch < 0: query.size(0).
void check_common(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const AttentionOptions& o,
                  const BackendLimits& limits, int64_t batch = -1) {
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
  TORCH_CHECK(batch >= 0 || key.size(0) == B, "flashcore: key batch size ", key.size(0), " does not match query batch size ", B);
  TORCH_CHECK(batch >= 0 || value.size(0) == B, "flashcore: value batch size ", value.size(0), " does not match query batch size ",
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
  TORCH_CHECK(o.window_left >= -1, "flashcore: window_left (window_size[0]) must be -1 (unbounded) or >= 0; got ",
              o.window_left);
  TORCH_CHECK(o.window_right >= -1, "flashcore: window_right (window_size[1]) must be -1 (unbounded) or >= 0; got ",
              o.window_right);
  TORCH_CHECK(std::isfinite(o.softcap) && o.softcap >= 0.0, "flashcore: softcap must be finite and >= 0 (0: off); got ",
              o.softcap);
  const int64_t call_batch = batch < 0 ? query.size(0) : batch;
  check_head_vector(o.sinks, "sinks", query, call_batch, /*allow_batch=*/false);
  check_head_vector(o.alibi_slopes, "alibi_slopes", query, call_batch, /*allow_batch=*/true);
}

void check_same_shape(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.defined(), "flashcore: ", name, " is undefined (None)");
  TORCH_CHECK(t.sizes() == ref.sizes(), "flashcore: ", name, " has shape ", t.sizes(), " but ", ref_name,
              " has shape ", ref.sizes());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "flashcore: ", name, " has dtype ",
              dtype_name(t.scalar_type()), " but ", ref_name, " has dtype ", dtype_name(ref.scalar_type()));
  TORCH_CHECK(t.device() == ref.device(), "flashcore: ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device());
  TORCH_CHECK(t.numel() == 0 || t.stride(-1) == 1 || t.size(-1) == 1, "flashcore: ", name,
              " must have a contiguous last dimension (stride 1); got strides ", t.strides());
}

Strides strides_of(const at::Tensor& t) {
  return Strides{t.stride(0), t.stride(1), t.stride(2)};
}

}  // namespace

AttentionOptions make_options(double softmax_scale, bool is_causal, bool causal_bottom_right, int64_t window_left,
                              int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks,
                              const std::optional<at::Tensor>& alibi_slopes) {
  // A window side of 2^31 or more reaches past any sequence (lengths stay below 2^31): unbounded, and kept out of
  // the band's 64-bit diagonal arithmetic (mask.h), which a side near 2^63 would overflow.
  constexpr int64_t kUnboundedWindow = int64_t(1) << 31;
  if (window_left >= kUnboundedWindow) window_left = -1;
  if (window_right >= kUnboundedWindow) window_right = -1;
  AttentionOptions o{softmax_scale, is_causal, causal_bottom_right, window_left, window_right, softcap, {}, {}};
  // The kernels index the vectors with their strides (ALiBi) or contiguously (sinks, one float a head).
  if (sinks.has_value() && sinks->defined()) o.sinks = sinks->dim() == 1 ? sinks->contiguous() : *sinks;
  if (alibi_slopes.has_value() && alibi_slopes->defined()) o.alibi_slopes = *alibi_slopes;
  return o;
}

bool transforms_scores(const AttentionOptions& o) {
  return o.softcap > 0.0 || o.alibi_slopes.defined() || !(static_cast<float>(o.softmax_scale) > 0.f);
}

void check_fwd_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const AttentionOptions& opts, const BackendLimits& limits) {
  check_common(query, key, value, opts, limits);
}

void check_bwd_inputs(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                      const AttentionOptions& opts, const BackendLimits& limits) {
  check_common(query, key, value, opts, limits);
  check_same_shape(grad_out, query, "grad_out", "query");
  check_same_shape(out, query, "out", "query");
  TORCH_CHECK(lse.defined(), "flashcore: lse is undefined (None)");
  const auto lse_dtype = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(lse.scalar_type() == lse_dtype, "flashcore: lse must be ",
              lse_dtype == at::kDouble ? "float64 (as fwd returns it for float64 inputs)" : "float32", "; got ",
              dtype_name(lse.scalar_type()));
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
  // float32, or float64 for float64 inputs (their LSE keeps float64 exactness: the backward and ring merges use it)
  const auto lse_dtype = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor lse = at::empty({query.size(0), query.size(1), query.size(2)}, query.options().dtype(lse_dtype));
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
                          const at::Tensor& out, const at::Tensor& lse, const AttentionOptions& opts) {
  FwdParams p;
  p.q = query.data_ptr();
  p.k = key.data_ptr();
  p.v = value.data_ptr();
  p.out = out.defined() ? out.data_ptr() : nullptr;
  if (lse.defined() && lse.scalar_type() == at::kDouble)
    p.lse64 = lse.data_ptr<double>();
  else
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
  ScoreParams& sp = p.score;
  if (opts.softcap > 0.0) {
    sp.softcap = static_cast<float>(opts.softcap);
    sp.softcap_fp64 = opts.softcap;
    sp.softcap_inv = static_cast<float>(opts.softmax_scale / opts.softcap);
    sp.softcap_log2 = static_cast<float>(opts.softcap * 1.4426950408889634);
  }
  if (opts.alibi_slopes.defined()) {
    const at::Tensor& a = opts.alibi_slopes;
    sp.alibi_slopes = a.data_ptr<float>();
    sp.alibi_stride_batch = a.dim() == 2 ? a.stride(0) : 0;
    sp.alibi_stride_head = a.stride(-1);
  }
  sp.alibi_offset = p.seqlen_k - p.seqlen_q;
  sp.sinks = opts.sinks.defined() ? opts.sinks.data_ptr<float>() : nullptr;
  return p;
}

BwdParams make_bwd_params(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                          const at::Tensor& grad_query, const at::Tensor& grad_key, const at::Tensor& grad_value,
                          const AttentionOptions& opts, bool deterministic) {
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

bool fwd_is_trivial(const FwdParams& p, at::Tensor& out, at::Tensor& lse, const AttentionOptions& opts) {
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0 || p.head_dim == 0) return true;
  if (p.seqlen_k == 0) {
    fill_no_key_outputs(out, lse, opts);  // lse = the sink where there is one, as the kernels give no-key rows
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

// ---- Variable-length batches ----

namespace {

void check_packed(const at::Tensor& t, const char* name, const char* rows) {
  TORCH_CHECK(t.defined(), "flashcore: ", name, " is undefined (None)");
  TORCH_CHECK(t.dim() == 3, "flashcore: ", name, " must be 3-D (", rows, ", heads, head_dim) for a variable-length "
              "batch; got ", t.dim(), "-D with shape ", t.sizes());
}

void check_offsets_tensor(const at::Tensor& t, const char* name, const at::Tensor& query, int64_t expected_len,
                          const char* len_text) {
  TORCH_CHECK(t.defined(), "flashcore: ", name, " is undefined (None)");
  TORCH_CHECK(t.scalar_type() == at::kInt, "flashcore: ", name, " must be int32 (torch.int32); got ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(t.dim() == 1, "flashcore: ", name, " must be 1-D; got ", t.dim(), "-D with shape ", t.sizes());
  TORCH_CHECK(t.device() == query.device(), "flashcore: ", name, " is on ", t.device(), " but query is on ",
              query.device());
  TORCH_CHECK(expected_len < 0 || t.size(0) == expected_len, "flashcore: ", name, " must have length ", len_text,
              " = ", expected_len, "; got ", t.size(0));
}

// The offsets' values: read on the host (a device sync for CUDA tensors, hence opt-in there).
void check_offset_values(const VarlenArgs& a, int64_t total_q, int64_t total_k) {
  const at::Tensor cq = a.cu_seqlens_q.cpu(), ck = a.cu_seqlens_k.cpu();
  const at::Tensor used = a.seqused_k.defined() ? a.seqused_k.cpu() : at::Tensor();
  const int32_t* q = cq.data_ptr<int32_t>();
  const int32_t* k = ck.data_ptr<int32_t>();
  const int64_t B = a.batch();
  TORCH_CHECK(q[0] >= 0 && k[0] >= 0, "flashcore: cu_seqlens_q[0] and cu_seqlens_k[0] must be >= 0; got ", q[0],
              " and ", k[0]);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(q[b + 1] >= q[b], "flashcore: cu_seqlens_q must be non-decreasing; cu_seqlens_q[", b + 1, "] = ",
                q[b + 1], " < cu_seqlens_q[", b, "] = ", q[b]);
    TORCH_CHECK(k[b + 1] >= k[b], "flashcore: cu_seqlens_k must be non-decreasing; cu_seqlens_k[", b + 1, "] = ",
                k[b + 1], " < cu_seqlens_k[", b, "] = ", k[b]);
    TORCH_CHECK(q[b + 1] - q[b] <= a.max_seqlen_q, "flashcore: sequence ", b, " has ", q[b + 1] - q[b],
                " queries, more than max_seqlen_q = ", a.max_seqlen_q);
    const int64_t len_k = used.defined() ? used.data_ptr<int32_t>()[b] : k[b + 1] - k[b];
    TORCH_CHECK(!used.defined() || (len_k >= 0 && len_k <= k[b + 1] - k[b]), "flashcore: seqused_k[", b, "] = ",
                len_k, " must be in [0, cu_seqlens_k[", b + 1, "] - cu_seqlens_k[", b, "]] = [0, ", k[b + 1] - k[b],
                "]");
    TORCH_CHECK(len_k <= a.max_seqlen_k, "flashcore: sequence ", b, " has ", len_k,
                " keys, more than max_seqlen_k = ", a.max_seqlen_k);
  }
  TORCH_CHECK(q[B] <= total_q, "flashcore: cu_seqlens_q[-1] = ", q[B], " exceeds query's ", total_q, " rows");
  TORCH_CHECK(k[B] <= total_k, "flashcore: cu_seqlens_k[-1] = ", k[B], " exceeds key's ", total_k, " rows");
}

void check_varlen_common(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const VarlenArgs& a, const AttentionOptions& opts, const BackendLimits& limits) {
  check_packed(query, "query", "total_q");
  check_packed(key, "key", "total_k");
  check_packed(value, "value", "total_k");
  check_offsets_tensor(a.cu_seqlens_q, "cu_seqlens_q", query, -1, "");
  TORCH_CHECK(a.cu_seqlens_q.size(0) >= 1, "flashcore: cu_seqlens_q must have length batch + 1 >= 1; got 0");
  check_offsets_tensor(a.cu_seqlens_k, "cu_seqlens_k", query, a.cu_seqlens_q.size(0), "len(cu_seqlens_q)");
  if (a.seqused_k.defined()) check_offsets_tensor(a.seqused_k, "seqused_k", query, a.batch(), "batch");
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(a.max_seqlen_q >= 1 && a.max_seqlen_q <= kIntMax, "flashcore: max_seqlen_q must be in [1, 2^31 - 1]; got ",
              a.max_seqlen_q);
  TORCH_CHECK(a.max_seqlen_k >= 1 && a.max_seqlen_k <= kIntMax, "flashcore: max_seqlen_k must be in [1, 2^31 - 1]; got ",
              a.max_seqlen_k);
  TORCH_CHECK(query.size(0) <= kIntMax && key.size(0) <= kIntMax, "flashcore: total_q and total_k must be below 2^31 "
              "(int32 offsets); got ", query.size(0), " and ", key.size(0));
  TORCH_CHECK(value.size(0) == key.size(0), "flashcore: value has ", value.size(0), " rows (total_k) but key has ",
              key.size(0));
  check_common(packed_as_bhsd(query), packed_as_bhsd(key), packed_as_bhsd(value), opts, limits, a.batch());
  if (query.is_cpu() || check_varlen_offsets()) check_offset_values(a, query.size(0), key.size(0));
}

at::Tensor contiguous_offsets(const at::Tensor& t) { return t.defined() ? t.contiguous() : t; }

void set_varlen_fields(FwdParams& p, const VarlenArgs& a, int64_t total_q, int64_t total_k) {
  p.batch = a.batch();
  p.q_stride.batch = p.k_stride.batch = p.v_stride.batch = p.out_stride.batch = 0;
  p.seqlen_q = a.max_seqlen_q;
  p.seqlen_k = a.max_seqlen_k;
  p.varlen.cu_seqlens_q = a.cu_seqlens_q.data_ptr<int32_t>();
  p.varlen.cu_seqlens_k = a.cu_seqlens_k.data_ptr<int32_t>();
  p.varlen.seqused_k = a.seqused_k.defined() ? a.seqused_k.data_ptr<int32_t>() : nullptr;
  p.varlen.total_q = total_q;
  p.varlen.total_k = total_k;
  p.band = p.mask.band(p.seqlen_q, p.seqlen_k);  // unused by varlen kernels (band_of), kept consistent
  p.score.alibi_offset = 0;                       // per sequence: seqlen_k - seqlen_q of seq(b)
}

}  // namespace

at::Tensor packed_as_bhsd(const at::Tensor& t) { return t.unsqueeze(0).transpose(1, 2); }

VarlenArgs make_varlen_args(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                            int64_t max_seqlen_k, const std::optional<at::Tensor>& seqused_k) {
  VarlenArgs a;
  a.cu_seqlens_q = contiguous_offsets(cu_seqlens_q);
  a.cu_seqlens_k = contiguous_offsets(cu_seqlens_k);
  if (seqused_k.has_value()) a.seqused_k = contiguous_offsets(*seqused_k);
  a.max_seqlen_q = max_seqlen_q;
  a.max_seqlen_k = max_seqlen_k;
  return a;
}

void check_varlen_fwd_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const VarlenArgs& args, const AttentionOptions& opts, const BackendLimits& limits) {
  check_varlen_common(query, key, value, args, opts, limits);
}

void check_varlen_bwd_inputs(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                             const VarlenArgs& args, const AttentionOptions& opts, const BackendLimits& limits) {
  check_varlen_common(query, key, value, args, opts, limits);
  check_same_shape(grad_out, query, "grad_out", "query");
  check_same_shape(out, query, "out", "query");
  TORCH_CHECK(lse.defined(), "flashcore: lse is undefined (None)");
  const auto lse_dtype = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(lse.scalar_type() == lse_dtype, "flashcore: lse must be ",
              lse_dtype == at::kDouble ? "float64" : "float32", "; got ", dtype_name(lse.scalar_type()));
  TORCH_CHECK(lse.device() == query.device(), "flashcore: lse is on ", lse.device(), " but query is on ",
              query.device());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == query.size(1) && lse.size(1) == query.size(0),
              "flashcore: lse must have shape (heads_q, total_q) = (", query.size(1), ", ", query.size(0), "); got ",
              lse.sizes());
  TORCH_CHECK(lse.is_contiguous(), "flashcore: lse must be contiguous");
}

std::tuple<at::Tensor, at::Tensor> alloc_varlen_fwd_outputs(const at::Tensor& query) {
  at::Tensor out = at::empty_like(query);
  const auto lse_dtype = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // -inf: the value of rows outside every sequence (no kernel visits them); the kernels write every other row.
  at::Tensor lse = at::full({query.size(1), query.size(0)}, -std::numeric_limits<double>::infinity(),
                            query.options().dtype(lse_dtype));
  poison_if_enabled({out});
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> alloc_varlen_bwd_outputs(const at::Tensor& query,
                                                                        const at::Tensor& key,
                                                                        const at::Tensor& value) {
  at::Tensor grad_query = at::empty_like(query);
  poison_if_enabled({grad_query});
  return {grad_query, at::zeros_like(key), at::zeros_like(value)};
}

bool varlen_fwd_is_trivial(const FwdParams& p, at::Tensor& out) {
  if (p.batch == 0 || p.heads_q == 0 || p.varlen.total_q == 0 || p.head_dim == 0) return true;
  if (p.varlen.total_k == 0) {
    out.zero_();  // lse is -inf already
    return true;
  }
  return false;
}

FwdParams make_varlen_fwd_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 const at::Tensor& out, const at::Tensor& lse, const VarlenArgs& args,
                                 const AttentionOptions& opts) {
  FwdParams p = make_fwd_params(packed_as_bhsd(query), packed_as_bhsd(key), packed_as_bhsd(value),
                                out.defined() ? packed_as_bhsd(out) : out, lse, opts);
  set_varlen_fields(p, args, query.size(0), key.size(0));
  return p;
}

BwdParams make_varlen_bwd_params(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                                 const at::Tensor& grad_query, const at::Tensor& grad_key,
                                 const at::Tensor& grad_value, const VarlenArgs& args, const AttentionOptions& opts,
                                 bool deterministic) {
  auto view = [](const at::Tensor& t) { return t.defined() ? packed_as_bhsd(t) : t; };
  BwdParams p = make_bwd_params(view(grad_out), view(query), view(key), view(value), view(out), lse,
                                view(grad_query), view(grad_key), view(grad_value), opts, deterministic);
  set_varlen_fields(p, args, query.size(0), key.size(0));
  p.dout_stride.batch = p.dq_stride.batch = p.dk_stride.batch = p.dv_stride.batch = 0;
  return p;
}


// ---- KV-cache calls ----

namespace {

void check_index_tensor(const at::Tensor& t, const char* name, const at::Tensor& query, int64_t dims) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "flashcore: ", name, " must be int32 (torch.int32); got ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(t.dim() == dims, "flashcore: ", name, " must be ", dims, "-D; got ", t.dim(), "-D with shape ",
              t.sizes());
  TORCH_CHECK(t.device() == query.device(), "flashcore: ", name, " is on ", t.device(), " but query is on ",
              query.device());
  TORCH_CHECK(t.size(0) == query.size(0), "flashcore: ", name, " must have batch = ", query.size(0),
              " rows (query.size(0)); got ", t.size(0));
}

// The index tensors' values (CPU tensors only: reading CUDA ones would sync).
void check_kvcache_values(const KvCacheArgs& a, int64_t cache_rows, int64_t capacity) {
  const int64_t B = a.cache_seqlens.size(0);
  const int32_t* len = a.cache_seqlens.data_ptr<int32_t>();
  const int32_t* pad = a.cache_leftpad.defined() ? a.cache_leftpad.data_ptr<int32_t>() : nullptr;
  const int32_t* idx = a.cache_batch_idx.defined() ? a.cache_batch_idx.data_ptr<int32_t>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] <= capacity, "flashcore: cache_seqlens[", b, "] = ", len[b],
                " is outside the cache's capacity [0, ", capacity, "]");
    TORCH_CHECK(!pad || (pad[b] >= 0 && pad[b] <= len[b]), "flashcore: cache_leftpad[", b, "] = ", pad[b],
                " must be in [0, cache_seqlens[", b, "] = ", len[b], "]");
    TORCH_CHECK(!idx || (idx[b] >= 0 && idx[b] < cache_rows), "flashcore: cache_batch_idx[", b, "] = ", idx[b],
                " is not a row of the cache [0, ", cache_rows, ")");
    if (a.paged()) {
      const int32_t* row = a.block_table.data_ptr<int32_t>() + b * a.block_table.stride(0);  // stride(1) == 1
      const int64_t page_size = capacity / std::max<int64_t>(a.block_table.size(1), 1);
      const int64_t used = page_size > 0 ? (len[b] + page_size - 1) / page_size : 0;
      for (int64_t s = 0; s < used; ++s) {
        const int64_t page = row[s];
        TORCH_CHECK(page >= 0 && page < cache_rows, "flashcore: block_table[", b, ", ", s, "] = ", page,
                    " is not a page of the cache [0, ", cache_rows, ")");
      }
    }
  }
}

}  // namespace

KvCacheArgs make_kvcache_args(const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
                              const std::optional<at::Tensor>& cache_batch_idx,
                              const std::optional<at::Tensor>& cache_leftpad, int64_t num_splits) {
  KvCacheArgs a;
  a.cache_seqlens = contiguous_offsets(cache_seqlens);
  if (block_table.has_value() && block_table->defined()) a.block_table = *block_table;
  if (cache_batch_idx.has_value() && cache_batch_idx->defined()) a.cache_batch_idx = contiguous_offsets(*cache_batch_idx);
  if (cache_leftpad.has_value() && cache_leftpad->defined()) a.cache_leftpad = contiguous_offsets(*cache_leftpad);
  if (a.block_table.defined() && a.block_table.dim() == 2 && a.block_table.stride(1) != 1)
    a.block_table = a.block_table.contiguous();
  a.num_splits = num_splits;
  return a;
}

void check_kvcache_inputs(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          const KvCacheArgs& a, const AttentionOptions& opts, const BackendLimits& limits) {
  TORCH_CHECK(query.defined() && query.dim() == 4, "flashcore: query must be 4-D (batch, seqlen_q, heads_q, "
              "head_dim) for a KV-cache call; got ", query.defined() ? query.dim() : 0, "-D");
  const char* layout = a.paged() ? "(num_pages, page_size, heads_kv, head_dim) with block_table"
                                 : "(cache_batch, seqlen_cache, heads_kv, head_dim)";
  TORCH_CHECK(key_cache.defined() && key_cache.dim() == 4, "flashcore: key_cache must be 4-D ", layout, "; got ",
              key_cache.defined() ? key_cache.dim() : 0, "-D");
  TORCH_CHECK(value_cache.defined() && value_cache.sizes() == key_cache.sizes(), "flashcore: value_cache must have "
              "key_cache's shape ", key_cache.sizes(), "; got ", value_cache.defined() ? value_cache.sizes() : at::IntArrayRef{});
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type(), "flashcore: key_cache has dtype ",
              dtype_name(key_cache.scalar_type()), " but query has dtype ", dtype_name(query.scalar_type()),
              "; the cache must have query's dtype");
  TORCH_CHECK(value_cache.scalar_type() == query.scalar_type(), "flashcore: value_cache has dtype ",
              dtype_name(value_cache.scalar_type()), " but query has dtype ", dtype_name(query.scalar_type()),
              "; the cache must have query's dtype");
  TORCH_CHECK(a.cache_seqlens.defined(), "flashcore: cache_seqlens is undefined (None)");
  check_index_tensor(a.cache_seqlens, "cache_seqlens", query, 1);
  if (a.cache_leftpad.defined()) check_index_tensor(a.cache_leftpad, "cache_leftpad", query, 1);
  if (a.cache_batch_idx.defined()) {
    check_index_tensor(a.cache_batch_idx, "cache_batch_idx", query, 1);
    TORCH_CHECK(!a.paged(), "flashcore: cache_batch_idx cannot be combined with block_table (a paged cache maps "
                "batch entries to pages through block_table)");
  }
  if (a.paged()) {
    check_index_tensor(a.block_table, "block_table", query, 2);
    TORCH_CHECK(key_cache.size(1) >= 1, "flashcore: page_size (key_cache.size(1)) must be at least 1");
    TORCH_CHECK(a.block_table.size(1) >= 1 || query.size(0) == 0, "flashcore: block_table must have at least one "
                "column");
  } else {
    TORCH_CHECK(a.cache_batch_idx.defined() || key_cache.size(0) >= query.size(0), "flashcore: key_cache has ",
                key_cache.size(0), " rows but the batch has ", query.size(0),
                " entries; pass cache_batch_idx to map entries to cache rows");
  }
  TORCH_CHECK(a.num_splits >= 0 && a.num_splits <= 256, "flashcore: num_splits must be in [0, 256] (0: "
              "automatic); got ", a.num_splits);
  // The attention itself: query and the cache as (batch, heads, seq, dim) views.
  check_common(query.transpose(1, 2), key_cache.transpose(1, 2), value_cache.transpose(1, 2), opts, limits,
               query.size(0));
  const int64_t capacity = a.paged() ? a.block_table.size(1) * key_cache.size(1) : key_cache.size(1);
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(capacity <= kIntMax && key_cache.size(0) <= kIntMax, "flashcore: cache capacity and rows must be below"
              " 2^31; got ", capacity, " and ", key_cache.size(0));
  if (query.is_cpu()) check_kvcache_values(a, key_cache.size(0), capacity);
}

std::tuple<at::Tensor, at::Tensor> alloc_kvcache_outputs(const at::Tensor& query) {
  at::Tensor out = at::empty_like(query);
  const auto lse_dtype = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor lse = at::empty({query.size(0), query.size(2), query.size(1)}, query.options().dtype(lse_dtype));
  poison_if_enabled({out, lse});
  return {out, lse};
}

void fill_no_key_outputs(at::Tensor& out, at::Tensor& lse, const AttentionOptions& opts) {
  out.zero_();
  if (opts.sinks.defined())
    lse.copy_(opts.sinks.view({1, -1, 1}).expand_as(lse));
  else
    lse.fill_(-std::numeric_limits<double>::infinity());
}

DecodeParams make_decode_params(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& out, const at::Tensor& lse, const KvCacheArgs& a,
                                const AttentionOptions& opts) {
  DecodeParams p;
  p.f = make_fwd_params(query.transpose(1, 2), key_cache.transpose(1, 2), value_cache.transpose(1, 2),
                        out.transpose(1, 2), lse, opts);
  p.f.batch = query.size(0);
  KvCacheParams& kv = p.kv;
  kv.cache_seqlens = a.cache_seqlens.defined() ? a.cache_seqlens.data_ptr<int32_t>() : nullptr;
  kv.cache_batch_idx = a.cache_batch_idx.defined() ? a.cache_batch_idx.data_ptr<int32_t>() : nullptr;
  kv.cache_leftpad = a.cache_leftpad.defined() ? a.cache_leftpad.data_ptr<int32_t>() : nullptr;
  kv.cache_rows = key_cache.size(0);
  if (a.paged()) {
    kv.block_table = a.block_table.data_ptr<int32_t>();
    kv.block_table_stride = a.block_table.stride(0);
    kv.max_pages = a.block_table.size(1);
    kv.page_size = key_cache.size(1);
    kv.page_div = FastDiv(kv.page_size);
    kv.capacity = kv.max_pages * kv.page_size;
  } else {
    kv.capacity = key_cache.size(1);
  }
  p.f.seqlen_k = kv.capacity;
  p.f.band = p.f.mask.band(p.f.seqlen_q, p.f.seqlen_k);  // per entry: mask.band(seqlen_q, kv_seq(b).seqlen_k)
  p.f.score.alibi_offset = 0;                            // per entry as well
  p.num_splits = 1;
  p.lse_batch_stride = p.f.heads_q * p.f.seqlen_q;
  p.lse_head_stride = p.f.seqlen_q;
  return p;
}

DecodeParams make_varlen_decode_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                       const at::Tensor& out, const at::Tensor& lse, const VarlenArgs& args,
                                       const AttentionOptions& opts) {
  auto one_query = [](const at::Tensor& t) { return t.unsqueeze(2); };                 // (batch, heads, 1, dim)
  auto one_row = [](const at::Tensor& t) { return t.unsqueeze(0).transpose(1, 2); };  // (1, heads, total_k, dim)
  DecodeParams p;
  p.f = make_fwd_params(one_query(query), one_row(key), one_row(value), one_query(out), lse, opts);
  KvCacheParams& kv = p.kv;
  const int32_t* starts = args.cu_seqlens_k.data_ptr<int32_t>();
  kv.cache_leftpad = starts;
  kv.seqlens_from_leftpad = args.seqused_k.defined();
  kv.cache_seqlens = kv.seqlens_from_leftpad ? args.seqused_k.data_ptr<int32_t>() : starts + 1;
  kv.max_seqlen_k = args.max_seqlen_k;
  kv.cache_rows = 1;
  kv.capacity = key.size(0);
  p.f.seqlen_k = args.max_seqlen_k;
  p.f.band = p.f.mask.band(p.f.seqlen_q, p.f.seqlen_k);  // per entry: mask.band(1, kv_seq(b).seqlen_k)
  p.f.score.alibi_offset = 0;
  p.lse_batch_stride = p.f.seqlen_q;  // the varlen layout (heads_q, total_q); seqlen_q 1, total_q = batch
  p.lse_head_stride = p.f.batch * p.f.seqlen_q;
  return p;
}

}  // namespace flashcore
