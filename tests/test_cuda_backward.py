"""CUDA backward paths (the fused wgmma and mma.sync kernels, the composite deterministic one) against float64
autograd through the reference and SDPA's low-precision gradients; each test asserts the path it forced ran."""

import pytest
import torch
import torch.nn.functional as F

import flashcore
from conftest import (assert_ran, check_gradients, cuda_skip_reason, gpu_families, lowp_attention, make_generator,
                      randn, reference_attention)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")]

DEV = "cuda"


def check_grads(got, q, k, v, dout, causal=False, offset=0, scale=None, dtype=None):
    """dq, dk, dv against float64 autograd through the reference, by the suite's rule (PyTorch's own error: autograd
    through its low-precision computation)."""
    lowp = torch.autograd.grad(lowp_attention(q, k, v, causal, scale, offset), (q, k, v), dout)
    lowp = [x.nan_to_num(0.0) for x in lowp]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(reference_attention(q64, k64, v64, causal, scale, offset)[0], (q64, k64, v64),
                              dout.double())
    assert all(a.dtype == q.dtype for a in got)
    check_gradients(got, ref, lowp, dtype=dtype)


BWD_HEAD_DIMS = [32, 64, 80, 96, 128, 192, 256]
# (B, Hq, Hkv, Sq, Sk): equal lengths, GQA with Sq < Sk, one query row, Sq > Sk (rows that see no key when
# bottom-right aligned), and the GQA 257 x 257 shape whose dK once was 2.5x PyTorch's error.
BWD_SHAPES = [(2, 4, 4, 300, 300), (1, 8, 2, 129, 517), (1, 2, 1, 1, 77), (2, 3, 3, 200, 17), (2, 8, 4, 257, 257)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", BWD_HEAD_DIMS)
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
def test_backward(request, bwd_path, dtype, head_dim, shape, mask):
    B, Hq, Hkv, Sq, Sk = shape
    g = make_generator(request, DEV)
    causal = mask != "none"
    offset = Sk - Sq if mask == "bottom_right" else 0
    dout = randn((B, Hq, Sq, head_dim), dtype, g, DEV)
    if mask == "bottom_right":
        # flash-attn's API on BSHD storage: the kernels see BSHD strides (asserted), not a BHSD copy.
        qs = randn((B, Hq, Sq, head_dim), dtype, g, DEV, layout="bshd").transpose(1, 2).detach().requires_grad_()
        ks = randn((B, Hkv, Sk, head_dim), dtype, g, DEV, layout="bshd").transpose(1, 2).detach().requires_grad_()
        vs = randn((B, Hkv, Sk, head_dim), dtype, g, DEV, layout="bshd").transpose(1, 2).detach().requires_grad_()
        assert qs.is_contiguous() and qs.transpose(1, 2).stride(2) == Hq * head_dim
        out = flashcore.flash_attn_func(qs, ks, vs, causal=True)
        got = [x.transpose(1, 2) for x in torch.autograd.grad(out, (qs, ks, vs), dout.transpose(1, 2))]
        q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (qs, ks, vs))
    else:
        q = randn((B, Hq, Sq, head_dim), dtype, g, DEV).requires_grad_()
        k = randn((B, Hkv, Sk, head_dim), dtype, g, DEV).requires_grad_()
        v = randn((B, Hkv, Sk, head_dim), dtype, g, DEV).requires_grad_()
        out = flashcore.attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
        got = torch.autograd.grad(out, (q, k, v), dout)
    assert_ran("bwd", bwd_path)
    check_grads(got, q, k, v, dout, causal, offset, dtype=dtype)


@pytest.mark.parametrize("scale", [0.02, 0.3, 1.5])
def test_backward_non_default_scale(request, bwd_path, scale):
    g = make_generator(request, DEV)
    q, k, v = (randn((2, 4, 200, 64), torch.bfloat16, g, DEV).requires_grad_() for _ in range(3))
    dout = randn((2, 4, 200, 64), torch.bfloat16, g, DEV)
    got = torch.autograd.grad(flashcore.attention(q, k, v, is_causal=True, scale=scale), (q, k, v), dout)
    assert_ran("bwd", bwd_path)
    check_grads(got, q, k, v, dout, True, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_backward_misaligned_and_strided(request, bwd_path, dtype):
    """Odd storage offsets, padded rows and BSHD gradients reach the backward."""
    g = make_generator(request, DEV)
    D = 64
    base = torch.randn(2 * 4 * 300 * D + 3, generator=g, device=DEV).to(dtype)
    q = base[3:].view(2, 4, 300, D).detach().requires_grad_()
    k = randn((2, 4, 280, D), dtype, g, DEV, layout="padded").detach().requires_grad_()
    v = randn((2, 4, 280, D), dtype, g, DEV, layout="padded").detach().requires_grad_()
    dout = randn((2, 4, 300, D), dtype, g, DEV).transpose(1, 2).contiguous().transpose(1, 2)  # BSHD strides
    got = torch.autograd.grad(flashcore.attention(q, k, v, is_causal=True), (q, k, v), dout)
    assert_ran("bwd", bwd_path)
    check_grads(got, q, k, v, dout, True, dtype=dtype)


@pytest.mark.parametrize("layout", ["bshd", "head_dim_40"])
def test_backward_grad_query_post_pass_layouts(request, bwd_path, layout):
    """grad_query comes from the fp32 dQ accumulator through the post-pass kernel, which applies the softmax scale
    once (the Hopper kernels sum dQ without it) and writes grad_query in the strides empty_like gives it: BSHD
    storage, or head dim 40 (five 8-column chunks a row)."""
    g = make_generator(request, DEV)
    D = 40 if layout == "head_dim_40" else 64
    if layout == "bshd":  # empty_like keeps the permutation: grad_query's rows are Hq * D apart
        q = randn((2, 150, 3, D), torch.float16, g, DEV).transpose(1, 2).detach().requires_grad_()
        assert q.stride(2) == 3 * D
    else:
        q = randn((2, 3, 150, D), torch.float16, g, DEV).detach().requires_grad_()
    k, v = (randn((2, 3, 170, D), torch.float16, g, DEV).detach().requires_grad_() for _ in range(2))
    dout = randn((2, 3, 150, D), torch.float16, g, DEV)
    got = torch.autograd.grad(flashcore.attention(q, k, v, scale=0.3), (q, k, v), dout)
    assert_ran("bwd", bwd_path)
    assert got[0].stride() == torch.empty_like(q).stride()
    check_grads(got, q, k, v, dout, False, dtype=torch.float16, scale=0.3)


def test_backward_expanded_kv_and_zero_stride_grad(request):
    """Zero-stride (expanded) K/V heads and the zero-stride gradient of out.sum(): right, on whatever path the
    dispatcher picks for them."""
    g = make_generator(request, DEV)
    q = randn((2, 4, 300, 64), torch.float16, g, DEV).requires_grad_()
    k1 = randn((2, 1, 280, 64), torch.float16, g, DEV).requires_grad_()
    v1 = randn((2, 1, 280, 64), torch.float16, g, DEV).requires_grad_()
    k, v = k1.expand(2, 4, 280, 64), v1.expand(2, 4, 280, 64)
    out = flashcore.attention(q, k, v, is_causal=True)
    dout = torch.ones_like(out).expand_as(out)  # what out.sum() sends back
    got = torch.autograd.grad(out, (q, k1, v1), dout)
    lowp = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k1, v1), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k1, v1))
    ref = torch.autograd.grad(reference_attention(q64, k64.expand(2, 4, 280, 64), v64.expand(2, 4, 280, 64),
                                                  True)[0], (q64, k64, v64), dout.double())
    check_gradients(got, ref, lowp)


def test_backward_large_and_one_hot(request, bwd_path):
    """Scores near fp16's range, nearly one-hot rows and a long sequence (many key and query blocks)."""
    g = make_generator(request, DEV)
    q = randn((1, 4, 2100, 128), torch.float16, g, DEV, scale=3.0).requires_grad_()
    k = randn((1, 4, 2100, 128), torch.float16, g, DEV, scale=3.0)
    k[:, :, 7] = q.detach()[:, :, 7] * 2
    k.requires_grad_()
    v = randn((1, 4, 2100, 128), torch.float16, g, DEV).requires_grad_()
    dout = randn((1, 4, 2100, 128), torch.float16, g, DEV)
    got = torch.autograd.grad(flashcore.attention(q, k, v, is_causal=True), (q, k, v), dout)
    assert_ran("bwd", bwd_path)
    check_grads(got, q, k, v, dout, True)


def test_keys_no_query_sees_get_zero_gradients(request, bwd_path):
    """Top-left causal with Sk > Sq: keys past Sq are seen by no query; their dK/dV must be written as exact
    zeros (the outputs are poisoned before the kernels run)."""
    g = make_generator(request, DEV)
    q = randn((1, 2, 100, 64), torch.bfloat16, g, DEV).requires_grad_()
    k, v = (randn((1, 2, 400, 64), torch.bfloat16, g, DEV).requires_grad_() for _ in range(2))
    dout = randn((1, 2, 100, 64), torch.bfloat16, g, DEV)
    got = torch.autograd.grad(flashcore.attention(q, k, v, is_causal=True), (q, k, v), dout)
    assert_ran("bwd", bwd_path)
    assert (got[1][:, :, 100:] == 0).all() and (got[2][:, :, 100:] == 0).all()
    check_grads(got, q, k, v, dout, True)


def test_bwd_kernel_name(monkeypatch):
    q = torch.randn(1, 2, 64, 128, device=DEV, dtype=torch.float16)
    monkeypatch.delenv("FLASHCORE_FORCE_BWD", raising=False)
    expected = "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80"
    assert flashcore.bwd_kernel_name(q, q, q, q) == expected
    # deterministic: the same fused kernels, their dQ additions ordered by key block
    assert flashcore.bwd_kernel_name(q, q, q, q, deterministic=True) == expected
    monkeypatch.setenv("FLASHCORE_FORCE_BWD", "sm80")
    assert flashcore.bwd_kernel_name(q, q, q, q) == "sm80"
    assert flashcore.bwd_kernel_name(q, q, q, q, deterministic=True) == "sm80"


@pytest.mark.parametrize("how", ["argument", "global"])
def test_backward_deterministic_mode(request, how):
    """deterministic=True (or torch.use_deterministic_algorithms) gives bitwise-identical, correct gradients."""
    g = make_generator(request, DEV)
    q, k, v = (randn((2, 4, 700, 64), torch.float16, g, DEV).requires_grad_() for _ in range(3))
    dout = randn((2, 4, 700, 64), torch.float16, g, DEV)
    prev = torch.are_deterministic_algorithms_enabled()
    if how == "global":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = [
            torch.autograd.grad(flashcore.attention(q, k, v, is_causal=True, deterministic=how == "argument"),
                                (q, k, v), dout)
            for _ in range(2)
        ]
        ran = assert_ran("bwd", "sm90" if "sm90" in gpu_families() else "sm80")
        assert "deterministic" in ran, ran
    finally:
        torch.use_deterministic_algorithms(prev)
    for x, y in zip(*runs):
        assert torch.equal(x, y)
    check_grads(runs[0], q, k, v, dout, True)


DETERMINISTIC_CASES = {  # (B, Hq, Hkv, Sq, Sk, D, dtype, causal, kwargs)
    "hd128_80row": (2, 4, 2, 1000, 1000, 128, torch.bfloat16, False, {}),
    "hd128_causal_gqa": (1, 8, 2, 777, 777, 128, torch.float16, True, {}),
    "hd96_sq_lt_sk": (2, 2, 2, 300, 1100, 96, torch.bfloat16, True, {}),
    "hd64_rows": (2, 4, 4, 1100, 900, 64, torch.float16, False, {}),
    "hd64_softcap_keys": (1, 4, 2, 700, 700, 64, torch.bfloat16, True, {"softcap": 20.0}),
    "hd256_chunks": (1, 2, 1, 600, 500, 256, torch.bfloat16, False, {}),
    "window": (1, 4, 4, 1500, 1500, 128, torch.bfloat16, True, {"window_size": (200, 0)}),
}


@pytest.mark.parametrize("path", ["sm90", "sm80"])
@pytest.mark.parametrize("case", list(DETERMINISTIC_CASES))
def test_backward_deterministic_fused(request, monkeypatch, path, case):
    """deterministic=True on the fused kernels (dQ additions in key-block order, BwdParams::dq_turns): on the Hopper
    kernel every head-dim tile and dQ split (80-row fragment order at head dim 128, 80-row rows at 96, 64-row by
    columns, by rows, by keys, head dim 256's chunks), on the mma.sync kernel its atomics; GQA, causal with
    Sq != Sk, a window, softcap: bitwise-identical gradients over three runs (the order of the blocks on the GPU
    varies run to run), within the rule against float64."""
    if path not in gpu_families():
        pytest.skip(f"no {path} kernels on this GPU")
    monkeypatch.setenv("FLASHCORE_FORCE_BWD", path)
    B, Hq, Hkv, Sq, Sk, D, dtype, causal, kw = DETERMINISTIC_CASES[case]
    g = make_generator(request, DEV)
    q = randn((B, Hq, Sq, D), dtype, g, DEV, layout="bshd").requires_grad_()
    k, v = (randn((B, Hkv, Sk, D), dtype, g, DEV).requires_grad_() for _ in range(2))
    dout = randn((B, Hq, Sq, D), dtype, g, DEV)
    runs = []
    for _ in range(3):
        out = flashcore.attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv, deterministic=True, **kw)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
        ran = assert_ran("bwd", path)
        assert "deterministic" in ran, ran
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            assert torch.equal(x, y)
    if not kw:
        check_grads(runs[0], q, k, v, dout, causal, dtype=dtype)


@pytest.mark.parametrize("seed", range(6))
def test_backward_gqa_257_precision(seed):
    """B=2, Hq=8, Hkv=4, 257 x 257, head dim 128, bf16, causal, several draws: dK summed over the query heads of a
    group stays within the rule on the default path (it was once measured at 2.5x PyTorch's error)."""
    g = torch.Generator(device=DEV).manual_seed(1000 + seed)
    q = randn((2, 8, 257, 128), torch.bfloat16, g, DEV).requires_grad_()
    k, v = (randn((2, 4, 257, 128), torch.bfloat16, g, DEV).requires_grad_() for _ in range(2))
    dout = randn((2, 8, 257, 128), torch.bfloat16, g, DEV)
    got = torch.autograd.grad(flashcore.attention(q, k, v, is_causal=True, enable_gqa=True), (q, k, v), dout)
    check_grads(got, q, k, v, dout, True)


WIDE_SHAPES = [(1, 2, 2, 80, 128), (2, 4, 2, 161, 300), (1, 3, 1, 1000, 77), (1, 2, 2, 1, 129), (1, 4, 4, 2100, 640)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [80, 96, 112, 128])
@pytest.mark.parametrize("shape", WIDE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_backward_wide_steps(request, monkeypatch, dtype, head_dim, shape, causal):
    """The Hopper backward's 80-row kernel (head-dim tiles 96 and 128, dQ computed transposed): query lengths that
    are and are not multiples of 80, one row, GQA, padded head dims, BSHD and sliced storage, with and without the
    causal mask; against float64, and the 64-row kernel (FLASHCORE_BWD_WIDE_STEPS=0) on the same inputs, each path
    asserted."""
    if "sm90" not in gpu_families():
        pytest.skip("the wide-step kernel is sm90's")
    monkeypatch.delenv("FLASHCORE_FORCE_BWD", raising=False)
    B, Hq, Hkv, Sq, Sk = shape
    g = make_generator(request, DEV)
    q = randn((B, Hq, Sq, head_dim), dtype, g, DEV, layout="bshd").detach().requires_grad_()
    k = randn((B, Hkv, Sk, head_dim), dtype, g, DEV, layout="bshd").detach().requires_grad_()
    v = randn((B, Hkv, Sk, head_dim), dtype, g, DEV, layout="padded").detach().requires_grad_()
    dout = randn((B, Hq, Sq, head_dim), dtype, g, DEV)
    runs = {}
    for wide in ("1", "0"):
        monkeypatch.setenv("FLASHCORE_BWD_WIDE_STEPS", wide)
        out = flashcore.attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
        runs[wide] = torch.autograd.grad(out, (q, k, v), dout)
        ran = assert_ran("bwd", "sm90")
        assert ran.endswith(" m80") == (wide == "1"), ran
    check_grads(runs["1"], q, k, v, dout, causal, dtype=dtype)
    check_grads(runs["0"], q, k, v, dout, causal, dtype=dtype)


def test_backward_peak_memory_scales_with_head_dim(monkeypatch):
    """The fused backward's fp32 dQ accumulator holds head_dim columns (the fragment-ordered tiles of head dim 128's
    80-row steps hold exactly 128): the memory a forward+backward adds at head dim 96 is 96/128 of head dim 128's,
    up to the per-row lse/dsum. Head dim 96 once accumulated in 128-column fragment tiles (0.83 here by the sizes of
    the buffers, and 11 % above cuDNN's peak at 4x16x8192x96); rows of 96 columns measure 0.75 (19.1 against
    25.4 MB on an H100). Each head dim runs once unmeasured first, so that one-time allocations (workspaces,
    descriptors) stay out of the peak."""
    monkeypatch.delenv("FLASHCORE_FORCE_BWD", raising=False)
    monkeypatch.delenv("FLASHCORE_BWD_WIDE_STEPS", raising=False)
    g = torch.Generator(device=DEV).manual_seed(7)
    peaks = {}
    for head_dim in (96, 128):
        q, k, v = (torch.randn((2, 2048, 4, head_dim), device=DEV, dtype=torch.bfloat16, generator=g)
                   .transpose(1, 2).requires_grad_() for _ in range(3))
        dout = torch.randn_like(q)
        for measured in (False, True):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            grads = torch.autograd.grad(flashcore.attention(q, k, v), (q, k, v), dout)
            torch.cuda.synchronize()
            if measured:
                peaks[head_dim] = torch.cuda.max_memory_allocated() - base
            assert all(torch.isfinite(x).all() for x in grads)
            del grads
        del q, k, v, dout
    ratio = peaks[96] / peaks[128]
    assert ratio < 0.8, (ratio, peaks)


@pytest.mark.parametrize("head_dim,wide", [(64, "1"), (96, "1"), (128, "1"), (128, "0"), (256, "1")])
def test_dq_post_pass_aten_fallback(request, monkeypatch, head_dim, wide):
    """The fused backward's dQ post-pass (the fp32 accumulator, fragment-ordered tiles for the Hopper 80-row kernel,
    to grad_query) by its kernel and by ATen (FLASHCORE_DQ_CONVERT=aten, the fallback for grids it cannot cover):
    bitwise equal, and within the rule against float64."""
    monkeypatch.delenv("FLASHCORE_FORCE_BWD", raising=False)
    monkeypatch.setenv("FLASHCORE_BWD_WIDE_STEPS", wide)
    B, Hq, Hkv, Sq, Sk = 2, 4, 2, 171, 203
    g = make_generator(request, DEV)
    q = randn((B, Hq, Sq, head_dim), torch.bfloat16, g, DEV, layout="bshd").detach().requires_grad_()
    k = randn((B, Hkv, Sk, head_dim), torch.bfloat16, g, DEV).detach().requires_grad_()
    v = randn((B, Hkv, Sk, head_dim), torch.bfloat16, g, DEV).detach().requires_grad_()
    dout = randn((B, Hq, Sq, head_dim), torch.bfloat16, g, DEV)
    runs = {}
    for convert in ("kernel", "aten"):
        monkeypatch.setenv("FLASHCORE_DQ_CONVERT", convert)
        out = flashcore.attention(q, k, v, is_causal=True, enable_gqa=True)
        runs[convert] = torch.autograd.grad(out, (q, k, v), dout)
    ran = assert_ran("bwd", "sm90" if "sm90" in gpu_families() else "sm80")
    if "sm90" in gpu_families():
        assert ran.endswith(" m80") == (wide == "1" and head_dim in (96, 128)), ran
    assert torch.equal(runs["kernel"][0], runs["aten"][0]), ran
    check_grads(runs["aten"], q, k, v, dout, True, dtype=torch.bfloat16)


@pytest.mark.parametrize("case", ["gqa", "padded_dim", "hd64_causal_unseen_keys", "softcap", "hd96_strided"])
def test_backward_tma_epilogue(request, monkeypatch, case):
    """The Hopper backward writes dK and dV through shared memory and TMA stores (rows past seqlen_k and columns
    past head_dim dropped by TMA; blocks no query sees store zeros): bitwise equal to the direct stores
    (FLASHCORE_BWD_TMA_EPILOGUE=0) on the same inputs, and within the rule against float64."""
    if "sm90" not in gpu_families():
        pytest.skip("the TMA epilogue is sm90's")
    monkeypatch.delenv("FLASHCORE_FORCE_BWD", raising=False)
    shape, D, causal, kw, layout = {
        "gqa": ((2, 4, 2, 300, 190), 128, False, {}, "bhsd"),
        "padded_dim": ((1, 2, 2, 77, 1000), 112, False, {}, "bshd"),
        "hd64_causal_unseen_keys": ((1, 2, 1, 100, 400), 64, True, {}, "bhsd"),
        "softcap": ((1, 3, 3, 200, 333), 128, True, {"softcap": 20.0}, "bhsd"),
        "hd96_strided": ((2, 2, 2, 129, 257), 96, False, {}, "padded"),
    }[case]
    B, Hq, Hkv, Sq, Sk = shape
    g = make_generator(request, DEV)
    q = randn((B, Hq, Sq, D), torch.bfloat16, g, DEV, layout=layout).detach().requires_grad_()
    k = randn((B, Hkv, Sk, D), torch.bfloat16, g, DEV, layout=layout).detach().requires_grad_()
    v = randn((B, Hkv, Sk, D), torch.bfloat16, g, DEV, layout=layout).detach().requires_grad_()
    dout = randn((B, Hq, Sq, D), torch.bfloat16, g, DEV)
    runs = {}
    for tma in ("1", "0"):
        monkeypatch.setenv("FLASHCORE_BWD_TMA_EPILOGUE", tma)
        out = flashcore.attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv, **kw)
        runs[tma] = torch.autograd.grad(out, (q, k, v), dout)
        assert_ran("bwd", "sm90")
    assert torch.equal(runs["1"][1], runs["0"][1]) and torch.equal(runs["1"][2], runs["0"][2])
    if case == "hd64_causal_unseen_keys":
        assert (runs["1"][1][:, :, Sq:] == 0).all() and (runs["1"][2][:, :, Sq:] == 0).all()
    if not kw:
        check_grads(runs["1"], q, k, v, dout, causal, dtype=torch.bfloat16)


OVERLAP_CASES = {  # (B, Hq, Hkv, Sq, Sk, D, FLASHCORE_BWD_WIDE_STEPS, call, kwargs, rows that see no key)
    "hd128_80row_fragments_gqa": (2, 4, 2, 1000, 1000, 128, "1", "attention", {"is_causal": True}, None),
    "hd128_64row": (1, 4, 4, 333, 900, 128, "0", "attention", {}, None),
    "hd96_80row_rows": (2, 2, 2, 300, 1100, 96, "1", "attention", {"is_causal": True}, None),
    "hd64_bottom_right_unseen_head": (2, 3, 3, 700, 200, 64, "1", "flash_attn_func", {"causal": True}, (0, 500)),
    "hd128_window_unseen_tail": (1, 4, 4, 1500, 400, 128, "1", "attention", {"window_size": (50, 0)}, (450, 1500)),
    "hd256_window": (1, 2, 1, 600, 500, 256, "1", "attention", {"window_size": (100, 20)}, None),
    # ~8 waves of blocks: the post-pass starts during the last one, with earlier heads' tiles long complete
    "hd128_multi_wave": (4, 16, 16, 2048, 2048, 128, "1", "attention", {"is_causal": True}, None),
}


@pytest.mark.parametrize("case", list(OVERLAP_CASES))
def test_dq_post_pass_overlap(request, monkeypatch, case):
    """The Hopper backward counts each dQ tile down (BwdParams::dq_tiles_pending, set by the pre-pass to the key
    blocks that see the tile) and its post-pass, launched behind it, converts tiles as they reach zero: every layout
    (80-row fragment tiles, 80-row rows at head dim 96, 64- and 128-row tiles, head dim 256), GQA, Sq != Sk, and
    tiles no key block adds to (their rows see no key: zeros). Deterministic gradients are bitwise equal with and
    without the overlap (FLASHCORE_BWD_DQ_OVERLAP=0: the post-pass waits for the whole kernel), and the default
    gradients agree with them."""
    if "sm90" not in gpu_families():
        pytest.skip("the countdowns are the sm90 backward's")
    monkeypatch.delenv("FLASHCORE_FORCE_BWD", raising=False)
    B, Hq, Hkv, Sq, Sk, D, wide, call, kw, unseen = OVERLAP_CASES[case]
    monkeypatch.setenv("FLASHCORE_BWD_WIDE_STEPS", wide)
    g = make_generator(request, DEV)
    q = randn((B, Hq, Sq, D), torch.bfloat16, g, DEV, layout="bshd").detach().requires_grad_()
    k, v = (randn((B, Hkv, Sk, D), torch.bfloat16, g, DEV, layout="bshd").detach().requires_grad_()
            for _ in range(2))
    dout = randn((B, Hq, Sq, D), torch.bfloat16, g, DEV, layout="bshd")

    def grads(deterministic):
        if call == "flash_attn_func":  # (B, S, H, D) views of the BSHD storage, bottom-right causal
            out = flashcore.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            deterministic=deterministic, **kw).transpose(1, 2)
        else:
            out = flashcore.attention(q, k, v, enable_gqa=Hq != Hkv, deterministic=deterministic, **kw)
        return torch.autograd.grad(out, (q, k, v), dout)

    runs = {}
    for overlap in ("1", "0"):
        monkeypatch.setenv("FLASHCORE_BWD_DQ_OVERLAP", overlap)
        runs[overlap] = grads(True)
        ran = assert_ran("bwd", "sm90")
        assert ("dq-overlap" in ran) == (overlap == "1"), ran
    assert all(torch.equal(x, y) for x, y in zip(runs["1"], runs["0"]))
    monkeypatch.setenv("FLASHCORE_BWD_DQ_OVERLAP", "1")
    default = grads(False)
    for x, y in zip(default, runs["0"]):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x.float(), y.float(), atol=3e-2, rtol=3e-2)
    if unseen is not None:
        assert (default[0][:, :, unseen[0]:unseen[1]] == 0).all()
        assert default[0][:, :, :unseen[0]].abs().sum() + default[0][:, :, unseen[1]:].abs().sum() > 0
    if call == "attention" and set(kw) <= {"is_causal"} and B * Hq * Sq * Sk < 2**24:
        check_grads(default, q, k, v, dout, kw.get("is_causal", False), dtype=torch.bfloat16)


@pytest.mark.parametrize("switch", ["FLASHCORE_PDL=0", "FLASHCORE_DQ_CONVERT=aten"])
def test_dq_post_pass_overlap_off_without_its_kernel_or_pdl(request, monkeypatch, switch):
    """The countdowns are only set up where the post-pass kernel can overlap the backward (programmatic dependent
    launch allowed, the kernel taking the conversion): with either switched off the trace has no dq-overlap, and
    deterministic gradients equal those of the overlapping path."""
    if "sm90" not in gpu_families():
        pytest.skip("the countdowns are the sm90 backward's")
    monkeypatch.delenv("FLASHCORE_FORCE_BWD", raising=False)
    g = make_generator(request, DEV)
    q, k, v = (randn((2, 4, 333, 128), torch.bfloat16, g, DEV).requires_grad_() for _ in range(3))
    dout = randn((2, 4, 333, 128), torch.bfloat16, g, DEV)
    runs = []
    for off in (False, True):
        if off:
            name, value = switch.split("=")
            monkeypatch.setenv(name, value)
        out = flashcore.attention(q, k, v, is_causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
        ran = assert_ran("bwd", "sm90")
        assert ("dq-overlap" in ran) == (not off), ran
    assert all(torch.equal(x, y) for x, y in zip(*runs))
