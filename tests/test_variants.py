"""The attention variants on every path: sliding window, softcap, attention sinks and ALiBi, alone and together,
forward and backward, against the float64 reference and PyTorch's own low-precision computation of the same
variant (conftest.lowp_attention), by the suite's one rule. CPU tests run everywhere (all CPU dtypes); GPU tests
force each kernel family and backward path and assert it ran."""

import math

import pytest
import torch

import flashcore
from conftest import (assert_ran, check_close, check_gradients, check_lse, cuda_skip_reason, gpu_families,
                      lowp_attention, lowp_dsinks, lowp_lse, make_generator, randn, reference_attention)

requires_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")


def make_case(request, device, dtype, B, Hq, Hkv, Sq, Sk, D, variant, layout="bhsd"):
    """Inputs and keyword arguments of one variant: a dict of flashcore.attention kwargs and its reference kwargs."""
    g = make_generator(request, device)
    scale = 3.0 if "large" in variant else 1.0
    q = randn((B, Hq, Sq, D), dtype, g, device, layout=layout, scale=scale)
    k = randn((B, Hkv, Sk, D), dtype, g, device, layout=layout, scale=scale)
    v = randn((B, Hkv, Sk, D), dtype, g, device, layout=layout)
    kw, ref = {}, {}
    if "window" in variant:
        kw["window_size"] = ref["window"] = variant["window"]
    if variant.get("causal"):
        kw["is_causal"] = ref["causal"] = True
    if "softcap" in variant:
        kw["softcap"] = ref["softcap"] = variant["softcap"]
    if "sinks" in variant:
        s = variant["sinks"]
        sinks = (torch.randn(Hq, generator=g, device=device) * 2 if s == "random"
                 else torch.full((Hq,), float(s), device=device))
        kw["sinks"] = ref["sinks"] = sinks
    if "alibi" in variant:
        shape = (Hq,) if variant["alibi"] == "head" else (B, Hq)
        slopes = torch.rand(shape, generator=g, device=device) * 0.2
        kw["alibi_slopes"] = ref["alibi"] = slopes
    return q, k, v, kw, ref


VARIANTS = {
    "window_small": {"window": (5, 3)},  # smaller than one tile
    "window_diag": {"window": (0, 0)},  # only the diagonal
    "window_left_only": {"window": (40, -1)},
    "window_right_only": {"window": (-1, 17)},
    "window_causal": {"window": (60, -1), "causal": True},
    "window_empty_rows": {"window": (0, 5)},  # top-left: query i sees keys i..i+5, none for i >= Sk
    "softcap5": {"softcap": 5.0, "large": True},
    "softcap50_causal": {"softcap": 50.0, "causal": True, "large": True},
    "sinks_random": {"sinks": "random"},
    "sinks_neg_inf": {"sinks": float("-inf"), "causal": True},
    "sinks_zero": {"sinks": 0.0},
    "sinks_plus20": {"sinks": 20.0},
    "alibi_head": {"alibi": "head"},
    "alibi_batch_causal": {"alibi": "batch", "causal": True},
    "alibi_window": {"alibi": "head", "window": (30, 10)},
    "all": {"window": (50, -1), "causal": True, "softcap": 30.0, "sinks": "random", "alibi": "batch"},
}


def run_forward(q, k, v, kw, ref, dtype=None):
    out, lse = flashcore.attention(q, k, v, enable_gqa=q.size(1) != k.size(1), return_lse=True, **kw)
    r, _ = reference_attention(q, k, v, **ref)
    check_close("out", out, r, lowp_attention(q, k, v, **ref), dtype=dtype)
    lse_kw = {key: val for key, val in ref.items() if key != "window"}
    if "window" in ref:
        lse_kw["window"] = ref["window"]
    check_lse(lse, q, k, **lse_kw)
    return out, lse


def run_backward(q, k, v, kw, ref, dtype=None):
    sinks = kw.get("sinks")
    if sinks is not None:
        sinks = sinks.clone().requires_grad_()
        kw = dict(kw, sinks=sinks)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    g = torch.Generator(device=q.device).manual_seed(7)
    dout = torch.randn(q.shape[:-1] + v.shape[-1:], generator=g, device=q.device).to(q.dtype)  # out's shape
    inputs = (q, k, v) + ((sinks,) if sinks is not None else ())
    out = flashcore.attention(q, k, v, enable_gqa=q.size(1) != k.size(1), **kw)
    got = torch.autograd.grad(out, inputs, dout)
    ref_s = dict(ref, sinks=sinks) if sinks is not None else ref
    out_lowp = lowp_attention(q, k, v, **ref_s)
    low = torch.autograd.grad(out_lowp, inputs, dout)
    low = [x.nan_to_num(0.0) for x in low]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    inputs64 = (q64, k64, v64)
    ref64 = dict(ref)
    if sinks is not None:
        s64 = sinks.detach().double().requires_grad_()
        ref64["sinks"] = s64
        inputs64 += (s64,)
    out64, lse64 = reference_attention(q64, k64, v64, **ref64)
    want = torch.autograd.grad(out64, inputs64, dout.double())
    check_gradients(got[:3], want[:3], low[:3], dtype=dtype)
    if sinks is not None:
        low[3] = lowp_dsinks(out_lowp.detach(), lowp_lse(q, k, **ref_s), out64.detach(), lse64.detach(), dout,
                             sinks.detach())
        check_close("dsinks", got[3], want[3], low[3], dtype=torch.float32)
    return got


# ---------------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------------

CPU_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_variant_forward_cpu(request, variant, dtype):
    q, k, v, kw, ref = make_case(request, "cpu", dtype, 2, 4, 2, 150, 110, 32, VARIANTS[variant])
    out, lse = run_forward(q, k, v, kw, ref)
    if variant == "window_empty_rows":  # rows 110.. see no key: exactly 0 and -inf
        assert (out[:, :, 110:] == 0).all() and torch.isneginf(lse[:, :, 110:]).all()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("sq", [1, 5])
def test_variant_few_queries_gqa_cpu(request, one_thread, variant, dtype, sq):
    """A decode step and a short chunk with GQA: the CPU forward packs a group's query heads into one task's rows
    (row r: query r % Sq of head r / Sq), so the mask, softcap, sinks and LSE rows must follow each row's query and
    head (ALiBi keeps one head a task); the backward reads that LSE."""
    q, k, v, kw, ref = make_case(request, "cpu", dtype, 2, 8, 2, sq, 150, 32, VARIANTS[variant])
    run_forward(q, k, v, kw, ref)
    if dtype in (torch.float32, torch.bfloat16):
        run_backward(q, k, v, kw, ref, dtype=dtype)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_variant_backward_cpu(request, variant, dtype):
    q, k, v, kw, ref = make_case(request, "cpu", dtype, 1, 4, 2, 90, 130, 48, VARIANTS[variant], layout="bshd")
    run_backward(q, k, v, kw, ref)


@pytest.mark.parametrize("variant", ["window_small", "softcap5", "sinks_random", "alibi_batch_causal", "all"])
def test_variant_gradcheck_float64(request, variant):
    q, k, v, kw, _ = make_case(request, "cpu", torch.float64, 1, 2, 1, 9, 12, 8, VARIANTS[variant])
    sinks = kw.pop("sinks", None)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        inputs.append(sinks.double().requires_grad_())

    def f(q, k, v, *rest):
        s = rest[0].float() if rest else None
        return flashcore.attention(q, k, v, enable_gqa=True, sinks=s, **kw)

    # sinks are float32 by the schema: their gradient is checked above with the rule; here only q, k, v
    if sinks is not None:
        inputs[3].requires_grad_(False)
    assert torch.autograd.gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_softcap_float64_is_not_rounded_to_float32_cpu(request):
    """A float64 call keeps a cap that float32 cannot represent (7.3): its forward and gradients match the float64
    reference to float64 precision, not to float32's (a cap rounded to float32 moves them by ~1e-8)."""
    q, k, v, kw, ref = make_case(request, "cpu", torch.float64, 1, 2, 1, 21, 33, 16, {"softcap": 7.3, "large": True})
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out = flashcore.attention(*inputs, enable_gqa=True, **kw)
    want, _ = reference_attention(*inputs, **ref)
    assert (out - want).abs().max().item() < 1e-12
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, dout)
    exp = torch.autograd.grad(want, inputs, dout)
    for name, a, b in zip("qkv", got, exp):
        assert (a - b).abs().max().item() < 1e-12, name


@pytest.mark.parametrize("softcap", [1e3, 1e4, 1e5])
def test_large_softcap_float32_cpu(request, softcap):
    """A large cap makes tanh's arguments small, where (1 - e) / (1 + e) cancels: the CPU kernel's float32 tanh must
    stay within the rule there too (it was 8x torch's error at 1e3, 100x at 1e4)."""
    g = make_generator(request)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(3))
    scale = 64 ** -0.5

    def attend(q, k, v):
        s = (q @ k.transpose(-1, -2)) * scale
        return torch.softmax(softcap * torch.tanh(s / softcap), -1) @ v

    ref = attend(q.double(), k.double(), v.double())
    err = (flashcore.attention(q, k, v, softcap=softcap).double() - ref).abs().max().item()
    torch_err = (attend(q, k, v).double() - ref).abs().max().item()
    assert err <= 2 * torch_err + 1e-7, (err, torch_err)


def test_flash_attn_func_signature_and_semantics(request):
    """flash-attn 2.x's flash_attn_func: positional order (q, k, v, dropout_p, softmax_scale, causal, window_size,
    softcap, alibi_slopes, deterministic, return_attn_probs), bottom-right windows, window_size as a tensor,
    (out, lse, empty S_dmask) with return_attn_probs, dropout refused by name."""
    import inspect

    from flashcore.flash_attn_interface import flash_attn_func

    names = list(inspect.signature(flash_attn_func).parameters)
    assert names == ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
                     "deterministic", "return_attn_probs"]
    g = make_generator(request)
    q = torch.randn(2, 40, 4, 24, generator=g)
    k = torch.randn(2, 60, 2, 24, generator=g)
    v = torch.randn(2, 60, 2, 24, generator=g)
    out, lse, probs = flash_attn_func(q, k, v, 0.0, 0.3, True, torch.tensor([8, 0]), 0.0, None, False, True)
    assert probs.shape == (0,) and out.shape == q.shape and lse.shape == (2, 4, 40)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    ref, _ = reference_attention(qt, kt, vt, True, 0.3, 20, (8, -1))
    check_close("out", out.transpose(1, 2), ref, lowp_attention(qt, kt, vt, True, 0.3, 20, (8, -1)))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_func(q, k, v, 0.1)


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------

GPU_SHAPES = [(2, 4, 2, 300, 260, 64), (1, 4, 4, 129, 700, 128), (1, 2, 1, 333, 333, 256), (2, 2, 2, 200, 200, 96)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_variant_forward_cuda(request, family, variant, shape, dtype):
    q, k, v, kw, ref = make_case(request, "cuda", dtype, *shape, VARIANTS[variant], layout="bshd")
    out, lse = run_forward(q, k, v, kw, ref)
    ran = assert_ran("fwd", family)
    mod = "softcap" in kw or "alibi_slopes" in kw
    assert ran.endswith(" mod") == mod, ran


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", GPU_SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_variant_backward_cuda(request, bwd_path, variant, shape, dtype):
    q, k, v, kw, ref = make_case(request, "cuda", dtype, *shape, VARIANTS[variant])
    run_backward(q, k, v, kw, ref)
    assert_ran("bwd", bwd_path)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.startswith(("window", "sinks"))])
@pytest.mark.parametrize("shape", [GPU_SHAPES[1], GPU_SHAPES[3]], ids=lambda s: "x".join(map(str, s)))
def test_variant_backward_64_row_steps_cuda(request, monkeypatch, variant, shape):
    """The Hopper backward's 64-row kernels at head-dim tiles 96 and 128 (FLASHCORE_BWD_WIDE_STEPS=0; the 80-row
    ones run by default and in the test above) with windows, causal and sinks."""
    if "sm90" not in gpu_families():
        pytest.skip("the 64-row alternative is sm90's")
    monkeypatch.setenv("FLASHCORE_FORCE_BWD", "sm90")
    monkeypatch.setenv("FLASHCORE_BWD_WIDE_STEPS", "0")
    q, k, v, kw, ref = make_case(request, "cuda", torch.bfloat16, *shape, VARIANTS[variant])
    run_backward(q, k, v, kw, ref)
    ran = assert_ran("bwd", "sm90")
    assert not ran.endswith(" m80"), ran


SCORE_MOD_VARIANTS = ["softcap5", "softcap50_causal", "alibi_batch_causal", "alibi_window", "all"]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("wide", ["1", "0"])
@pytest.mark.parametrize("variant", SCORE_MOD_VARIANTS)
@pytest.mark.parametrize("shape", [GPU_SHAPES[1], GPU_SHAPES[3], (2, 4, 2, 211, 300, 64)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_score_mod_backward_step_widths_cuda(request, monkeypatch, wide, variant, shape, dtype):
    """The Hopper score-mod backward at head-dim tiles 96 and 128 on 80-row steps (the default) and on 64-row
    steps (FLASHCORE_BWD_WIDE_STEPS=0), and at head dim 64 on 128-row steps (either setting): the wider steps
    read the lse from shared memory after the score transform."""
    if "sm90" not in gpu_families():
        pytest.skip("the step widths are sm90's")
    monkeypatch.setenv("FLASHCORE_FORCE_BWD", "sm90")
    monkeypatch.setenv("FLASHCORE_BWD_WIDE_STEPS", wide)
    q, k, v, kw, ref = make_case(request, "cuda", dtype, *shape, VARIANTS[variant])
    run_backward(q, k, v, kw, ref)
    ran = assert_ran("bwd", "sm90")
    assert " mod" in ran, ran
    assert ran.endswith(" m80") == (wide == "1" and shape[-1] in (96, 128)), ran


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("wide", ["1", "0"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_softcap_backward_saturated_cuda(request, monkeypatch, wide, head_dim):
    """Gradients where tanh saturates (scores far beyond the cap: a derivative near 0, a whole head of equal
    logits) beside ordinary heads, on the 64-, 80- and 128-row score-mod steps."""
    if "sm90" not in gpu_families():
        pytest.skip("the step widths are sm90's")
    monkeypatch.setenv("FLASHCORE_FORCE_BWD", "sm90")
    monkeypatch.setenv("FLASHCORE_BWD_WIDE_STEPS", wide)
    g = make_generator(request, "cuda")
    B, H, S = 1, 4, 333
    q = torch.randn(B, H, S, head_dim, generator=g, device="cuda") * 4
    k = torch.randn(B, H, S, head_dim, generator=g, device="cuda") * 4
    q[:, 1] = q[:, 1].abs()
    k[:, 1] = -k[:, 1].abs()  # head 1: every score far below -cap
    v = torch.randn(B, H, S, head_dim, generator=g, device="cuda")
    q, k, v = (t.bfloat16() for t in (q, k, v))
    kw = ref = {"softcap": 10.0}
    run_backward(q, k, v, dict(kw), dict(ref))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("scale", [0.0, -0.3])
def test_nonpositive_scale_cuda(request, family, scale):
    """A zero or negative scale runs the score-mod kernels (the row max of scaled scores), forward and backward."""
    q, k, v, kw, ref = make_case(request, "cuda", torch.bfloat16, 1, 2, 2, 200, 200, 64, {"causal": True})
    kw["scale"] = ref["scale"] = scale
    run_forward(q, k, v, kw, ref)
    assert_ran("fwd", family)
    run_backward(q, k, v, kw, ref)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("window", [(4096, 0), (256, 0), (100, 100)])
def test_long_sliding_window_cuda(request, family, window):
    """Long sequences with a window: key blocks outside it are skipped (a block's walk is ~window / tile)."""
    q, k, v, kw, ref = make_case(request, "cuda", torch.bfloat16, 1, 4, 2, 5000, 5000, 128,
                                 {"window": window, "causal": window[1] == 0})
    run_forward(q, k, v, kw, ref)
    assert_ran("fwd", family)


@pytest.mark.gpu
@pytest.mark.skipif("sm90" not in gpu_families(), reason="the persistent grid is the Hopper forward's")
@requires_cuda  # evaluated first (the mark nearest the function): "no CUDA device" on CPU-only machines
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("window", [(200, 0), (150, 70)])
def test_window_persistent_grid_cuda(request, monkeypatch, head_dim, window):
    """Narrow windows take the Hopper forward's persistent grid (fwd_sm90_launch.cuh: take_persistent_grid): 2 x 16
    heads of 1500 queries on 1700 keys are 256-384 tiles for the GPU's SMs, 2-3 a block. Forced on and off
    (FLASHCORE_FWD_PERSISTENT), both match the reference and each other bit for bit."""
    opts = {"window": window, "causal": window[1] == 0}
    q, k, v, kw, ref = make_case(request, "cuda", torch.bfloat16, 2, 16, 4, 1500, 1700, head_dim, opts, layout="bshd")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm90")
    monkeypatch.setenv("FLASHCORE_FWD_PERSISTENT", "1")
    out, lse = run_forward(q, k, v, kw, ref)
    assert assert_ran("fwd", "sm90").split()[2] != "wg1", "the persistent grid is for multi-warpgroup blocks"
    monkeypatch.setenv("FLASHCORE_FWD_PERSISTENT", "0")
    out_tiles, lse_tiles = run_forward(q, k, v, kw, ref)
    assert torch.equal(out, out_tiles) and torch.equal(lse, lse_tiles)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", ["softcap5", "alibi_head", "all_noncausal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_long_keys_score_mod_cuda(request, family, variant, dtype):
    """Score-mod variants over long key walks without a mask (4700 keys: 37 tiles of 128, the last partial)."""
    extra = {"all_noncausal": {"softcap": 30.0, "sinks": "random", "alibi": "batch"}}
    opts = extra[variant] if variant in extra else VARIANTS[variant]
    q, k, v, kw, ref = make_case(request, "cuda", dtype, 1, 4, 2, 300, 4700, 128, opts, layout="bshd")
    run_forward(q, k, v, kw, ref)
    assert assert_ran("fwd", family).endswith(" mod")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("softcap", [41.5, 50.0])
@pytest.mark.parametrize("Sk", [1, 5, 130])
@pytest.mark.parametrize("sinks", [False, True])
def test_softcap_logits_near_their_floor_cuda(request, family, softcap, Sk, sinks):
    """bf16 rows whose every logit sits near -softcap (scores far below zero, so tanh saturates), beside one head
    whose first key has a logit of 0: the softmax of tiny unnormalised probabilities and the lse near -softcap.
    (A softmax against the fixed bound softcap instead of a running max failed this: its probabilities near
    2^-120 times small values of V fell below float32's normal range in the tensor cores and were flushed.)"""
    g = make_generator(request, "cuda")
    B, H, Sq, D = 2, 3, 70, 64
    q = torch.randn(B, H, Sq, D, generator=g, device="cuda").abs().mul_(6).bfloat16()
    k = torch.randn(B, H, Sk, D, generator=g, device="cuda").abs().mul_(-6).bfloat16()
    k[0, 0, 0] = 0.0
    v = torch.randn(B, H, Sk, D, generator=g, device="cuda").bfloat16()
    kw = {"softcap": softcap}
    if sinks:
        kw["sinks"] = torch.randn(H, generator=g, device="cuda") * 2
    ref = {"softcap": softcap, **({"sinks": kw["sinks"]} if sinks else {})}
    run_forward(q, k, v, kw, ref)
    assert assert_ran("fwd", family).endswith(" mod")


@pytest.mark.gpu
@requires_cuda
def test_variants_in_cuda_graph_and_compile(request):
    """Window, softcap, sinks and ALiBi under torch.compile(fullgraph=True) and captured in a CUDA graph."""
    from conftest import capture_graph

    q, k, v, kw, ref = make_case(request, "cuda", torch.float16, 2, 4, 2, 256, 256, 64, VARIANTS["all"])
    eager = flashcore.attention(q, k, v, enable_gqa=True, **kw)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flashcore.attention(q, k, v, enable_gqa=True, **kw), fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)
    graph, static = capture_graph(lambda: flashcore.attention(q, k, v, enable_gqa=True, **kw))
    q.copy_(torch.randn_like(q))
    static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, flashcore.attention(q, k, v, enable_gqa=True, **kw))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (32, 1)], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_variant_decode_step_cuda(request, variant, heads, head_dim):
    """One query a head against 2 100 keys through the dense op (a generation loop calling flash_attn_func or
    attention() on a contiguous cache): the KV-cache kernel's route (cuda/attention_cuda.cpp: dense_decode_step), with
    every variant in the dense op's own alignment (top-left here: the query sees key 0 under causal; the windows
    leave it few keys or none), BSHD views, and the backward through its LSE."""
    Hq, Hkv = heads
    q, k, v, kw, ref = make_case(request, "cuda", torch.bfloat16, 3, Hq, Hkv, 1, 2100, head_dim, VARIANTS[variant],
                                 layout="bshd")
    run_forward(q, k, v, kw, ref)
    assert flashcore.last_kernel("fwd").startswith("decode"), flashcore.last_kernel("fwd")
    # The backward through the route's LSE. Not for "all": its top-left window leaves the query one key beside a
    # sink, where dS = P (dP - delta) with delta = dO . O from the rounded output loses ~P / (1 - P) of delta's
    # relative error, the FlashAttention backward's own conditioning (seen on the CPU path and the dense kernels
    # alike, some seeds past 2x PyTorch's error); test_variant_backward_cuda covers "all" with many keys a row.
    if head_dim == 128 and Hq == 8 and variant != "all":
        run_backward(q, k, v, kw, ref)


@pytest.mark.gpu
@requires_cuda
def test_decode_step_bottom_right_and_graph_cuda(request):
    """flash_attn_func's bottom-right causal (the query sees every key) and a CUDA graph of the route."""
    from conftest import capture_graph
    from flashcore.flash_attn_interface import flash_attn_func

    g = make_generator(request, "cuda")
    q = torch.randn(4, 1, 16, 128, generator=g, device="cuda").half()
    k, v = (torch.randn(4, 4096, 4, 128, generator=g, device="cuda").half() for _ in range(2))
    out = flash_attn_func(q, k, v, causal=True)
    assert flashcore.last_kernel("fwd").startswith("decode")
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(4, 1), v.transpose(1, 2).repeat_interleave(4, 1)
    r, _ = reference_attention(qt, kt, vt)
    check_close("out", out.transpose(1, 2), r, lowp_attention(qt, kt, vt))
    graph, static = capture_graph(lambda: flash_attn_func(q, k, v, causal=True))
    q.copy_(torch.randn_like(q))
    static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, flash_attn_func(q, k, v, causal=True))
