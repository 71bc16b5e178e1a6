"""CPU forward against the float64 reference and SDPA (flash-attn's tolerance rule)."""

import itertools
import math

import pytest
import torch

import flashcore
from conftest import check_close, check_lse, lowp_attention, make_generator, randn, reference_attention, sdpa

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# (B, Hq, Hkv, Sq, Sk, D): lengths 1, 17, 64, 113, 256, 1000, Sq != Sk, head dims 16..256 and odd ones, GQA/MQA.
SHAPES = [
    (2, 2, 2, 17, 17, 16),
    (1, 2, 2, 64, 64, 32),
    (2, 3, 3, 113, 113, 64),
    (1, 4, 2, 256, 256, 128),
    (1, 1, 1, 1000, 1000, 64),
    (1, 2, 2, 1, 1000, 128),
    (1, 2, 2, 1000, 17, 32),
    (2, 4, 1, 113, 256, 96),
    (1, 2, 2, 64, 113, 256),
    (1, 2, 2, 17, 64, 80),
    (1, 2, 2, 256, 1, 40),
    (2, 2, 2, 33, 65, 3),
    (1, 1, 1, 5, 7, 1),
    (1, 6, 3, 50, 50, 200),
]


def _case_id(shape):
    return "x".join(map(str, shape))


@pytest.mark.parametrize("shape", SHAPES, ids=_case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_matches_reference(request, shape, dtype, causal):
    B, Hq, Hkv, Sq, Sk, D = shape
    g = make_generator(request)
    q = randn((B, Hq, Sq, D), dtype, g)
    k = randn((B, Hkv, Sk, D), dtype, g)
    v = randn((B, Hkv, Sk, D), dtype, g)
    out, lse = flashcore.attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv, return_lse=True)
    assert flashcore.last_kernel("fwd") == "cpu"
    ref, _ = reference_attention(q, k, v, causal)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # float64 inputs keep their exactness
    assert out.dtype == dtype and lse.dtype == lse_dtype and lse.shape == (B, Hq, Sq)
    check_close("out", out, ref, sdpa(q, k, v, causal))
    check_lse(lse, q, k, causal=causal)


@pytest.mark.parametrize("layout", ["bshd", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_strided_inputs(request, layout, dtype, causal):
    g = make_generator(request)
    q = randn((2, 4, 70, 64), dtype, g, layout=layout)
    k = randn((2, 2, 90, 64), dtype, g, layout=layout)
    v = randn((2, 2, 90, 64), dtype, g, layout="bhsd")
    assert not q.is_contiguous()
    out = flashcore.attention(q, k, v, is_causal=causal, enable_gqa=True)
    ref, _ = reference_attention(q, k, v, causal)
    check_close("out", out, ref, sdpa(q.contiguous(), k.contiguous(), v, causal))
    # Same answer as on contiguous copies (the kernel reads strides, it does not assume a layout).
    out_c = flashcore.attention(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=causal, enable_gqa=True)
    assert torch.equal(out, out_c)


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0, -0.5])
def test_forward_custom_scale(request, scale):
    g = make_generator(request)
    q, k, v = (randn((1, 2, 40, 32), torch.float32, g) for _ in range(3))
    out = flashcore.attention(q, k, v, scale=scale)
    ref, _ = reference_attention(q, k, v, scale=scale)
    check_close("out", out, ref, sdpa(q, k, v, scale=scale))


def test_forward_3d_inputs(request):
    g = make_generator(request)
    q = torch.randn(3, 50, 32, generator=g)
    k = torch.randn(3, 60, 32, generator=g)
    v = torch.randn(3, 60, 32, generator=g)
    out = flashcore.attention(q, k, v, is_causal=True)
    assert out.shape == (3, 50, 32)
    ref, _ = reference_attention(q[:, None], k[:, None], v[:, None], True)
    check_close("out", out, ref[:, 0], sdpa(q, k, v, True))


def test_forward_default_scale_and_is_causal_top_left(request):
    """Sq != Sk with is_causal: SDPA's top-left alignment (query i sees keys j <= i)."""
    g = make_generator(request)
    q = randn((1, 2, 30, 16), torch.float64, g)
    k = randn((1, 2, 50, 16), torch.float64, g)
    v = randn((1, 2, 50, 16), torch.float64, g)
    out = flashcore.attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-12)


@pytest.mark.parametrize("Sq,Sk", [(20, 50), (50, 20), (1, 9), (9, 1)])
def test_flash_attn_func_bottom_right(request, Sq, Sk):
    """flash_attn_func: BSHD, causal aligned bottom-right; rows that see no key give 0 (and lse -inf)."""
    g = make_generator(request)
    q = torch.randn(2, Sq, 4, 32, generator=g)
    k = torch.randn(2, Sk, 2, 32, generator=g)
    v = torch.randn(2, Sk, 2, 32, generator=g)
    out, lse, _ = flashcore.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    ref, _ = reference_attention(qt, kt, vt, True, None, Sk - Sq)
    assert out.shape == q.shape
    check_close("out", out.transpose(1, 2), ref, lowp_attention(qt, kt, vt, True, None, Sk - Sq))
    check_lse(lse, qt, kt, causal=True, causal_offset=Sk - Sq)
    if Sq > Sk:  # rows that see no key: exactly 0 and -inf
        assert (out[:, : Sq - Sk] == 0).all() and torch.isneginf(lse[:, :, : Sq - Sk]).all()


def test_forward_large_magnitude_and_one_hot_rows(request):
    """Scores far outside exp's range must not overflow (the running max), nearly one-hot rows stay exact."""
    g = make_generator(request)
    q = randn((1, 2, 64, 32), torch.float32, g, scale=30.0)
    k = randn((1, 2, 80, 32), torch.float32, g, scale=30.0)
    v = randn((1, 2, 80, 32), torch.float32, g)
    out = flashcore.attention(q, k, v)
    ref, _ = reference_attention(q, k, v)
    check_close("out", out, ref, sdpa(q, k, v))


def test_forward_deterministic(request):
    g = make_generator(request)
    q, k, v = (randn((2, 4, 300, 64), torch.float32, g) for _ in range(3))
    a = flashcore.attention(q, k, v, is_causal=True)
    b = flashcore.attention(q, k, v, is_causal=True)
    assert torch.equal(a, b)


def test_portable_isa_path_matches(request):
    """The non-AVX2 code path (FLASHCORE_CPU_ISA=portable, read once per process), forward and backward, in a
    subprocess, against the float64 reference by the suite's rule."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {here!r})\n"
        "import torch, flashcore\n"
        "from conftest import check_close, check_gradients, reference_attention, sdpa\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    q, k, v = (torch.randn(1, 2, 70, 48, generator=g).to(dtype).requires_grad_() for _ in range(3))\n"
        "    dout = torch.randn(1, 2, 70, 48, generator=g).to(dtype)\n"
        "    out = flashcore.attention(q, k, v, is_causal=True)\n"
        "    got = torch.autograd.grad(out, (q, k, v), dout)\n"
        "    low = torch.autograd.grad(sdpa(q, k, v, True), (q, k, v), dout)\n"
        "    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))\n"
        "    ref_out = reference_attention(q64, k64, v64, True)[0]\n"
        "    ref = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())\n"
        "    check_close('out', out, ref_out, sdpa(q, k, v, True))\n"
        "    check_gradients(got, ref, low)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, FLASHCORE_CPU_ISA="portable")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


SDPA_SHAPES = {  # (query, key, value shapes, kwargs): what SDPA accepts beyond (B, H, S, D)
    "5d": ((2, 3, 4, 5, 8), (2, 3, 4, 7, 8), (2, 3, 4, 7, 8), {}),
    "2d_causal": ((5, 8), (7, 8), (7, 8), {"is_causal": True}),
    "3d_heads_gqa": ((6, 5, 8), (2, 7, 8), (2, 7, 8), {"enable_gqa": True}),
    "value_dim_larger": ((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 12), {}),
    "value_dim_smaller_causal": ((2, 4, 9, 16), (2, 4, 7, 16), (2, 4, 7, 6), {"is_causal": True}),
}


@pytest.mark.parametrize("case", list(SDPA_SHAPES))
def test_sdpa_shapes(request, case):
    """SDPA's shapes: any leading batch dims, 3-D as (heads, seq, dim) (so enable_gqa groups dim -3), 2-D, a value
    head dim other than query's; forward and gradients against SDPA in float64, lse of query's rows."""
    qs, ks, vs, kw = SDPA_SHAPES[case]
    g = make_generator(request)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in (qs, ks, vs))
    out, lse = flashcore.attention(q, k, v, return_lse=True, **kw)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    assert out.shape == want.shape and lse.shape == qs[:-1]
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_sdpa_modes(request):
    """Inputs whose last dim is strided (copied, as SDPA takes them); under torch.autocast float32 inputs run in the
    autocast dtype, as SDPA's; sinks of another float dtype (model.double()); torch.compile with dynamic shapes."""
    g = make_generator(request)
    x = torch.randn(2, 4, 16, 5, generator=g, dtype=torch.float64).transpose(-1, -2)
    torch.testing.assert_close(flashcore.attention(x, x, x), torch.nn.functional.scaled_dot_product_attention(x, x, x),
                               rtol=1e-10, atol=1e-10)
    q = torch.randn(1, 2, 9, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flashcore.attention(q, q, q, is_causal=True)
        want = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.dtype == want.dtype == torch.bfloat16
    check_close("out", out, reference_attention(q.double(), q.double(), q.double(), causal=True)[0],
                lowp_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), causal=True))
    q64 = q.double()
    sinks = torch.randn(2, generator=g, dtype=torch.float64)
    torch.testing.assert_close(flashcore.attention(q64, q64, q64, sinks=sinks),
                               flashcore.attention(q64, q64, q64, sinks=sinks.float()), rtol=0, atol=0)
    f = torch.compile(lambda a: flashcore.attention(a, a, a, is_causal=True), fullgraph=True, dynamic=True)
    for n in (9, 13):
        a = torch.randn(1, 2, n, 16, generator=g)
        torch.testing.assert_close(f(a), flashcore.attention(a, a, a, is_causal=True))
