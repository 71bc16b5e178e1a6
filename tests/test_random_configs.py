"""Randomly drawn calls through flash-attn's interface (flashcore.flash_attn_interface), dense and variable-length
(forward and backward) and flash_attn_with_kvcache, and through the SDPA-style flashcore.attention (top-left
masks, sinks, BHSD or BSHD storage, a value head dim of its own), against the float64 reference under the suite's
tolerance rule (conftest.check_close).

Each case draws its head counts and GQA group, lengths (Sq != Sk, single tokens and, in varlen batches, empty
sequences), head dim (odd ones included, which the interface pads as flash-attn does), causal mask, window,
softcap, ALiBi, dtype, strides (BSHD slices of wider tensors), the deterministic flag and, on the GPU, the kernel
family (KV cache: dense or paged caches with pages of 1-256, lengths from empty to past the capacity, appended
tokens, rotary, left pads, cache rows, sinks, forced splits, through test_kvcache.py's independent reference),
from a generator seeded by the test's name and case index: a failure names a case that reproduces. The
combinations are the point: the parametrized suites test each feature on chosen shapes, these tests the features
together on shapes nobody chose. The CPU draws a few small cases (CI); the GPU many."""

import os
import random
import zlib

import pytest
import torch
from torch.nn.attention import SDPBackend

import flashcore
from conftest import (check_close, check_gradients, check_lse, cuda_skip_reason, gpu_families, lowp_attention,
                      lowp_sdpa_backend, randn, reference_attention)
from test_kvcache import make_case as kvcache_case
from test_kvcache import run_case as run_kvcache_case
from test_variants import run_forward as run_variant_forward

requires_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")

HEAD_DIMS = [32, 33, 40, 64, 72, 80, 96, 100, 128, 160, 192, 256]


def seed_of(request, index):
    """A seed stable across processes (str hashes are salted per process). FLASHCORE_RANDOM_SALT draws other cases
    (a longer hunt on the GPU: the same tests, new configurations)."""
    salt = os.environ.get("FLASHCORE_RANDOM_SALT", "")
    return zlib.crc32(f"{request.node.originalname}-{index}{salt}".encode())


def draw_lengths(rng, case, max_len, few_queries):
    """(B, Sq, Sk) of a dense call. few_queries: speculative-decoding checks and decode steps under GQA (1-16 queries
    a head over 2k-9k keys, groups of 2-8, up to 8 sequences), the shapes the decode-rows and packed varlen routes
    take; the case's head counts are redrawn to a GQA group."""
    if few_queries:
        case["hkv"] = rng.choice([1, 2, 4])
        case["hq"] = case["hkv"] * rng.choice([2, 4, 8])
        return rng.randint(1, 8), rng.randint(1, 16), rng.randint(2048, 9000)
    batch = rng.randint(1, 3)
    sq = rng.choice([1, rng.randint(1, max_len)])
    return batch, sq, sq if rng.random() < 0.4 else rng.randint(1, max_len)


def draw_case(rng, device, max_len):
    """One configuration: a dict of the call's options and shapes."""
    hkv = rng.choice([1, 2, 3])
    group = rng.choice([1, 1, 2, 4])
    causal = rng.random() < 0.5
    window = (-1, -1)
    if rng.random() < 0.35:
        left = rng.choice([-1, rng.randint(0, max_len // 2)])
        right = 0 if causal else rng.choice([-1, rng.randint(0, max_len // 3)])
        window = (left, right)
    # Half precision only: the rule's float32 floor is a few units of rounding, which single-key rows (dS = P (dP -
    # delta) with P a rounding away from 1) exceed in noise; float32 and float64 have their parametrized suites.
    dtypes = [torch.float16, torch.bfloat16]
    family = rng.choice(["sm80", "sm90", "default", "default"])  # one list everywhere: the same draws on any machine
    return {
        "hq": hkv * group, "hkv": hkv, "d": rng.choice(HEAD_DIMS), "causal": causal, "window": window,
        "softcap": rng.choice([0.0, 0.0, round(rng.uniform(5.0, 50.0), 2)]),
        "alibi": rng.choice([None, None, None, "head", "batch"]),
        "scale": rng.choice([None, None, round(rng.uniform(0.02, 0.3), 4)]),
        "dtype": rng.choice(dtypes), "strided": rng.random() < 0.4, "deterministic": rng.random() < 0.25,
        "family": family if device == "cuda" and family in gpu_families() + ["default"] else "default",
    }


def make_tensor(shape, case, gen, device):
    """A tensor of `shape` (leading dims, heads, head dim), contiguous or a slice of a wider one."""
    *lead, h, d = shape
    if case["strided"]:
        t = torch.randn(*lead, h + 1, d + 8, generator=gen, device=device)[..., 1:, 3:d + 3]
    else:
        t = torch.randn(*shape, generator=gen, device=device)
    return t.to(case["dtype"])


def alibi_slopes(case, batch, gen, device):
    if case["alibi"] is None:
        return None
    shape = (case["hq"],) if case["alibi"] == "head" else (batch, case["hq"])
    return torch.rand(shape, generator=gen, device=device) * 0.3


def flash_attn_window(left, right, causal, seqlen_q, seqlen_k):
    """The window flash-attn 2's C++ applies (flash_api.cpp: mha_fwd / mha_varlen_fwd with the batch's max lengths,
    then set_params_fprop), written out here from flash-attn, not taken from flashcore: causal sets right = 0, a side
    of at least seqlen_k is unbounded, and a one-sided window gets seqlen_k on its unbounded side."""
    right = 0 if causal else right
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    if left < 0 <= right:
        left = seqlen_k
    if right < 0 <= left:
        right = seqlen_k
    return left, right


def flash_attn_alibi_by_key(left, right, causal, seqlen_k):
    """Whether flash-attn 2 runs its causal kernel (params.is_causal after mha_fwd's rewrites: left < 0 and
    right == 0), whose ALiBi adds slope * j (csrc/flash_attn/src/mask.h) and whose LSE its interface returns."""
    left = -1 if left >= seqlen_k else left
    right = 0 if causal else (-1 if right >= seqlen_k else right)
    return left < 0 and right == 0


def reference_kwargs(case, sq, sk, slopes, window=None, top_left=False, sinks=None):
    """conftest.reference_attention's options for one sequence (flash-attn aligns masks bottom-right, SDPA top-left);
    `window` the one the call applies (flash_attn_window), the case's own by default."""
    return {"causal": case["causal"], "scale": case["scale"], "causal_offset": 0 if top_left else sk - sq,
            "window": case["window"] if window is None else window, "softcap": case["softcap"], "alibi": slopes,
            "sinks": sinks}


def use_family(monkeypatch, case):
    if case["family"] != "default":
        monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", case["family"])
        monkeypatch.setenv("FLASHCORE_FORCE_BWD", case["family"])


def attention_of(case, q, k, v, slopes, sq_sk_list, dout, window, top_left=False, sinks=None):
    """float64 and low-precision outputs and gradients of each sequence, concatenated on the token dim: q/k/v/dout
    packed (tokens, heads, dim), slopes (Hq,) or (B, Hq) or None. Returns (out64, grads64, lse64 (Hq, tokens)) and
    (out_lowp, grads_lowp).

    The low-precision gradients are PyTorch's own (autograd through lowp_attention) plus what a fused backward adds
    to them: FlashAttention backwards (flashcore's, SDPA's flash kernels, FA2-4) take delta = rowsum(dO * O) from
    the rounded output, and dS = P (dP - delta) turns its rounding error e_i into -P_ij e_i, the gradient of
    -sum_i e_i lse_i (d lse_i / d s_ij = P_ij, through softcap and ALiBi alike). Where a row's probability sits on
    one key (few visible keys, a steep ALiBi slope, a large scale, a sink), that term is ~P / (1 - P) times the
    row's true dS, an error PyTorch's autograd, which never rounds O, does not make.

    The yardstick is SDPA's FlashAttention kernel where SDPA takes it for the call (plain calls, on CUDA and on the
    CPU, whose flash backward also takes its row sums from the rounded output: it has that term already), else
    attention written out in the input dtype, as flash-attn's own tests measure PyTorch's error: SDPA's other kernels are not FlashAttention's precision (cuDNN's dQ for one query over 533 keys, head
    dim 72 with a value head dim of 64, came out at the output's rounding, a third of what a kernel that rounds dS
    to the input dtype before dS K makes; its math backend computes in float32)."""
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    outs64, lses64, outs, rounded, q0, k0 = [], [], [], [], 0, 0
    for b, (sq, sk) in enumerate(sq_sk_list):
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        kw = reference_kwargs(case, sq, sk, sl, window, top_left, sinks)
        slices = [[t[a:a + n].transpose(0, 1)[None] for t, a, n in zip(ls, (q0, k0, k0), (sq, sk, sk))]
                  for ls in (leaves64, leaves)]
        o, lse = reference_attention(*slices[0], **kw)
        outs64.append(o[0].transpose(0, 1))
        lses64.append(lse[0])
        # SDPA's FlashAttention kernel, where it takes the call, else attention written out in the input dtype (see
        # the docstring); the former takes delta from its rounded output already.
        flash = lowp_sdpa_backend(*slices[1], **kw) == int(SDPBackend.FLASH_ATTENTION.value)
        outs.append(lowp_attention(*slices[1], **kw, step_by_step=not flash)[0].transpose(0, 1))
        rounded.append(torch.full((sq,), float(flash), device=q.device))
        q0, k0 = q0 + sq, k0 + sk
    out64, lse64, out = torch.cat(outs64), torch.cat(lses64, dim=-1), torch.cat(outs)
    grads64 = torch.autograd.grad(out64, leaves64, dout.double(), retain_graph=True, allow_unused=True)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True)
    delta_error = ((dout.double() * out.detach().double()).sum(-1) - (dout.double() * out64.detach()).sum(-1)).t()
    delta_error = delta_error * (1.0 - torch.cat(rounded).double())  # only where the yardstick lacks the term
    fused = -(delta_error * torch.where(torch.isfinite(lse64), lse64, torch.zeros_like(lse64))).sum()
    extra = torch.autograd.grad(fused, leaves64, allow_unused=True)

    def clean(gs, like):
        return [torch.zeros_like(x) if g is None else g.detach().nan_to_num(0.0) for g, x in zip(gs, like)]

    grads64, grads, extra = clean(grads64, leaves64), clean(grads, leaves), clean(extra, leaves64)
    grads = [(g.double() + e).to(g.dtype) for g, e in zip(grads, extra)]
    return (out64.detach(), grads64, lse64.detach()), (out.detach(), grads)


def check_call(case, out, lse, grads, q, k, v, slopes, lens, dout, max_lens):
    """out/grads/lse of one call against the reference of each sequence (lens: (sq, sk) each), under the window
    flash-attn applies for the call's (max) lengths."""
    window = flash_attn_window(*case["window"], case["causal"], *max_lens)
    (out64, grads64, lse64), (out_lowp, grads_lowp) = attention_of(case, q, k, v, slopes, lens, dout, window)
    check_close("out", out, out64, out_lowp)
    check_gradients(grads, grads64, grads_lowp)
    # The LSE of a few rows is judged by the dedicated suites: a row's LSE can be a small sum of large terms (one
    # key: the score itself), whose float32 rounding the rule's floor, scaled by the result, does not cover, and the
    # yardstick's largest error over a handful of values is noise.
    if lse.numel() < 32:
        return
    by_key = slopes is not None and flash_attn_alibi_by_key(*case["window"], case["causal"], max_lens[1])
    q0, k0 = 0, 0
    for b, (sq, sk) in enumerate(lens):
        qs, ks = q[q0:q0 + sq].transpose(0, 1)[None], k[k0:k0 + sk].transpose(0, 1)[None]
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        check_lse(lse[:, q0:q0 + sq][None], qs, ks, **reference_kwargs(case, sq, sk, sl, window),
                  alibi_by_key=by_key)
        q0, k0 = q0 + sq, k0 + sk


def run_dense(seed, device, max_len, monkeypatch, few_queries=False):
    rng = random.Random(seed)
    case = draw_case(rng, device, max_len)
    B, sq, sk = draw_lengths(rng, case, max_len, few_queries)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = make_tensor((B, sq, case["hq"], case["d"]), case, gen, device).requires_grad_()
    k = make_tensor((B, sk, case["hkv"], case["d"]), case, gen, device).requires_grad_()
    v = make_tensor((B, sk, case["hkv"], case["d"]), case, gen, device).requires_grad_()
    slopes = alibi_slopes(case, B, gen, device)
    dout = torch.randn(q.shape, generator=gen, device=device).to(case["dtype"])
    use_family(monkeypatch, case)
    out, lse, _ = flashcore.flash_attn_func(q, k, v, 0.0, case["scale"], case["causal"], case["window"],
                                            case["softcap"], slopes, case["deterministic"], True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (B, case["hq"], sq)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # as one varlen batch of B equal sequences: (tokens, heads, dim), lse (Hq, tokens)
    flat = [t.detach().flatten(0, 1) for t in (q, k, v, out, dout)] + [g.flatten(0, 1) for g in grads]
    lse_flat = lse.transpose(0, 1).flatten(1)
    check_call(case, flat[3], lse_flat, flat[5:], *flat[:3], slopes, [(sq, sk)] * B, flat[4], (sq, sk))
    return case


def run_varlen(seed, device, max_len, monkeypatch):
    rng = random.Random(seed)
    case = draw_case(rng, device, max_len)
    B = rng.randint(1, 5)
    lens = []
    for _ in range(B):
        sq = rng.choice([0, 1, rng.randint(1, max_len), rng.randint(1, max_len)])
        sk = sq if rng.random() < 0.4 else rng.choice([0, rng.randint(1, max_len)])
        lens.append((sq, sk))
    if all(sq == 0 for sq, _ in lens):
        lens[0] = (1, lens[0][1])
    gen = torch.Generator(device=device).manual_seed(seed)
    tq, tk = sum(s for s, _ in lens), sum(s for _, s in lens)
    q = make_tensor((tq, case["hq"], case["d"]), case, gen, device).requires_grad_()
    k = make_tensor((tk, case["hkv"], case["d"]), case, gen, device).requires_grad_()
    v = make_tensor((tk, case["hkv"], case["d"]), case, gen, device).requires_grad_()
    slopes = alibi_slopes(case, B, gen, device)
    dout = torch.randn(q.shape, generator=gen, device=device).to(case["dtype"])
    cu = [torch.tensor([0] + [sum(x[i] for x in lens[:b + 1]) for b in range(B)], dtype=torch.int32, device=device)
          for i in (0, 1)]
    max_q, max_k = max(max(s for s, _ in lens), 1), max(max(s for _, s in lens), 1)
    use_family(monkeypatch, case)
    out, lse, _ = flashcore.flash_attn_varlen_func(q, k, v, cu[0], cu[1], max_q, max_k, 0.0, case["scale"],
                                                   case["causal"], case["window"], case["softcap"], slopes,
                                                   case["deterministic"], True)
    assert out.shape == q.shape and lse.shape == (case["hq"], tq)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_call(case, out.detach(), lse, grads, q.detach(), k.detach(), v.detach(), slopes, lens, dout,
               (max_q, max_k))
    return case


def draw_kvcache(rng, device, max_cap):
    """make_case's keyword arguments of one flash_attn_with_kvcache call."""
    hkv = rng.choice([1, 2, 3])
    B = rng.randint(1, 5)
    page = rng.choice([None, None, 1, 16, 48, 64, 256])
    sq = rng.choice([1, 1, 2, 5, rng.randint(1, 70)])
    sn = rng.choice([0, sq, rng.randint(0, sq)])
    cap = rng.randint(sq if sn else 1, max(sq, max_cap))  # with new keys, flash-attn wants seqlen_q <= capacity
    pages = -(-cap // page) if page else 1
    real_cap = pages * page if page else cap
    lens = [rng.choice([0, rng.randint(0, real_cap), max(real_cap - sn, 0), real_cap]) for _ in range(B)]
    causal = rng.random() < 0.6
    window = (-1, -1)
    if rng.random() < 0.3:
        window = (rng.choice([-1, rng.randint(0, real_cap)]), 0 if causal else rng.choice([-1, rng.randint(0, 50)]))
    kw = dict(B=B, Sq=sq, Sn=sn, Hq=hkv * rng.choice([1, 2, 4, 8]), Hkv=hkv,
              D=rng.choice([32, 40, 64, 100, 128] + ([256] if device == "cuda" else [])), capacity=cap, lens=lens,
              page_size=page, causal=causal, window=window, softcap=rng.choice([0.0, 0.0, 12.5]),
              sinks=rng.random() < 0.2, alibi=rng.choice([None, None, None, "head", "batch"]),
              num_splits=rng.choice([0, 0, 1, rng.randint(2, 8)]))
    if rng.random() < 0.3 and sn > 0:
        kw["rotary"] = rng.choice(["neox", "interleaved"])
        kw["rotary_dim"] = rng.choice([None, 16])
    if rng.random() < 0.25:
        kw["leftpad"] = [rng.randint(0, x) if x > 0 else 0 for x in lens]
    if page is None and rng.random() < 0.3:
        kw["batch_idx"] = True
    return kw


def run_kvcache(request, seed, device, dtype, max_cap):
    rng = random.Random(seed)
    inputs, kw = kvcache_case(request, device, rng.choice([dtype] if dtype else [torch.float16, torch.bfloat16]),
                              **draw_kvcache(rng, device, max_cap))
    run_kvcache_case(inputs, kw)


def run_sdpa_style(seed, device, max_len, monkeypatch, few_queries=False):
    """flashcore.attention with SDPA's conventions: (B, H, S, D) tensors (contiguous, BSHD views or slices of wider
    ones), top-left masks, sinks, and now and then a value head dim other than the query's. Forward through
    test_variants' checks (out, LSE); the gradients of q, k and v through attention_of (d sinks: test_variants)."""
    rng = random.Random(seed)
    case = draw_case(rng, device, max_len)
    B, sq, sk = draw_lengths(rng, case, max_len, few_queries)
    d = case["d"]
    dv = rng.choice([d, d, d, max(8, d // 2), 64])
    layout = rng.choice(["bhsd", "bshd", "padded"])
    gen = torch.Generator(device=device).manual_seed(seed)

    def tensor(h, s, dim):
        return randn((B, h, s, dim), case["dtype"], gen, device, layout=layout)

    q, k, v = tensor(case["hq"], sq, d), tensor(case["hkv"], sk, d), tensor(case["hkv"], sk, dv)
    kw = {"is_causal": case["causal"], "scale": case["scale"], "softcap": case["softcap"]}
    ref = {"causal": case["causal"], "scale": case["scale"], "softcap": case["softcap"]}
    if case["window"] != (-1, -1):
        kw["window_size"] = ref["window"] = case["window"]
    slopes = alibi_slopes(case, B, gen, device)
    if slopes is not None:
        kw["alibi_slopes"] = ref["alibi"] = slopes
    # Sinks with 16 query rows or more: a row that sees one key beside a sink is the fused backward's ill-conditioned
    # case (attention_of), and over one or two such rows the rule compares two samples of rounding noise.
    if rng.random() < 0.3 and sq >= 16:
        kw["sinks"] = ref["sinks"] = torch.randn(case["hq"], generator=gen, device=device) * 2
    if case["deterministic"]:
        kw["deterministic"] = True
    use_family(monkeypatch, case)
    run_variant_forward(q, k, v, kw, ref)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flashcore.attention(*leaves, enable_gqa=case["hq"] != case["hkv"], **kw)
    dout = torch.randn(out.shape, generator=gen, device=device).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, dout)

    def packed(t):  # (B, H, S, D) -> (B * S, H, D)
        return t.detach().transpose(1, 2).flatten(0, 1)

    (_, grads64, _), (_, grads_lowp) = attention_of(case, *map(packed, (q, k, v)), slopes, [(sq, sk)] * B,
                                                     packed(dout), case["window"], top_left=True,
                                                     sinks=kw.get("sinks"))
    check_gradients([packed(g) for g in grads], grads64, grads_lowp)


@pytest.mark.parametrize("index", range(4))
def test_random_sdpa_style_cpu(request, monkeypatch, index):
    run_sdpa_style(seed_of(request, index), "cpu", 90, monkeypatch)


@pytest.mark.parametrize("index", range(4))
def test_random_dense_cpu(request, monkeypatch, index):
    run_dense(seed_of(request, index), "cpu", 90, monkeypatch)


@pytest.mark.parametrize("index", range(3))
def test_random_varlen_cpu(request, monkeypatch, index):
    run_varlen(seed_of(request, index), "cpu", 70, monkeypatch)


@pytest.mark.parametrize("index", range(4))
def test_random_kvcache_cpu(request, index):
    run_kvcache(request, seed_of(request, index), "cpu", None, 60)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("index", range(60))
def test_random_kvcache_cuda(request, index):
    run_kvcache(request, seed_of(request, index), "cuda", None, 1200)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("index", range(60))
def test_random_dense_cuda(request, monkeypatch, index):
    run_dense(seed_of(request, index), "cuda", 700, monkeypatch)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("index", range(60))
def test_random_sdpa_style_cuda(request, monkeypatch, index):
    run_sdpa_style(seed_of(request, index), "cuda", 700, monkeypatch)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("index", range(40))
def test_random_varlen_cuda(request, monkeypatch, index):
    run_varlen(seed_of(request, index), "cuda", 500, monkeypatch)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("index", range(24))
def test_random_few_queries_cuda(request, monkeypatch, index):
    """A few queries a head over long keys under GQA, through flash-attn's interface (BSHD) and flashcore.attention
    (BHSD, BSHD views, padded slices): the decode-rows and packed varlen routes with the features drawn together."""
    run = run_dense if index % 2 == 0 else run_sdpa_style
    run(seed_of(request, index), "cuda", 9000, monkeypatch, few_queries=True)
