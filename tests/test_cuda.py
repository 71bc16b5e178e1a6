"""CUDA kernels against the float64 reference and SDPA, run per kernel family (FLASHCORE_FORCE_KERNEL).
Every test skips with a reason when there is no CUDA device or flashcore was built without CUDA kernels."""

import math

import pytest
import torch
import torch.nn.functional as F

import flashcore
from conftest import assert_flash_close, cuda_skip_reason, make_generator, randn, reference_attention

pytestmark = pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")

DEV = "cuda"


def _families():
    fams = ["sm80"]
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        fams.append("sm90")
    return fams


@pytest.fixture(params=["sm80", "sm90"])
def family(request, monkeypatch):
    if request.param not in _families():
        pytest.skip(f"{request.param} kernels need a compute capability 9.0 GPU")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", request.param)
    return request.param


def _sdpa_lowp(q, k, v, causal, offset):
    """PyTorch's own low-precision answer (the error yardstick); bottom-right causal through a boolean mask."""
    gqa = q.size(1) != k.size(1)
    if not causal or offset == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    Sq, Sk = q.size(2), k.size(2)
    i = torch.arange(Sq, device=q.device)[:, None]
    j = torch.arange(Sk, device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=j <= i + offset, enable_gqa=gqa).nan_to_num(0.0)


def _check_forward(q, k, v, mask):
    """flashcore::fwd against the float64 reference (out with flash-attn's rule, lse finite where it must be)."""
    Sq, Sk = q.size(2), k.size(2)
    causal = mask != "none"
    offset = Sk - Sq if mask == "bottom_right" else 0
    out, lse = torch.ops.flashcore.fwd(q, k, v, 1.0 / math.sqrt(q.size(-1)), causal, mask == "bottom_right")
    ref, ref_lse = reference_attention(q, k, v, causal, None, offset)
    assert_flash_close("out", out, ref, _sdpa_lowp(q, k, v, causal, offset))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=2e-3, rtol=1e-4)


def _random_qkv(request, shape, head_dim, dtype, q_layout, kv_layout):
    """Fresh q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D) for shape (B, Hq, Hkv, Sq, Sk), seeded from the test id."""
    B, Hq, Hkv, Sq, Sk = shape
    g = make_generator(request, DEV)
    q = randn((B, Hq, Sq, head_dim), dtype, g, DEV, layout=q_layout)
    k = randn((B, Hkv, Sk, head_dim), dtype, g, DEV, layout=kv_layout)
    v = randn((B, Hkv, Sk, head_dim), dtype, g, DEV, layout=kv_layout)
    return q, k, v


HEAD_DIMS = [32, 40, 64, 80, 96, 128, 136, 192, 256]
# (B, Hq, Hkv, Sq, Sk)
SHAPES = [(2, 4, 4, 113, 113), (1, 4, 2, 1000, 777), (1, 2, 1, 1, 300), (1, 2, 2, 257, 64), (1, 2, 2, 7, 2048)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
def test_forward_grid(request, family, dtype, head_dim, shape, mask):
    layout = "bshd" if (head_dim + shape[3]) % 2 == 0 else "bhsd"
    _check_forward(*_random_qkv(request, shape, head_dim, dtype, layout, layout), mask)


# The sm90 launcher picks the block height (64 rows per consumer warpgroup) from the grid size: the fewest
# warpgroups whose grid fits in one wave of the GPU's SMs, else the configured width. Every SHAPES entry runs
# 64-row blocks; 4x40x333 runs the configured (wide) blocks on any GPU with up to 160 SMs; 1x12x1000 (96 or 192
# blocks of 128 or 64 rows) runs the two-warpgroup variant of head dim 64 on a 132-SM H100. The persistent sm90
# grid has one block per SM, so the large shapes give each block several tiles; 600 queries on 300 keys with the
# bottom-right mask interleave tiles that see no key at all (n_blocks == 0) with full ones.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
@pytest.mark.parametrize("shape", [(4, 40, 8, 333, 517), (1, 12, 4, 1000, 1000), (4, 40, 40, 600, 300)],
                         ids=lambda s: "x".join(map(str, s)))
def test_forward_block_heights(request, family, dtype, head_dim, mask, shape):
    _check_forward(*_random_qkv(request, shape, head_dim, dtype, "bshd", "bhsd"), mask)


# Long key sequences: the sm90 launcher switches unmasked head-dim-128 calls to wider key tiles from
# FwdSm90Config::kWideMinKeys (4096) keys on; 4500 and 8193 keys end in a partial tile of either width.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 300, 4500), (2, 2, 2, 65, 8193), (1, 2, 2, 200, 4095)],
                         ids=lambda s: "x".join(map(str, s)))
def test_forward_long_keys(request, family, dtype, head_dim, mask, shape):
    layout = "bshd" if shape[3] % 2 == 0 else "bhsd"
    _check_forward(*_random_qkv(request, shape, head_dim, dtype, layout, layout), mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_misaligned_and_strided(request, family, dtype, head_dim):
    """Storage offsets that break 16-byte alignment, padded rows, expanded (zero-stride) K/V heads."""
    g = make_generator(request, DEV)
    base = torch.randn(2 * 4 * 300 * head_dim + 3, generator=g, device=DEV).to(dtype)
    q = base[3:].view(2, 4, 300, head_dim)  # 6-byte offset
    k = randn((2, 4, 280, head_dim), dtype, g, DEV, layout="padded")
    v = randn((2, 1, 280, head_dim), dtype, g, DEV).expand(2, 4, 280, head_dim)
    out = flashcore.attention(q, k, v, is_causal=True)
    ref, _ = reference_attention(q, k, v, True)
    assert_flash_close("out", out, ref, F.scaled_dot_product_attention(q, k, v.contiguous(), is_causal=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_large_magnitude_and_one_hot(request, family, dtype):
    """Scores near fp16's range (|s| up to ~50 after scaling) and nearly one-hot rows."""
    g = make_generator(request, DEV)
    q = randn((2, 4, 512, 128), dtype, g, DEV, scale=4.0)
    k = randn((2, 4, 512, 128), dtype, g, DEV, scale=4.0)
    v = randn((2, 4, 512, 128), dtype, g, DEV)
    out = flashcore.attention(q, k, v)
    ref, _ = reference_attention(q, k, v)
    assert_flash_close("out", out, ref, F.scaled_dot_product_attention(q, k, v))
    k2 = k.clone()
    k2[:, :, 7] = q[:, :, 7] * 3  # row 7 attends almost only to key 7
    out = flashcore.attention(q, k2, v)
    ref, _ = reference_attention(q, k2, v)
    assert_flash_close("out", out, ref, F.scaled_dot_product_attention(q, k2, v))


def test_outputs_do_not_depend_on_stale_memory(request, family):
    """The op allocates its outputs: fill the caching allocator with NaN first, then check every element."""
    g = make_generator(request, DEV)
    junk = torch.full((64 << 20,), float("nan"), device=DEV)
    del junk
    q, k, v = (randn((3, 5, 333, 96), torch.float16, g, DEV) for _ in range(3))
    out, lse = torch.ops.flashcore.fwd(q, k, v, 0.1, False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_forward_deterministic_run_to_run(request, family):
    g = make_generator(request, DEV)
    q, k, v = (randn((2, 8, 1500, 128), torch.bfloat16, g, DEV) for _ in range(3))
    a = flashcore.attention(q, k, v, is_causal=True)
    for _ in range(3):
        assert torch.equal(a, flashcore.attention(q, k, v, is_causal=True))


def _capture(fn):
    """fn captured in a CUDA graph after a warm-up call on a side stream: (graph, fn's outputs in the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


def test_cuda_graph_capture(request, family):
    g = make_generator(request, DEV)
    q, k, v = (randn((2, 4, 256, 64), torch.float16, g, DEV) for _ in range(3))
    eager = flashcore.attention(q, k, v, is_causal=True)
    graph, static_out = _capture(lambda: flashcore.attention(q, k, v, is_causal=True))
    q.copy_(randn((2, 4, 256, 64), torch.float16, g, DEV))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, flashcore.attention(q, k, v, is_causal=True))
    assert not torch.equal(static_out, eager)


# (B, H, Sq, Sk, D), causal, bottom_right: a short grid on part of the SMs (one-warpgroup sm90 blocks); a
# persistent sm90 grid (blocks walk several tiles, the next Q loading behind a tile's tail); query rows that see no
# key (bottom-right mask, Sq > Sk).
CHAINS = {
    "small": ((1, 8, 512, 512, 64), True, False),
    "persistent": ((4, 16, 1024, 1024, 64), False, False),
    "empty_rows": ((1, 4, 300, 100, 64), True, True),
}


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", list(CHAINS))
def test_back_to_back_calls_see_previous_outputs(request, family, in_graph, case):
    """Forward kernels start before the previous kernel of the stream ends (programmatic dependent launch): each
    call here reads the previous call's output as its query, and its output reuses the memory of the output
    before that (freed, so the allocator hands it out again). A kernel touching memory before the previous one
    completed would read a stale query or overwrite one still being read; the synchronized chain is the truth.
    The graph case is the one that catches a missing wait (eager calls rarely overlap: the host is slower)."""
    g = make_generator(request, DEV)
    (B, H, Sq, Sk, D), causal, bottom_right = CHAINS[case]
    q0 = randn((B, H, Sq, D), torch.float16, g, DEV)
    k, v = (randn((B, H, Sk, D), torch.float16, g, DEV) for _ in range(2))
    steps = 8

    def chain(sync):
        y = q0
        for _ in range(steps):
            # back to back (no kernel between), scale 2: sharp rows, so each output is far from the last
            y, _ = torch.ops.flashcore.fwd(y, k, v, 2.0, causal, bottom_right)
            if sync:
                torch.cuda.synchronize()
        return y

    expected = chain(sync=True)
    if in_graph:
        graph, static_out = _capture(lambda: chain(sync=False))
        graph.replay()
        torch.cuda.synchronize()
        got = static_out
    else:
        got = chain(sync=False)
    assert torch.isfinite(expected).all() and not torch.equal(expected, q0)
    assert torch.equal(got, expected)


def test_grid_beyond_65535_blocks(request, family):
    g = make_generator(request, DEV)
    q = randn((1, 70000, 16, 64), torch.float16, g, DEV)
    k = randn((1, 70000, 24, 64), torch.float16, g, DEV)
    v = randn((1, 70000, 24, 64), torch.float16, g, DEV)
    out = flashcore.attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out, ref, atol=2e-3, rtol=0)


# Key splits (sm90): a one-warpgroup grid that leaves SMs idle gives each query tile a cluster of blocks, each
# over a slice of the key tiles, merged through rank 0's shared memory; the launcher splits walks of about 5 key
# tiles or more. FLASHCORE_KEY_SPLITS caps the blocks a tile (1: no split). The last two shapes give slices that
# see no key at all: causal query blocks with fewer key tiles than blocks in the cluster, and bottom-right rows
# (Sq > Sk) that see nothing.
SPLIT_SHAPES = [(1, 2, 1, 70, 1500), (1, 3, 3, 1, 4097), (1, 1, 1, 1400, 1200), (1, 1, 1, 1280, 1280)]


@pytest.fixture
def sm90_only(monkeypatch):
    if "sm90" not in _families():
        pytest.skip("key splits are an sm90 kernel feature: they need a compute capability 9.0 GPU")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm90")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("splits", ["2", "3", "8"])
def test_forward_key_splits(request, sm90_only, monkeypatch, dtype, head_dim, mask, shape, splits):
    monkeypatch.setenv("FLASHCORE_KEY_SPLITS", splits)
    _check_forward(*_random_qkv(request, shape, head_dim, dtype, "bhsd", "bshd"), mask)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_key_split_taken_deterministic_and_graph_safe(request, sm90_only, monkeypatch, head_dim):
    """A long key walk over few heads is split (its sums run in another order than the unsplit kernel's, so the
    bits differ); the split result is accurate, identical run to run, and recomputed on CUDA graph replay."""
    q, k, v = _random_qkv(request, (1, 3, 3, 1, 4097), head_dim, torch.bfloat16, "bhsd", "bhsd")
    monkeypatch.setenv("FLASHCORE_KEY_SPLITS", "1")
    unsplit = flashcore.attention(q, k, v)
    monkeypatch.delenv("FLASHCORE_KEY_SPLITS")
    split = flashcore.attention(q, k, v)
    assert not torch.equal(split, unsplit), "the key split did not run"
    ref, _ = reference_attention(q, k, v)
    assert_flash_close("out", split, ref, F.scaled_dot_product_attention(q, k, v))
    for _ in range(3):
        assert torch.equal(split, flashcore.attention(q, k, v))
    graph, out = _capture(lambda: flashcore.attention(q, k, v))
    g = torch.Generator(device=DEV).manual_seed(20261123)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=g, device=DEV))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = reference_attention(q, k, v)
    assert_flash_close("out", out, ref, F.scaled_dot_product_attention(q, k, v))


def test_kernel_name_reports_family(monkeypatch):
    q = torch.randn(1, 2, 64, 128, device=DEV, dtype=torch.float16)
    monkeypatch.delenv("FLASHCORE_FORCE_KERNEL", raising=False)
    expected = "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80"
    assert flashcore.fwd_kernel_name(q, q, q) == expected
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm80")
    assert flashcore.fwd_kernel_name(q, q, q) == "sm80"
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "nonsense")
    with pytest.raises(RuntimeError, match="FLASHCORE_FORCE_KERNEL"):
        flashcore.fwd_kernel_name(q, q, q)


@pytest.fixture(params=["sm80", "sm90", "composite"])
def bwd_path(request, monkeypatch):
    """The fused mma.sync and wgmma backwards and the composite (ATen) one, each forced."""
    if request.param == "sm90" and "sm90" not in _families():
        pytest.skip("the sm90 backward needs a compute capability 9.0 GPU")
    monkeypatch.setenv("FLASHCORE_FORCE_BWD", request.param)
    return request.param


BWD_HEAD_DIMS = [32, 64, 80, 96, 128, 192, 256]
# (B, Hq, Hkv, Sq, Sk): equal lengths, GQA with Sq < Sk, one query row, Sq > Sk (rows that see no key when
# bottom-right aligned)
BWD_SHAPES = [(2, 4, 4, 300, 300), (1, 8, 2, 129, 517), (1, 2, 1, 1, 77), (2, 3, 3, 200, 17)]


def _check_grads(got, q, k, v, dout, causal, offset, dtype):
    lowp = torch.autograd.grad(_sdpa_lowp(q, k, v, causal, offset), (q, k, v), dout)
    lowp = [x.nan_to_num(0.0) for x in lowp]  # SDPA: NaN on rows a boolean mask hides entirely
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(reference_attention(q64, k64, v64, causal, None, offset)[0], (q64, k64, v64),
                              dout.double())
    for name, a, r, l in zip(("dq", "dk", "dv"), got, ref, lowp):
        assert_flash_close(name, a, r, l, dtype=dtype, factor=2.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", BWD_HEAD_DIMS)
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
def test_backward(request, bwd_path, dtype, head_dim, shape, mask):
    B, Hq, Hkv, Sq, Sk = shape
    g = make_generator(request, DEV)
    q = randn((B, Hq, Sq, head_dim), dtype, g, DEV).requires_grad_()
    k = randn((B, Hkv, Sk, head_dim), dtype, g, DEV).requires_grad_()
    v = randn((B, Hkv, Sk, head_dim), dtype, g, DEV).requires_grad_()
    dout = randn((B, Hq, Sq, head_dim), dtype, g, DEV)
    causal = mask != "none"
    offset = Sk - Sq if mask == "bottom_right" else 0
    if mask == "bottom_right":  # flash-attn's API: BSHD views, so the kernels also see non-BHSD strides
        out = flashcore.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        out = out.transpose(1, 2)
    else:
        out = flashcore.attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
    got = torch.autograd.grad(out, (q, k, v), dout)
    _check_grads(got, q, k, v, dout, causal, offset, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_backward_misaligned_and_strided(request, bwd_path, dtype):
    """Odd storage offsets, padded rows and zero-stride (expanded) K/V heads reach the backward too."""
    g = make_generator(request, DEV)
    D = 64
    base = torch.randn(2 * 4 * 300 * D + 3, generator=g, device=DEV).to(dtype)
    q = base[3:].view(2, 4, 300, D).detach().requires_grad_()
    k = randn((2, 4, 280, D), dtype, g, DEV, layout="padded").detach().requires_grad_()
    v1 = randn((2, 1, 280, D), dtype, g, DEV).requires_grad_()
    v = v1.expand(2, 4, 280, D)
    dout = randn((2, 4, 300, D), dtype, g, DEV).transpose(1, 2).contiguous().transpose(1, 2)  # BSHD strides
    got = torch.autograd.grad(flashcore.attention(q, k, v, is_causal=True), (q, k, v1), dout)
    lowp = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v1), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v1))
    ref = torch.autograd.grad(reference_attention(q64, k64, v64.expand(2, 4, 280, D), True)[0], (q64, k64, v64),
                              dout.double())
    for name, a, r, l in zip(("dq", "dk", "dv"), got, ref, lowp):
        assert_flash_close(name, a, r, l, dtype=dtype, factor=2.5)


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
    _check_grads(got, q, k, v, dout, True, 0, torch.float16)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_backward_cuda_graph_capture(request, deterministic):
    """The backward op captured in a CUDA graph recomputes the gradients of new inputs on replay."""
    g = make_generator(request, DEV)
    shape, scale = (2, 4, 300, 64), 0.125
    q, k, v, dout = (randn(shape, torch.float16, g, DEV) for _ in range(4))
    out, lse = torch.ops.flashcore.fwd(q, k, v, scale, True)

    def bwd():
        return torch.ops.flashcore.bwd(dout, q, k, v, out, lse, scale, True, deterministic=deterministic)

    before = bwd()
    graph, static_grads = _capture(bwd)
    dout.copy_(randn(shape, torch.float16, g, DEV))
    graph.replay()
    torch.cuda.synchronize()
    for got, want, old in zip(static_grads, bwd(), before):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3)  # dQ's fp32 atomics may reorder: 1 ulp
        assert not torch.equal(got, old)


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
    finally:
        torch.use_deterministic_algorithms(prev)
    for x, y in zip(*runs):
        assert torch.equal(x, y)
    _check_grads(runs[0], q, k, v, dout, True, 0, torch.float16)


def test_compile_on_cuda(request):
    torch._dynamo.reset()
    g = make_generator(request, DEV)
    q, k, v = (randn((2, 4, 128, 64), torch.bfloat16, g, DEV).requires_grad_() for _ in range(3))
    f = torch.compile(lambda q, k, v: flashcore.attention(q, k, v, is_causal=True).float().square().sum(),
                      fullgraph=True, backend="aot_eager")
    loss = f(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    loss_ref = flashcore.attention(q, k, v, is_causal=True).float().square().sum()
    grads_ref = torch.autograd.grad(loss_ref, (q, k, v))
    assert torch.allclose(loss, loss_ref)
    for a, b in zip(grads, grads_ref):  # dQ is summed with atomics: equal up to summation order
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()


class _TinyDecoder(torch.nn.Module):
    """Two pre-norm causal attention blocks with GQA (8 query heads, 2 key/value heads, head dim 64)."""

    def __init__(self, attn, dim=256, heads=8, kv_heads=2, layers=2):
        super().__init__()
        self.attn, self.heads, self.kv_heads, self.hd = attn, heads, kv_heads, dim // heads
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(layers))
        self.qkv = torch.nn.ModuleList(
            torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, S, _ = x.shape
        for norm, qkv, proj in zip(self.norms, self.qkv, self.proj):
            q, k, v = qkv(norm(x)).split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], -1)
            q = q.view(B, S, self.heads, self.hd).transpose(1, 2)  # BSHD storage, read in place
            k = k.view(B, S, self.kv_heads, self.hd).transpose(1, 2)
            v = v.view(B, S, self.kv_heads, self.hd).transpose(1, 2)
            y = self.attn(q, k, v, is_causal=True, enable_gqa=True)
            x = x + proj(y.transpose(1, 2).reshape(B, S, -1))
        return self.head(x)


def _train(attn, dtype, steps, data, seed_state, autocast):
    model = _TinyDecoder(attn).to(DEV)
    model.load_state_dict(seed_state)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, target = data
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=autocast):
            loss = (model(x).float() - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_training_matches_sdpa(request, dtype):
    """300 Adam steps of a small causal GQA decoder under autocast: flashcore's loss curve stays as close to the
    float32 run (SDPA math) as SDPA's own low-precision run does (flash-attn's 2x rule on window means)."""
    g = make_generator(request, DEV)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g, device=DEV)))
    init = {k: v.clone() for k, v in _TinyDecoder(None).to(DEV).state_dict().items()}
    x = torch.randn(4, 256, 256, generator=g, device=DEV)
    target = torch.randn(4, 256, 256, generator=g, device=DEV).cumsum(1) / 16  # needs attention to the past
    steps = 300

    def sdpa_math(*a, **kw):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return F.scaled_dot_product_attention(*a, **kw)

    ref = _train(sdpa_math, dtype, steps, (x, target), init, autocast=False)
    fc = _train(flashcore.attention, dtype, steps, (x, target), init, autocast=True)
    sd = _train(F.scaled_dot_product_attention, dtype, steps, (x, target), init, autocast=True)
    assert torch.isfinite(fc).all()
    assert fc[-20:].mean() < 0.7 * fc[:5].mean(), "the model did not learn: the comparison would be vacuous"
    win = lambda c: c.view(-1, 20).mean(1)  # noqa: E731
    err_fc = (win(fc) - win(ref)).abs()
    err_sd = (win(sd) - win(ref)).abs()
    assert (err_fc <= 2 * err_sd + 0.01 * win(ref)).all(), (err_fc, err_sd, win(ref))
