// Autograd for flashcore::fwd, registered in C++ at the Autograd dispatch key (for every backend).
//
// Why C++ and not torch.library.register_autograd: a Python autograd kernel runs on every call, even with no
// input requiring grad, and costs ~10 us of host time per call; a small attention call is host-bound, so that
// time is the whole difference to SDPA (docs/PERFORMANCE.md, "Host path"). torch.compile traces through this
// node like any C++ autograd kernel: forward and backward reach the fake kernels registered in flashcore/ops.py.
//
// The backward calls flashcore::bwd, which has no autograd of its own (double backward is not supported).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
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
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["bottom_right"] = bottom_right;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &out = saved[3], &lse = saved[4], &sinks = saved[5], &alibi = saved[6];
    at::Tensor dout = grads[0];
    if (!dout.defined()) {
      dout = at::zeros_like(out);  // only lse was used: out's gradient is zero
    } else if (dout.stride(-1) != 1) {
      dout = dout.contiguous();  // e.g. the expanded (zero-stride) gradient of out.sum()
    }
    const CallOptions o{ctx->saved_data["scale"].toDouble(),       ctx->saved_data["causal"].toBool(),
                        ctx->saved_data["bottom_right"].toBool(),  ctx->saved_data["window_left"].toInt(),
                        ctx->saved_data["window_right"].toInt(),   ctx->saved_data["softcap"].toDouble(),
                        ctx->saved_data["deterministic"].toBool()};
    // The bitwise-reproducible backward: asked for by the call (deterministic=True) or globally by
    // torch.use_deterministic_algorithms(True) when the backward runs.
    const bool deterministic = o.deterministic || at::globalContext().deterministicAlgorithms();
    auto [dq, dk, dv] = call_bwd(dout, saved[0], saved[1], saved[2], out, lse, o, deterministic, optional_of(alibi));
    // d out_i / d sink = -p_sink,i out_i with p_sink,i = exp(sink - lse_i), so
    // d loss / d sink_h = -sum over (b, i) of p_sink * rowsum(dout * out). A row with lse = -inf (no key, sink
    // -inf) contributes 0 (exp(nan) -> 0).
    at::Tensor dsinks;
    if (sinks.defined() && ctx->needs_input_grad(3)) {
      const at::Tensor rowsum = (dout.to(lse.scalar_type()) * out.to(lse.scalar_type())).sum(-1);  // (B, Hq, Sq)
      const at::Tensor p_sink = (sinks.view({1, -1, 1}) - lse).exp_().nan_to_num_(0.0);
      dsinks = -(p_sink * rowsum).sum(at::IntArrayRef{0, 2}).to(sinks.scalar_type());
    }
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

}  // namespace

TORCH_LIBRARY_IMPL(flashcore, Autograd, m) { m.impl("fwd", &fwd_autograd); }

}  // namespace flashcore
