// Autograd for flashcore::fwd, registered in C++ at the Autograd dispatch key (for every backend).
//
// Why C++ and not torch.library.register_autograd: a Python autograd kernel runs on every call, even with no
// input requiring grad, and costs ~10 us of host time per call; a small attention call is host-bound, so that
// time is the whole difference to SDPA (docs/PERFORMANCE.md, "Host path"). torch.compile traces through this
// node like any C++ autograd kernel: forward and backward reach the fake kernels registered in flashcore/ops.py.
//
// The backward calls flashcore::bwd. Its gradients are not differentiable (no double backward, as in flash-attn):
// bwd's own Autograd kernel below gives them a node that raises when differentiated.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <tuple>

namespace flashcore {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The options of one call, as the schemas order them after the tensors.
struct CallOptions {
  double scale;
  bool causal, bottom_right;
  int64_t window_left, window_right;
  double softcap;
  bool deterministic;
};

std::tuple<at::Tensor, at::Tensor> call_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const CallOptions& o, const std::optional<at::Tensor>& sinks,
                                            const std::optional<at::Tensor>& alibi) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("flashcore::fwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                    bool, bool, int64_t, int64_t, double, bool,
                                                    const std::optional<at::Tensor>&,
                                                    const std::optional<at::Tensor>&)>();
  return op.call(q, k, v, o.scale, o.causal, o.bottom_right, o.window_left, o.window_right, o.softcap,
                 o.deterministic, sinks, alibi);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& lse,
                                                        const CallOptions& o, bool deterministic,
                                                        const std::optional<at::Tensor>& alibi) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("flashcore::bwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, double, bool, bool, int64_t, int64_t, double, bool,
              const std::optional<at::Tensor>&)>();
  return op.call(dout, q, k, v, out, lse, o.scale, o.causal, o.bottom_right, o.window_left, o.window_right,
                 o.softcap, deterministic, alibi);
}

std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The options travel from forward to backward in the node's saved_data.
void save_options(AutogradContext* ctx, const CallOptions& o) {
  ctx->saved_data["scale"] = o.scale;
  ctx->saved_data["causal"] = o.causal;
  ctx->saved_data["bottom_right"] = o.bottom_right;
  ctx->saved_data["window_left"] = o.window_left;
  ctx->saved_data["window_right"] = o.window_right;
  ctx->saved_data["softcap"] = o.softcap;
  ctx->saved_data["deterministic"] = o.deterministic;
}

CallOptions saved_options(AutogradContext* ctx) {
  return CallOptions{ctx->saved_data["scale"].toDouble(),       ctx->saved_data["causal"].toBool(),
                     ctx->saved_data["bottom_right"].toBool(),  ctx->saved_data["window_left"].toInt(),
                     ctx->saved_data["window_right"].toInt(),   ctx->saved_data["softcap"].toDouble(),
                     ctx->saved_data["deterministic"].toBool()};
}

// out's incoming gradient as the kernels take it: zeros when only lse was used, a contiguous last dim otherwise
// (e.g. the expanded, zero-stride gradient of out.sum()).
at::Tensor grad_for_kernels(const at::Tensor& grad, const at::Tensor& out) {
  if (!grad.defined()) return at::zeros_like(out);
  return grad.stride(-1) != 1 ? grad.contiguous() : grad;
}

// d out_i / d sink = -p_sink,i out_i with p_sink,i = exp(sink - lse_i), so
// d loss / d sink_h = -sum over the rows of head h of p_sink * rowsum(dout * out). Only rows with a finite lse count:
// a row that saw no key and no sink has lse = -inf, and rows outside every sequence of a varlen batch have lse = -inf
// and an unspecified out (torch.where keeps both out of the sum, NaN included).
// Dense: out/dout (B, Hq, Sq, D), lse (B, Hq, Sq). Packed (varlen): out/dout (total_q, Hq, D), lse (Hq, total_q).
at::Tensor sinks_grad(const at::Tensor& sinks, const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                      bool packed) {
  const auto dt = lse.scalar_type();
  at::Tensor rowsum = (dout.to(dt) * out.to(dt)).sum(-1);
  if (packed) rowsum = rowsum.t();  // (Hq, total_q), lse's layout
  const at::Tensor sink = packed ? sinks.view({-1, 1}) : sinks.view({1, -1, 1});
  const at::Tensor terms = (sink.to(dt) - lse).exp() * rowsum;
  const at::Tensor kept = at::where(at::isfinite(lse), terms, at::zeros_like(terms));
  return -kept.sum(packed ? at::IntArrayRef{1} : at::IntArrayRef{0, 2}).to(sinks.scalar_type());
}

// The bitwise-reproducible backward: asked for by the call (deterministic=True) or globally by
// torch.use_deterministic_algorithms(True) when the backward runs.
bool backward_deterministic(const CallOptions& o) {
  return o.deterministic || at::globalContext().deterministicAlgorithms();
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  // Only q, k, v and sinks are differentiable (ALiBi slopes are constants, as in flash-attn).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi,
                               double scale, bool causal, bool bottom_right, int64_t window_left,
                               int64_t window_right, double softcap, bool deterministic) {
    // Below autograd: the call reaches the CPU/CUDA/fake kernel instead of this one again.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const CallOptions o{scale, causal, bottom_right, window_left, window_right, softcap, deterministic};
    auto [out, lse] = call_fwd(q, k, v, o, sinks, alibi);
    ctx->save_for_backward({q, k, v, out, lse, sinks.value_or(at::Tensor()), alibi.value_or(at::Tensor())});
    save_options(ctx, o);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &out = saved[3], &lse = saved[4], &sinks = saved[5], &alibi = saved[6];
    const at::Tensor dout = grad_for_kernels(grads[0], out);
    const CallOptions o = saved_options(ctx);
    auto [dq, dk, dv] =
        call_bwd(dout, saved[0], saved[1], saved[2], out, lse, o, backward_deterministic(o), optional_of(alibi));
    at::Tensor dsinks;
    if (sinks.defined() && ctx->needs_input_grad(3)) dsinks = sinks_grad(sinks, dout, out, lse, /*packed=*/false);
    return {dq, dk, dv, dsinks, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                double scale, bool causal, bool bottom_right, int64_t window_left,
                                                int64_t window_right, double softcap, bool deterministic,
                                                const std::optional<at::Tensor>& sinks,
                                                const std::optional<at::Tensor>& alibi) {
  variable_list outs = AttentionFunction::apply(q, k, v, sinks, alibi, scale, causal, bottom_right, window_left,
                                                window_right, softcap, deterministic);
  return {outs[0], outs[1]};
}

// ---- Variable-length batches: the same node over varlen_fwd/varlen_bwd ----

struct VarlenShape {
  int64_t max_seqlen_q, max_seqlen_k;
};

std::tuple<at::Tensor, at::Tensor> call_varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& cu_q, const at::Tensor& cu_k,
                                                   const VarlenShape& vs, const CallOptions& o,
                                                   const std::optional<at::Tensor>& sinks,
                                                   const std::optional<at::Tensor>& alibi,
                                                   const std::optional<at::Tensor>& seqused_k) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("flashcore::varlen_fwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
              int64_t, double, bool, int64_t, int64_t, double, bool, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  return op.call(q, k, v, cu_q, cu_k, vs.max_seqlen_q, vs.max_seqlen_k, o.scale, o.causal, o.window_left,
                 o.window_right, o.softcap, o.deterministic, sinks, alibi, seqused_k);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, const VarlenShape& vs,
    const CallOptions& o, bool deterministic, const std::optional<at::Tensor>& alibi,
    const std::optional<at::Tensor>& seqused_k) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("flashcore::varlen_bwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, double, bool, int64_t,
              int64_t, double, bool, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  return op.call(dout, q, k, v, out, lse, cu_q, cu_k, vs.max_seqlen_q, vs.max_seqlen_k, o.scale, o.causal,
                 o.window_left, o.window_right, o.softcap, deterministic, alibi, seqused_k);
}

class VarlenAttentionFunction : public torch::autograd::Function<VarlenAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& sinks, const at::Tensor& cu_q, const at::Tensor& cu_k,
                               int64_t max_seqlen_q, int64_t max_seqlen_k, const std::optional<at::Tensor>& alibi,
                               const std::optional<at::Tensor>& seqused_k, double scale, bool causal,
                               int64_t window_left, int64_t window_right, double softcap, bool deterministic) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const CallOptions o{scale, causal, true, window_left, window_right, softcap, deterministic};
    const VarlenShape vs{max_seqlen_q, max_seqlen_k};
    auto [out, lse] = call_varlen_fwd(q, k, v, cu_q, cu_k, vs, o, sinks, alibi, seqused_k);
    ctx->save_for_backward({q, k, v, out, lse, sinks.value_or(at::Tensor()), alibi.value_or(at::Tensor()), cu_q,
                            cu_k, seqused_k.value_or(at::Tensor())});
    save_options(ctx, o);
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &out = saved[3], &lse = saved[4], &sinks = saved[5], &alibi = saved[6];
    const at::Tensor dout = grad_for_kernels(grads[0], out);
    const CallOptions o = saved_options(ctx);
    const VarlenShape vs{ctx->saved_data["max_seqlen_q"].toInt(), ctx->saved_data["max_seqlen_k"].toInt()};
    auto [dq, dk, dv] = call_varlen_bwd(dout, saved[0], saved[1], saved[2], out, lse, saved[7], saved[8], vs, o,
                                        backward_deterministic(o), optional_of(alibi), optional_of(saved[9]));
    at::Tensor dsinks;
    if (sinks.defined() && ctx->needs_input_grad(3)) dsinks = sinks_grad(sinks, dout, out, lse, /*packed=*/true);
    variable_list grads_in(16);
    grads_in[0] = dq;
    grads_in[1] = dk;
    grads_in[2] = dv;
    grads_in[3] = dsinks;
    return grads_in;
  }
};

std::tuple<at::Tensor, at::Tensor> varlen_fwd_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q, const at::Tensor& cu_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, bool deterministic, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& alibi, const std::optional<at::Tensor>& seqused_k) {
  variable_list outs = VarlenAttentionFunction::apply(q, k, v, sinks, cu_q, cu_k, max_seqlen_q, max_seqlen_k, alibi,
                                                      seqused_k, scale, causal, window_left, window_right, softcap,
                                                      deterministic);
  return {outs[0], outs[1]};
}

// The backward ops' Autograd kernels. Where autograd records (a backward with create_graph=True, or a direct call
// on inputs that require grad), their gradients get an Error node: differentiating them again raises. Without
// this, PyTorch's fallback for an op with no autograd kernel only warned and gave a second derivative of zeros.
// Without recording (every ordinary backward) this is one more dispatcher hop.
using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

template <typename... Inputs>
Grads not_differentiable_again(Grads grads, const Inputs&... inputs) {
  if (torch::autograd::compute_requires_grad(inputs...)) {
    std::shared_ptr<torch::autograd::Error> node(
        new torch::autograd::Error("flashcore: the attention backward is not differentiable (double backward, "
                                   "e.g. a gradient of gradients taken with create_graph=True, is not supported)",
                                   torch::autograd::collect_next_edges(inputs...)),
        torch::autograd::deleteNode);
    torch::autograd::set_history(std::get<0>(grads), node);
    torch::autograd::set_history(std::get<1>(grads), node);
    torch::autograd::set_history(std::get<2>(grads), node);
  }
  return grads;
}

Grads bwd_autograd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, double scale, bool causal, bool bottom_right,
                   int64_t window_left, int64_t window_right, double softcap, bool deterministic,
                   const std::optional<at::Tensor>& alibi) {
  Grads grads = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const CallOptions o{scale, causal, bottom_right, window_left, window_right, softcap, deterministic};
    return call_bwd(dout, q, k, v, out, lse, o, deterministic, alibi);
  }();
  return not_differentiable_again(std::move(grads), dout, q, k, v, out, lse);
}

Grads varlen_bwd_autograd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_q,
                          const at::Tensor& cu_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                          bool causal, int64_t window_left, int64_t window_right, double softcap, bool deterministic,
                          const std::optional<at::Tensor>& alibi, const std::optional<at::Tensor>& seqused_k) {
  Grads grads = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const CallOptions o{scale, causal, true, window_left, window_right, softcap, deterministic};
    return call_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, VarlenShape{max_seqlen_q, max_seqlen_k}, o,
                           deterministic, alibi, seqused_k);
  }();
  return not_differentiable_again(std::move(grads), dout, q, k, v, out, lse);
}

}  // namespace

TORCH_LIBRARY_IMPL(flashcore, Autograd, m) {
  m.impl("fwd", &fwd_autograd);
  m.impl("varlen_fwd", &varlen_fwd_autograd);
  m.impl("bwd", &bwd_autograd);
  m.impl("varlen_bwd", &varlen_bwd_autograd);
  // Inference only: the KV-cache op's outputs carry no autograd history (as flash-attn's flash_attn_with_kvcache,
  // a plain kernel call), instead of PyTorch's fallback that warns and hands a backward zero gradients.
  m.impl("kvcache_fwd", torch::CppFunction::makeFallthrough());
}

}  // namespace flashcore
