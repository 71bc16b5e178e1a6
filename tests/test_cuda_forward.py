"""CUDA forward kernels against the float64 reference and SDPA, per kernel family (FLASHCORE_FORCE_KERNEL); each
test asserts that the family it forced is the one that ran. Skipped, with the reason, without a CUDA device or a
CUDA build."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

import flashcore
from conftest import (assert_ran, check_close, check_gradients, check_lse, cuda_skip_reason, gpu_families,
                      lowp_attention, make_generator, packed_varlen_grid, randn, reference_attention)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")]

DEV = "cuda"


def check_forward(q, k, v, mask, family=None, scale=None):
    """flashcore::fwd against the float64 reference: out and lse by the suite's rule; the family that ran."""
    Sq, Sk = q.size(2), k.size(2)
    causal = mask != "none"
    offset = Sk - Sq if mask == "bottom_right" else 0
    sc = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    out, lse = torch.ops.flashcore.fwd(q, k, v, sc, causal, mask == "bottom_right")
    if family is not None:
        assert_ran("fwd", family)
    ref, _ = reference_attention(q, k, v, causal, sc, offset)
    check_close("out", out, ref, lowp_attention(q, k, v, causal, sc, offset))
    check_lse(lse, q, k, causal=causal, scale=sc, causal_offset=offset)
    return out, lse


def random_qkv(request, shape, head_dim, dtype, q_layout, kv_layout):
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
    q, k, v = random_qkv(request, shape, head_dim, dtype, layout, layout)
    if layout == "bshd":
        assert q.stride(1) == head_dim and q.stride(2) == shape[1] * head_dim  # BSHD storage reaches the kernel
    check_forward(q, k, v, mask, family)


# The sm90 launcher picks the block height (64 rows per consumer warpgroup) from the grid size: the fewest
# warpgroups whose grid fits in one wave of the GPU's SMs, else the configured width, or without a mask the mid
# width where its waves come out fewer. Every SHAPES entry runs 64-row blocks; 4x40x333 runs the configured (wide)
# blocks on any GPU with up to 160 SMs; 1x12x1000 (96 or 192 blocks of 128 or 64 rows) runs the two-warpgroup
# variant of head dim 64 on a 132-SM H100, and so does 1x8x3100 unmasked (136 blocks of 192 rows in 2 waves
# against 200 of 128), its masked calls the wide one. The persistent sm90
# grid has one block per SM, so the large shapes give each block several tiles; 600 queries on 300 keys with the
# bottom-right mask interleave tiles that see no key at all (n_blocks == 0) with full ones.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
@pytest.mark.parametrize("shape", [(4, 40, 8, 333, 517), (1, 12, 4, 1000, 1000), (4, 40, 40, 600, 300),
                                   (1, 8, 4, 3100, 3100)], ids=lambda s: "x".join(map(str, s)))
def test_forward_block_heights(request, family, dtype, head_dim, mask, shape):
    check_forward(*random_qkv(request, shape, head_dim, dtype, "bshd", "bhsd"), mask, family)


@pytest.mark.parametrize("warpgroups", [1, 2, 3])
def test_forward_forced_block_height(request, monkeypatch, warpgroups):
    """FLASHCORE_FWD_WARPGROUPS=n (the A/B of the launcher's block height) runs blocks of n warpgroups, at most
    the head dim's configured width (3 at head dim 64), and each is exact."""
    if "sm90" not in gpu_families():
        pytest.skip("the block height is the sm90 forward's (compute capability 9.0)")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm90")
    monkeypatch.setenv("FLASHCORE_FWD_WARPGROUPS", str(warpgroups))
    check_forward(*random_qkv(request, (1, 8, 4, 700, 900), 64, torch.bfloat16, "bshd", "bhsd"), "none", "sm90")
    assert f" wg{warpgroups}" in flashcore.last_kernel("fwd")


def packed_route_expected(shape, head_dim):
    """Whether a dense call runs on the Hopper varlen kernel with query heads packed (attention_cuda.cpp:
    dense_on_packed_varlen): Hopper, GQA, a pack the rule takes, queries at most half of a one-head block and more
    than half of a packed one or (more than one query) 1024 keys or more, and a grid of at least a third as many
    blocks as SMs. Any of the layouts below (K/V read in place whatever their batch stride, q copied where BHSD)."""
    B, Hq, Hkv, Sq, Sk = shape
    if torch.cuda.get_device_capability() != (9, 0) or Hkv >= Hq:
        return False
    block_m = 192 if head_dim <= 96 else 128
    g, blocks, mostly_full = packed_varlen_grid(B, Hq, Hkv, Sq, block_m)
    long_keys = Sq > 1 and Sk >= 1024
    fits = os.environ.get("FLASHCORE_PACK_GQA") == "always" or (2 * Sq <= block_m and (mostly_full or long_keys))
    return g > 1 and fits and 3 * blocks >= torch.cuda.get_device_properties(0).multi_processor_count


# Dense GQA calls with a few queries a head against many keys (a chunked prefill or a speculative-decoding check
# through flash_attn_func, SDPA or transformers): on Hopper the varlen kernel runs them with the group's query heads
# packed into a block's rows, reading K/V in place in BSHD memory, BHSD memory (its rows an entry apart by the other
# heads' keys) or as the first Sk slots of a static cache (B, Hkv, capacity, D); where the queries fill the blocks
# anyway, the dense kernels. Both causal alignments (top-left keeps the first keys only; bottom-right almost all),
# and a grid too small to route.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
@pytest.mark.parametrize("shape", [(6, 32, 8, 40, 3000), (24, 16, 2, 16, 1500), (5, 24, 2, 7, 700),
                                   (2, 8, 2, 40, 500)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "cache"])
def test_forward_gqa_few_queries(request, dtype, head_dim, mask, shape, layout):
    if layout == "cache":  # q BSHD, k/v the first Sk slots of a BHSD cache 37 slots longer
        B, Hq, Hkv, Sq, Sk = shape
        q, k, v = random_qkv(request, (B, Hq, Hkv, Sq, Sk + 37), head_dim, dtype, "bshd", "bhsd")
        k, v = k[:, :, :Sk], v[:, :, :Sk]
    else:
        q, k, v = random_qkv(request, shape, head_dim, dtype, layout, layout)
    check_forward(q, k, v, mask)
    ran = flashcore.last_kernel("fwd")
    assert ("varlen" in ran) == packed_route_expected(shape, head_dim), ran


def decode_rows_expected(shape, head_dim):
    """Whether a dense call with a few queries a head under GQA runs on the KV-cache kernel (attention_cuda.cpp:
    dense_decode_step): a KV head's query rows (Sq x group) at most 64, 2048 keys or more and at least 512 keys (all
    entries together) a row (1024 above head dim 128 where the dense grid, B x Hq blocks, fills half the SMs), and
    at most 16 rows where the packed varlen route would take the call; on Hopper."""
    B, Hq, Hkv, Sq, Sk = shape
    rows = Sq * (Hq // Hkv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    keys_per_row = 1024 if head_dim > 128 and 2 * B * Hq >= sms else 512
    if torch.cuda.get_device_capability() != (9, 0) or Sq < 2 or Hq == Hkv or rows > 64 or Sk < 2048 or \
            B * Sk < keys_per_row * rows:
        return False
    return rows <= 16 or not packed_route_expected(shape, head_dim)


# A few queries a head under GQA over long keys (a speculative-decoding check): the KV-cache kernel, a KV head's
# group x Sq rows a block, where its rule says (decode_rows_expected), the dense or packed kernels elsewhere; both
# causal alignments (top-left: the queries see the first keys only), and the variants (window, softcap, sinks,
# ALiBi) against the float64 reference.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
@pytest.mark.parametrize("shape", [(1, 8, 2, 4, 9000), (3, 16, 2, 2, 3000), (2, 32, 8, 16, 16400),
                                   (1, 8, 2, 16, 5000), (8, 32, 8, 8, 4096), (4, 32, 8, 8, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_forward_gqa_decode_rows(request, dtype, head_dim, mask, shape):
    layout = "bshd" if shape[0] % 2 else "bhsd"
    q, k, v = random_qkv(request, shape, head_dim, dtype, layout, layout)
    check_forward(q, k, v, mask)
    ran = flashcore.last_kernel("fwd")
    assert ran.startswith("decode") == decode_rows_expected(shape, head_dim), ran


@pytest.mark.parametrize("variant", ["window", "softcap", "sinks", "alibi"])
def test_forward_gqa_decode_rows_variants(request, variant):
    B, Hq, Hkv, Sq, Sk, D = 2, 16, 4, 4, 5000, 128
    q, k, v = random_qkv(request, (B, Hq, Hkv, Sq, Sk), D, torch.bfloat16, "bshd", "bshd")
    g = make_generator(request, DEV)
    window, softcap, sinks, slopes = (-1, -1), 0.0, None, None
    if variant == "window":
        window = (700, 0)
    elif variant == "softcap":
        softcap, q = 20.0, q * 4
    elif variant == "sinks":
        sinks = torch.randn(Hq, generator=g, device=DEV) * 3
    else:
        slopes = torch.rand(Hq, generator=g, device=DEV) * 0.1
    sc = 1 / math.sqrt(D)
    out, _ = torch.ops.flashcore.fwd(q, k, v, sc, True, True, *window, softcap, False, sinks, slopes)
    assert flashcore.last_kernel("fwd").startswith("decode"), flashcore.last_kernel("fwd")
    mask = dict(window=window, softcap=softcap, sinks=sinks, alibi=slopes)
    ref, _ = reference_attention(q, k, v, True, sc, Sk - Sq, **mask)
    check_close("out", out, ref, lowp_attention(q, k, v, True, sc, Sk - Sq, **mask))


def test_backward_after_decode_rows_forward(request):
    """The dense backward takes the out and lse the KV-cache kernel wrote for a few queries a head (bottom-right
    causal, BHSD)."""
    shape = (2, 16, 4, 4, 5000)
    q, k, v = (t.requires_grad_() for t in random_qkv(request, shape, 128, torch.bfloat16, "bhsd", "bhsd"))
    out = flashcore.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    assert flashcore.last_kernel("fwd").startswith("decode"), flashcore.last_kernel("fwd")
    out = out.transpose(1, 2)
    dout = torch.randn(out.shape, generator=make_generator(request, DEV), device=DEV).to(out.dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    offset = shape[4] - shape[3]
    low = torch.autograd.grad(lowp_attention(q, k, v, True, None, offset), (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(reference_attention(q64, k64, v64, True, None, offset)[0], (q64, k64, v64),
                               dout.double())
    check_gradients(got, want, low)


# FLASHCORE_PACK_GQA=always (an A/B switch, docs/PERFORMANCE.md): every dense GQA call in BSHD memory takes the
# packed varlen kernel, however many queries a head, with the largest pack the block's rows allow.
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
def test_forward_pack_gqa_always(request, monkeypatch, head_dim, mask):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("pack-GQA is the Hopper varlen kernel's (compute capability 9.0)")
    monkeypatch.setenv("FLASHCORE_PACK_GQA", "always")
    shape = (3, 16, 4, 700, 900)
    check_forward(*random_qkv(request, shape, head_dim, torch.bfloat16, "bshd", "bshd"), mask)
    ran = flashcore.last_kernel("fwd")
    block_m = 192 if head_dim <= 96 else 128
    assert "varlen" in ran and f"pack{packed_varlen_grid(*shape[:4], block_m)[0]}" in ran, ran


def test_backward_after_packed_forward(request):
    """The dense backward takes the out and lse the packed varlen forward wrote (the route is forward only)."""
    shape = (6, 32, 8, 40, 3000)
    q, k, v = (t.requires_grad_() for t in random_qkv(request, shape, 128, torch.bfloat16, "bshd", "bshd"))
    out = flashcore.attention(q, k, v, enable_gqa=True)
    assert ("varlen" in flashcore.last_kernel("fwd")) == packed_route_expected(shape, 128)
    dout = torch.randn(out.shape, generator=make_generator(request, DEV), device=DEV).to(out.dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    low = torch.autograd.grad(lowp_attention(q, k, v), (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(reference_attention(q64, k64, v64)[0], (q64, k64, v64), dout.double())
    check_gradients(got, want, low)


# Long key sequences: the sm90 launcher switches unmasked head-dim-128 calls to wider key tiles from
# FwdSm90Config::kWideMinKeys (4096) keys on; 4500 and 8193 keys end in a partial tile of either width.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "bottom_right"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 300, 4500), (2, 2, 2, 65, 8193), (1, 2, 2, 200, 4095)],
                         ids=lambda s: "x".join(map(str, s)))
def test_forward_long_keys(request, family, dtype, head_dim, mask, shape):
    layout = "bshd" if shape[3] % 2 == 0 else "bhsd"
    check_forward(*random_qkv(request, shape, head_dim, dtype, layout, layout), mask, family)


@pytest.mark.parametrize("scale", [0.02, 0.3, 1.0])
def test_forward_non_default_scale(request, family, scale):
    q, k, v = random_qkv(request, (2, 4, 2, 300, 333), 128, torch.bfloat16, "bshd", "bshd")
    check_forward(q, k, v, "causal", family, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_misaligned_and_padded(request, family, dtype, head_dim):
    """Storage offsets that break 16-byte alignment (copied to aligned storage first) and padded rows: the forced
    family still runs."""
    g = make_generator(request, DEV)
    base = torch.randn(2 * 4 * 300 * head_dim + 3, generator=g, device=DEV).to(dtype)
    q = base[3:].view(2, 4, 300, head_dim)  # 6-byte offset
    k = randn((2, 4, 280, head_dim), dtype, g, DEV, layout="padded")
    v = randn((2, 4, 280, head_dim), dtype, g, DEV, layout="padded")
    out = flashcore.attention(q, k, v, is_causal=True)
    assert_ran("fwd", family)
    ref, _ = reference_attention(q, k, v, True)
    check_close("out", out, ref, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_forward_expanded_kv_runs_mma_sync(request, dtype, monkeypatch):
    """Zero-stride (expanded) K/V heads cannot be described by TMA: the dispatcher runs the mma.sync family, even
    when sm90 is forced, and the result is right."""
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80")
    g = make_generator(request, DEV)
    q = randn((2, 4, 300, 64), dtype, g, DEV)
    k = randn((2, 1, 280, 64), dtype, g, DEV).expand(2, 4, 280, 64)
    v = randn((2, 1, 280, 64), dtype, g, DEV).expand(2, 4, 280, 64)
    out = flashcore.attention(q, k, v, is_causal=True)
    assert_ran("fwd", "sm80")
    ref, _ = reference_attention(q, k, v, True)
    check_close("out", out, ref, F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), is_causal=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_large_magnitude_and_one_hot(request, family, dtype):
    """Scores near fp16's range (|s| up to ~50 after scaling) and nearly one-hot rows."""
    g = make_generator(request, DEV)
    q = randn((2, 4, 512, 128), dtype, g, DEV, scale=4.0)
    k = randn((2, 4, 512, 128), dtype, g, DEV, scale=4.0)
    v = randn((2, 4, 512, 128), dtype, g, DEV)
    out = flashcore.attention(q, k, v)
    assert_ran("fwd", family)
    ref, _ = reference_attention(q, k, v)
    check_close("out", out, ref, F.scaled_dot_product_attention(q, k, v))
    k2 = k.clone()
    k2[:, :, 7] = q[:, :, 7] * 3  # row 7 attends almost only to key 7
    out = flashcore.attention(q, k2, v)
    ref, _ = reference_attention(q, k2, v)
    check_close("out", out, ref, F.scaled_dot_product_attention(q, k2, v))


def test_rows_without_keys_are_zero_and_neg_inf(request, family):
    """Bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key; out exactly 0, lse exactly -inf
    (outputs are poisoned with NaN before the kernel runs, so these rows must be written)."""
    q, k, v = random_qkv(request, (2, 3, 3, 300, 100), 64, torch.float16, "bhsd", "bhsd")
    out, lse = check_forward(q, k, v, "bottom_right", family)
    assert (out[:, :, :200] == 0).all() and torch.isneginf(lse[:, :, :200]).all()


def test_forward_deterministic_run_to_run(request, family):
    g = make_generator(request, DEV)
    q, k, v = (randn((2, 8, 1500, 128), torch.bfloat16, g, DEV) for _ in range(3))
    a = flashcore.attention(q, k, v, is_causal=True)
    for _ in range(3):
        assert torch.equal(a, flashcore.attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("shape_q,shape_kv", [((0, 2, 5, 64), (0, 2, 6, 64)), ((1, 2, 0, 64), (1, 2, 6, 64)),
                                              ((1, 2, 5, 64), (1, 2, 0, 64)), ((1, 0, 5, 64), (1, 0, 6, 64))],
                         ids=["batch0", "sq0", "sk0", "heads0"])
def test_empty_inputs_on_cuda(shape_q, shape_kv):
    q = torch.randn(*shape_q, device=DEV, dtype=torch.float16, requires_grad=True)
    k = torch.randn(*shape_kv, device=DEV, dtype=torch.float16, requires_grad=True)
    v = torch.randn(*shape_kv, device=DEV, dtype=torch.float16, requires_grad=True)
    out, lse = flashcore.attention(q, k, v, return_lse=True)
    assert out.shape == shape_q and lse.shape == shape_q[:3]
    if shape_kv[2] == 0:
        assert (out == 0).all() and torch.isneginf(lse).all()
    out.float().sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


def test_kernel_name_reports_family(monkeypatch):
    q = torch.randn(1, 2, 64, 128, device=DEV, dtype=torch.float16)
    monkeypatch.delenv("FLASHCORE_FORCE_KERNEL", raising=False)
    expected = "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80"
    assert flashcore.fwd_kernel_name(q, q, q) == expected
    flashcore.attention(q, q, q)
    assert_ran("fwd", expected)
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm80")
    assert flashcore.fwd_kernel_name(q, q, q) == "sm80"
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "nonsense")
    with pytest.raises(RuntimeError, match="FLASHCORE_FORCE_KERNEL"):
        flashcore.fwd_kernel_name(q, q, q)


@pytest.mark.slow
def test_grid_beyond_65535_blocks(request, family):
    g = make_generator(request, DEV)
    q = randn((1, 70000, 16, 64), torch.float16, g, DEV)
    k = randn((1, 70000, 24, 64), torch.float16, g, DEV)
    v = randn((1, 70000, 24, 64), torch.float16, g, DEV)
    out = flashcore.attention(q, k, v)
    assert_ran("fwd", family)
    ref, _ = reference_attention(q, k, v)
    check_close("out", out, ref, F.scaled_dot_product_attention(q, k, v))
