"""flashcore.attention under torch.func transforms (grad, vjp, jacrev, vmap of those), as SDPA runs there.

The op's autograd is a C++ torch::autograd::Function (csrc/flashcore/autograd.cpp: no Python on the common path,
whose host time bounds small calls), and functorch refuses C++ autograd Functions. While a transform is active,
flashcore.attention runs the same forward and backward ops through this Python Function instead: forward `fwd`,
backward `bwd` and the sinks' gradient, as the C++ node computes them. Outside transforms nothing here runs.
"""

from __future__ import annotations

import torch

_fwd_op = torch.ops.flashcore.fwd.default
_bwd_op = torch.ops.flashcore.bwd.default


def transforms_active() -> bool:
    """Whether a torch.func transform is active (never under torch.compile, whose graphs take the C++ node)."""
    return not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()


def _sinks_grad(sinks, dout, out, lse):
    """d loss / d sink_h = -sum over head h's rows of exp(sink_h - lse) * rowsum(dout * out), over rows with a finite
    lse (autograd.cpp's sinks_grad, dense layout: out (B, Hq, Sq, D), lse (B, Hq, Sq))."""
    rowsum = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    terms = (sinks.view(1, -1, 1).to(lse.dtype) - lse).exp() * rowsum
    return -torch.where(torch.isfinite(lse), terms, torch.zeros_like(terms)).sum((0, 2)).to(sinks.dtype)


class FunctorchAttention(torch.autograd.Function):
    """flashcore::fwd with its backward, in the form functorch takes (forward without ctx, setup_context)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, scale, causal, bottom_right, left, right, softcap, deterministic, sinks, alibi):
        """The op's arguments, in its schema's order."""
        return _fwd_op(q, k, v, scale, causal, bottom_right, left, right, softcap, deterministic, sinks, alibi)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, *options, sinks, alibi = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, sinks, alibi)
        ctx.options = options
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks, alibi = ctx.saved_tensors
        scale, causal, bottom_right, left, right, softcap, deterministic = ctx.options
        deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
        dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, scale, causal, bottom_right, left, right, softcap,
                             deterministic, alibi)
        dsinks = _sinks_grad(sinks, dout, out, lse) if sinks is not None and ctx.needs_input_grad[10] else None
        return dq, dk, dv, None, None, None, None, None, None, None, dsinks, None
