"""flash-attn 2.x's rotary embedding functions and module (`flash_attn.layers.rotary`), in PyTorch ops:

    from flashcore.layers.rotary import apply_rotary_emb   # was: from flash_attn.layers.rotary import ...
    q = apply_rotary_emb(q, cos, sin, interleaved=False, seqlen_offsets=cache_seqlens)

Same arguments and results as flash-attn 2.8: x (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with
cu_seqlens; cos/sin (seqlen_ro, rotary_dim / 2); the first rotary_dim dims of each head are rotated, GPT-NeoX halves
(x[i], x[i + rotary_dim / 2]) or, interleaved, GPT-J pairs (x[2i], x[2i + 1]). Token s of sequence b takes row
s + seqlen_offsets[b] of cos/sin; rows past seqlen_ro leave it unrotated (flash-attn's kernel loads cos 1, sin 0
there), which only a tensor of offsets can reach: a table shorter than the sequences, or than an int offset plus
their length, is refused as flash-attn's apply_rotary asserts (RotaryArgumentError). Computed in float32 (float64
for float64 x) and rounded to x's dtype once, as flash-attn's kernel does;
gradients flow through autograd (the rotation's transpose).
"""

from __future__ import annotations

import torch

from ..ops import packed_rows

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_torch", "apply_rotary_emb_qkv_",
           "apply_rotary_emb_kv_", "ApplyRotaryEmb", "ApplyRotaryEmbQKV_", "ApplyRotaryEmbKV_", "RotaryEmbedding",
           "rotate_half", "rotate_rows", "apply_rotary", "RotaryArgumentError"]


class RotaryArgumentError(ValueError, AssertionError):
    """Arguments flash-attn's apply_rotary refuses by assert (flash_attn/ops/triton/rotary.py): a ValueError as
    flashcore's argument checks raise, and an AssertionError as flash-attn's."""


def rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """(-x2, x1) for the halves (x1, x2) of the last dim, or for its pairs (x[2i], x[2i + 1]) when interleaved."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           interleaved: bool = False) -> torch.Tensor:
    """flash-attn's reference: x (batch, seqlen, nheads, headdim), cos/sin (seqlen, rotary_dim / 2) or (batch,
    seqlen, rotary_dim / 2), in x's dtype."""
    ro_dim = cos.shape[-1] * 2
    if ro_dim > x.shape[-1]:
        raise ValueError(f"apply_rotary_emb_torch: rotary_dim = 2 * cos.shape[-1] = {ro_dim} exceeds headdim "
                         f"{x.shape[-1]}")
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    rotated = x[..., :ro_dim] * cos + rotate_half(x[..., :ro_dim], interleaved) * sin
    return torch.cat((rotated, x[..., ro_dim:]), dim=-1)


def _rotated_dims(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x's first 2 * c.size(-1) dims rotated by the angles' cos/sin c, s (broadcastable to x[..., :half]):
    computed in float32 (float64 for float64 x) and rounded to x's dtype once."""
    half = c.size(-1)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = c.to(cdt), s.to(cdt)
    xr = x[..., : 2 * half].to(cdt)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return rot.to(x.dtype)


def _rotated(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x with its first 2 * c.size(-1) dims rotated (_rotated_dims), the rest as they are."""
    return torch.cat((_rotated_dims(x, c, s, interleaved), x[..., 2 * c.size(-1):]), dim=-1)


def rotate_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (B, S, H, D) with its first 2 * cos.size(-1) dims rotated by per-token angles cos/sin (B, S, rotary_dim / 2)
    (shared by the heads): computed in float32 (float64 for float64 x) and rounded to x's dtype once. The rotation
    of apply_rotary_emb and of flash_attn_with_kvcache's rotary_cos/rotary_sin."""
    if cos.size(-1) == 0 or x.numel() == 0:
        return x
    return _rotated(x, cos.unsqueeze(-2), sin.unsqueeze(-2), interleaved)


def _positions(x, seqlen_offsets, cu_seqlens, max_seqlen):
    """Row of cos/sin for each token: (batch, seqlen), or (1, total) for packed sequences."""
    dev = x.device
    offsets = seqlen_offsets.to(dev, torch.long) if isinstance(seqlen_offsets, torch.Tensor) else int(seqlen_offsets)
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        pos = torch.arange(seqlen, device=dev).expand(batch, seqlen)
        return pos + (offsets[:, None] if isinstance(offsets, torch.Tensor) else offsets)
    starts = cu_seqlens.to(dev, torch.long)
    t, b = packed_rows(starts, x.shape[0])
    pos = t - starts[b] + (offsets[b] if isinstance(offsets, torch.Tensor) else offsets)
    return pos.unsqueeze(0)


def _check_table_rows(x, seqlen_ro, seqlen_offsets, cu_seqlens, max_seqlen, fn):
    """flash-attn's apply_rotary asserts: max_seqlen given with cu_seqlens, and a table of at least seqlen rows
    (x's seqlen, or max_seqlen), of seqlen + seqlen_offsets for an int offset. A tensor of offsets is not checked
    (that would be a sync): its tokens past the table stay unrotated, as in flash-attn's kernel."""
    if cu_seqlens is not None and max_seqlen is None:
        raise RotaryArgumentError(f"{fn}: max_seqlen must be given with cu_seqlens")
    seqlen = x.shape[1] if cu_seqlens is None else int(max_seqlen)
    if seqlen_ro < seqlen:
        raise RotaryArgumentError(f"{fn}: cos/sin have {seqlen_ro} rows (seqlen_ro) but the sequences are up to "
                                  f"{seqlen} tokens long{' (max_seqlen)' if cu_seqlens is not None else ''}: "
                                  "seqlen_ro must be >= seqlen")
    if not isinstance(seqlen_offsets, torch.Tensor) and int(seqlen_offsets) + seqlen > seqlen_ro:
        raise RotaryArgumentError(f"{fn}: seqlen_offsets + seqlen = {int(seqlen_offsets)} + {seqlen} exceeds the "
                                  f"{seqlen_ro} rows of cos/sin (seqlen_ro)")


def _token_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlen_offsets, cu_seqlens, max_seqlen,
                  fn: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's cos/sin, shaped to broadcast over x's heads: (batch, seqlen, 1, half) for x (batch, seqlen,
    nheads, headdim), (total, 1, half) for packed x (total, nheads, headdim) with cu_seqlens. Rows past seqlen_ro
    take cos 1, sin 0 (unrotated)."""
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise RotaryArgumentError(f"{fn}: cos and sin must both be (seqlen_ro, rotary_dim / 2); got "
                                  f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    half = cos.shape[1]
    if 2 * half > x.shape[-1]:
        raise RotaryArgumentError(f"{fn}: rotary_dim = 2 * cos.shape[1] = {2 * half} exceeds headdim {x.shape[-1]}")
    if x.dim() != (3 if cu_seqlens is not None else 4):
        raise ValueError(f"{fn}: x must be (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with "
                         f"cu_seqlens; got shape {tuple(x.shape)}")
    _check_table_rows(x, cos.shape[0], seqlen_offsets, cu_seqlens, max_seqlen, fn)
    pos = _positions(x, seqlen_offsets, cu_seqlens, max_seqlen)
    inside = (pos >= 0) & (pos < cos.shape[0])
    row = pos.clamp(0, max(cos.shape[0] - 1, 0))
    c = torch.where(inside[..., None], cos[row], 1.0)  # (B, S, half), or (1, total, half)
    s = torch.where(inside[..., None], sin[row], 0.0)
    if cu_seqlens is not None:
        c, s = c.squeeze(0), s.squeeze(0)
    return c.unsqueeze(-2), s.unsqueeze(-2)


# A rotation written into parts of a tensor: (index into the tensor, c, s) per part (_token_tables' shapes).
_Parts = list[tuple[tuple, torch.Tensor, torch.Tensor]]


def _write_rotations(x: torch.Tensor, parts: _Parts, interleaved: bool, transposed: bool = False) -> None:
    for index, c, s in parts:
        view = x[index]
        if c.size(-1) and view.numel():
            view[..., : 2 * c.size(-1)] = _rotated_dims(view, c, -s if transposed else s, interleaved)


class _RotateLeafInPlace(torch.autograd.Function):
    """In-place rotation of a tensor whose autograd root is a leaf that requires grad, which autograd cannot
    record in place: flash-attn's form (its rotary functions are autograd Functions that write in place): the
    rotation is written into the leaf's memory and the returned view carries its gradient, the transposed
    rotation (cos, -sin)."""

    @staticmethod
    def forward(ctx, x, parts, interleaved):
        ctx.parts, ctx.interleaved = parts, interleaved
        _write_rotations(x, parts, interleaved)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        _write_rotations(grad, ctx.parts, ctx.interleaved, transposed=True)
        return grad, None, None


def _leaf_in_place(x: torch.Tensor) -> bool:
    """Whether an in-place write into x is one autograd refuses: x is, or views, a leaf that requires grad (a view
    made a leaf itself, base[0:1].requires_grad_(), counts too)."""
    root = x if x._base is None else x._base
    return torch.is_grad_enabled() and ((x.is_leaf and x.requires_grad) or (root.is_leaf and root.requires_grad))


def _rotate_in_place(x: torch.Tensor, parts: _Parts, interleaved: bool) -> torch.Tensor:
    """Rotates parts of x in place and returns x: through _RotateLeafInPlace where x is or views a leaf that
    requires grad (a view of x comes back), else with autograd recording the writes, so that gradients flow
    whether the caller uses the returned tensor or its own."""
    if _leaf_in_place(x):
        return _RotateLeafInPlace.apply(x, parts, interleaved)
    _write_rotations(x, parts, interleaved)
    return x


_ALL = (Ellipsis,)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: int | torch.Tensor = 0,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """x (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens (batch + 1,);
    cos/sin (seqlen_ro, rotary_dim / 2); seqlen_offsets an int or a (batch,) tensor (the position of each
    sequence's first token, e.g. a KV cache's length). Returns x rotated in its first rotary_dim dims (written
    into x with inplace=True; for x a leaf that requires grad, or a view of one, a view of x that carries the
    rotation's gradient, as flash-attn's autograd Function returns)."""
    c, s = _token_tables(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, "apply_rotary_emb")
    if inplace:
        return _rotate_in_place(x, [(_ALL, c, s)], interleaved)
    return _rotated(x, c, s, interleaved) if c.size(-1) and x.numel() else x.clone()


# flash-attn's older name
apply_rotary_emb_func = apply_rotary_emb


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlen_offsets: int | torch.Tensor = 0,
                 cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None, interleaved: bool = False,
                 inplace: bool = False, conjugate: bool = False) -> torch.Tensor:
    """flash-attn's `flash_attn.ops.triton.rotary.apply_rotary`, the kernel under apply_rotary_emb: the same
    rotation, not recorded by autograd (flash-attn's Triton kernel is not; callers wrap it in their own autograd
    Function), by -sin with conjugate=True (the transpose, a backward's rotation)."""
    with torch.no_grad():
        c, s = _token_tables(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, "apply_rotary")
        if conjugate:
            s = -s
        if inplace:
            _write_rotations(x, [(_ALL, c, s)], interleaved)
            return x
        return _rotated(x, c, s, interleaved) if c.size(-1) and x.numel() else x.clone()


def _q_and_k_index(qkv: torch.Tensor, num_heads_q: int | None, fn: str) -> tuple[tuple, tuple]:
    """Indices of Q and K in a packed qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 *
    num_heads_k, headdim) with num_heads_q (MQA / GQA)."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"{fn}: qkv (batch, seqlen, 3, nheads, headdim) must have 3 at dim 2; got shape "
                             f"{tuple(qkv.shape)}")
        return (slice(None), slice(None), 0), (slice(None), slice(None), 1)
    if qkv.dim() != 4 or num_heads_q is None:
        raise ValueError(f"{fn}: qkv must be (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 "
                         f"* num_heads_k, headdim) with num_heads_q given; got shape {tuple(qkv.shape)} and "
                         f"num_heads_q={num_heads_q}")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q <= 0 or num_heads_k <= 0 or qkv.shape[2] != num_heads_q + 2 * num_heads_k:
        raise ValueError(f"{fn}: qkv's {qkv.shape[2]} heads are not num_heads_q + 2 * num_heads_k with num_heads_q="
                         f"{num_heads_q}")
    return (slice(None), slice(None), slice(0, num_heads_q)), \
        (slice(None), slice(None), slice(num_heads_q, num_heads_q + num_heads_k))


def apply_rotary_emb_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cos_k: torch.Tensor | None = None,
                          sin_k: torch.Tensor | None = None, interleaved: bool = False,
                          seqlen_offsets: int | torch.Tensor = 0, num_heads_q: int | None = None) -> torch.Tensor:
    """Rotates Q and K of a packed qkv in place (V untouched) and returns qkv: (batch, seqlen, 3, nheads, headdim),
    or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) with num_heads_q. K takes cos_k/sin_k where given
    (XPos), else cos/sin; seqlen_offsets as in apply_rotary_emb. (A qkv that is, or views, a leaf requiring grad
    comes back as a view of it carrying the rotation's gradient, as flash-attn's does.)"""
    fn = "apply_rotary_emb_qkv_"
    q_index, k_index = _q_and_k_index(qkv, num_heads_q, fn)
    q = qkv[q_index]
    c, s = _token_tables(q, cos, sin, seqlen_offsets, None, None, fn)
    if cos_k is None and sin_k is None:  # Q and K share the tables: one pass over both where one view holds them
        ck, sk = c, s
        if qkv.dim() == 4:
            qk_index = (slice(None), slice(None), slice(0, k_index[2].stop))
            return _rotate_in_place(qkv, [(qk_index, c, s)], interleaved)
        if not _leaf_in_place(qkv) and qkv.stride(2) == qkv.shape[3] * qkv.stride(3):
            # Q's heads then K's at one stride: a (B, S, 2H, D) view (autograd records the write through it)
            joint = qkv[:, :, :2].view(qkv.shape[0], qkv.shape[1], 2 * qkv.shape[3], qkv.shape[4])
            _write_rotations(joint, [(_ALL, c, s)], interleaved)
            return qkv
    else:
        ck, sk = _token_tables(qkv[k_index], cos if cos_k is None else cos_k, sin if sin_k is None else sin_k,
                               seqlen_offsets, None, None, fn)
    return _rotate_in_place(qkv, [(q_index, c, s), (k_index, ck, sk)], interleaved)


def apply_rotary_emb_kv_(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                         seqlen_offsets: int | torch.Tensor = 0) -> torch.Tensor:
    """Rotates K of a packed kv (batch, seqlen, 2, nheads, headdim) in place (V untouched) and returns kv."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"apply_rotary_emb_kv_: kv must be (batch, seqlen, 2, nheads, headdim); got shape "
                         f"{tuple(kv.shape)}")
    k_index = (slice(None), slice(None), 0)
    c, s = _token_tables(kv[k_index], cos, sin, seqlen_offsets, None, None, "apply_rotary_emb_kv_")
    return _rotate_in_place(kv, [(k_index, c, s)], interleaved)


class ApplyRotaryEmb:
    """flash-attn's autograd-function names: ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace,
    seqlen_offsets, cu_seqlens, max_seqlen) is apply_rotary_emb."""
    apply = staticmethod(apply_rotary_emb)


class ApplyRotaryEmbQKV_:  # noqa: N801 (flash-attn's name)
    """ApplyRotaryEmbQKV_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)."""
    apply = staticmethod(apply_rotary_emb_qkv_)


class ApplyRotaryEmbKV_:  # noqa: N801
    """ApplyRotaryEmbKV_.apply(kv, cos, sin, interleaved, seqlen_offsets)."""
    apply = staticmethod(apply_rotary_emb_kv_)


class RotaryEmbedding(torch.nn.Module):
    """flash-attn's rotary module (RoFormer's rotary position embedding; XPos with scale_base): forward(qkv, kv=None,
    seqlen_offset=0, max_seqlen=None, num_heads_q=None) rotates Q and K in place and returns qkv, or (q, kv) when kv
    is given. The cos/sin tables cover positions [0, seqlen + seqlen_offset) (or max_seqlen when given: a tensor
    offset needs it to grow them), computed in float32 and rounded to the input's dtype, and are rebuilt when the
    length grows, the device or dtype changes, or an inference-mode table meets training."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: float | None = None,
                 device=None):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        self.register_buffer("scale", self._xpos_scale(device) if scale_base is not None else None, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inv_freq(self, device=None) -> torch.Tensor:
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / self.base ** exponents

    def _xpos_scale(self, device=None) -> torch.Tensor:
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None):
        cached = self._cos_cached
        if not (seqlen > self._seq_len_cached or cached is None or cached.device != device or cached.dtype != dtype
                or (self.training and cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        # float32 angles: positions times frequencies lose too much in a half-precision buffer (a module cast
        # with .half() has its buffers cast too, so they are recomputed here when not float32)
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inv_freq(device)
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device))
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._xpos_scale(self.scale.device)
        power = (torch.arange(seqlen, dtype=torch.float32, device=scale.device) - seqlen // 2) / self.scale_base
        xpos = (scale.to(power.device) ** power[:, None]).to(device)  # Q's rows scaled up, K's down
        self._cos_cached, self._sin_cached = (cos * xpos).to(dtype), (sin * xpos).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / xpos).to(dtype), (sin / xpos).to(dtype)

    def forward(self, qkv: torch.Tensor, kv: torch.Tensor | None = None, seqlen_offset: int | torch.Tensor = 0,
                max_seqlen: int | None = None, num_heads_q: int | None = None):
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        xpos = self.scale is not None
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached,
                                         self._cos_k_cached if xpos else None, self._sin_k_cached if xpos else None,
                                         interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                                         num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved, inplace=True,
                             seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_k_cached if xpos else self._cos_cached,
                                  self._sin_k_cached if xpos else self._sin_cached, interleaved=self.interleaved,
                                  seqlen_offsets=seqlen_offset)
        return q, kv
