"""Variable-length batches (flashcore.varlen_attention, torch.ops.flashcore.varlen_fwd/varlen_bwd, and flash-attn's
varlen functions): every sequence of a packed batch must equal attention over that sequence alone, forward and
backward, by the suite's one rule (float64 reference and PyTorch's own low-precision answer, sequence by sequence).
Covers empty sequences, a batch of one, many short sequences, GQA, seqused_k, every variant, bottom-right causal
alignment per sequence, strided inputs, errors naming the argument, opcheck and torch.compile."""

import math

import pytest
import torch

import flashcore
from conftest import (assert_ran, check_close, check_gradients, cuda_skip_reason, gpu_families, lowp_attention,
                      lowp_lse, make_generator, pack_gqa_heads, packed_varlen_grid, reference_attention,
                      reference_lse)

requires_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")


def offsets(lens, device):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)


def packed(total, heads, dim, dtype, g, device, strided=False, scale=1.0):
    """(total, heads, dim); strided: a view with padded row and head strides (last dim contiguous)."""
    if strided:
        base = torch.randn(total, heads + 1, dim + 8, generator=g, device=device) * scale
        return base.to(dtype)[:, 1:, :dim]
    return (torch.randn(total, heads, dim, generator=g, device=device) * scale).to(dtype)


def make_case(request, device, dtype, lens_q, lens_k, Hq, Hkv, D, variant=None, strided=False, used_k=None):
    variant = variant or {}
    g = make_generator(request, device)
    scale = 3.0 if "softcap" in variant else 1.0
    q = packed(sum(lens_q), Hq, D, dtype, g, device, strided, scale)
    k = packed(sum(lens_k), Hkv, D, dtype, g, device, strided, scale)
    v = packed(sum(lens_k), Hkv, D, dtype, g, device, strided)
    kw = {}
    if variant.get("causal"):
        kw["is_causal"] = True
    if "window" in variant:
        kw["window_size"] = variant["window"]
    if "softcap" in variant:
        kw["softcap"] = variant["softcap"]
    if "sinks" in variant:
        kw["sinks"] = torch.randn(Hq, generator=g, device=device) * 2
    if "alibi" in variant:
        kw["alibi_slopes"] = torch.rand((len(lens_q), Hq), generator=g, device=device) * 0.2
    if used_k is not None:
        kw["seqused_k"] = torch.tensor(used_k, dtype=torch.int32, device=device)
    return q, k, v, offsets(lens_q, device), offsets(lens_k, device), kw


def per_sequence(fn, q, k, v, cu_q, cu_k, kw, **extra):
    """fn(q_b, k_b, v_b, **reference kwargs) for each sequence on (1, H, S, D) views; outputs re-packed:
    out (total_q, Hq, D) and lse (Hq, total_q) (None when fn returns only out)."""
    outs, lses = [], []
    used = kw.get("seqused_k")
    for b in range(cu_q.numel() - 1):
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
        if used is not None:
            k1 = k0 + int(used[b])
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        ref = dict(causal=kw.get("is_causal", False), causal_offset=(k1 - k0) - (q1 - q0),
                   window=tuple(kw.get("window_size", (-1, -1))), softcap=kw.get("softcap", 0.0),
                   sinks=kw.get("sinks"), **extra)
        if kw.get("alibi_slopes") is not None:
            ref["alibi"] = kw["alibi_slopes"][b:b + 1]
        r = fn(qb, kb, vb, **ref)
        o, l = r if isinstance(r, tuple) else (r, None)
        outs.append(o[0].transpose(0, 1))
        if l is not None:
            lses.append(l[0])
    out = torch.cat(outs, 0)
    return out, (torch.cat(lses, 1) if lses else None)


def lowp_packed_lse(q, k, v, cu_q, cu_k, kw):
    """PyTorch's own float32 LSE of each sequence (conftest.lowp_lse), packed (Hq, total_q)."""
    return per_sequence(lambda qb, kb, vb, **ref: (qb, lowp_lse(qb, kb, **ref)), q, k, v, cu_q, cu_k, kw)[1]


def run_forward(q, k, v, cu_q, cu_k, kw, dtype=None):
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 1
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 1
    out, lse = flashcore.varlen_attention(q, k, v, cu_q, cu_k, max(max_q, 1), max(max_k, 1), return_lse=True, **kw)
    ref, ref_lse = per_sequence(reference_attention, q, k, v, cu_q, cu_k, kw)
    low, _ = per_sequence(lowp_attention, q, k, v, cu_q, cu_k, kw)
    check_close("out", out, ref, low, dtype=dtype)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    low_lse = ref_lse if lse_dtype == torch.float64 else lowp_packed_lse(q, k, v, cu_q, cu_k, kw)
    assert lse.dtype == lse_dtype and lse.shape == (q.size(1), q.size(0))
    check_close("lse", lse, ref_lse, low_lse, dtype=lse_dtype)
    return out, lse


def run_backward(q, k, v, cu_q, cu_k, kw, dtype=None):
    sinks = kw.get("sinks")
    if sinks is not None:
        sinks = sinks.clone().requires_grad_()
        kw = dict(kw, sinks=sinks)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    g = torch.Generator(device=q.device).manual_seed(11)
    dout = torch.randn(q.shape, generator=g, device=q.device).to(q.dtype)
    max_q = max(int((cu_q[1:] - cu_q[:-1]).max()), 1)
    max_k = max(int((cu_k[1:] - cu_k[:-1]).max()), 1)
    inputs = (q, k, v) + ((sinks,) if sinks is not None else ())
    out = flashcore.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    got = torch.autograd.grad(out, inputs, dout)
    low_out, _ = per_sequence(lowp_attention, q, k, v, cu_q, cu_k, kw)
    low = [x.nan_to_num(0.0) for x in torch.autograd.grad(low_out, inputs, dout, allow_unused=True)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kw64 = dict(kw)
    inputs64 = (q64, k64, v64)
    if sinks is not None:
        kw64["sinks"] = sinks.detach().double().requires_grad_()
        inputs64 += (kw64["sinks"],)
    ref_out, _ = per_sequence(reference_attention, q64, k64, v64, cu_q, cu_k, kw64)
    want = torch.autograd.grad(ref_out, inputs64, dout.double(), allow_unused=True)
    want = [torch.zeros_like(x) if w is None else w for w, x in zip(want, inputs64)]
    check_gradients(got[:3], want[:3], low[:3], dtype=dtype)
    if sinks is not None:
        # PyTorch's own error on dsinks through its float32 softmax is far below a fused kernel's (which reads O
        # rounded); the yardstick is the exact value plus the rounded-output terms' error, as test_variants does.
        check_close("dsinks", got[3], want[3], want[3] + (low[3] - want[3]).abs() + 2 ** -8 * want[3].abs(),
                    dtype=torch.float32)
    return got


# Sequence lengths (queries, keys): empty sequences inside the batch, Sq > Sk (rows that see nothing under a
# bottom-right causal mask), Sq < Sk (a KV prefix), tile edges.
LENS = ([5, 0, 130, 64, 1, 77], [7, 3, 100, 200, 0, 77])

VARIANTS = {
    "dense": {},
    "causal": {"causal": True},
    "window_causal": {"window": (20, 0), "causal": True},
    "window_both": {"window": (15, 9)},
    "softcap": {"softcap": 20.0},
    "sinks": {"sinks": True},
    "alibi": {"alibi": True, "causal": True},
    "all": {"window": (40, -1), "causal": True, "softcap": 30.0, "sinks": True, "alibi": True},
}


# ---------------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_varlen_forward_cpu(request, variant, dtype):
    q, k, v, cu_q, cu_k, kw = make_case(request, "cpu", dtype, *LENS, 4, 2, 40, VARIANTS[variant])
    out, lse = run_forward(q, k, v, cu_q, cu_k, kw)
    if variant == "causal":  # sequence 0: 5 queries, 7 keys; sequence 4: 1 query, no key -> 0 and -inf
        row = int(cu_q[4])
        assert (out[row] == 0).all() and torch.isneginf(lse[:, row]).all()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_backward_cpu(request, variant, dtype):
    q, k, v, cu_q, cu_k, kw = make_case(request, "cpu", dtype, *LENS, 4, 2, 24, VARIANTS[variant], strided=True)
    run_backward(q, k, v, cu_q, cu_k, kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_few_queries_gqa_cpu(request, one_thread, variant, dtype):
    """Decode-like batches (at most 3 queries a sequence) with GQA: the CPU forward's packed query heads
    (fwd_cpu.cpp: heads_per_task) per sequence, with empty sequences and sequences without keys."""
    q, k, v, cu_q, cu_k, kw = make_case(request, "cpu", dtype, [1, 0, 3, 1, 2], [50, 7, 0, 130, 64], 8, 2, 40,
                                        VARIANTS[variant])
    run_forward(q, k, v, cu_q, cu_k, kw)
    run_backward(q, k, v, cu_q, cu_k, kw)


def test_varlen_seqused_k_cpu(request):
    """seqused_k: only the first n keys of each sequence; the unused keys get zero gradients."""
    q, k, v, cu_q, cu_k, kw = make_case(request, "cpu", torch.float32, [30, 10, 70], [50, 20, 90], 2, 2, 16,
                                        {"causal": True}, used_k=[40, 0, 90])
    run_forward(q, k, v, cu_q, cu_k, kw)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flashcore.varlen_attention(q, k, v, cu_q, cu_k, 70, 90, **kw)
    out.sum().backward()
    assert (k.grad[40:50] == 0).all() and (k.grad[50:70] == 0).all() and (v.grad[40:70] == 0).all()
    run_backward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, kw)


def test_varlen_many_short_sequences_cpu(request):
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 9, (500,), generator=g).tolist()
    q, k, v, cu_q, cu_k, kw = make_case(request, "cpu", torch.float32, lens, lens, 2, 1, 16, {"causal": True})
    run_forward(q, k, v, cu_q, cu_k, kw)


def test_varlen_batch_of_one_matches_dense_cpu(request):
    q, k, v, cu_q, cu_k, kw = make_case(request, "cpu", torch.float32, [93], [93], 4, 2, 32, {"causal": True})
    out, lse = flashcore.varlen_attention(q, k, v, cu_q, cu_k, 93, 93, is_causal=True, return_lse=True)
    dense, dense_lse = flashcore.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out, dense[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(lse, dense_lse[0], rtol=0, atol=0)


def _rows_outside_sequences(device, dtype, g):
    """cu_seqlens covering only the middle of the tensors (rows 5..40 of 50): rows before and after get out 0 and
    lse -inf, as a row that sees no key, and zero dQ; keys outside get zero dK/dV."""
    q, k, v = (torch.randn(50, 2, 16, generator=g, device=device).to(dtype).requires_grad_() for _ in range(3))
    cu = torch.tensor([5, 20, 40], dtype=torch.int32, device=device)
    out, lse = flashcore.varlen_attention(q, k, v, cu, cu, 20, 20, return_lse=True)
    outside = torch.cat([torch.arange(5), torch.arange(40, 50)]).to(device)
    assert (out[outside] == 0).all() and torch.isneginf(lse[:, outside]).all()
    assert torch.isfinite(lse[:, 5:40]).all() and torch.isfinite(out[5:40]).all()
    out[5:40].float().sum().backward()
    assert (q.grad[outside] == 0).all() and (k.grad[outside] == 0).all() and (v.grad[outside] == 0).all()


def test_varlen_rows_outside_sequences_cpu(request):
    _rows_outside_sequences("cpu", torch.float32, make_generator(request))


def test_varlen_errors_name_the_argument():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    f = flashcore.varlen_attention
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be int32"):
        f(q, q, q, cu.long(), cu, 6, 6)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must have length"):
        f(q, q, q, cu, cu[:2], 6, 6)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be 1-D"):
        f(q, q, q, cu[None], cu, 6, 6)
    with pytest.raises(RuntimeError, match="max_seqlen_q must be in"):
        f(q, q, q, cu, cu, 0, 6)
    with pytest.raises(RuntimeError, match="query must be 3-D"):
        f(q[None], q, q, cu, cu, 6, 6)
    with pytest.raises(RuntimeError, match="value has 9 rows"):
        f(q, q, q[:9], cu, cu, 6, 6)
    with pytest.raises(RuntimeError, match="more than max_seqlen_q"):
        f(q, q, q, cu, cu, 5, 6)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        f(q, q, q, torch.tensor([0, 6, 4], dtype=torch.int32), cu, 6, 6)
    with pytest.raises(RuntimeError, match="exceeds query's 10 rows"):
        f(q, q, q, torch.tensor([0, 4, 11], dtype=torch.int32), cu, 7, 6)
    with pytest.raises(RuntimeError, match="seqused_k"):
        f(q, q, q, cu, cu, 6, 6, seqused_k=torch.tensor([5, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="alibi_slopes must have shape"):
        f(q, q, q, cu, cu, 6, 6, alibi_slopes=torch.rand(3, 2))


def test_varlen_opcheck_and_compile(request):
    q, k, v, cu_q, cu_k, kw = make_case(request, "cpu", torch.float32, [5, 0, 17], [9, 4, 17], 2, 1, 16,
                                        {"causal": True})
    args = (q, k, v, cu_q, cu_k, 17, 17, 0.25, True, -1, -1, 0.0, False, None, None, None)
    torch.library.opcheck(torch.ops.flashcore.varlen_fwd.default, args)
    out, lse = torch.ops.flashcore.varlen_fwd(*args)
    bwd_args = (torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, 17, 17, 0.25, True, -1, -1, 0.0, False, None,
                None)
    torch.library.opcheck(torch.ops.flashcore.varlen_bwd.default, bwd_args)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: flashcore.varlen_attention(q, k, v, cu_q, cu_k, 17, 17, is_causal=True),
                       fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), flashcore.varlen_attention(q, k, v, cu_q, cu_k, 17, 17, is_causal=True),
                               rtol=0, atol=0)


def test_varlen_gradcheck_float64(request):
    q, k, v, cu_q, cu_k, kw = make_case(request, "cpu", torch.float64, [3, 0, 6], [5, 2, 4], 2, 1, 8,
                                        {"causal": True, "softcap": 5.0, "window": (3, 0)})
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: flashcore.varlen_attention(q, k, v, cu_q, cu_k, 6, 5, **kw),
                                    inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_flash_attn_varlen_interface(request):
    """flash-attn 2.x's varlen functions: argument order and defaults, (out, lse (nheads, total_q), S_dmask empty) with
    return_attn_probs, the packed forms, window_size as a tensor, dropout refused by name, and a block_table with
    packed (3-D) k refused naming k (paged prefill is tested in test_kvcache.py)."""
    import inspect

    from flashcore.flash_attn_interface import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                                flash_attn_varlen_qkvpacked_func)

    assert list(inspect.signature(flash_attn_varlen_func).parameters) == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale",
        "causal", "window_size", "softcap", "alibi_slopes", "deterministic", "return_attn_probs", "block_table"]
    assert list(inspect.signature(flash_attn_varlen_qkvpacked_func).parameters) == [
        "qkv", "cu_seqlens", "max_seqlen", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
        "alibi_slopes", "deterministic", "return_attn_probs"]
    q, k, v, cu_q, cu_k, kw = make_case(request, "cpu", torch.float32, [12, 30], [20, 30], 4, 2, 20)
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, 0.0, 0.3, True, torch.tensor([6, 0]),
                                             0.0, None, False, True)
    assert probs.shape == (0,) and probs.dtype == q.dtype and out.shape == q.shape and lse.shape == (4, 42)
    want = flashcore.varlen_attention(q, k, v, cu_q, cu_k, 30, 30, scale=0.3, is_causal=True, window_size=(6, 0))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    kv = torch.stack([k, v], 1)
    torch.testing.assert_close(flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 30, 30, causal=True),
                               flashcore.varlen_attention(q, k, v, cu_q, cu_k, 30, 30, is_causal=True), rtol=0, atol=0)
    qkv = torch.stack([q[:, :2], q[:, 2:], q[:, :2]], 1)
    same = offsets([12, 30], "cpu")
    torch.testing.assert_close(flash_attn_varlen_qkvpacked_func(qkv, same, 30),
                               flashcore.varlen_attention(q[:, :2], q[:, 2:], q[:, :2], same, same, 30, 30),
                               rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, 0.1)
    with pytest.raises(RuntimeError, match="k must be 4-D .*block_table"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, block_table=torch.zeros(2, 1, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------

GPU_DIMS = [64, 128, 96, 256]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", GPU_DIMS + [32, 192])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_varlen_forward_cuda(request, family, variant, head_dim, dtype):
    lens_q, lens_k = [5, 0, 300, 128, 1, 77, 513], [7, 3, 260, 700, 0, 77, 513]
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", dtype, lens_q, lens_k, 4, 2, head_dim, VARIANTS[variant],
                                        strided=head_dim == 64)
    run_forward(q, k, v, cu_q, cu_k, kw)
    assert assert_ran("fwd", family).endswith("varlen")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", ["dense", "causal", "window_causal", "softcap", "sinks", "alibi", "all"])
@pytest.mark.parametrize("heads", [(8, 2), (16, 2), (12, 1), (6, 2), (4, 4)], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_pack_gqa_cuda(request, monkeypatch, variant, heads, head_dim):
    """Short sequences with GQA on the Hopper varlen forward (forced: it would leave the shortest batches to the
    mma.sync kernel), where a block packs several query heads of a key/value head into its rows (pack-GQA): each
    warp's rows are one head's, so the mask, the per-head sinks and ALiBi slopes, the LSE rows and the bounded O
    stores must all follow the warp's head. Sequences shorter than a head's rows, spanning several blocks, empty,
    and with no keys. The pack taken is the one the rule predicts (MHA: none); test_kvcache's prefills cover packed
    blocks reading paged keys."""
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm90")
    Hq, Hkv = heads
    lens_q, lens_k = [1, 17, 0, 40, 33, 16], [300, 17, 5, 1000, 64, 0]
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, lens_q, lens_k, Hq, Hkv, head_dim,
                                        VARIANTS[variant])
    run_forward(q, k, v, cu_q, cu_k, kw)
    ran = assert_ran("fwd", "sm90")
    block_m = 192 if head_dim <= 96 else 128
    want = pack_gqa_heads(Hq // Hkv, max(lens_q), block_m)
    assert (f" pack{want} " in ran) if want > 1 else ("pack" not in ran), ran


# The key splits of the Hopper varlen forward (sm90/fwd_sm90_traits.cuh): the two-warpgroup kernels where rank 0's
# ring holds the partial results (head dim 128); the three-warpgroup ones (64, 96) are built without.
VARLEN_MAX_KEY_SPLITS = {64: 1, 96: 1, 128: 2, 256: 1}


def key_splits_of(ran):
    return int(ran.split(" splits")[1].split()[0]) if " splits" in ran else 1


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", ["dense", "causal", "window_causal", "softcap", "sinks", "all"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_varlen_key_splits_cuda(request, monkeypatch, variant, head_dim, dtype):
    """A few query tiles over long keys (a chunked prefill of a few sequences) leave most SMs idle, so the Hopper
    varlen forward splits each tile's keys over a cluster of blocks and merges them in rank 0's shared memory. Slices
    that see no key (a sequence of one key tile, one of none, rows a causal mask hides), sequences past one query
    tile; forward against the reference, the backward through the merged O and LSE, and FLASHCORE_KEY_SPLITS=1 (no
    split) for the same inputs."""
    if "sm90" not in gpu_families():
        pytest.skip("the Hopper varlen forward needs a compute capability 9.0 GPU")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm90")
    lens_q, lens_k = [40, 1, 17, 0, 150], [3000, 2049, 100, 0, 700]
    # Windows the split can cut (the launcher splits walks of a few key tiles or more; VARIANTS' 20 and 40 keys are
    # one or two).
    variant_kw = dict(VARIANTS[variant])
    if "window" in variant_kw:
        variant_kw["window"] = (1500, variant_kw["window"][1])
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", dtype, lens_q, lens_k, 8, 2, head_dim, variant_kw)
    out, lse = run_forward(q, k, v, cu_q, cu_k, kw)
    ran = assert_ran("fwd", "sm90")
    want = VARLEN_MAX_KEY_SPLITS[head_dim]
    assert key_splits_of(ran) == want, f"expected {want} key splits: {ran}"
    if variant in ("causal", "all"):
        run_backward(q, k, v, cu_q, cu_k, kw)
    monkeypatch.setenv("FLASHCORE_KEY_SPLITS", "1")
    out1, lse1 = run_forward(q, k, v, cu_q, cu_k, kw)
    assert key_splits_of(assert_ran("fwd", "sm90")) == 1
    # The same inputs split and unsplit: each rank rounds its own P (against its own running max) and the merge adds
    # float32 partials, so the outputs differ by roundings only. (Head dims 64, 96 and 256 do not split: for them
    # this compares two unsplit runs, and the test checks their forward.)
    assert (out.float() - out1.float()).abs().max().item() <= 2 * torch.finfo(dtype).eps * out1.abs().max().item()
    assert torch.equal(torch.isinf(lse), torch.isinf(lse1))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", ["causal", "window_causal", "softcap", "sinks"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_few_queries_long_keys_cuda(request, variant, head_dim):
    """A few queries a sequence over long keys under GQA (a speculative-decoding check or a small chunk through
    flash_attn_varlen_func) takes the packed Hopper kernel by default, not the mma.sync one that reads each K/V head
    once a query head (8 x 16 queries on 8192 keys, 32 / 8 heads: 425 against 75 us, H200); from 1024 keys."""
    if "sm90" not in gpu_families():
        pytest.skip("the Hopper varlen forward needs a compute capability 9.0 GPU")
    lens_q, lens_k = [16, 3, 9, 0], [2500, 1100, 40, 7]
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, lens_q, lens_k, 8, 2, head_dim,
                                        VARIANTS[variant])
    run_forward(q, k, v, cu_q, cu_k, kw)
    ran = assert_ran("fwd", "sm90")
    assert f" pack{pack_gqa_heads(4, max(lens_q), 192 if head_dim <= 96 else 128)} " in ran, ran
    lens_k = [1000, 900, 40, 7]  # under 1024 keys: the mma.sync kernel, whose small blocks suit a few queries
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, lens_q, lens_k, 8, 2, head_dim,
                                        VARIANTS[variant])
    run_forward(q, k, v, cu_q, cu_k, kw)
    assert_ran("fwd", "sm80")


def takes_packed_grid(batch, heads_q, heads_kv, total_q, max_seqlen_q, block_m):
    """Whether the Hopper varlen forward launches the sequences' own tiles (csrc/.../sm90/fwd_sm90_launch.cuh,
    cuda/common/varlen_tile_scan.cuh): at most 256 sequences, and a bound of groups x min(batch x ceil(max_seqlen_q /
    rows), ceil(total_q / rows) + batch) tiles at most 7/8 of the grid of max_seqlen_q's tiles for every sequence."""
    pack, blocks, _ = packed_varlen_grid(batch, heads_q, heads_kv, max_seqlen_q, block_m)
    groups = heads_q // pack
    bound = groups * min(blocks // groups, -(-total_q // (block_m // pack)) + batch)
    return batch <= 256 and 8 * bound <= 7 * blocks


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", ["mixed", "two_chunks", "all_chunks", "past_the_scan", "equal"])
@pytest.mark.parametrize("heads", [(8, 8), (16, 2)], ids=lambda h: f"{h[0]}x{h[1]}")
def test_varlen_packed_grid_cuda(request, monkeypatch, case, heads):
    """The Hopper varlen forward's packed grid (each block finds its tile by one warp's scan of cu_seqlens_q) runs
    exactly the tiles of the grid of max_seqlen_q's tiles for every sequence: bitwise the same out and lse as with
    FLASHCORE_VARLEN_FWD_PACKED=0, over batches the scan covers in one chunk of 32 sequences, in several, in all 8,
    and past them (256: the other grid), with empty sequences, max_seqlen_q above the longest, rows past the last
    sequence, and pack-GQA; the grid taken is the one the rule predicts, and the first case matches the reference."""
    if "sm90" not in gpu_families():
        pytest.skip("the packed grid is the sm90 varlen forward's")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm90")
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(5)
    batch = {"mixed": 7, "two_chunks": 70, "all_chunks": 256, "past_the_scan": 257, "equal": 12}[case]
    lens = torch.randint(0, 300, (batch,), generator=g).tolist()
    lens[1] = 0
    if case == "mixed":
        lens = [5, 0, 700, 128, 1, 77, 513]
    elif case == "equal":
        lens = [256] * batch
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, lens, lens, Hq, Hkv, 128, {"causal": True})
    if case == "mixed":
        run_forward(q, k, v, cu_q, cu_k, kw)
        assert "packed-grid" in assert_ran("fwd", "sm90")
    total = q.size(0)
    q_past = torch.cat([q, torch.randn(5, Hq, 128, device="cuda").to(q.dtype)])  # rows past the last sequence
    max_q = max(lens) + 50

    def run():
        return flashcore.varlen_attention(q_past, k, v, cu_q, cu_k, max_q, max(lens), is_causal=True,
                                          return_lse=True)

    out, lse = run()
    ran = assert_ran("fwd", "sm90")
    assert ("packed-grid" in ran) == takes_packed_grid(batch, Hq, Hkv, q_past.size(0), max_q, 128), ran
    monkeypatch.setenv("FLASHCORE_VARLEN_FWD_PACKED", "0")
    want, want_lse = run()
    assert "packed-grid" not in assert_ran("fwd", "sm90")
    assert torch.equal(out[:total], want[:total]) and torch.equal(lse[:, :total], want_lse[:, :total])
    assert not out[:total].isnan().any()


@pytest.mark.gpu
@requires_cuda
def test_varlen_packed_grid_bad_offsets_cuda(request, monkeypatch):
    """Offsets that lie on the packed grid (its bound assumes they fit q's rows): the scan clamps them as SeqInfo
    does, so no block reads or writes outside the tensors (compute-sanitizer runs this test too)."""
    if "sm90" not in gpu_families():
        pytest.skip("the packed grid is the sm90 varlen forward's")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm90")
    g = make_generator(request, "cuda")
    q, k, v = (torch.randn(100, 8, 128, generator=g, device="cuda").bfloat16() for _ in range(3))
    for cu in ([0, 150, 90, 100000, 5], [90, 10, -7, 100, 100], [0, 2**31 - 1, 7, 8, 9]):
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        flashcore.varlen_attention(q, k, v, cu_t, cu_t, 1000, 1000, is_causal=True)
        assert "packed-grid" in assert_ran("fwd", "sm90")
        torch.cuda.synchronize()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", GPU_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_varlen_backward_cuda(request, bwd_path, variant, head_dim, dtype):
    lens_q, lens_k = [5, 0, 300, 128, 1, 77], [7, 3, 260, 400, 0, 77]
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", dtype, lens_q, lens_k, 4, 2, head_dim, VARIANTS[variant],
                                        strided=head_dim == 128)
    run_backward(q, k, v, cu_q, cu_k, kw)
    assert_ran("bwd", bwd_path)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", ["dense", "causal", "window_causal", "alibi", "softcap"])
@pytest.mark.parametrize("steps", ["default", "narrow"])
def test_varlen_backward_gqa_tile_edges_cuda(request, monkeypatch, bwd_path, variant, steps):
    """GQA 8/2 at head dim 128, lengths around the key block (128) and the query steps (64 and 80), sequences
    whose tails share boxes with the next sequence's first rows: each sequence's gradients alone. sm90 runs its
    80-row kernels by default (ALiBi: the score-mod one) and its 64-row ones with FLASHCORE_BWD_WIDE_STEPS=0."""
    if steps == "narrow":
        monkeypatch.setenv("FLASHCORE_BWD_WIDE_STEPS", "0")
    lens_q = [64, 65, 127, 129, 1, 256, 63, 200, 80, 81, 160, 79]
    lens_k = [64, 129, 127, 128, 300, 256, 1, 190, 80, 81, 160, 79]
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, lens_q, lens_k, 8, 2, 128,
                                        VARIANTS[variant])
    run_backward(q, k, v, cu_q, cu_k, kw)
    ran = assert_ran("bwd", bwd_path)
    wide = bwd_path == "sm90" and steps == "default"
    assert ran.endswith("varlen m80") == wide, ran


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fused,batch", [("sm80", 60), ("sm90", 60), ("sm90", 33), ("sm90", 64), ("sm90", 256),
                                         ("sm90", 257)])
def test_varlen_schedule_matches_given_order_cuda(request, monkeypatch, fused, batch):
    """The backward's launch schedule (longest first, a packed grid on sm90) only reorders blocks: both backwards
    pass the rule with and without it, and the forward (never scheduled) is bitwise unchanged. Sequences of 0-300
    tokens, one without queries and some with queries but no keys (slots of no tiles: repeated tile_end values),
    GQA, causal. The batch sizes cross the sm90 lookup's 32-slot chunks (locate_packed_tile_warp) and its 256-slot
    limit, past which the binary search takes over."""
    if fused == "sm90" and "sm90" not in gpu_families():
        pytest.skip("sm90 kernels need a compute capability 9.0 GPU")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", fused)
    monkeypatch.setenv("FLASHCORE_FORCE_BWD", fused)
    g = torch.Generator().manual_seed(3 + batch)
    lens = torch.randint(0, 301, (batch,), generator=g).tolist()
    lens[7] = 0
    lens_k = [0 if i % 9 == 4 else n for i, n in enumerate(lens)]
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, lens, lens_k, 8, 2, 128, {"causal": True})
    max_q, max_k = max(lens), max(lens_k)
    scheduled = flashcore.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, return_lse=True)
    assert_ran("fwd", fused)
    run_backward(q, k, v, cu_q, cu_k, kw)
    assert_ran("bwd", fused)
    monkeypatch.setenv("FLASHCORE_VARLEN_SCHEDULE", "0")
    given = flashcore.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, return_lse=True)
    assert torch.equal(scheduled[0], given[0]) and torch.equal(scheduled[1], given[1])
    run_backward(q, k, v, cu_q, cu_k, kw)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", ["dense", "causal", "softcap"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_backward_tma_epilogue_cuda(request, monkeypatch, variant, head_dim):
    """The Hopper varlen backward writes dK and dV through TMA for the warpgroups whose 64 keys are all their
    sequence's, and directly for the rest (a box past a sequence's end would write the next one's rows): key
    lengths on both sides of 64 and 128, strided tensors, bitwise equal to the direct stores
    (FLASHCORE_BWD_TMA_EPILOGUE=0), with seqused_k leaving rows no store may touch, and within the rule."""
    if "sm90" not in gpu_families():
        pytest.skip("the TMA epilogue is sm90's")
    monkeypatch.setenv("FLASHCORE_FORCE_BWD", "sm90")
    lens_q = [70, 130, 64, 200, 5, 128, 190]
    lens_k = [63, 129, 64, 192, 65, 128, 300]
    used = [63, 129, 64, 191, 65, 127, 250]
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, lens_q, lens_k, 4, 2, head_dim,
                                        VARIANTS[variant], strided=True, used_k=used)
    runs = {}
    for tma in ("1", "0"):
        monkeypatch.setenv("FLASHCORE_BWD_TMA_EPILOGUE", tma)
        runs[tma] = run_backward(q, k, v, cu_q, cu_k, kw)
        assert_ran("bwd", "sm90")
    assert torch.equal(runs["1"][1], runs["0"][1]) and torch.equal(runs["1"][2], runs["0"][2])
    for b, n in enumerate(used):  # keys past seqused_k get no gradient
        rows = slice(int(cu_k[b]) + n, int(cu_k[b + 1]))
        assert (runs["1"][1][rows] == 0).all() and (runs["1"][2][rows] == 0).all()


@pytest.mark.gpu
@requires_cuda
def test_varlen_backward_default_path_cuda(request):
    """Unforced, a Hopper GPU runs the wgmma varlen backward on long enough sequences (mma.sync elsewhere)."""
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.float16, [100, 300], [120, 280], 4, 4, 64,
                                        {"causal": True})
    run_backward(q, k, v, cu_q, cu_k, kw)
    assert_ran("bwd", "sm90" if "sm90" in gpu_families() else "sm80")


@pytest.mark.gpu
@requires_cuda
def test_varlen_many_short_sequences_cuda(request, family):
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(0, 17, (10000,), generator=g).tolist()
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, lens, lens, 2, 1, 64, {"causal": True})
    out, lse = flashcore.varlen_attention(q, k, v, cu_q, cu_k, 16, 16, is_causal=True, return_lse=True)
    # against the float64 reference and PyTorch on the padded batch (B, 2, 16, 64)
    B, L = len(lens), 16
    idx = torch.cat([torch.arange(n) + i * L for i, n in enumerate(lens)]).cuda()
    def pad(t):
        z = t.new_zeros(B * L, t.size(1), t.size(2))
        z[idx] = t
        return z.view(B, L, t.size(1), t.size(2)).transpose(1, 2)
    qp, kp, vp = pad(q), pad(k), pad(v)
    # bottom-right causal with Sq == Sk is top-left causal; the padded keys come after a sequence's real ones, so
    # its real rows never see them
    ref, _ = reference_attention(qp, kp, vp, causal=True)
    low = lowp_attention(qp, kp, vp, causal=True)
    flat = lambda t: t.transpose(1, 2).reshape(B * L, 2, 64)[idx]
    check_close("out", out, flat(ref), flat(low))
    assert_ran("fwd", family)
    empty_rows = torch.isneginf(lse).all(0)
    assert not empty_rows.any()  # every query of a causal sequence sees its own key


@pytest.mark.gpu
@requires_cuda
def test_varlen_long_sequence_cuda(request, family):
    """A sequence longer than 64k among short ones: checked on its last rows against the float64 reference."""
    lens = [3, 70000, 129]
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, lens, lens, 2, 1, 64, {"causal": True})
    out, lse = flashcore.varlen_attention(q, k, v, cu_q, cu_k, 70000, 70000, is_causal=True, return_lse=True)
    q1, k1, v1 = q[3:70003], k[3:70003], v[3:70003]
    rows = slice(70000 - 128, 70000)
    qb, kb, vb = (t.transpose(0, 1)[None] for t in (q1[rows], k1, v1))
    ref, ref_lse = reference_attention(qb, kb, vb, causal=True, causal_offset=70000 - 128)
    low = lowp_attention(qb, kb, vb, causal=True, causal_offset=70000 - 128)
    check_close("out", out[3:70003][rows], ref[0].transpose(0, 1), low[0].transpose(0, 1))
    run_forward(q[70003:], k[70003:], v[70003:], offsets([129], "cuda"), offsets([129], "cuda"), kw)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_varlen_rows_outside_sequences_cuda(request, monkeypatch, family):
    """The same on the GPU kernels (outputs poisoned first in the suite: the rows no kernel visits are zeroed)."""
    if family not in gpu_families():
        pytest.skip(f"no {family} kernels on this GPU")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", family)
    _rows_outside_sequences("cuda", torch.bfloat16, make_generator(request, "cuda"))


@pytest.mark.gpu
@requires_cuda
def test_varlen_seqused_and_outside_rows_cuda(request):
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.float16, [30, 10, 170], [50, 20, 190], 4, 2, 128,
                                        {"causal": True}, used_k=[40, 0, 190])
    run_forward(q, k, v, cu_q, cu_k, kw)
    run_backward(q, k, v, cu_q, cu_k, kw)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_varlen_backward_key_rows_outside_batch_cuda(request, head_dim, strided):
    """Key rows before the first sequence and after the last (a padded buffer) get zero dK/dV from the fused
    backward's gap launch (cuda/varlen_rows.cu), not a fill: the gradients start poisoned in the suite, so a row
    neither the gap launch nor a kernel writes fails; a sequence without queries keeps its keys' zeros too."""
    lens_q, lens_k, lead, tail = [100, 0, 200], [150, 40, 300], 37, 300
    q, k, v, cu_q, _, kw = make_case(request, "cuda", torch.bfloat16, lens_q, [lead + sum(lens_k) + tail], 8, 2,
                                     head_dim, {"causal": True}, strided=strided)
    cu_k = offsets(lens_k, "cuda") + lead
    got = run_backward(q, k, v, cu_q, cu_k, kw)
    outside = torch.cat([torch.arange(lead), torch.arange(lead + sum(lens_k), k.shape[0])]).cuda()
    assert (got[1][outside] == 0).all() and (got[2][outside] == 0).all()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("lens_q", [[96, 200, 70], [30, 10, 50]], ids=["long", "short"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_nan_past_seqused_cuda(request, lens_q, head_dim, causal):
    """Keys past each sequence's seqused_k hold NaN (a KV cache's unwritten slots, read through seqused_k): the
    kernels read whole key tiles, and P = 0 (dS = 0) on those keys does not cancel a NaN value (0 x NaN is NaN), so
    they must keep them out of P V, dO V^T and dS K. Long query sequences run on the Hopper kernels, short ones on
    mma.sync."""
    used = [0, 513, 257]
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, lens_q, [1000, 1000, 300], 8, 2, head_dim,
                                        {"causal": causal}, used_k=used)
    for b, n in enumerate(used):
        k[int(cu_k[b]) + n:int(cu_k[b + 1])] = float("nan")
        v[int(cu_k[b]) + n:int(cu_k[b + 1])] = float("nan")
    run_forward(q, k, v, cu_q, cu_k, kw)
    run_backward(q, k, v, cu_q, cu_k, kw)


@pytest.mark.gpu
@requires_cuda
def test_varlen_compile_and_graph_cuda(request):
    from conftest import capture_graph

    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, [100, 0, 257], [80, 5, 257], 4, 4, 64,
                                        {"causal": True})
    f = lambda q, k, v: flashcore.varlen_attention(q, k, v, cu_q, cu_k, 257, 257, is_causal=True)
    eager = f(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), eager)
    graph, static = capture_graph(lambda: f(q, k, v))
    q.copy_(torch.randn_like(q))
    static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, f(q, k, v))
    args = (q, k, v, cu_q, cu_k, 257, 257, 0.125, True, -1, -1, 0.0, False, None, None, None)
    torch.library.opcheck(torch.ops.flashcore.varlen_fwd.default, args)
    out, lse = torch.ops.flashcore.varlen_fwd(*args)
    torch.library.opcheck(torch.ops.flashcore.varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, 257, 257, 0.125, True, -1, -1, 0.0,
                           False, None, None))


@pytest.mark.gpu
@requires_cuda
def test_varlen_bad_offsets_stay_in_bounds_cuda(request, family, monkeypatch):
    """Offsets that lie (past the tensors, decreasing, longer than max_seqlen) must not make a kernel touch memory
    outside its tensors (compute-sanitizer runs this test too); the validation mode reports them."""
    monkeypatch.setenv("FLASHCORE_FORCE_BWD", family)  # the same family's backward
    g = make_generator(request, "cuda")
    q, k, v = (torch.randn(100, 2, 64, generator=g, device="cuda").half().requires_grad_() for _ in range(3))
    for cu in ([0, 150, 90], [50, 40, 100000], [-5, 100, 100], [0, 2**31 - 1, 7]):
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        out = flashcore.varlen_attention(q, k, v, cu_t, cu_t, 64, 64, is_causal=True)
        out.float().sum().backward()
        torch.cuda.synchronize()
    monkeypatch.setenv("FLASHCORE_CHECK_VARLEN", "1")
    with pytest.raises(RuntimeError, match="cu_seqlens_q"):
        flashcore.varlen_attention(q, k, v, torch.tensor([0, 150, 90], dtype=torch.int32, device="cuda"),
                                   torch.tensor([0, 50, 90], dtype=torch.int32, device="cuda"), 150, 150)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", ["causal", "all"])
def test_varlen_deterministic_backward_cuda(request, variant):
    """deterministic=True: the per-sequence composite backward, accurate and bitwise reproducible."""
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, [5, 0, 300, 128, 1], [7, 3, 260, 400, 0],
                                        4, 2, 64, VARIANTS[variant])
    kw["deterministic"] = True
    first = run_backward(q, k, v, cu_q, cu_k, kw)
    assert flashcore.last_kernel("bwd") == "composite"
    again = run_backward(q, k, v, cu_q, cu_k, kw)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.gpu
@requires_cuda
def test_flash_attn_varlen_func_any_head_dim_cuda(request):
    """flash-attn pads any head dim up to 256 itself: 100 runs (padded to 104 here), forward and backward."""
    from flashcore.flash_attn_interface import flash_attn_varlen_func

    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, [70, 0, 130], [90, 4, 130], 4, 2, 100,
                                        {"causal": True})
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 130, 130, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, q.size(0))
    ref, _ = per_sequence(reference_attention, q, k, v, cu_q, cu_k, kw)
    low, _ = per_sequence(lowp_attention, q, k, v, cu_q, cu_k, kw)
    check_close("out", out, ref, low)
    run_backward(q, k, v, cu_q, cu_k, kw)


# One query a sequence (a decode step through flash_attn_varlen_func): the KV-cache kernel's route
# (cuda/attention_cuda.cpp: varlen_decode_step), whose entries read the packed keys as the varlen kernels do.
DECODE_LENS_K = [0, 1, 63, 64, 65, 700, 3000, 129]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (32, 1), (6, 3)], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])
def test_varlen_decode_step_cuda(request, variant, heads, head_dim):
    """Empty, one-key, tile-edge and long sequences; MHA, GQA and a 32-head group (the kernel's rows mode); every
    variant (the causal diagonal, window and ALiBi distance aligned to each sequence's last key); the LSE in the
    varlen layout (the backward reads it: run_backward goes through the same forward)."""
    Hq, Hkv = heads
    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, [1] * len(DECODE_LENS_K), DECODE_LENS_K,
                                        Hq, Hkv, head_dim, VARIANTS[variant], strided=head_dim == 64)
    out, lse = run_forward(q, k, v, cu_q, cu_k, kw)
    assert flashcore.last_kernel("fwd").startswith("decode"), flashcore.last_kernel("fwd")
    assert (out[0] == 0).all()  # no key (its LSE, -inf or the sink, checked by run_forward)
    if head_dim == 128 and Hq == 8:
        run_backward(q, k, v, cu_q, cu_k, kw)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_varlen_decode_step_seqused_and_gaps_cuda(request, dtype):
    """seqused_k (keys past it hold NaN), key rows between and around the sequences, and the kernel family forced:
    the varlen kernels then run the same call."""
    lens_k, used = [300, 40, 2000, 5, 900], [300, 0, 1234, 5, 17]
    q, k, v, _, cu_k, kw = make_case(request, "cuda", dtype, [1] * 5, [sum(lens_k) + 50], 16, 4, 128,
                                     {"causal": True}, used_k=used)
    cu_q = offsets([1] * 5, "cuda")
    cu_k = offsets(lens_k, "cuda") + 50
    for b, n in enumerate(used):
        k[int(cu_k[b]) + n:int(cu_k[b + 1])] = float("nan")
        v[int(cu_k[b]) + n:int(cu_k[b + 1])] = float("nan")
    out, lse = run_forward(q, k, v, cu_q, cu_k, kw)
    assert flashcore.last_kernel("fwd").startswith("decode")
    for fam in gpu_families():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FLASHCORE_FORCE_KERNEL", fam)
            out_f, lse_f = flashcore.varlen_attention(q, k, v, cu_q, cu_k, 1, 2000, return_lse=True, **kw)
            assert_ran("fwd", fam)
        torch.testing.assert_close(out_f, out, atol=2e-2, rtol=0)
        torch.testing.assert_close(lse_f, lse, atol=1e-3, rtol=0)


@pytest.mark.gpu
@requires_cuda
def test_varlen_decode_step_bad_offsets_stay_in_bounds_cuda(request):
    """Offsets and seqused_k that lie (past the keys, decreasing, negative, longer than max_seqlen_k) on the
    KV-cache kernel's route: no access outside the tensors (compute-sanitizer runs this test too)."""
    g = make_generator(request, "cuda")
    q = torch.randn(3, 8, 128, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(200, 2, 128, generator=g, device="cuda").bfloat16() for _ in range(2))
    cases = ([0, 150, 90, 400], [50, 40, 100000, -3], [-5, 100, 100, 2**31 - 1], [0, 2**31 - 1, 7, 8])
    for cu in cases:
        cu_k = torch.tensor(cu, dtype=torch.int32, device="cuda")
        for used in (None, torch.tensor([500, -1, 2**31 - 1], dtype=torch.int32, device="cuda")):
            out = flashcore.varlen_attention(q, k, v, offsets([1, 1, 1], "cuda"), cu_k, 1, 64, is_causal=True,
                                             seqused_k=used)
            assert flashcore.last_kernel("fwd").startswith("decode")
            assert torch.isfinite(out).all()
    torch.cuda.synchronize()


@pytest.mark.gpu
@requires_cuda
def test_varlen_decode_step_in_a_graph_cuda(request):
    """Captured with seqused_k changing between replays (a serving engine's decode step): the split plan depends
    on the shapes only."""
    from conftest import capture_graph

    q, k, v, cu_q, cu_k, kw = make_case(request, "cuda", torch.bfloat16, [1] * 4, [4096] * 4, 32, 8, 128)
    used = torch.tensor([4096, 1, 2000, 0], dtype=torch.int32, device="cuda")
    f = lambda: flashcore.varlen_attention(q, k, v, cu_q, cu_k, 1, 4096, is_causal=True, seqused_k=used)
    graph, static = capture_graph(f)
    for lengths in ([7, 4096, 300, 1], [0, 0, 4095, 64]):
        used.copy_(torch.tensor(lengths))
        static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, f())
        run_forward(q, k, v, cu_q, cu_k, dict(kw, is_causal=True, seqused_k=used))
