"""Python side of the flashcore ops: fake (meta) kernels, autograd, and the friendly entry points.

The schemas and the CPU/CUDA kernels live in C++ (csrc/flashcore/ops.cpp); `torch.ops.flashcore.fwd` and
`torch.ops.flashcore.bwd` work in eager mode, under torch.compile (through the fake kernels below) and inside CUDA
graphs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["attention", "flash_attn_func", "fwd_kernel_name", "bwd_kernel_name", "last_kernel"]


# ----------------------------------------------------------------------------------------------------------------
# Fake (meta) kernels: shapes, dtypes and strides of the outputs, the same rules as the C++ allocation
# (attention_host.cpp: out = empty_like(query), lse = (B, Hq, Sq) float32 contiguous).
# ----------------------------------------------------------------------------------------------------------------


@torch.library.register_fake("flashcore::fwd")
def _fwd_fake(query, key, value, softmax_scale, is_causal=False, causal_bottom_right=False, window_left=-1,
              window_right=-1, softcap=0.0, deterministic=False):
    torch._check(query.dim() == 4, lambda: f"flashcore: query must be 4-D; got {query.dim()}-D")
    torch._check(key.dim() == 4 and value.dim() == 4, lambda: "flashcore: key and value must be 4-D")
    out = torch.empty_like(query)
    lse = query.new_empty((query.size(0), query.size(1), query.size(2)), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flashcore::bwd")
def _bwd_fake(grad_out, query, key, value, out, lse, softmax_scale, is_causal=False, causal_bottom_right=False,
              window_left=-1, window_right=-1, softcap=0.0, deterministic=False):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


# ----------------------------------------------------------------------------------------------------------------
# Autograd: registered in C++ (csrc/flashcore/autograd.cpp) at the Autograd key; a Python autograd kernel would
# add ~10 us of host time to every call. out's gradient goes through flashcore::bwd; lse is not differentiable;
# fwd's deterministic=True or torch.use_deterministic_algorithms(True) selects the bitwise-reproducible backward.
# ----------------------------------------------------------------------------------------------------------------

_fwd_op = torch.ops.flashcore.fwd.default


# ----------------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------------


def _check_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flashcore.attention: {name} must be a torch.Tensor; got {type(t).__name__}")


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    return_lse: bool = False,
    deterministic: bool = False,
):
    """Exact fused attention with the semantics of ``torch.nn.functional.scaled_dot_product_attention``.

    query: (B, Hq, Sq, D); key, value: (B, Hkv, Sk, D), any strides with a contiguous last dim (BSHD tensors
    passed as ``x.transpose(1, 2)`` views are read in place). 3-D inputs (B, S, D) are treated as one head.
    is_causal masks as SDPA does (top-left aligned when Sq != Sk). scale defaults to 1/sqrt(D). With
    enable_gqa=True, Hq may be a multiple of Hkv (grouped-query attention; K/V are never copied per head).
    attn_mask and dropout_p exist for drop-in compatibility and must be None and 0.

    deterministic=True makes the backward bitwise reproducible run to run (on CUDA it then sums dQ without
    atomics, at a large cost in speed: docs/PERFORMANCE.md); torch.use_deterministic_algorithms(True) does the same
    for every call. The forward is always deterministic.

    Returns out (shape and dtype of query), or (out, lse) with return_lse=True, lse being the float32
    (B, Hq, Sq) natural-log log-sum-exp of each row of scaled scores (not differentiable).
    """
    _check_tensor(query, "query")
    _check_tensor(key, "key")
    _check_tensor(value, "value")
    if attn_mask is not None:
        raise NotImplementedError("flashcore.attention: attn_mask is not supported; use is_causal for causal masks")
    if dropout_p != 0.0:
        raise NotImplementedError("flashcore.attention: dropout_p must be 0 (dropout is not supported)")
    if query.dim() != key.dim() or query.dim() != value.dim():
        raise RuntimeError(
            f"flashcore.attention: query, key and value must have the same rank; got query {query.dim()}-D, "
            f"key {key.dim()}-D, value {value.dim()}-D"
        )
    if query.dim() not in (3, 4):
        raise RuntimeError(
            f"flashcore.attention: query must be 4-D (batch, heads, seq_len, head_dim) or 3-D; got "
            f"{query.dim()}-D with shape {tuple(query.shape)}"
        )
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    if not enable_gqa and query.size(1) != key.size(1):
        raise RuntimeError(
            f"flashcore.attention: query has {query.size(1)} heads but key has {key.size(1)}; pass enable_gqa=True "
            "for grouped-query attention"
        )
    if scale is None:
        head_dim = query.size(-1)
        softmax_scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    else:
        softmax_scale = float(scale)
    out, lse = _fwd_op(query, key, value, softmax_scale, bool(is_causal), False, -1, -1, 0.0, bool(deterministic))
    if squeeze:
        out, lse = out.squeeze(1), lse.squeeze(1)
    return (out, lse) if return_lse else out


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False, deterministic=False):
    """flash-attn style call: q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D) (BSHD), causal aligned bottom-right
    (query i sees keys j <= i + Sk - Sq), GQA whenever Hq is a multiple of Hkv. Returns out in BSHD
    (and lse (B, Hq, Sq) with return_lse=True)."""
    _check_tensor(q, "q")
    _check_tensor(k, "k")
    _check_tensor(v, "v")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise RuntimeError(f"flashcore.flash_attn_func: {name} must be 4-D (batch, seq_len, heads, head_dim)")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.size(-1)) if q.size(-1) > 0 else 1.0
    out, lse = _fwd_op(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), float(softmax_scale), bool(causal), bool(causal),
        -1, -1, 0.0, bool(deterministic),
    )
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def fwd_kernel_name(query, key, value, is_causal=False) -> str:
    """Which forward kernel family flashcore runs for these inputs ("cpu", "sm80", "sm90")."""
    return torch.ops.flashcore.fwd_kernel_name(query, key, value, bool(is_causal))


def bwd_kernel_name(grad_out, query, key, value, deterministic=False) -> str:
    """Which backward path flashcore runs for these inputs ("cpu", "sm80", "sm90", "composite")."""
    return torch.ops.flashcore.bwd_kernel_name(grad_out, query, key, value, bool(deterministic))


def last_kernel(pass_: str = "fwd") -> str:
    """The kernel the last forward ("fwd") or backward ("bwd") call ran, process-wide, e.g. "sm90 hdim128 wg2",
    "sm90 hdim64 wg1 splits3", "sm80 hdim64", "composite", "cpu" ("none" before any call or after an empty one).
    For tests and benchmarks: it says which path really ran, after any fallback."""
    from . import _C

    return _C._last_kernel(pass_)
