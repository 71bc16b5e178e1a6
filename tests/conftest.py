"""Shared helpers of the flashcore test suite.

Reference: attention computed in float64 (explicit scores, mask, softmax), the exact answer up to float64
rounding. Tolerance (flash-attn's rule): flashcore's error against the float64 reference may be at most about
twice the error of PyTorch's own computation in the input dtype (SDPA on the same inputs), plus a small absolute
floor for the cases where PyTorch's error happens to be ~0. NaN or inf never passes.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import flashcore

# Absolute floor added to 2x PyTorch's error, per dtype (a few ulps of O(1) outputs).
ATOL_FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_generator(request_or_name, device="cpu") -> torch.Generator:
    """A generator seeded from the test id: random inputs, reproducible per test."""
    name = request_or_name if isinstance(request_or_name, str) else request_or_name.node.nodeid
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(name.encode()))
    return g


def randn(shape, dtype, gen, device="cpu", layout="bhsd", scale=1.0):
    """Random (B, H, S, D) tensor; layout "bshd" returns a (B, H, S, D) view of a (B, S, H, D) tensor."""
    B, H, S, D = shape
    if layout == "bshd":
        t = torch.randn(B, S, H, D, generator=gen, device=device, dtype=torch.float32).mul_(scale).to(dtype)
        return t.transpose(1, 2)
    if layout == "padded":  # a slice of a wider tensor: every stride differs from the contiguous one
        t = torch.randn(B, H, S + 3, D + 8, generator=gen, device=device, dtype=torch.float32).mul_(scale).to(dtype)
        return t[:, :, 1 : S + 1, :D]
    return torch.randn(B, H, S, D, generator=gen, device=device, dtype=torch.float32).mul_(scale).to(dtype)


def reference_attention(q, k, v, causal=False, scale=None, causal_offset=0):
    """float64 attention: returns (out, lse). causal: key j visible from query i iff j <= i + causal_offset.
    A row that sees no key gets out = 0 and lse = -inf (flashcore's convention)."""
    qd, kd, vd = q.double(), k.double(), v.double()
    group = qd.size(-3) // kd.size(-3)
    if group > 1:
        kd = kd.repeat_interleave(group, dim=-3)
        vd = vd.repeat_interleave(group, dim=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    s = (qd @ kd.transpose(-1, -2)) * scale
    if causal:
        Sq, Sk = s.shape[-2:]
        i = torch.arange(Sq, device=s.device)[:, None]
        j = torch.arange(Sk, device=s.device)[None, :]
        s = s.masked_fill(j > i + causal_offset, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ vd, lse


def sdpa(q, k, v, causal=False, scale=None):
    """PyTorch's own computation in the input dtype (the error yardstick)."""
    group = q.size(-3) // k.size(-3)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=group > 1)


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_flash_close(name, got, ref64, ref_lowp=None, dtype=None, factor=2.0):
    """flash-attn's rule: |got - ref64| <= factor * |ref_lowp - ref64| + floor; NaN/inf fail."""
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    dtype = dtype or got.dtype
    err = max_err(got, ref64)
    base = max_err(ref_lowp, ref64) if ref_lowp is not None else 0.0
    bound = factor * base + ATOL_FLOOR[dtype]
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (PyTorch's own error {base:.3e})"
    return err


def cuda_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not flashcore._has_cuda_kernels():
        return "flashcore was built without CUDA kernels"
    return None


requires_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")
