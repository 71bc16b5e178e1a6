"""Python side of the flashcore ops: fake (meta) kernels, autograd, and the friendly entry points.

The schemas and the CPU/CUDA kernels live in C++ (csrc/flashcore/ops.cpp); `torch.ops.flashcore.fwd` and
`torch.ops.flashcore.bwd` work in eager mode, under torch.compile (through the fake kernels below) and inside CUDA
graphs.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch

__all__ = ["attention", "varlen_attention", "fwd_kernel_name", "bwd_kernel_name", "last_kernel"]


# ----------------------------------------------------------------------------------------------------------------
# Fake (meta) kernels: shapes, dtypes and strides of the outputs, the same rules as the C++ allocation
# (attention_host.cpp: out = empty_like(query), lse = (B, Hq, Sq) float32 contiguous).
# ----------------------------------------------------------------------------------------------------------------


def _check_devices(op: str, first, args, kwargs):
    """Every tensor argument on the first one's device. The C++ checks say so too, but a tensor on the meta device
    among real ones sends the whole call here, to the fake kernel, which would return uninitialised outputs."""
    names = [a.name for a in getattr(torch.ops.flashcore, op).default._schema.arguments]
    for name, value in [*zip(names, (first, *args)), *kwargs.items()]:
        if isinstance(value, torch.Tensor) and value.device != first.device:
            raise RuntimeError(f"flashcore: {name} is on {value.device} but {names[0]} is on {first.device}; "
                               "all tensors of a call must be on one device")


def _check_unit_stride(tensors):
    """The C++ rule (attention_host.cpp): the kernels read rows of unit stride; a last dim of size 1 has none."""
    for name, t in tensors:
        torch._check(t.numel() == 0 or t.stride(-1) == 1 or t.size(-1) == 1,
                     lambda: f"flashcore: {name} must have a contiguous last dimension (stride 1); got strides "
                     f"{tuple(t.stride())}")


def _check_qkv(query, key, value, head_axis):
    """The shape and dtype rules the C++ checks apply (attention_host.cpp), on fake tensors too: under torch.compile
    or on the meta device a bad call fails when traced, not at run time."""
    for name, t in (("key", key), ("value", value)):
        torch._check(t.dtype == query.dtype,
                     lambda: f"flashcore: {name} has dtype {t.dtype} but query has dtype {query.dtype}")
        torch._check(t.size(-1) == query.size(-1), lambda: f"flashcore: {name} head_dim {t.size(-1)} does not "
                     f"match query head_dim {query.size(-1)}")
    torch._check(query.is_floating_point(), lambda: f"flashcore: query has dtype {query.dtype}; expected a float")
    _check_unit_stride((("query", query), ("key", key), ("value", value)))
    torch._check(value.shape[:-1] == key.shape[:-1], lambda: f"flashcore: value shape {tuple(value.shape)} does not "
                 f"match key shape {tuple(key.shape)} but for the head dim")
    hq, hkv = query.size(head_axis), key.size(head_axis)
    torch._check((hq == 0 and hkv == 0) or (hkv > 0 and hq % hkv == 0),
                 lambda: f"flashcore: query heads {hq} must be a multiple of key/value heads {hkv}")


@torch.library.register_fake("flashcore::fwd")
def _fwd_fake(query, key, value, *args, **kwargs):  # the schema's other arguments do not change the shapes
    _check_devices("fwd", query, (key, value, *args), kwargs)
    torch._check(query.dim() == 4, lambda: f"flashcore: query must be 4-D; got {query.dim()}-D")
    torch._check(key.dim() == 4 and value.dim() == 4, lambda: "flashcore: key and value must be 4-D")
    _check_qkv(query, key, value, head_axis=1)
    torch._check(key.size(0) == query.size(0), lambda: f"flashcore: key batch size {key.size(0)} does not match "
                 f"query batch size {query.size(0)}")
    out = torch.empty_like(query)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    lse = query.new_empty((query.size(0), query.size(1), query.size(2)), dtype=lse_dtype)
    return out, lse


@torch.library.register_fake("flashcore::bwd")
def _bwd_fake(grad_out, query, key, value, *args, **kwargs):
    _check_devices("bwd", grad_out, (query, key, value, *args), kwargs)
    _check_unit_stride((("grad_out", grad_out),))
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


@torch.library.register_fake("flashcore::varlen_fwd")
def _varlen_fwd_fake(query, key, value, *args, **kwargs):
    _check_devices("varlen_fwd", query, (key, value, *args), kwargs)
    torch._check(query.dim() == 3, lambda: f"flashcore: query must be 3-D (total_q, heads, head_dim); got {query.dim()}-D")
    torch._check(key.dim() == 3 and value.dim() == 3, lambda: "flashcore: key and value must be 3-D")
    _check_qkv(query, key, value, head_axis=1)
    out = torch.empty_like(query)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    lse = query.new_empty((query.size(1), query.size(0)), dtype=lse_dtype)
    return out, lse


@torch.library.register_fake("flashcore::varlen_bwd")
def _varlen_bwd_fake(grad_out, query, key, value, *args, **kwargs):
    _check_devices("varlen_bwd", grad_out, (query, key, value, *args), kwargs)
    _check_unit_stride((("grad_out", grad_out),))
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


@torch.library.register_fake("flashcore::kvcache_fwd")
def _kvcache_fwd_fake(query, *args, **kwargs):
    _check_devices("kvcache_fwd", query, args, kwargs)
    torch._check(query.dim() == 4, lambda: f"flashcore: query must be 4-D (batch, seqlen_q, heads_q, head_dim); got {query.dim()}-D")
    out = torch.empty_like(query)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    lse = query.new_empty((query.size(0), query.size(2), query.size(1)), dtype=lse_dtype)
    return out, lse


# ----------------------------------------------------------------------------------------------------------------
# Autograd: registered in C++ (csrc/flashcore/autograd.cpp) at the Autograd key; a Python autograd kernel would
# add ~10 us of host time to every call. out's gradient goes through flashcore::bwd; lse is not differentiable;
# fwd's deterministic=True or torch.use_deterministic_algorithms(True) selects the bitwise-reproducible backward.
# Under torch.func transforms, which refuse C++ autograd Functions, attention() takes a Python node (functorch.py).
# ----------------------------------------------------------------------------------------------------------------

_fwd_op = torch.ops.flashcore.fwd.default
_varlen_fwd_op = torch.ops.flashcore.varlen_fwd.default

from .functorch import FunctorchAttention, transforms_active  # noqa: E402  (needs the ops registered above)


# ----------------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------------


_MAX_HEAD_DIM = 256  # the kernels' largest head dim (attention_host.cpp's limits, every family)
_INT32_MAX = 2**31 - 1  # the ops' lengths and offsets are int32
_FLOAT32_FLOOR = 2.0**-80  # the smallest softcap magnitude the kernels take (float_arg)


def _check_tensor(t, name, fn="flashcore.attention"):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor; got {type(t).__name__}")


def window_pair(window_size, fn) -> tuple[int, int]:
    """(left, right) from None, a pair of ints, or a 2-element tensor/list (flash-attn code passes all three)."""
    if window_size is None:
        return -1, -1
    if isinstance(window_size, torch.Tensor):
        window_size = window_size.tolist()
    try:
        if isinstance(window_size, (str, bytes)):
            raise TypeError
        left, right = window_size
        if any(isinstance(x, float) and not x.is_integer() for x in (left, right)):
            raise ValueError
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: window_size must be a pair (left, right) of ints, -1 for unbounded; got "
                        f"{window_size!r}") from None
    # A side longer than any sequence can be (2^31 - 1 tokens) hides no key: unbounded, and within the op's int64.
    return tuple(-1 if x > _INT32_MAX else x for x in (left, right))


def _is_numpy_bool(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")  # numpy 1.x / 2.x


def flag_arg(value, name, fn) -> bool:
    """A bool argument (causal, deterministic, ...), or a TypeError naming it, as SDPA's schema takes a bool: a
    Python or numpy bool (an int or a string such as 'no' is refused)."""
    if isinstance(value, (bool, torch.SymBool)):
        return value
    if _is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"{fn}: {name} must be a bool; got {value!r}")


def custom_op_flag_arg(value, name, fn) -> bool:
    """A bool argument of the flash-attn interface, taken as flash-attn's custom ops take one: also an integer
    (1, 0) or a 0-d bool or integer tensor; a string such as 'no', a float or None is a TypeError naming it."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() and \
            not value.is_complex():
        return bool(value)
    if not isinstance(value, bool) and (isinstance(value, (int, torch.SymInt)) or
                                        (type(value).__module__ == "numpy" and hasattr(value, "__index__"))):
        return bool(value)
    return flag_arg(value, name, fn)


def int_arg(value, name, fn, minimum=None):
    """An int argument (max_seqlen_q, num_splits, ...): a Python, numpy or 0-d integer tensor value as an int, or a
    TypeError naming it (a float such as 5.9 is not truncated); below `minimum` or above 2^31 - 1 a RuntimeError,
    as the op raises for its own checks."""
    if isinstance(value, torch.SymInt):
        return value
    try:
        if isinstance(value, (bool, float)):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an int; got {value!r}") from None
    if (minimum is not None and out < minimum) or out > _INT32_MAX:
        bound = f"in [{minimum}, 2^31 - 1]" if minimum is not None else "at most 2^31 - 1"
        raise RuntimeError(f"{fn}: {name} must be {bound}; got {out}")
    return out


def float_arg(value, name, fn, default=None, float32=False) -> float:
    """A float argument (scale, softcap) as the op takes it, or a TypeError naming it; None gives `default` when
    one is given. float32: the kernels hold the value in float32 (softcap), so a magnitude beyond its range is
    refused here rather than turned into inf/NaN scores there."""
    if value is None and default is not None:
        return default
    try:
        if isinstance(value, (str, bytes)):  # float("0.5") would parse it
            raise TypeError
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: {name} must be a float; got {value!r}") from None
    # Not under torch.compile: with dynamic shapes dynamo makes Python floats symbolic, which math cannot take.
    if float32 and not torch.compiler.is_compiling() and math.isfinite(out):
        if abs(out) > 3.4e38:
            raise ValueError(f"{fn}: {name}={value!r} is beyond float32's range, in which the kernels apply it")
        if 0.0 < abs(out) < _FLOAT32_FLOOR:
            # Would round to 0 (no cap at all) or make scale / softcap infinite in float32; any cap this small gives
            # logits of 0 to float32's precision, and so does the floor.
            out = math.copysign(_FLOAT32_FLOOR, out)
    return out


def packed_rows(cu_seqlens, total):
    """(t, b): the rows 0 .. total - 1 of a packed batch and the sequence each lies in by cu_seqlens (batch + 1
    offsets); rows past the last sequence count as the last one's (callers mask them by its length). Device ops
    only, no sync."""
    t = torch.arange(total, device=cu_seqlens.device)
    b = torch.searchsorted(cu_seqlens[1:].long(), t, right=True).clamp(max=max(cu_seqlens.numel() - 2, 0))
    return t, b


def maybe_contiguous(x):
    """x with a contiguous last dimension (a copy only where it has none), as flash-attn's helper of that name: the
    kernels read unit-stride rows, the Python entry points accept any strides."""
    return x.contiguous() if x is not None and x.dim() > 0 and x.stride(-1) != 1 else x


def _float32_vector(t, name, fn):
    """sinks / alibi_slopes of another float dtype (a model.double()) as the float32 the op takes; a TypeError naming
    the argument when it is no tensor (the op checks shape, dtype and device)."""
    if t is None:
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a float32 tensor or None; got {type(t).__name__}")
    return t.float() if t.dtype != torch.float32 and t.is_floating_point() else t


def _autocast(*tensors):
    """Inside torch.autocast, the dtype SDPA would compute in: float32 (and mixed) inputs cast to the autocast dtype
    (float64 left alone, as autocast does)."""
    device_type = tensors[0].device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def pad_head_dim(tensors, multiple=8):
    """Zero-pads the last dim of each tensor to a multiple of `multiple` (the CUDA kernels' granularity), as
    flash-attn does for any head dim up to 256; returns (tensors, original head dim)."""
    d = tensors[0].size(-1)
    extra = -d % multiple
    if extra == 0 or not tensors[0].is_cuda:
        return tensors, d
    return [torch.nn.functional.pad(t, (0, extra)) for t in tensors], d


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
    window_size=None,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
):
    """Exact fused attention with the semantics of ``torch.nn.functional.scaled_dot_product_attention``.

    query: (B, Hq, Sq, D); key: (B, Hkv, Sk, D); value: (B, Hkv, Sk, Dv), any strides (BSHD tensors passed as
    ``x.transpose(1, 2)`` views are read in place when the last dim is contiguous, copied otherwise). As in SDPA,
    any number of leading batch dims (..., H, S, D) works and broadcasts (a single key/value head serves every
    query head without enable_gqa; expanded views, no copies), 3-D inputs are (H, S, D) and 2-D one head, and Dv
    may differ from D. is_causal masks as SDPA does (top-left aligned when Sq != Sk). scale defaults to
    1/sqrt(D). With enable_gqa=True, Hq may be a multiple of Hkv (grouped-query attention; K/V are never copied
    per head). Inside torch.autocast, float32 inputs run in the autocast dtype, as SDPA's do. attn_mask and
    dropout_p exist for drop-in compatibility and must be None and 0.

    Variants (aligned top-left like is_causal; flash_attn_func aligns them bottom-right):
      window_size=(left, right): query i sees keys i - left .. i + right (-1: unbounded on that side);
      softcap > 0: scores become softcap * tanh(score / softcap) (after the scale);
      sinks: (Hq,), each row's softmax denominator gains exp(sinks[h]) (differentiable; held in float32);
      alibi_slopes: (Hq,) or (B, Hq), scores gain -slope * |i + Sk - Sq - j| (float32; not differentiable).

    deterministic=True makes the backward bitwise reproducible run to run (on CUDA the fused kernels then add dQ in
    a fixed order, at 0.7-0.95x their speed: docs/PERFORMANCE.md); torch.use_deterministic_algorithms(True) does the
    same for every call. The forward is always deterministic.

    Returns out (query's shape with Dv last, query's dtype), or (out, lse) with return_lse=True, lse being the
    (B, Hq, Sq) natural-log log-sum-exp of each row of logits, sinks included (float32; float64 for float64
    inputs; not differentiable).
    """
    _check_tensor(query, "query")
    _check_tensor(key, "key")
    _check_tensor(value, "value")
    if attn_mask is not None:
        raise NotImplementedError("flashcore.attention: attn_mask is not supported; use is_causal or window_size")
    if dropout_p != 0.0:
        raise NotImplementedError("flashcore.attention: dropout_p must be 0 (dropout is not supported)")
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa), ("deterministic", deterministic)):
        flag_arg(flag, name, "flashcore.attention")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 2:
            raise RuntimeError(
                f"flashcore.attention: {name} must be (..., seq_len, head_dim), at least 2-D; got {t.dim()}-D with "
                f"shape {tuple(t.shape)}"
            )
    # The common calls (same batch dims and key/value heads; grouped query heads with enable_gqa) skip this.
    if not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3] and query.dim() == key.dim() == value.dim()
            and (query.dim() == 2 or (key.size(-3) == value.size(-3)
                                      and (enable_gqa or query.size(-3) == key.size(-3))))):
        query, key, value, enable_gqa = _broadcast_batch_dims(query, key, value, enable_gqa)
    # SDPA's shapes: (..., heads, seq_len, head_dim), any number of leading batch dims (flattened into one here);
    # 3-D is (heads, seq_len, head_dim) and 2-D one head.
    rows_shape = None  # other than 4-D: out is (*rows_shape, value head dim), lse rows_shape
    if query.dim() != 4:
        rows_shape = tuple(query.shape[:-1])
        query, key, value = (t.reshape((-1,) + tuple(t.shape[-3:])) if t.dim() >= 3 else t.reshape((1, 1) + tuple(t.shape))
                             for t in (query, key, value))
    if torch._C._is_any_autocast_enabled():  # one cheap call on the common path (host time bounds small calls)
        query, key, value = _autocast(query, key, value)
    # Strided rows are copied (maybe_contiguous; tested once on the common path); a value head dim other than
    # query's (SDPA allows it) runs zero-padded to the larger one: zeros add nothing to q.k, padded value columns are
    # cropped.
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        query, key, value = maybe_contiguous(query), maybe_contiguous(key), maybe_contiguous(value)
    qk_dim, v_dim = query.size(-1), value.size(-1)
    if v_dim > _MAX_HEAD_DIM and v_dim > qk_dim:  # named here: padded, query's head dim would be reported
        raise RuntimeError(f"flashcore.attention: value head_dim {v_dim} (value.size(-1)) is not supported; at most "
                           f"{_MAX_HEAD_DIM}")
    if v_dim < qk_dim:
        value = torch.nn.functional.pad(value, (0, qk_dim - v_dim))
    elif v_dim > qk_dim:
        query, key = (torch.nn.functional.pad(t, (0, v_dim - qk_dim)) for t in (query, key))
    elif qk_dim == 0:  # SDPA's empty head dim: every score 0; the kernels run one zero column
        query, key, value = (torch.nn.functional.pad(t, (0, 1)) for t in (query, key, value))
    if not enable_gqa and query.size(1) != key.size(1):
        raise RuntimeError(
            f"flashcore.attention: query has {query.size(1)} heads but key has {key.size(1)}; pass enable_gqa=True "
            "for grouped-query attention"
        )
    fn = "flashcore.attention"
    if sinks is not None or alibi_slopes is not None:
        sinks, alibi_slopes = _float32_vector(sinks, "sinks", fn), _float32_vector(alibi_slopes, "alibi_slopes", fn)
    left, right = window_pair(window_size, fn)
    if scale is None:
        softmax_scale = 1.0 / math.sqrt(qk_dim) if qk_dim > 0 else 1.0
    else:
        softmax_scale = float_arg(scale, "scale", fn)
    softcap = float_arg(softcap, "softcap", fn, default=0.0, float32=True)
    (query, key, value), _ = pad_head_dim([query, key, value])
    fwd = FunctorchAttention.apply if transforms_active() else _fwd_op  # torch.func: a Python autograd node
    out, lse = fwd(query, key, value, softmax_scale, bool(is_causal), False, left, right, softcap, bool(deterministic),
                   sinks, alibi_slopes)
    if out.size(-1) != v_dim:
        out = _dense_slice(out, v_dim)
    if rows_shape is not None:
        out, lse = out.reshape(rows_shape + (v_dim,)), lse.reshape(rows_shape)
    return (out, lse) if return_lse else out


def _dense_slice(out, cols):
    """out[..., :cols] as a dense tensor in out's dimension order (query's layout), not a view into the padded
    buffer, so that callers may .view() it as they may SDPA's output."""
    order = sorted(range(out.dim()), key=lambda d: out.stride(d), reverse=True)
    inverse = [order.index(d) for d in range(out.dim())]
    return out[..., :cols].permute(order).contiguous().permute(inverse)


def _broadcast_batch_dims(query, key, value, enable_gqa):
    """SDPA's broadcasting of the dims before (seq_len, head_dim): batch dims broadcast as in torch, and a single
    key/value head serves every query head (SDPA allows it without enable_gqa: here it is grouped-query attention
    with one group), or a single query head every key/value head. Expanded views (stride 0), no copies."""
    def lead(t):  # (batch dims, heads)
        return tuple(t.shape[:-3]), (t.size(-3) if t.dim() >= 3 else 1)

    (qb, hq), (kb, hk), (vb, hv) = lead(query), lead(key), lead(value)
    try:
        batch = torch.broadcast_shapes(qb, kb, vb)
    except RuntimeError:
        raise RuntimeError(f"flashcore.attention: the batch dims of query {tuple(query.shape)}, key "
                           f"{tuple(key.shape)} and value {tuple(value.shape)} do not broadcast") from None
    if hk != hv and 1 not in (hk, hv):
        raise RuntimeError(f"flashcore.attention: key has {hk} heads and value {hv}; they must match (or one be 1)")
    hkv = max(hk, hv)
    if hq == 1 and hkv > 1 and not enable_gqa:
        hq = hkv  # one query head broadcast over the key/value heads
    elif hkv == 1 and hq > 1:
        enable_gqa = True  # one key/value head for all query heads
    rank = max(query.dim(), key.dim(), value.dim(), 3)
    def expand(t, heads):
        t = t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) if t.dim() < rank else t
        return t.expand(*batch, heads, t.size(-2), t.size(-1))
    return expand(query, hq), expand(key, hkv), expand(value, hkv), enable_gqa


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window_size=None,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Attention over a batch of sequences of different lengths, packed along the sequence dimension.

    query (total_q, Hq, D), key and value (total_k, Hkv, D) with Hq a multiple of Hkv, any strides with a
    contiguous last dim. Sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of query and
    cu_seqlens_k[b]:cu_seqlens_k[b+1] of key/value (int32 tensors of length B+1 on query's device), of which only
    the first seqused_k[b] keys are used when seqused_k (int32, (B,)) is given. max_seqlen_q/max_seqlen_k (ints)
    bound the lengths. is_causal and window_size=(left, right) align bottom-right in each sequence (flash-attn's
    rule: query i of a sequence with Sq queries and Sk keys sees keys up to i + Sk - Sq); softcap, sinks and
    alibi_slopes ((Hq,) or (B, Hq)) as in attention(). Differentiable in query, key, value and sinks.

    Returns out (total_q, Hq, D), or (out, lse) with return_lse=True, lse float32 (Hq, total_q) (flash-attn's
    varlen layout; -inf on rows outside every sequence).
    """
    fn = "flashcore.varlen_attention"
    for t, name in ((query, "query"), (key, "key"), (value, "value"), (cu_seqlens_q, "cu_seqlens_q"),
                    (cu_seqlens_k, "cu_seqlens_k")):
        _check_tensor(t, name, fn)
    query, key, value = _autocast(query, key, value)
    query, key, value = maybe_contiguous(query), maybe_contiguous(key), maybe_contiguous(value)
    sinks, alibi_slopes = _float32_vector(sinks, "sinks", fn), _float32_vector(alibi_slopes, "alibi_slopes", fn)
    if seqused_k is not None:
        _check_tensor(seqused_k, "seqused_k", fn)
    max_seqlen_q, max_seqlen_k = int_arg(max_seqlen_q, "max_seqlen_q", fn), int_arg(max_seqlen_k, "max_seqlen_k", fn)
    is_causal, deterministic = flag_arg(is_causal, "is_causal", fn), flag_arg(deterministic, "deterministic", fn)
    left, right = window_pair(window_size, fn)
    if scale is None:
        softmax_scale = 1.0 / math.sqrt(query.size(-1)) if query.size(-1) > 0 else 1.0
    else:
        softmax_scale = float_arg(scale, "scale", fn)
    softcap = float_arg(softcap, "softcap", fn, default=0.0, float32=True)
    (query, key, value), head_dim = pad_head_dim([query, key, value])
    out, lse = _varlen_fwd_op(query, key, value, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                              softmax_scale, bool(is_causal), left, right, float(softcap), bool(deterministic), sinks,
                              alibi_slopes, seqused_k)
    if out.size(-1) != head_dim:
        out = out[..., :head_dim]
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
