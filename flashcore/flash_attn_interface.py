"""flash-attn 2.x's Python interface on flashcore's kernels: code written for flash-attn runs by changing one import,

    from flashcore.flash_attn_interface import flash_attn_func   # was: from flash_attn import flash_attn_func

with flash-attn's argument names, order, defaults, return values and layouts: inputs (batch, seqlen, heads,
head_dim) (BSHD), causal and sliding windows aligned bottom-right (query i sees keys up to i + Sk - Sq),
window_size as a pair or a 2-element tensor, any head dim up to 256 (padded to a multiple of 8 here, as flash-attn
does), softmax_lse (batch, heads, seqlen_q) float32 with return_attn_probs=True. The varlen functions take
sequences packed as (total, heads, head_dim) with int32 cu_seqlens offsets and return softmax_lse as (heads,
total_q). flash_attn_with_kvcache attends new queries to a dense or paged KV cache, appending new keys/values
(rotated by rotary_cos/rotary_sin when given) into the cache in place first, as flash-attn 2.x does; its index
arguments are read on the device without a sync (torch.compile and CUDA graphs work). What flashcore does not
implement raises NotImplementedError naming the argument: dropout_p > 0.

Where flash-attn's documentation and its kernels differ, this module follows the kernels: window_size is rewritten
as flash-attn's C++ side rewrites it (_flash_window), and inputs of any strides are accepted (maybe_contiguous).
The lower-level _flash_attn_forward / _flash_attn_backward (and varlen) functions keep flash-attn 2.8's signatures.
One deliberate difference: a row that sees no key has LSE -inf (flash-attn 2 writes +inf), out 0 in both. Under
ALiBi the returned softmax_lse is flash-attn's too where its causal kernel runs (_shift_alibi_lse).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .layers.rotary import rotate_rows
from .ops import (_check_tensor, _float32_vector, custom_op_flag_arg, float_arg, int_arg, maybe_contiguous,
                  packed_rows, pad_head_dim, window_pair)

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
]

# Names flash-attn 2.8's interface module also exports, which its own tests (tests/test_flash_attn.py) and ring-attention
# code import: no ROCm Triton backend here; the block sizes its CUDA kernels tile S_dmask by.
USE_TRITON_ROCM = False


def round_multiple(x, m):
    """x rounded up to a multiple of m (flash-attn's helper)."""
    return (x + m - 1) // m * m


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block width of flash-attn 2's forward kernel for a head dim on a device (flash-attn's helper, used to
    unpack its dropout S_dmask; flashcore returns no S_dmask to unpack, the value is flash-attn's)."""
    assert head_dim <= 256
    major, minor = torch.cuda.get_device_capability(device)
    sm8x_not_sm80 = major == 8 and minor > 0
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96 or head_dim > 128:
        return 64
    if is_dropout:
        return 32
    return 64 if (is_causal or not sm8x_not_sm80) else 32


_fwd_op = torch.ops.flashcore.fwd.default
_bwd_op = torch.ops.flashcore.bwd.default
_varlen_fwd_op = torch.ops.flashcore.varlen_fwd.default
_varlen_bwd_op = torch.ops.flashcore.varlen_bwd.default
_kvcache_fwd_op = torch.ops.flashcore.kvcache_fwd.default


def _flash_cpp_window(left, right, causal, seqlen_k):
    """The first of flash-attn 2's C++ rewrites of window_size (csrc/flash_attn/flash_api.cpp: mha_fwd, mha_varlen_fwd
    with max_seqlen_k, mha_fwd_kvcache with the cache's capacity): a negative side or one >= seqlen_k is unbounded
    (-1), causal sets right = 0. flash-attn runs its causal kernel (params.is_causal) iff then left < 0 and right == 0.
    A negative side is unbounded as in flash-attn's C++ (flashcore's own API refuses values below -1)."""
    left, right = max(left, -1), max(right, -1)
    left = -1 if left >= seqlen_k else left
    right = 0 if causal else (-1 if right >= seqlen_k else right)
    return left, right


def _flash_window(left, right, causal, seqlen_q, seqlen_k):
    """The window flash-attn 2's kernels apply for window_size=(left, right): _flash_cpp_window, then (set_params_fprop)
    a one-sided window gets seqlen_k on its unbounded side. That last step changes the mask where seqlen_q > seqlen_k
    + 1 (query i then sees keys up to i + 2 seqlen_k - seqlen_q only). Bounds that no query meets (left >= seqlen_k -
    1, right >= seqlen_q - 1) go back to -1, so the op keeps its unbanded kernels. Varlen calls pass max_seqlen_q/k,
    as flash-attn does."""
    left, right = _flash_cpp_window(left, right, causal, seqlen_k)
    if left < 0 and right >= 0:
        left = seqlen_k
    if left >= 0 and right < 0:
        right = seqlen_k
    left = -1 if left >= seqlen_k - 1 else left
    right = -1 if right >= seqlen_q - 1 and not causal else right
    return left, right


def _causal_alibi_kernel(alibi_slopes, sinks, causal, left, right, seqlen_k):
    """Whether the returned LSE takes flash-attn's causal-kernel ALiBi form (_shift_alibi_lse): ALiBi on a call that
    flash-attn 2 runs on its causal kernel (_flash_cpp_window). Not with sinks, which flash-attn 2 does not have: the
    LSE is then flashcore's own, of the defined logits and the sink."""
    if alibi_slopes is None or sinks is not None:
        return False
    left, right = _flash_cpp_window(left, right, causal, seqlen_k)
    return left < 0 and right == 0


def _shift_alibi_lse(lse, slopes, diagonal, sign):
    """softmax_lse as flash-attn 2's causal kernel writes it under ALiBi (sign=1), or back to flashcore's (sign=-1).
    That kernel adds slope * j to key j's score (csrc/flash_attn/src/mask.h, Mask::apply_mask: "Simpler, we add the
    same bias vector to all rows") where its other kernels, and flashcore's, add -slope * |i + Sk - Sq - j|; within
    a causal row (j <= i + Sk - Sq) the two differ by slope * (i + Sk - Sq) for every key, so probabilities, out and
    gradients agree and only the LSE moves by it. diagonal: i + Sk - Sq of each lse entry and slopes, both
    broadcast against lse. Rows that see no key stay -inf. The float32 LSE carries the shift's magnitude, so a
    round trip (the lower-level forward, then backward) loses what flash-attn's own LSE loses: ~1e-3 relative in
    the gradients at slope 0.5 and 100k keys."""
    return lse + sign * slopes * diagonal.to(lse.dtype)


def _dense_alibi_lse(lse, alibi_slopes, seqlen_k_minus_q, sign=1.0):
    """_shift_alibi_lse for lse (batch, heads, seqlen_q); seqlen_k_minus_q an int (a size) or a (batch,) tensor."""
    Sq = lse.size(-1)
    diagonal = torch.arange(Sq, device=lse.device)[None, None, :]  # (1, 1, Sq)
    if isinstance(seqlen_k_minus_q, torch.Tensor):
        diagonal = diagonal + seqlen_k_minus_q.to(lse.device).long()[:, None, None]  # (batch, 1, Sq)
    else:
        diagonal = diagonal + seqlen_k_minus_q
    slopes = alibi_slopes.to(lse.device)
    slopes = slopes[:, :, None] if slopes.dim() == 2 else slopes[None, :, None]  # (1 or batch, heads, 1)
    return _shift_alibi_lse(lse, slopes, diagonal, sign)


def _varlen_alibi_lse(lse, alibi_slopes, cu_seqlens_q, lens_k, max_seqlen_q, sign=1.0):
    """_shift_alibi_lse for a varlen lse (heads, total_q): row t of sequence b at i = t - cu_seqlens_q[b], Sq that
    sequence's queries as the kernels clamp them (seqlen.h: varlen_seqlen_q) and Sk = lens_k[b] (as the caller's
    kernel clamps it). Device ops only, no sync."""
    total_q = lse.size(-1)
    if total_q == 0 or cu_seqlens_q.numel() < 2:
        return lse
    t, b = packed_rows(cu_seqlens_q, total_q)
    cu = cu_seqlens_q.long()
    starts = cu[:-1].clamp(0, total_q)
    lens_q = (torch.maximum(cu[1:].clamp(max=total_q), starts) - starts).clamp(max=max(int(max_seqlen_q), 0))
    diagonal = (t - starts[b] + lens_k.long()[b] - lens_q[b])[None, :]
    slopes = alibi_slopes[:, None] if alibi_slopes.dim() == 1 else alibi_slopes[b].transpose(0, 1)  # (H, 1 or total)
    return _shift_alibi_lse(lse, slopes, diagonal, sign)


def _varlen_key_lengths(cu_seqlens_k, seqused_k, total_k, max_seqlen_k):
    """Each sequence's keys as the varlen kernels clamp them (seqlen.h: varlen_seq_info): cu_seqlens_k into the
    tensor, seqused_k into that, both into max_seqlen_k."""
    cu = cu_seqlens_k.long()
    begin = cu[:-1].clamp(0, total_k)
    lens = torch.maximum(cu[1:].clamp(max=total_k), begin) - begin
    if seqused_k is not None:
        lens = torch.minimum(seqused_k.long().clamp(min=0), lens)
    return lens.clamp(max=max(int(max_seqlen_k), 0))


def _cache_key_lengths(seqlens, cache_leftpad, capacity):
    """Each KV-cache entry's keys as the kernels clamp them (paged_kv.h: kv_seq): its end into the capacity, its left
    pad into its end."""
    end = seqlens.long().clamp(0, capacity)
    if cache_leftpad is None:
        return end
    return end - torch.minimum(cache_leftpad.long().clamp(min=0), end)


def _scale(softmax_scale, head_dim, fn):
    """flash-attn's default 1/sqrt(headdim) (of the unpadded head dim), or the caller's value as a float."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return float_arg(softmax_scale, "softmax_scale", fn)


class CacheCapacityError(ValueError, RuntimeError):
    """New tokens that do not fit a KV cache (or the pages a block_table addresses) at an int cache_seqlens: a
    ValueError as flashcore's argument checks raise, and a RuntimeError as flash-attn's (a TORCH_CHECK)."""


def _no_dropout_mask(q):
    """What flash-attn returns as S_dmask without dropout: an empty tensor of q's dtype (its kernels fill one only
    for dropout_p > 0)."""
    return q.new_empty((0,))


def _rng_state(q):
    """flash-attn's rng_state: a (2,) int64 tensor (Philox seed and offset), zeros here (no dropout)."""
    return torch.zeros(2, dtype=torch.int64, device=q.device)


def _check_kv_like_q(q, kv, fn):
    """kv (the packed k and v) with q's dtype, device and head dim, named as the caller passed it (the op would name
    key and value)."""
    _check_tensor(q, "q", fn)
    if kv.dtype != q.dtype or kv.device != q.device:
        raise RuntimeError(f"{fn}: kv has dtype {kv.dtype} on {kv.device} but q has {q.dtype} on {q.device}")
    if kv.size(-1) != q.size(-1):
        raise RuntimeError(f"{fn}: kv has head dim {kv.size(-1)} but q has {q.size(-1)}")


def _flash_softcap(softcap, fn):
    """flash-attn's softcap: a value <= 0 turns it off ("<=0.0 means deactivate"); NaN stays an error (the op's)."""
    softcap = float_arg(softcap, "softcap", fn, default=0.0, float32=True)
    return 0.0 if softcap <= 0 else softcap


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
    causal = custom_op_flag_arg(causal, "causal", fn)
    deterministic = custom_op_flag_arg(deterministic, "deterministic", fn)
    return_attn_probs = custom_op_flag_arg(return_attn_probs, "return_attn_probs", fn)
    sinks, alibi_slopes = _float32_vector(sinks, "sinks", fn), _float32_vector(alibi_slopes, "alibi_slopes", fn)
    window = window_pair(window_size, fn)
    left, right = _flash_window(*window, causal, q.size(1), k.size(1))
    softcap = _flash_softcap(softcap, fn)
    softmax_scale = _scale(softmax_scale, q.size(-1), fn)
    (q, k, v), head_dim = pad_head_dim([maybe_contiguous(x) for x in (q, k, v)])
    out, lse = _fwd_op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), float(softmax_scale), bool(causal),
                       True, left, right, float(softcap), bool(deterministic), sinks, alibi_slopes)
    out = out.transpose(1, 2)
    if out.size(-1) != head_dim:
        out = out[..., :head_dim]
    if not return_attn_probs:
        return out
    if _causal_alibi_kernel(alibi_slopes, sinks, causal, *window, k.size(1)):
        lse = _dense_alibi_lse(lse, alibi_slopes, k.size(1) - q.size(1))
    return out, lse, _no_dropout_mask(q)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim) with nheads a multiple
    of nheads_k (MQA/GQA). Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, S_dmask) with
    return_attn_probs=True; S_dmask is empty (flash-attn's dropout pattern, which needs dropout)."""
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
    _check_kv_like_q(q, kv, "flash_attn_kvpacked_func")
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
        want = 4 if block_table is not None and name != "q" else 3
        if t.dim() != want:
            shape = ("num_blocks, page_block_size, nheads_k, headdim) with block_table" if want == 4
                     else "total_tokens, nheads, headdim)")
            raise RuntimeError(f"{fn}: {name} must be {want}-D ({shape}; got {t.dim()}-D with shape "
                               f"{tuple(t.shape)}")
    _check_dropout(dropout_p, fn)
    max_seqlen_q, max_seqlen_k = int_arg(max_seqlen_q, "max_seqlen_q", fn), int_arg(max_seqlen_k, "max_seqlen_k", fn)
    causal = custom_op_flag_arg(causal, "causal", fn)
    deterministic = custom_op_flag_arg(deterministic, "deterministic", fn)
    return_attn_probs = custom_op_flag_arg(return_attn_probs, "return_attn_probs", fn)
    sinks, alibi_slopes = _float32_vector(sinks, "sinks", fn), _float32_vector(alibi_slopes, "alibi_slopes", fn)
    if seqused_k is not None:
        _check_tensor(seqused_k, "seqused_k", fn)
    window = window_pair(window_size, fn)
    left, right = _flash_window(*window, causal, max_seqlen_q, max_seqlen_k)
    softcap = _flash_softcap(softcap, fn)
    softmax_scale = _scale(softmax_scale, q.size(-1), fn)
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    if block_table is not None:
        _check_paged_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, fn)
        out, lse, paged_lens_k = _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                                               softmax_scale, causal, left, right, softcap, alibi_slopes, sinks,
                                               seqused_k)
    else:
        (q, k, v), head_dim = pad_head_dim([q, k, v])
        out, lse = _varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                  float(softmax_scale), bool(causal), left, right, float(softcap), bool(deterministic),
                                  sinks, alibi_slopes, seqused_k)
        if out.size(-1) != head_dim:
            out = out[..., :head_dim]
    if not return_attn_probs:
        return out
    if _causal_alibi_kernel(alibi_slopes, sinks, causal, *window, max_seqlen_k):
        if block_table is not None:  # the KV-cache op's lengths, clamped into the pages
            lens_k = _cache_key_lengths(paged_lens_k, None, block_table.size(1) * k.size(1))
        else:
            lens_k = _varlen_key_lengths(cu_seqlens_k, seqused_k, k.size(0), max_seqlen_k)
        lse = _varlen_alibi_lse(lse, alibi_slopes, cu_seqlens_q, lens_k, max_seqlen_q)
    return out, lse, _no_dropout_mask(q)


def _varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, softmax_scale, causal,
                  left, right, softcap, alibi_slopes, sinks, seqused_k):
    """flash_attn_varlen_func with block_table (paged prefill): sequence b's keys are the first
    cu_seqlens_k[b+1] - cu_seqlens_k[b] (or seqused_k[b]) of its pages; returns (out, lse, those lengths). Runs on the KV-cache op: each sequence's
    queries are placed at the END of a (batch, max_seqlen_q) block (left padding), so the op's bottom-right alignment
    to the block's length is each sequence's own; the rows are gathered back into the packed layout. Index
    arithmetic only, on the device: no sync."""
    # No sequence has more queries than q has rows: a larger max_seqlen_q would only pad the block.
    B, total_q = cu_seqlens_q.numel() - 1, q.size(0)
    Mq = min(int(max_seqlen_q), max(total_q, 1))
    dev = q.device
    starts = cu_seqlens_q[:-1].long()
    lens_q = (cu_seqlens_q[1:].long() - starts).clamp(0, Mq)  # the varlen kernels' rule: at most max_seqlen_q
    pad = Mq - lens_q                                        # padding rows before each sequence's queries
    r = torch.arange(Mq, device=dev)
    src = (starts[:, None] + r[None, :] - pad[:, None]).clamp(0, max(total_q - 1, 0))
    q_block = q[src] if total_q > 0 else q.new_zeros(B, Mq, *q.shape[1:])  # (B, Mq, Hq, D); pad rows: any row
    lens_k = seqused_k if seqused_k is not None else (cu_seqlens_k[1:] - cu_seqlens_k[:-1])
    if (not lens_k.is_cuda and lens_k.numel() and isinstance(block_table, torch.Tensor) and block_table.dim() == 2
            and not torch.compiler.is_compiling()):
        # Free on the host (the op checks too, naming its own cache_seqlens); on a GPU this would be a sync, so
        # there the kernels clamp to the pages instead.
        capacity = block_table.size(1) * k_cache.size(1)
        longest = int(lens_k.max())
        if longest > capacity:
            what = "seqused_k" if seqused_k is not None else "cu_seqlens_k[b + 1] - cu_seqlens_k[b]"
            raise RuntimeError(f"flash_attn_varlen_func: max({what}) = {longest} keys exceed the capacity addressable "
                               f"by block_table ({block_table.size(1)} pages of {k_cache.size(1)} = {capacity})")
    (qp, kc, vc), head_dim = pad_head_dim([q_block, k_cache, v_cache])
    out_block, lse_block = _kvcache_fwd_op(qp, kc, vc, lens_k.to(torch.int32).contiguous(), block_table, None, None,
                                           float(softmax_scale), bool(causal), left, right, float(softcap), sinks,
                                           alibi_slopes, 0)
    # packed row t: sequence b, padded row t - starts[b] + pad[b]; rows outside every sequence: lse -inf and out 0,
    # as the varlen op gives them
    t, b = packed_rows(cu_seqlens_q, total_q)
    row = (t - starts[b] + pad[b]).clamp(0, max(Mq - 1, 0))
    inside = (t >= starts[b]) & (t - starts[b] < lens_q[b])
    out = torch.where(inside[:, None, None], out_block[b, row], 0.0)[..., :head_dim]
    lse = torch.where(inside[None, :], lse_block[b, :, row].transpose(0, 1), float("-inf"))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        out = _PagedNoBackward.apply(out, q, k_cache, v_cache)
    return out, lse, lens_k


class _PagedNoBackward(torch.autograd.Function):
    """Marks a paged prefill's output as depending on q, k and v, with a backward that raises: the KV-cache op has
    no gradient (flash-attn's varlen backward rejects a block_table too), and a silent None gradient is worse."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("flash_attn_varlen_func: block_table (paged K/V) has no backward; run paged "
                                  "prefill under torch.no_grad() or with inputs that do not require grad")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim): sequences packed along the first dim,
    sequence b at rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (int32, (batch + 1,)). Causal and windows align
    bottom-right in each sequence. Returns out (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q),
    S_dmask) with return_attn_probs=True, S_dmask empty as in flash_attn_func. block_table (int32 (batch, max_num_blocks_per_seq)) makes k and v paged
    caches (num_blocks, page_block_size, nheads_k, headdim) as in flash-attn: sequence b's keys are the first
    cu_seqlens_k[b+1] - cu_seqlens_k[b] of its pages (paged prefill; forward only)."""
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
    # The shared body names cu_seqlens_q / max_seqlen_q; the caller passed one of each.
    _check_index(cu_seqlens, "cu_seqlens", fn, qkv, rows=cu_seqlens.numel() if isinstance(cu_seqlens, torch.Tensor)
                 else 0, what="(batch + 1,)")
    int_arg(max_seqlen, "max_seqlen", fn, minimum=1)
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
    _check_kv_like_q(q, kv, fn)
    k, v = kv.unbind(1)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs, fn)


# ----------------------------------------------------------------------------------------------------------------
# flash-attn's autograd Function classes, for code that calls e.g. FlashAttnFunc.apply(...) directly: the same
# positional arguments (flash-attn 2.8, is_grad_enabled last), run through the functions above (flashcore's own
# autograd); is_grad_enabled=False records no graph, as flash-attn's forward saves nothing then.
# ----------------------------------------------------------------------------------------------------------------


def _apply_as(fn, is_grad_enabled, *args):
    if is_grad_enabled is None or is_grad_enabled:
        return fn(*args)
    with torch.no_grad():
        return fn(*args)


class FlashAttnFunc:
    @staticmethod
    def apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              return_softmax, is_grad_enabled=None):
        return _apply_as(flash_attn_func, is_grad_enabled, q, k, v, dropout_p, softmax_scale, causal, window_size,
                         softcap, alibi_slopes, deterministic, return_softmax)


class FlashAttnQKVPackedFunc:
    @staticmethod
    def apply(qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              return_softmax, is_grad_enabled=None):
        return _apply_as(flash_attn_qkvpacked_func, is_grad_enabled, qkv, dropout_p, softmax_scale, causal,
                         window_size, softcap, alibi_slopes, deterministic, return_softmax)


class FlashAttnKVPackedFunc:
    @staticmethod
    def apply(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              return_softmax, is_grad_enabled=None):
        return _apply_as(flash_attn_kvpacked_func, is_grad_enabled, q, kv, dropout_p, softmax_scale, causal,
                         window_size, softcap, alibi_slopes, deterministic, return_softmax)


class FlashAttnVarlenFunc:
    @staticmethod
    def apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
              window_size, softcap, alibi_slopes, deterministic, return_softmax, block_table=None,
              is_grad_enabled=None):
        return _apply_as(flash_attn_varlen_func, is_grad_enabled, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         deterministic, return_softmax, block_table)


class FlashAttnVarlenQKVPackedFunc:
    @staticmethod
    def apply(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
              deterministic, return_softmax, is_grad_enabled=None):
        return _apply_as(flash_attn_varlen_qkvpacked_func, is_grad_enabled, qkv, cu_seqlens, max_seqlen, dropout_p,
                         softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_softmax)


class FlashAttnVarlenKVPackedFunc:
    @staticmethod
    def apply(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
              window_size, softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled=None):
        return _apply_as(flash_attn_varlen_kvpacked_func, is_grad_enabled, q, kv, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                         alibi_slopes, deterministic, return_softmax)


# ----------------------------------------------------------------------------------------------------------------
# flash-attn's lower-level functions, which libraries built on flash-attn call directly (ring attention, context
# parallelism): the same signatures and returns (no dropout: S_dmask is empty, rng_state zeros).
# ----------------------------------------------------------------------------------------------------------------


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                        alibi_slopes, return_softmax):
    """flash-attn 2.x's _flash_attn_forward: q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k,
    headdim). Returns (out, softmax_lse (batch, nheads, seqlen_q), S_dmask (an empty tensor: no dropout),
    rng_state ((2,) int64))."""
    out, lse, _ = _attention_bshd(q, k, v, dropout_p, softmax_scale, causal, (window_size_left, window_size_right),
                                  softcap, alibi_slopes, False, True, "_flash_attn_forward")
    return out, lse, _no_dropout_mask(q), _rng_state(q)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    """flash-attn 2.x's _flash_attn_backward: writes the gradients into dq, dk, dv (those given) and returns softmax_d
    (batch, nheads, seqlen_q rounded up to 128) float32, rowsum(dout * out)."""
    fn = "_flash_attn_backward"
    _check_dropout(dropout_p, fn)
    window = window_pair((window_size_left, window_size_right), fn)
    left, right = _flash_window(*window, causal, q.size(1), k.size(1))
    alibi_slopes = _float32_vector(alibi_slopes, "alibi_slopes", fn)
    if _causal_alibi_kernel(alibi_slopes, None, causal, *window, k.size(1)):  # as _flash_attn_forward returned it
        softmax_lse = _dense_alibi_lse(softmax_lse, alibi_slopes, k.size(1) - q.size(1), sign=-1.0)
    softmax_scale = _scale(softmax_scale, q.size(-1), fn)
    head_dim = q.size(-1)
    (q_, k_, v_, o_, do_), _ = pad_head_dim([maybe_contiguous(x) for x in (q, k, v, out, dout)])
    grads = _bwd_op(do_.transpose(1, 2), q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
                    o_.transpose(1, 2), softmax_lse, float(softmax_scale), bool(causal), True, left, right,
                    float(softcap), bool(deterministic), alibi_slopes)
    for dst, g in zip((dq, dk, dv), grads):
        if dst is not None:
            dst.copy_(g.transpose(1, 2)[..., :head_dim])
    B, Sq, H = q.shape[:3]
    softmax_d = torch.zeros(B, H, (Sq + 127) // 128 * 128, dtype=torch.float32, device=q.device)
    softmax_d[:, :, :Sq] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return softmax_d


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """flash-attn 2.x's _flash_attn_varlen_forward: packed (total, nheads, headdim) inputs. Returns (out, softmax_lse
    (nheads, total_q), S_dmask (an empty tensor: no dropout), rng_state ((2,) int64))."""
    fn = "_flash_attn_varlen_forward"
    if leftpad_k is not None:
        raise NotImplementedError(f"{fn}: leftpad_k is not supported; pass leftpad_k=None")
    if block_table is not None and num_splits > 1:
        raise RuntimeError(f"{fn}: num_splits > 1 is not supported for varlen paged KV (block_table); got "
                           f"num_splits={num_splits}")
    out, lse, _ = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                          causal, (window_size_left, window_size_right), softcap, alibi_slopes, False, True, fn,
                          block_table=block_table, seqused_k=seqused_k)
    return out, lse, _no_dropout_mask(q), _rng_state(q)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    """flash-attn 2.x's _flash_attn_varlen_backward: writes the gradients into dq, dk, dv (those given) and returns
    softmax_d (nheads, total_q + 128 * batch) float32 in flash-attn's padded layout: rowsum(dout * out) of packed
    row t of sequence b at column t + 128 b, zeros elsewhere."""
    fn = "_flash_attn_varlen_backward"
    _check_dropout(dropout_p, fn)
    window = window_pair((window_size_left, window_size_right), fn)
    left, right = _flash_window(*window, causal, int(max_seqlen_q), int(max_seqlen_k))
    alibi_slopes = _float32_vector(alibi_slopes, "alibi_slopes", fn)
    if _causal_alibi_kernel(alibi_slopes, None, causal, *window, int(max_seqlen_k)):  # as the forward returned it
        lens_k = _varlen_key_lengths(cu_seqlens_k, None, k.size(0), max_seqlen_k)
        softmax_lse = _varlen_alibi_lse(softmax_lse, alibi_slopes, cu_seqlens_q, lens_k, max_seqlen_q, sign=-1.0)
    softmax_scale = _scale(softmax_scale, q.size(-1), fn)
    head_dim = q.size(-1)
    (q_, k_, v_, o_, do_), _ = pad_head_dim([maybe_contiguous(x) for x in (q, k, v, out, dout)])
    grads = _varlen_bwd_op(do_, q_, k_, v_, o_, softmax_lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                           int(max_seqlen_k), float(softmax_scale), bool(causal), left, right, float(softcap),
                           bool(deterministic), alibi_slopes, None)
    for dst, g in zip((dq, dk, dv), grads):
        if dst is not None:
            dst.copy_(g[..., :head_dim])
    rowsum = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # (nheads, total_q)
    batch, total_q = cu_seqlens_q.numel() - 1, q.size(0)
    t, seq = packed_rows(cu_seqlens_q, total_q)
    softmax_d = rowsum.new_zeros(rowsum.size(0), total_q + 128 * batch)
    softmax_d[:, t + 128 * seq] = rowsum
    return softmax_d


# ----------------------------------------------------------------------------------------------------------------
# KV cache (inference): flash_attn_with_kvcache = the append (here, in PyTorch ops) + torch.ops.flashcore.kvcache_fwd
# ----------------------------------------------------------------------------------------------------------------


def _check_index(t, name, fn, q, dims=1, rows=None, what=None):
    """An int32 index tensor on q's device with `rows` rows (default q.size(0), the batch); `what` describes its
    shape in the message (the op checks these too, but after the append, and under its own names)."""
    _check_tensor(t, name, fn)
    if t.dtype != torch.int32:
        raise RuntimeError(f"{fn}: {name} must be int32 (torch.int32); got {t.dtype}")
    if t.device != q.device:
        raise RuntimeError(f"{fn}: {name} is on {t.device} but q is on {q.device}")
    rows = q.size(0) if rows is None else rows
    if t.dim() != dims or t.size(0) != rows:
        want = what or ("(batch,)" if dims == 1 else "(batch, max_num_blocks_per_seq)")
        raise RuntimeError(f"{fn}: {name} must have shape {want} with {rows} rows; got {tuple(t.shape)}")


def _check_paged_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, fn):
    """The varlen op's argument checks for the paged prefill, which runs on the KV-cache op instead: offsets int32,
    1-D, batch + 1 long, on q's device; max_seqlen at least 1; on the CPU (no sync there) also the offsets' values."""
    batch = cu_seqlens_q.numel() - 1 if isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1 else 0
    for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        _check_index(t, name, fn, q, rows=max(batch + 1, 1), what="(batch + 1,)")
    if seqused_k is not None:
        _check_index(seqused_k, "seqused_k", fn, q, rows=batch, what="(batch,)")
    for value, name in ((max_seqlen_q, "max_seqlen_q"), (max_seqlen_k, "max_seqlen_k")):
        int_arg(value, name, fn, minimum=1)
    if q.is_cuda or torch.compiler.is_compiling():
        return
    for cu, name, total in ((cu_seqlens_q, "cu_seqlens_q", q.size(0)), (cu_seqlens_k, "cu_seqlens_k", None)):
        lens = cu[1:] - cu[:-1]
        if int(cu[0]) < 0 or (lens.numel() and int(lens.min()) < 0):
            raise RuntimeError(f"{fn}: {name} must start at 0 or more and never decrease; got {cu.tolist()}")
        if total is not None and int(cu[-1]) > total:
            raise RuntimeError(f"{fn}: {name}[-1] = {int(cu[-1])} exceeds the {total} rows of q")
    longest = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch else 0
    if longest > max_seqlen_q:
        raise RuntimeError(f"{fn}: a sequence has {longest} queries, more than max_seqlen_q = {max_seqlen_q}")


def _check_before_append(q, k_cache, v_cache, seqlens, num_new, capacity, block_table, cache_batch_idx,
                         cache_leftpad, softmax_scale, causal, left, right, softcap, sinks, alibi_slopes, num_splits,
                         fn):
    """What the KV-cache op would refuse, checked before the new keys and values are written into the caches: the
    op checks only after the append, and a call that raises must leave the caches as they were (flash-attn checks
    before it writes). Everything that needs no index values is checked here; on the CPU, where reading them costs
    no sync, the op's own checks run on zero query rows (the lengths as they will be after the append). On a GPU
    the values are not read: the kernels clamp to the caches whatever they say."""
    B, _, Hq, D = q.shape
    Hkv = k_cache.size(2)
    dtypes = (torch.float16, torch.bfloat16) if q.is_cuda else (torch.float16, torch.bfloat16, torch.float32,
                                                                 torch.float64)
    if q.dtype not in dtypes:
        raise RuntimeError(f"{fn}: q has dtype {q.dtype}; the {q.device.type.upper()} kernels take "
                           f"{', '.join(str(d) for d in dtypes)}")
    if Hkv == 0 or Hq % Hkv:
        raise RuntimeError(f"{fn}: q's nheads ({Hq}) must be a multiple of the cache's nheads_k ({Hkv})")
    if D > 256:
        raise RuntimeError(f"{fn}: head dim {D} is not supported; at most 256")
    for t, name, batched in ((sinks, "sinks", False), (alibi_slopes, "alibi_slopes", True)):
        if t is not None and (t.dtype != torch.float32 or t.device != q.device
                              or not (tuple(t.shape) == (Hq,) or (batched and tuple(t.shape) == (B, Hq)))):
            shapes = f"({Hq},)" + (f" or ({B}, {Hq})" if batched else "")
            raise RuntimeError(f"{fn}: {name} must be float32 of shape {shapes} on q's device; got {t.dtype} of "
                               f"shape {tuple(t.shape)} on {t.device}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise RuntimeError(f"{fn}: softcap must be finite and >= 0 (0: off); got {softcap}")
    if block_table is None and cache_batch_idx is None and k_cache.size(0) < B:
        raise RuntimeError(f"{fn}: k_cache has {k_cache.size(0)} rows but the batch has {B} entries; pass "
                           "cache_batch_idx to map entries to cache rows")
    if not 0 <= num_splits <= 256:
        raise RuntimeError(f"{fn}: num_splits must be in [0, 256] (0: automatic); got {num_splits}")
    if not q.is_cuda and not torch.compiler.is_compiling():
        after = torch.clamp(seqlens + num_new, max=capacity)
        _kvcache_fwd_op(q[:, :0], k_cache, v_cache, after, block_table, cache_batch_idx, cache_leftpad,
                        float(softmax_scale), bool(causal), left, right, float(softcap), sinks, alibi_slopes,
                        num_splits)


def _apply_rotary(x, cos, sin, positions, interleaved):
    """x (B, S, H, D) with its first rotary_dim = 2 * cos.size(1) dims rotated by the angles at rows `positions`
    (B, S) of cos/sin (seqlen_ro, rotary_dim / 2): interleaved rotates GPT-J pairs (x[2i], x[2i+1]), otherwise
    GPT-NeoX halves (x[i], x[i + rotary_dim/2]). Computed in float32 (float64 for float64 x) and rounded to x's
    dtype once, as flash-attn's kernel (and its apply_rotary_emb) does."""
    if cos.size(1) == 0 or x.size(1) == 0:
        return x
    return rotate_rows(x, cos[positions], sin[positions], interleaved)


def _append_slots(seqlens, num_new, capacity, cache, block_table, cache_batch_idx):
    """Where the append writes, without reading any index on the host (no sync, static shapes: torch.compile and
    CUDA graphs): (first, second) index the cache's first two dims, keep says which of the B * num_new new tokens
    are written; all flat (B * num_new,).

    Token i of entry b belongs at absolute position seqlens[b] + i of its cache row (dense: row cache_batch_idx[b]
    or b) or, paged, at row p % page_size of page block_table[b, p // page_size]. A token whose position is outside
    [0, capacity), or whose row or page is outside the cache, is dropped: it is written nowhere. Indices are
    clamped into the tensors before any read, so nothing is accessed out of bounds whatever the values say."""
    B = seqlens.size(0)
    rows = cache.size(0)
    pos = seqlens.long()[:, None] + torch.arange(num_new, device=seqlens.device)
    keep = (pos >= 0) & (pos < capacity)
    pos = pos.clamp(0, capacity - 1)
    if block_table is not None:
        page_size = cache.size(1)
        page = block_table.gather(1, pos // page_size).long()
        keep = keep & (page >= 0) & (page < rows)
        first, second = page.clamp(0, rows - 1), pos % page_size
    else:
        row = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(B, device=seqlens.device)
        keep = keep & ((row >= 0) & (row < rows))[:, None]
        first, second = row.clamp(0, rows - 1)[:, None].expand(B, num_new), pos
    return first.reshape(-1), second.reshape(-1), keep.reshape(-1)


def _append(cache, new, first, second, keep):
    """cache[first[j], second[j]] = new token j where keep[j], in one index_put_ and without a sync. A static-shape
    write cannot leave tokens out, so a dropped token repeats the write of the first kept token (the same slot, the
    same value: duplicates that agree, whatever order they land in), or, when no token is kept, writes the first
    slot's own value back. Unlike writing a dropped token's own slot back to itself, this never races with a kept
    token written to that slot (an out-of-range page clamped onto a page that another entry appends to)."""
    new = new.reshape(-1, *new.shape[2:])
    sink = torch.argmax(keep.to(torch.int32)).reshape(1)  # the first kept token (0 when none is), a 1-D index
    sink_value = torch.where(keep[sink][:, None, None], new[sink], cache[first[sink], second[sink]])
    value = torch.where(keep[:, None, None], new, sink_value)
    cache.index_put_((torch.where(keep, first, first[sink]), torch.where(keep, second, second[sink])), value)


def _check_caches(q, k_cache, v_cache, block_table, cache_batch_idx, cache_leftpad, fn):
    """q and the caches (4-D, q's dtype and device, unit-stride rows, one head dim), the index tensors; returns the
    keys a sequence's cache can hold (paged: the block table's pages times the page size)."""
    for t, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        _check_tensor(t, name, fn)
        if t.dim() != 4:
            dims = "batch, seqlen, nheads, headdim" if name == "q" else "batch_cache, seqlen_cache, nheads_k, headdim"
            raise RuntimeError(f"{fn}: {name} must be 4-D ({dims}); got {t.dim()}-D with shape {tuple(t.shape)}")
    D = q.size(3)
    for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if cache.dtype != q.dtype:
            raise RuntimeError(f"{fn}: {name} has dtype {cache.dtype} but q has dtype {q.dtype}; the cache must have "
                               "q's dtype")
        if cache.device != q.device:
            raise RuntimeError(f"{fn}: {name} is on {cache.device} but q is on {q.device}")
        if cache.stride(-1) != 1:
            raise RuntimeError(f"{fn}: {name} must have a contiguous last dimension (it is read and updated in place)")
    if v_cache.shape != k_cache.shape:
        raise RuntimeError(f"{fn}: v_cache must have k_cache's shape {tuple(k_cache.shape)}; got "
                           f"{tuple(v_cache.shape)}")
    if k_cache.size(3) != D:
        raise RuntimeError(f"{fn}: k_cache has head dim {k_cache.size(3)} but q has {D}")
    if block_table is not None:
        if cache_batch_idx is not None:
            raise RuntimeError(f"{fn}: cache_batch_idx cannot be combined with block_table (a paged cache maps batch "
                               "entries to pages through block_table)")
        _check_index(block_table, "block_table", fn, q, dims=2)
        capacity = block_table.size(1) * k_cache.size(1)
    else:
        capacity = k_cache.size(1)
    for t, name in ((cache_batch_idx, "cache_batch_idx"), (cache_leftpad, "cache_leftpad")):
        if t is not None:
            _check_index(t, name, fn, q)
    return capacity


def _check_new_kv(q, k, v, k_cache, capacity, block_table, fn):
    """The new keys and values to append (both or neither; (batch, seqlen_new, nheads_k, headdim)); returns
    seqlen_new (0 without them)."""
    B, Sq, _, D = q.shape
    if (k is None) != (v is None):
        raise RuntimeError(f"{fn}: k and v (the new keys and values to append) must be given together; got only "
                           f"{'k' if v is None else 'v'}")
    if k is not None:
        _check_tensor(k, "k", fn)
        _check_tensor(v, "v", fn)
        want = (B, k.size(1) if k.dim() == 4 else -1, k_cache.size(2), D)
        for t, name in ((k, "k"), (v, "v")):
            if t.dim() != 4 or tuple(t.shape) != want:
                raise RuntimeError(f"{fn}: {name} must have shape (batch, seqlen_new, nheads_k, headdim) = "
                                   f"{tuple(want)} (batch and headdim of q, nheads_k of the cache, k's seqlen_new); "
                                   f"got {tuple(t.shape)}")
            if t.dtype != q.dtype or t.device != q.device:
                raise RuntimeError(f"{fn}: {name} must have q's dtype and device ({q.dtype}, {q.device}); got "
                                   f"{t.dtype} on {t.device}")
        Sn = k.size(1)
        if Sn > capacity:
            raise RuntimeError(f"{fn}: k has seqlen_new = {Sn} new tokens but the cache holds at most {capacity} "
                               "keys per sequence")
        if Sq > capacity:  # flash-attn's mha_fwd_kvcache refuses this too
            raise RuntimeError(f"{fn}: q has seqlen_q = {Sq} but the cache holds at most {capacity} keys; with new "
                               "keys (k) supplied, seqlen_q must be <= the seqlen of the KV cache (as in flash-attn)")
        if B > 0 and k_cache.size(0) == 0:
            raise RuntimeError(f"{fn}: k_cache has no {'pages' if block_table is not None else 'rows'} to append to")
        return Sn
    return 0


def _cache_lengths(q, cache_seqlens, has_new, num_new, capacity, k_cache, block_table, fn):
    """cache_seqlens as the int32 (batch,) tensor the op takes: None is the capacity (not with new keys), an int is
    checked against it (with the num_new new tokens), a tensor is taken as it is (reading it would sync)."""
    B, Sn = q.size(0), num_new
    if cache_seqlens is None:
        if has_new:
            raise RuntimeError(f"{fn}: cache_seqlens is required with k/v (it says where to append them)")
        return torch.full((B,), capacity, dtype=torch.int32, device=q.device)
    if isinstance(cache_seqlens, (int, torch.SymInt)) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - Sn:
            where = (f"the capacity addressable by block_table ({block_table.size(1)} pages of {k_cache.size(1)})"
                     if block_table is not None else "the cache's capacity")
            raise CacheCapacityError(f"{fn}: cache_seqlens = {cache_seqlens}"
                                     + (f" plus {Sn} new tokens (k)" if Sn else "") + f" does not fit {where}: "
                                     f"{capacity} keys")
        return torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    if isinstance(cache_seqlens, torch.Tensor):
        _check_index(cache_seqlens, "cache_seqlens", fn, q)
        return cache_seqlens
    raise TypeError(f"{fn}: cache_seqlens must be an int or an int32 tensor of shape (batch,); got "
                    f"{type(cache_seqlens).__name__}")


def _check_rotary(q, rotary_cos, rotary_sin, has_new, capacity, fn):
    """rotary_cos/rotary_sin: both or neither, only with new keys, (seqlen_ro >= capacity, rotary_dim / 2)."""
    D = q.size(3)
    if (rotary_cos is None) != (rotary_sin is None):
        raise RuntimeError(f"{fn}: rotary_cos and rotary_sin must be given together; got only "
                           f"{'rotary_cos' if rotary_sin is None else 'rotary_sin'}")
    if rotary_cos is not None:
        _check_tensor(rotary_cos, "rotary_cos", fn)
        _check_tensor(rotary_sin, "rotary_sin", fn)
        if not has_new:
            raise RuntimeError(f"{fn}: rotary_cos/rotary_sin need the new k and v to append (as in flash-attn)")
        if rotary_cos.dim() != 2 or rotary_sin.shape != rotary_cos.shape:
            raise RuntimeError(f"{fn}: rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2); got "
                               f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        if 2 * rotary_cos.size(1) > D:
            raise RuntimeError(f"{fn}: rotary_dim = 2 * rotary_cos.size(1) = {2 * rotary_cos.size(1)} exceeds the "
                               f"head dim {D}")
        if rotary_cos.size(0) < capacity:
            raise RuntimeError(f"{fn}: rotary_cos/rotary_sin have {rotary_cos.size(0)} positions (seqlen_ro) but the "
                               f"cache holds {capacity}; seqlen_ro must be at least the cache's capacity")
        for t, name in ((rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin")):
            if t.device != q.device or not t.is_floating_point():
                raise RuntimeError(f"{fn}: {name} must be a floating-point tensor on q's device ({q.device}); got "
                                   f"{t.dtype} on {t.device}")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, sinks=None):
    """Attention of q (batch, seqlen_q, nheads, headdim) to a KV cache, with flash-attn 2.x's signature and rules.

    k_cache/v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or paged (num_blocks, page_block_size,
    nheads_k, headdim) with block_table (batch, max_num_blocks_per_seq) int32 (key position p of entry b is row
    p % page_block_size of page block_table[b, p // page_block_size]; any page size). The capacity is seqlen_cache,
    or max_num_blocks_per_seq * page_block_size. cache_seqlens: int or int32 (batch,) tensor, the keys each entry
    has in the cache (None: the capacity); cache_batch_idx (int32 (batch,), dense caches only) maps entries to
    cache rows; cache_leftpad (int32 (batch,)): entry b's keys start there. Entry b attends keys
    [cache_leftpad[b], cache_seqlens[b] + seqlen_new); causal and window_size align bottom-right to them
    (query i sees keys up to i + seqlen_k - seqlen_q, seqlen_k counted from the left pad).

    k, v (batch, seqlen_new, nheads_k, headdim): written into the caches in place at positions cache_seqlens[b] + i
    before the attention (the caller's cache_seqlens is not changed; advance it yourself). With an int
    cache_seqlens a k/v that does not fit raises (CacheCapacityError: a ValueError, and a RuntimeError as flash-attn
    raises); with a tensor nothing is read on the host (no sync: this works under torch.compile and in CUDA graphs;
    flash-attn syncs to check paged calls) and tokens that would land past the capacity are dropped (the attention
    then sees the capacity's keys).

    rotary_cos/rotary_sin (seqlen_ro >= capacity, rotary_dim / 2), only with k/v: q and the new k are rotated in
    their first rotary_dim dims (rotary_interleaved: GPT-J pairs; else GPT-NeoX halves) before the append, k token
    i at position cache_seqlens[b] + i; q token i at cache_seqlens[b] + i when causal or local, else every q token
    at cache_seqlens[b] (flash-attn's rule; positions are absolute cache positions, cache_leftpad does not shift
    them).

    softcap, alibi_slopes ((nheads,) or (batch, nheads) float32), num_splits (key splits of the CUDA decode kernel;
    0: automatic; ignored on the CPU) and sinks (flashcore's addition, keyword-only: float32 (nheads,) attention
    sink logits) as in flash_attn_func. Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse
    (batch, nheads, seqlen_q) float32) with return_softmax_lse=True. No backward (inference only)."""
    fn = "flash_attn_with_kvcache"
    capacity = _check_caches(q, k_cache, v_cache, block_table, cache_batch_idx, cache_leftpad, fn)
    B, Sq, Hq, D = q.shape
    Sn = _check_new_kv(q, k, v, k_cache, capacity, block_table, fn)
    seqlens = _cache_lengths(q, cache_seqlens, k is not None, Sn, capacity, k_cache, block_table, fn)
    _check_rotary(q, rotary_cos, rotary_sin, k is not None, capacity, fn)

    causal = custom_op_flag_arg(causal, "causal", fn)
    rotary_interleaved = custom_op_flag_arg(rotary_interleaved, "rotary_interleaved", fn)
    return_softmax_lse = custom_op_flag_arg(return_softmax_lse, "return_softmax_lse", fn)
    # flash-attn's mha_fwd_kvcache: a window side as long as the cache is unbounded (-1); that also decides whether
    # the call is "local" for the rotary positions of q below. The kernel's window: _flash_window (seqlen_k is the
    # cache's capacity there).
    left, right = _flash_cpp_window(*window_pair(window_size, fn), causal, capacity)
    local = left >= 0 or right >= 0
    causal_alibi = _causal_alibi_kernel(alibi_slopes, sinks, causal, left, right, capacity)
    left, right = _flash_window(left, right, causal, Sq, capacity)
    softcap = _flash_softcap(softcap, fn)
    softmax_scale = _scale(softmax_scale, D, fn)
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))

    if rotary_cos is not None:
        # Positions as flash-attn's kernel reads cos/sin (csrc/flash_attn/src/flash_fwd_kernel.h,
        # compute_attn_1rowblock_splitkv: row_offset_cossin = (seqlen_k_cache + leftpad_k [+ m_block * kBlockM if
        # Is_causal || Is_local]), and for k (n_block * kBlockN + leftpad_k), seqlen_k_cache being
        # cache_seqlens - leftpad_k in block_info.h): absolute cache positions, new k token i at cache_seqlens + i,
        # q token i at cache_seqlens + i when causal or local, else all at cache_seqlens; the reference in
        # tests/test_flash_attn.py::test_flash_attn_kvcache rotates with seqlen_offsets=cache_seqlens, with or
        # without cache_leftpad. Clamped into the table: nothing reads outside it, whatever cache_seqlens says.
        last = rotary_cos.size(0) - 1
        start = seqlens.long()[:, None]
        pos_k = (start + torch.arange(Sn, device=q.device)).clamp(0, last)
        per_token = causal or local
        pos_q = (start + torch.arange(Sq, device=q.device)) if per_token else start.expand(B, Sq)
        q = _apply_rotary(q, rotary_cos, rotary_sin, pos_q.clamp(0, last), rotary_interleaved)
        k = _apply_rotary(k, rotary_cos, rotary_sin, pos_k, rotary_interleaved)

    sinks, alibi_slopes = _float32_vector(sinks, "sinks", fn), _float32_vector(alibi_slopes, "alibi_slopes", fn)
    num_splits = int_arg(num_splits, "num_splits", fn)
    if Sn > 0 and B > 0:
        _check_before_append(q, k_cache, v_cache, seqlens, Sn, capacity, block_table, cache_batch_idx, cache_leftpad,
                             softmax_scale, causal, left, right, softcap, sinks, alibi_slopes, num_splits, fn)
        # The cache is state, not part of the autograd graph (flash-attn's kernel writes it directly): no history
        # accumulates across decode steps, and a cache that requires grad may be written.
        with torch.no_grad():
            slots = _append_slots(seqlens, Sn, capacity, k_cache, block_table, cache_batch_idx)
            _append(k_cache, k, *slots)
            _append(v_cache, v, *slots)
        seqlens = torch.clamp(seqlens + Sn, max=capacity)  # tokens past the capacity were dropped

    (qp, kc, vc), head_dim = pad_head_dim([q, k_cache, v_cache])  # CUDA, head dim not a multiple of 8: copies
    out, lse = _kvcache_fwd_op(qp, kc, vc, seqlens, block_table, cache_batch_idx, cache_leftpad, float(softmax_scale),
                               bool(causal), left, right, float(softcap), sinks, alibi_slopes, num_splits)
    if out.size(-1) != head_dim:
        out = out[..., :head_dim]
    if not return_softmax_lse:
        return out
    if causal_alibi:  # an entry's keys past cache_leftpad (flash-attn's block_info.h actual_seqlen_k), clamped
        lse = _dense_alibi_lse(lse, alibi_slopes, _cache_key_lengths(seqlens, cache_leftpad, capacity) - Sq)
    return out, lse


# flash-attn's interface module imports its extension as `flash_attn_gpu`; code that reaches for it finds flashcore's
# form of those entry points here (flash_attn_gpu.py).
from . import flash_attn_gpu  # noqa: E402
