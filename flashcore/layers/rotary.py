"""flash-attn 2.x's rotary embedding functions (`flash_attn.layers.rotary`), in PyTorch ops:

    from flashcore.layers.rotary import apply_rotary_emb   # was: from flash_attn.layers.rotary import ...
    q = apply_rotary_emb(q, cos, sin, interleaved=False, seqlen_offsets=cache_seqlens)

Same arguments and results as flash-attn 2.8: x (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with
cu_seqlens; cos/sin (seqlen_ro, rotary_dim / 2); the first rotary_dim dims of each head are rotated, GPT-NeoX halves
(x[i], x[i + rotary_dim / 2]) or, interleaved, GPT-J pairs (x[2i], x[2i + 1]). Token s of sequence b takes row
s + seqlen_offsets[b] of cos/sin; rows past seqlen_ro leave it unrotated (flash-attn's kernel loads cos 1, sin 0
there). Computed in float32 (float64 for float64 x) and rounded to x's dtype once, as flash-attn's kernel does;
gradients flow through autograd (the rotation's transpose).
"""

from __future__ import annotations

import torch

from ..ops import packed_rows

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_torch", "rotate_half", "rotate_rows"]


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


def rotate_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (B, S, H, D) with its first 2 * cos.size(-1) dims rotated by per-token angles cos/sin (B, S, rotary_dim / 2)
    (shared by the heads): computed in float32 (float64 for float64 x) and rounded to x's dtype once. The rotation
    of apply_rotary_emb and of flash_attn_with_kvcache's rotary_cos/rotary_sin."""
    half = cos.size(-1)
    if half == 0 or x.numel() == 0:
        return x
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = cos.to(cdt).unsqueeze(-2), sin.to(cdt).unsqueeze(-2)  # (B, S, 1, half)
    xr = x[..., : 2 * half].to(cdt)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


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


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: int | torch.Tensor = 0,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """x (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens (batch + 1,);
    cos/sin (seqlen_ro, rotary_dim / 2); seqlen_offsets an int or a (batch,) tensor (the position of each
    sequence's first token, e.g. a KV cache's length). Returns x rotated in its first rotary_dim dims (written
    into x with inplace=True)."""
    fn = "apply_rotary_emb"
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"{fn}: cos and sin must both be (seqlen_ro, rotary_dim / 2); got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    half = cos.shape[1]
    if 2 * half > x.shape[-1]:
        raise ValueError(f"{fn}: rotary_dim = 2 * cos.shape[1] = {2 * half} exceeds headdim {x.shape[-1]}")
    if x.dim() != (3 if cu_seqlens is not None else 4):
        raise ValueError(f"{fn}: x must be (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with "
                         f"cu_seqlens; got shape {tuple(x.shape)}")
    xs = x.unsqueeze(0) if cu_seqlens is not None else x
    pos = _positions(x, seqlen_offsets, cu_seqlens, max_seqlen)
    inside = (pos >= 0) & (pos < cos.shape[0])
    row = pos.clamp(0, max(cos.shape[0] - 1, 0))
    c = torch.where(inside[..., None], cos[row], 1.0)  # (B, S, half)
    s = torch.where(inside[..., None], sin[row], 0.0)
    out = rotate_rows(xs, c, s, interleaved)
    if cu_seqlens is not None:
        out = out.squeeze(0)
    if inplace:
        x[..., : 2 * half] = out[..., : 2 * half]
        return x
    return out


# flash-attn's older name
apply_rotary_emb_func = apply_rotary_emb
