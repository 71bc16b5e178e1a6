"""CPU backward: dq, dk, dv against float64 autograd through the reference and SDPA's gradients."""

import pytest
import torch

import flashcore
from conftest import check_gradients, lowp_attention, make_generator, randn, reference_attention, sdpa

SHAPES = [
    (2, 2, 2, 17, 17, 16),
    (1, 2, 2, 113, 113, 64),
    (1, 4, 2, 64, 256, 128),
    (1, 4, 1, 256, 64, 40),
    (2, 2, 2, 1, 113, 64),
    (1, 2, 2, 113, 1, 32),
    (1, 3, 3, 70, 90, 256),
]


def _grads(fn, inputs, dout):
    out = fn(*inputs)
    return torch.autograd.grad(out, inputs, dout)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_matches_reference(request, shape, dtype, causal):
    B, Hq, Hkv, Sq, Sk, D = shape
    g = make_generator(request)
    q = randn((B, Hq, Sq, D), dtype, g).requires_grad_()
    k = randn((B, Hkv, Sk, D), dtype, g).requires_grad_()
    v = randn((B, Hkv, Sk, D), dtype, g).requires_grad_()
    dout = randn((B, Hq, Sq, D), dtype, g)
    gqa = Hq != Hkv
    got = _grads(lambda a, b, c: flashcore.attention(a, b, c, is_causal=causal, enable_gqa=gqa), (q, k, v), dout)
    lowp = _grads(lambda a, b, c: sdpa(a, b, c, causal), (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _grads(lambda a, b, c: reference_attention(a, b, c, causal)[0], (q64, k64, v64), dout.double())
    assert flashcore.last_kernel("bwd") == "cpu"
    assert all(a.dtype == dtype for a in got)
    check_gradients(got, ref, lowp, dtype=dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_gradcheck_float64(request, causal, gqa):
    g = make_generator(request)
    q = randn((1, 4, 9, 8), torch.float64, g).requires_grad_()
    k = randn((1, 2 if gqa else 4, 11, 8), torch.float64, g).requires_grad_()
    v = randn((1, 2 if gqa else 4, 11, 8), torch.float64, g).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b, c: flashcore.attention(a, b, c, is_causal=causal, enable_gqa=gqa), (q, k, v), eps=1e-6,
        atol=1e-7, rtol=1e-5
    )


@pytest.mark.parametrize("scale", [0.05, 0.7, -0.4])
def test_backward_non_default_scale(request, scale):
    g = make_generator(request)
    q, k, v = (randn((1, 2, 70, 32), torch.float32, g).requires_grad_() for _ in range(3))
    dout = randn((1, 2, 70, 32), torch.float32, g)
    got = _grads(lambda a, b, c: flashcore.attention(a, b, c, is_causal=True, scale=scale), (q, k, v), dout)
    lowp = _grads(lambda a, b, c: sdpa(a, b, c, True, scale), (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _grads(lambda a, b, c: reference_attention(a, b, c, True, scale)[0], (q64, k64, v64), dout.double())
    check_gradients(got, ref, lowp)


def test_backward_strided_and_expanded_grad(request):
    """BSHD views as inputs, and out.sum()'s expanded (zero-stride) gradient."""
    g = make_generator(request)
    q = randn((2, 4, 50, 32), torch.float32, g, layout="bshd").requires_grad_()
    k = randn((2, 4, 70, 32), torch.float32, g, layout="bshd").requires_grad_()
    v = randn((2, 4, 70, 32), torch.float32, g, layout="padded").requires_grad_()
    flashcore.attention(q, k, v, is_causal=True).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    sdpa(q, k, v, True).sum().backward()
    low = [t.grad for t in (q, k, v)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference_attention(q64, k64, v64, True)[0].sum().backward()
    check_gradients(got, [t.grad for t in (q64, k64, v64)], low)


def test_backward_deterministic(request):
    g = make_generator(request)
    q, k, v = (randn((1, 2, 200, 64), torch.float32, g).requires_grad_() for _ in range(3))
    dout = randn((1, 2, 200, 64), torch.float32, g)
    a = _grads(lambda x, y, z: flashcore.attention(x, y, z, is_causal=True), (q, k, v), dout)
    b = _grads(lambda x, y, z: flashcore.attention(x, y, z, is_causal=True), (q, k, v), dout)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_flash_attn_func_backward_bottom_right(request):
    g = make_generator(request)
    q = torch.randn(1, 40, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 25, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 25, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, 40, 2, 16, generator=g, dtype=torch.float64)
    got = _grads(lambda a, b, c: flashcore.flash_attn_func(a, b, c, causal=True), (q, k, v), dout)
    ref = _grads(
        lambda a, b, c: reference_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), True, None,
                                            25 - 40)[0].transpose(1, 2),
        (q, k, v),
        dout,
    )
    low = _grads(
        lambda a, b, c: lowp_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), True, None,
                                       25 - 40).transpose(1, 2),
        (q, k, v),
        dout,
    )
    check_gradients(got, ref, low)
