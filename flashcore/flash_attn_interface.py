"""flash-attn 2.x's Python interface on flashcore's kernels: code written for flash-attn runs by changing one import,

    from flashcore.flash_attn_interface import flash_attn_func   # was: from flash_attn import flash_attn_func

with flash-attn's argument names, order, defaults, return values and layouts: inputs (batch, seqlen, heads,
head_dim) (BSHD), causal and sliding windows aligned bottom-right (query i sees keys up to i + Sk - Sq),
window_size as a pair or a 2-element tensor, any head dim up to 256 (padded to a multiple of 8 here, as flash-attn
does), softmax_lse (batch, heads, seqlen_q) float32 with return_attn_probs=True. The varlen functions take
sequences packed as (total, heads, head_dim) with int32 cu_seqlens offsets and return softmax_lse as (heads,
total_q). What flashcore does not implement
raises NotImplementedError naming the argument: dropout_p > 0.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .ops import _check_tensor, pad_head_dim, window_pair

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
]

_fwd_op = torch.ops.flashcore.fwd.default
_varlen_fwd_op = torch.ops.flashcore.varlen_fwd.default


def _check_dropout(dropout_p, fn):
    if dropout_p:
        raise NotImplementedError(f"{fn}: dropout_p={dropout_p} is not supported (flashcore has no dropout); "
                                  "pass dropout_p=0.0")


def _attention_bshd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                    return_attn_probs, fn, sinks=None):
    """The shared body of the dense functions: BSHD in and out, flash-attn's bottom-right alignment."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(t, name, fn)
        if t.dim() != 4:
            raise RuntimeError(f"{fn}: {name} must be 4-D (batch, seqlen, nheads, headdim); got {t.dim()}-D with "
                               f"shape {tuple(t.shape)}")
    _check_dropout(dropout_p, fn)
    left, right = window_pair(window_size, fn)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.size(-1)) if q.size(-1) > 0 else 1.0
    (q, k, v), head_dim = pad_head_dim([q, k, v])
    out, lse = _fwd_op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), float(softmax_scale), bool(causal),
                       True, left, right, float(softcap), bool(deterministic), sinks, alibi_slopes)
    out = out.transpose(1, 2)
    if out.size(-1) != head_dim:
        out = out[..., :head_dim]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim) with nheads a multiple
    of nheads_k (MQA/GQA). Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, None) with
    return_attn_probs=True (flash-attn returns the dropout pattern third, which needs dropout)."""
    return _attention_bshd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, "flash_attn_func")


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv (batch, seqlen, 3, nheads, headdim): q, k and v stacked (read in place, no copy)."""
    _check_tensor(qkv, "qkv", "flash_attn_qkvpacked_func")
    if qkv.dim() != 5 or qkv.size(2) != 3:
        raise RuntimeError(f"flash_attn_qkvpacked_func: qkv must be (batch, seqlen, 3, nheads, headdim); got shape "
                           f"{tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)
    return _attention_bshd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, "flash_attn_qkvpacked_func")


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim): k and v stacked."""
    _check_tensor(kv, "kv", "flash_attn_kvpacked_func")
    if kv.dim() != 5 or kv.size(2) != 2:
        raise RuntimeError(f"flash_attn_kvpacked_func: kv must be (batch, seqlen_k, 2, nheads_k, headdim); got "
                           f"shape {tuple(kv.shape)}")
    k, v = kv.unbind(2)
    return _attention_bshd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, "flash_attn_kvpacked_func")


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, fn, block_table=None, sinks=None,
            seqused_k=None):
    """The shared body of the varlen functions: packed (total, heads, head_dim) in and out."""
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        _check_tensor(t, name, fn)
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 3:
            raise RuntimeError(f"{fn}: {name} must be 3-D (total_tokens, nheads, headdim); got {t.dim()}-D with "
                               f"shape {tuple(t.shape)}")
    _check_dropout(dropout_p, fn)
    if block_table is not None:
        raise NotImplementedError(f"{fn}: block_table (paged KV) is not supported by the varlen functions; use "
                                  "contiguous packed k/v")
    left, right = window_pair(window_size, fn)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.size(-1)) if q.size(-1) > 0 else 1.0
    (q, k, v), head_dim = pad_head_dim([q, k, v])
    out, lse = _varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                              float(softmax_scale), bool(causal), left, right, float(softcap), bool(deterministic),
                              sinks, alibi_slopes, seqused_k)
    if out.size(-1) != head_dim:
        out = out[..., :head_dim]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim): sequences packed along the first dim,
    sequence b at rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (int32, (batch + 1,)). Causal and windows align
    bottom-right in each sequence. Returns out (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q),
    None) with return_attn_probs=True. block_table (paged KV) is not supported here."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs, "flash_attn_varlen_func",
                   block_table=block_table)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, nheads, headdim): q, k and v of the same sequences stacked (read in place)."""
    fn = "flash_attn_varlen_qkvpacked_func"
    _check_tensor(qkv, "qkv", fn)
    if qkv.dim() != 4 or qkv.size(1) != 3:
        raise RuntimeError(f"{fn}: qkv must be (total, 3, nheads, headdim); got shape {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs, fn)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim): k and v stacked."""
    fn = "flash_attn_varlen_kvpacked_func"
    _check_tensor(kv, "kv", fn)
    if kv.dim() != 4 or kv.size(1) != 2:
        raise RuntimeError(f"{fn}: kv must be (total_k, 2, nheads_k, headdim); got shape {tuple(kv.shape)}")
    k, v = kv.unbind(1)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs, fn)
