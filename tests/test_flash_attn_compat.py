"""What code written for flash-attn 2.x observes beyond the public signatures (tests/test_variants.py,
tests/test_varlen.py and tests/test_kvcache.py check those): the window flash-attn's C++ side actually applies when
seqlen_q > seqlen_k, inputs without a contiguous last dimension, the package's top-level names, and the lower-level
_flash_attn_forward/_backward functions that ring-attention libraries import. CPU (CI) tests; the same Python
layer runs in front of the CUDA kernels."""

import inspect

import pytest
import torch

import flashcore
import flashcore.flash_attn_interface as fai

D = 32


def _inputs(B, Sq, Sk, H=2, Hk=1, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Sq, H, D, generator=g, dtype=dtype), torch.randn(B, Sk, Hk, D, generator=g, dtype=dtype),
            torch.randn(B, Sk, Hk, D, generator=g, dtype=dtype))


def _literal(q, k, v, window, causal=False):
    """The op with the window taken literally (bottom-right aligned, -1 unbounded)."""
    out, _ = torch.ops.flashcore.fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), D ** -0.5, causal,
                                     True, window[0], window[1])
    return out.transpose(1, 2)


# (window_size as passed, the window flash-attn 2's mha_fwd + set_params_fprop make of it) for seqlen_q 12,
# seqlen_k 5: a side >= seqlen_k becomes -1, then a one-sided window gets seqlen_k on its open side.
FA2_WINDOWS = [((-1, 7), (-1, -1)), ((2, 7), (2, 5)), ((3, -1), (3, 5)), ((2, 4), (2, 4)), ((6, 1), (-1, 1)),
               ((0, 0), (0, 0))]


@pytest.mark.parametrize("given,applied", FA2_WINDOWS, ids=str)
def test_window_as_flash_attn_applies_it(given, applied):
    q, k, v = _inputs(2, 12, 5)
    got = flashcore.flash_attn_func(q, k, v, window_size=given)
    torch.testing.assert_close(got, _literal(q, k, v, applied), rtol=1e-12, atol=1e-12)
    # varlen: the same rule with max_seqlen_k (flash-attn's mha_varlen_fwd)
    cu_q = torch.tensor([0, 12, 24], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 10], dtype=torch.int32)
    got = flashcore.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 12, 5,
                                           window_size=torch.tensor(given))
    torch.testing.assert_close(got, _literal(q, k, v, applied).flatten(0, 1), rtol=1e-12, atol=1e-12)


def test_window_unchanged_when_queries_do_not_outnumber_keys():
    q, k, v = _inputs(1, 9, 9)
    for window in [(-1, 3), (3, -1), (2, 8), (20, 0)]:
        torch.testing.assert_close(flashcore.flash_attn_func(q, k, v, window_size=window), _literal(q, k, v, window),
                                   rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(flashcore.flash_attn_func(q, k, v, causal=True, window_size=(3, -1)),
                               _literal(q, k, v, (3, 0), causal=True), rtol=1e-12, atol=1e-12)


def test_inputs_without_contiguous_last_dim():
    """flash-attn makes such inputs contiguous (maybe_contiguous); so does this interface."""
    q, k, v = _inputs(2, 7, 9)
    qs, ks, vs = (torch.stack([x, x], -1).flatten(-2)[..., ::2] for x in (q, k, v))  # same values, stride(-1) == 2
    assert qs.stride(-1) == 2
    want = flashcore.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(flashcore.flash_attn_func(qs, ks, vs, causal=True), want, rtol=1e-12, atol=1e-12)
    cu_q = torch.tensor([0, 7, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 18], dtype=torch.int32)
    got = flashcore.flash_attn_varlen_func(qs.flatten(0, 1), ks.flatten(0, 1), vs.flatten(0, 1), cu_q, cu_k, 7, 9,
                                           causal=True)
    torch.testing.assert_close(got, want.flatten(0, 1), rtol=1e-12, atol=1e-12)


def test_top_level_names():
    """flash_attn/__init__.py exports the seven functions; `from flashcore import ...` finds the same ones."""
    for name in fai.__all__:
        assert getattr(flashcore, name) is getattr(fai, name), name
    assert fai.maybe_contiguous(torch.zeros(3, 4).t()).is_contiguous()


def test_lower_level_functions_signatures():
    """The argument lists of flash-attn 2.8's _flash_attn_forward / _backward and their varlen forms."""
    params = {f: list(inspect.signature(getattr(fai, f)).parameters) for f in (
        "_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward")}
    assert params["_flash_attn_forward"] == [
        "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
        "alibi_slopes", "return_softmax"]
    assert params["_flash_attn_backward"] == [
        "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p", "softmax_scale", "causal",
        "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic", "rng_state"]
    assert params["_flash_attn_varlen_forward"] == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale",
        "causal", "window_size_left", "window_size_right", "softcap", "alibi_slopes", "return_softmax", "block_table",
        "leftpad_k", "seqused_k", "zero_tensors", "num_splits"]
    assert params["_flash_attn_varlen_backward"] == [
        "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
        "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size_left",
        "window_size_right", "softcap", "alibi_slopes", "deterministic", "rng_state", "zero_tensors"]


@pytest.mark.parametrize("window", [(-1, -1), (4, 2)])
def test_lower_level_forward_backward(window):
    """Ring-attention style use: _flash_attn_forward, then _flash_attn_backward into preallocated gradients; equal to
    flash_attn_func's output and autograd gradients; softmax_d = rowsum(dout * out) padded to 128 rows."""
    q, k, v = (x.requires_grad_() for x in _inputs(2, 37, 29, seed=3))
    scale = 0.2
    out, lse, s_dmask, rng = fai._flash_attn_forward(q, k, v, 0.0, scale, True, *window, 0.0, None, False)
    want, want_lse, want_s_dmask = flashcore.flash_attn_func(q, k, v, 0.0, scale, True, window,
                                                             return_attn_probs=True)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    # flash-attn's returns without dropout: an empty S_dmask of q's dtype, a (2,) int64 rng_state
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype
    assert rng.shape == (2,) and rng.dtype == torch.int64
    assert want_s_dmask.shape == (0,) and want_s_dmask.dtype == q.dtype
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(want, (q, k, v), dout)
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    softmax_d = fai._flash_attn_backward(dout, q, k, v, out.detach(), lse, dq, dk, dv, 0.0, scale, True, *window,
                                         0.0, None, False)
    for got, ref in zip((dq, dk, dv), grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    assert softmax_d.shape == (2, 2, 128)
    torch.testing.assert_close(softmax_d[..., :37], (dout * out).sum(-1).transpose(1, 2).float())
    assert not softmax_d[..., 37:].any()

    cu_q = torch.tensor([0, 37, 74], dtype=torch.int32)
    cu_k = torch.tensor([0, 29, 58], dtype=torch.int32)
    qv, kv_, vv = (x.detach().flatten(0, 1) for x in (q, k, v))
    out_v, lse_v, s_dmask_v, rng_v = fai._flash_attn_varlen_forward(qv, kv_, vv, cu_q, cu_k, 37, 29, 0.0, scale, True,
                                                                    *window)
    assert s_dmask_v.shape == (0,) and rng_v.shape == (2,) and rng_v.dtype == torch.int64
    torch.testing.assert_close(out_v, want.detach().flatten(0, 1), rtol=1e-12, atol=1e-12)
    assert lse_v.shape == (2, 74)
    dq, dk, dv = (torch.empty_like(x) for x in (qv, kv_, vv))
    softmax_d_v = fai._flash_attn_varlen_backward(dout.flatten(0, 1), qv, kv_, vv, out_v, lse_v, dq, dk, dv, cu_q,
                                                  cu_k, 37, 29, 0.0, scale, True, *window, 0.0, None, False)
    for got, ref in zip((dq, dk, dv), grads):
        torch.testing.assert_close(got, ref.flatten(0, 1), rtol=1e-10, atol=1e-12)
    # flash-attn's padded layout: (nheads, total_q + 128 batch), sequence b's rows from column cu_q[b] + 128 b
    assert softmax_d_v.shape == (2, 74 + 2 * 128)
    rowsum = (dout * out).sum(-1).transpose(1, 2).float()  # (batch, nheads, 37)
    torch.testing.assert_close(softmax_d_v[:, :37], rowsum[0])
    torch.testing.assert_close(softmax_d_v[:, 37 + 128:74 + 128], rowsum[1])
    assert not softmax_d_v[:, 37:37 + 128].any() and not softmax_d_v[:, 74 + 128:].any()
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fai._flash_attn_forward(q, k, v, 0.1, scale, True, -1, -1, 0.0, None, False)


def _flash_alibi_lse_ref(q, k, slopes, Sq, Sk, causal_form, window=(-1, -1)):
    """float64 softmax_lse (heads, Sq) of one sequence as flash-attn 2's kernels write it under ALiBi: the causal
    kernel adds slope * j to key j's score (mask.h, Mask::apply_mask), the others -slope * |i + Sk - Sq - j|; k holds
    the sequence's keys (a KV-cache entry's from its left pad on)."""
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * D ** -0.5
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Sk)[None, :]
    if causal_form:
        bias = slopes.double()[:, None, None] * j
        visible = j <= i + Sk - Sq
    else:
        bias = -slopes.double()[:, None, None] * (i + Sk - Sq - j).abs()
        visible = torch.ones(Sq, Sk, dtype=torch.bool)
        if window[0] >= 0:
            visible &= j >= i + Sk - Sq - window[0]
        if window[1] >= 0:
            visible &= j <= i + Sk - Sq + window[1]
    return torch.logsumexp((s + bias).masked_fill(~visible, float("-inf")), -1)


# (causal, window_size, whether flash-attn runs its causal kernel) for seqlen_k 7: a left side >= seqlen_k is
# unbounded, so (9, 0) is causal too; (2, 0) is a local window (the |i + Sk - Sq - j| form), and so is (5, 0)
# although the varlen batch's second sequence and the KV cache's first entry hold at most 5 keys (flash-attn
# decides by max_seqlen_k and by the cache's capacity, both 7).
CAUSAL_ALIBI_CASES = [(True, (-1, -1), True), (False, (-1, 0), True), (True, (9, -1), True), (True, (2, 0), False),
                      (True, (5, 0), False), (False, (-1, -1), False)]


@pytest.mark.parametrize("causal,window,causal_form", CAUSAL_ALIBI_CASES, ids=str)
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes_h", "slopes_bh"])
def test_alibi_lse_as_flash_attn(causal, window, causal_form, per_batch):
    """softmax_lse under ALiBi is what flash-attn 2 returns, including its causal kernel's slope * j bias (the LSE
    larger by slope * (i + Sk - Sq) than the |i + Sk - Sq - j| form; out and gradients the same): dense (Sq < Sk and
    Sq > Sk, rows without keys -inf), varlen, paged varlen, the KV cache with left padding and new keys, and the
    lower-level forward/backward pair, whose backward takes that LSE back."""
    B, H = 2, 2
    slopes = torch.tensor([[0.5, 0.25], [0.75, 0.125]]) if per_batch else torch.tensor([0.5, 0.25])
    slopes_of = (lambda b: slopes[b]) if per_batch else (lambda b: slopes)
    for Sq, Sk in [(5, 7), (9, 7), (0, 7)]:
        q, k, v = _inputs(B, Sq, Sk, H=H, Hk=H, seed=Sq)
        out, lse, _ = flashcore.flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes,
                                                return_attn_probs=True)
        for b in range(B):
            want = _flash_alibi_lse_ref(q[b], k[b], slopes_of(b), Sq, Sk, causal_form, window)
            torch.testing.assert_close(lse[b], want, rtol=1e-10, atol=1e-10)
        # the lower-level pair: the backward takes the LSE the forward returned
        q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
        ref_out = flashcore.flash_attn_func(q_, k_, v_, causal=causal, window_size=window, alibi_slopes=slopes)
        dout = torch.randn_like(ref_out)
        grads = torch.autograd.grad(ref_out, (q_, k_, v_), dout)
        out2, lse2, _, _ = fai._flash_attn_forward(q, k, v, 0.0, None, causal, *window, 0.0, slopes, False)
        torch.testing.assert_close(lse2, lse, rtol=0, atol=0)
        dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
        fai._flash_attn_backward(dout, q, k, v, out2, lse2, dq, dk, dv, 0.0, None, causal, *window, 0.0, slopes,
                                 False)
        for got, ref in zip((dq, dk, dv), grads):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)

    # varlen: sequences of 3 and 6 queries against 7 and 4 keys (the second with rows that see no key when causal)
    lens_q, lens_k = [3, 6], [7, 4]
    cu_q = torch.tensor([0, 3, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 11], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    qv, kv, vv = (torch.randn(n, H, D, generator=g, dtype=torch.float64) for n in (9, 11, 11))
    out, lse, _ = flashcore.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 6, 7, causal=causal, window_size=window,
                                                   alibi_slopes=slopes, return_attn_probs=True)
    for b in range(2):
        want = _flash_alibi_lse_ref(qv[cu_q[b]:cu_q[b + 1]], kv[cu_k[b]:cu_k[b + 1]], slopes_of(b), lens_q[b],
                                    lens_k[b], causal_form, window)
        torch.testing.assert_close(lse[:, cu_q[b]:cu_q[b + 1]], want, rtol=1e-10, atol=1e-10)
    out2, lse2, _, _ = fai._flash_attn_varlen_forward(qv, kv, vv, cu_q, cu_k, 6, 7, 0.0, None, causal, *window, 0.0,
                                                      slopes)
    torch.testing.assert_close(lse2, lse, rtol=0, atol=0)
    q_, k_, v_ = (x.clone().requires_grad_() for x in (qv, kv, vv))
    ref_out = flashcore.flash_attn_varlen_func(q_, k_, v_, cu_q, cu_k, 6, 7, causal=causal, window_size=window,
                                               alibi_slopes=slopes)
    dout = torch.randn_like(ref_out)
    grads = torch.autograd.grad(ref_out, (q_, k_, v_), dout)
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (qv, kv, vv))
    fai._flash_attn_varlen_backward(dout, qv, kv, vv, out2, lse2, dq, dk, dv, cu_q, cu_k, 6, 7, 0.0, None, causal,
                                    *window, 0.0, slopes, False)
    for got, ref in zip((dq, dk, dv), grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    # paged varlen (pages of 4 keys): the same LSE
    pages_k = torch.zeros(8, 4, H, D, dtype=torch.float64)
    pages_v = torch.zeros_like(pages_k)
    table = torch.tensor([[5, 2, 0, 0], [7, 1, 0, 0]], dtype=torch.int32)
    for b in range(2):
        for j in range(lens_k[b]):
            pages_k[table[b, j // 4], j % 4] = kv[cu_k[b] + j]
            pages_v[table[b, j // 4], j % 4] = vv[cu_k[b] + j]
    _, lse_paged, _ = flashcore.flash_attn_varlen_func(qv, pages_k, pages_v, cu_q, cu_k, 6, 7, causal=causal,
                                                       window_size=window, alibi_slopes=slopes,
                                                       return_attn_probs=True, block_table=table)
    torch.testing.assert_close(lse_paged, lse, rtol=1e-10, atol=1e-10)

    # KV cache, capacity 7, two new keys and queries an entry (a speculative-decoding check): entry 0 holds 3 keys,
    # entry 1 is left-padded by 2 and holds 3 (cache_seqlens 5), so it ends at the capacity
    k_cache, v_cache = (torch.randn(B, 7, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    k_new, v_new = (torch.randn(B, 2, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    q2 = torch.randn(B, 2, H, D, generator=g, dtype=torch.float64)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    leftpad = torch.tensor([0, 2], dtype=torch.int32)
    kc, vc = k_cache.clone(), v_cache.clone()
    _, lse = fai.flash_attn_with_kvcache(q2, kc, vc, k_new, v_new, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                         causal=causal, window_size=window, alibi_slopes=slopes,
                                         return_softmax_lse=True)
    for b in range(B):
        keys = kc[b, leftpad[b]:seqlens[b] + 2]
        want = _flash_alibi_lse_ref(q2[b], keys, slopes_of(b), 2, keys.size(0), causal_form, window)
        torch.testing.assert_close(lse[b], want, rtol=1e-10, atol=1e-10)
    # with sinks (flashcore's addition, which flash-attn 2 does not have) the LSE is flashcore's own: the defined
    # logits' and the sink's
    sinks = torch.tensor([0.5, -1.0])
    _, lse = fai.flash_attn_with_kvcache(q2, kc, vc, cache_seqlens=seqlens + 2, cache_leftpad=leftpad, causal=causal,
                                         window_size=window, alibi_slopes=slopes, return_softmax_lse=True, sinks=sinks)
    for b in range(B):
        keys = kc[b, leftpad[b]:seqlens[b] + 2]
        defined = _flash_alibi_lse_ref(q2[b], keys, slopes_of(b), 2, keys.size(0), False,
                                       (-1, 0) if causal_form else window)
        want = torch.logaddexp(defined, sinks.double()[:, None])
        torch.testing.assert_close(lse[b], want, rtol=1e-10, atol=1e-10)


def test_extension_entry_points_as_flash_attn_gpu():
    """flash_attn_interface.flash_attn_gpu (flash-attn's extension, flash_attn_2_cuda): the C++ functions' positional
    arguments and list returns, outputs written into the caller's tensors, on the same results as the lower-level
    Python functions; a non-None RNG slot raises as flash-attn's current extension does."""
    gpu = fai.flash_attn_gpu
    q, k, v = (x.requires_grad_() for x in _inputs(2, 9, 11, seed=4))
    slopes, scale = torch.tensor([0.3, 0.1]), 0.25
    want, want_lse = flashcore.flash_attn_func(q, k, v, 0.0, scale, True, (5, 0), 0.0, slopes,
                                               return_attn_probs=True)[:2]
    dout = torch.randn_like(want)
    grads = torch.autograd.grad(want, (q, k, v), dout)
    q, k, v = q.detach(), k.detach(), v.detach()
    out = torch.full_like(q, float("nan"))
    got = gpu.fwd(q, k, v, out, slopes, 0.0, scale, True, 5, 0, 0.0, False, None)
    assert len(got) == 4 and got[0] is out
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=0)
    torch.testing.assert_close(got[1], want_lse, rtol=0, atol=0)
    dq = torch.full_like(q, float("nan"))
    dq_, dk, dv, softmax_d = gpu.bwd(dout, q, k, v, out, got[1], dq, None, None, slopes, 0.0, scale, True, 5, 0, 0.0,
                                     False, None, got[3])
    assert dq_ is dq and softmax_d.shape == (2, 2, 128)
    for g, ref in zip((dq, dk, dv), grads):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12)
    # varlen: the batch as two sequences of 9 queries and 11 keys
    cu_q, cu_k = torch.tensor([0, 9, 18], dtype=torch.int32), torch.tensor([0, 11, 22], dtype=torch.int32)
    qv, kv, vv, dv_out = (x.flatten(0, 1) for x in (q, k, v, dout))
    res = gpu.varlen_fwd(qv, kv, vv, None, cu_q, cu_k, None, None, None, slopes, 9, 11, 0.0, scale, False, True, 5, 0,
                         0.0, False, None, 0)
    torch.testing.assert_close(res[0], want.detach().flatten(0, 1), rtol=0, atol=0)
    dqv, dkv, dvv, _ = gpu.varlen_bwd(dv_out, qv, kv, vv, res[0], res[1], None, None, None, cu_q, cu_k, slopes, 9, 11,
                                      0.0, scale, False, True, 5, 0, 0.0, False, None, None)
    for g, ref in zip((dqv, dkv, dvv), grads):
        torch.testing.assert_close(g, ref.flatten(0, 1), rtol=1e-10, atol=1e-12)
    # the KV cache: k/v appended in place, [out, softmax_lse]
    kc, vc = torch.zeros(2, 16, 1, D, dtype=torch.float64), torch.zeros(2, 16, 1, D, dtype=torch.float64)
    kc2, vc2 = kc.clone(), vc.clone()
    lens = torch.tensor([0, 3], dtype=torch.int32)
    out_kv, lse_kv = gpu.fwd_kvcache(q[:, :2], kc, vc, k[:, :4], v[:, :4], lens, None, None, None, None, None, slopes,
                                     None, scale, True, -1, -1, 0.0, True, 0)
    want_kv, want_lse_kv = fai.flash_attn_with_kvcache(q[:, :2], kc2, vc2, k[:, :4], v[:, :4], cache_seqlens=lens,
                                                       softmax_scale=scale, causal=True, alibi_slopes=slopes,
                                                       return_softmax_lse=True)
    torch.testing.assert_close(out_kv, want_kv, rtol=0, atol=0)
    torch.testing.assert_close(lse_kv, want_lse_kv, rtol=0, atol=0)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and kc[1, 3:7].abs().sum() > 0
    # causal (flash-attn's causal kernel): the shifted LSE goes from fwd into bwd
    ref_q, ref_k, ref_v = (x.clone().requires_grad_() for x in (q, k, v))
    ref = flashcore.flash_attn_func(ref_q, ref_k, ref_v, 0.0, scale, True, alibi_slopes=slopes)
    grads = torch.autograd.grad(ref, (ref_q, ref_k, ref_v), dout)
    o, lse, _, rng = gpu.fwd(q, k, v, None, slopes, 0.0, scale, True, -1, -1, 0.0, False, None)
    for g, want in zip(gpu.bwd(dout, q, k, v, o, lse, None, None, None, slopes, 0.0, scale, True, -1, -1, 0.0, False,
                               None, rng)[:3], grads):
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
    for call in (lambda: gpu.fwd(q, k, v, None, None, 0.0, scale, True, -1, -1, 0.0, False, torch.empty(1)),
                 lambda: gpu.bwd(dout, q, k, v, out, got[1], None, None, None, None, 0.0, scale, True, -1, -1, 0.0,
                                 False, torch.empty(1), None)):
        with pytest.raises(RuntimeError, match="generator` argument is no longer supported"):
            call()


def test_window_and_float_arguments():
    """A window side past any length is unbounded (not an overflow of the kernels' 64-bit diagonals); fractional
    windows, non-numeric or float32-overflowing softcap and scale raise, naming the argument. Sides below -1 raise
    in flashcore's own API; the flash-attn interface takes any negative side as unbounded and a softcap <= 0 as
    off, as flash-attn's C++ does."""
    q, k, v = _inputs(1, 5, 7, H=2, Hk=2)
    qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v))
    want = flashcore.attention(qb, kb, vb)
    for big in (2**63 - 1, 2**40):
        torch.testing.assert_close(flashcore.attention(qb, kb, vb, window_size=(-1, big)), want, rtol=1e-12,
                                   atol=1e-12)
        torch.testing.assert_close(flashcore.flash_attn_func(q, k, v, window_size=(big, big)), want.transpose(1, 2),
                                   rtol=1e-12, atol=1e-12)
    cu_q = torch.tensor([0, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 7], dtype=torch.int32)
    got = flashcore.varlen_attention(q[0], k[0], v[0], cu_q, cu_k, 5, 7, window_size=(2**63 - 1, 2**63 - 1))
    torch.testing.assert_close(got, want.transpose(1, 2)[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="window_size must be a pair"):
        flashcore.attention(qb, kb, vb, window_size=(1.7, 1))
    for window, unbounded in (((-5, 3), (-1, 3)), ((3, -7), (3, -1)), ((-2, -2), (-1, -1))):
        with pytest.raises(RuntimeError, match="window_left" if window[0] < -1 else "window_right"):
            flashcore.attention(qb, kb, vb, window_size=window)
        torch.testing.assert_close(flashcore.flash_attn_func(q, k, v, window_size=window),
                                   flashcore.flash_attn_func(q, k, v, window_size=unbounded), rtol=0, atol=0)
        torch.testing.assert_close(
            flashcore.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 5, 7, window_size=window),
            flashcore.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 5, 7, window_size=unbounded), rtol=0, atol=0)
    for cap in (-1.0, -float("inf"), 0):
        torch.testing.assert_close(flashcore.flash_attn_func(q, k, v, softcap=cap), want.transpose(1, 2), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="softcap"):
        flashcore.flash_attn_func(q, k, v, softcap=float("nan"))
    with pytest.raises(TypeError, match="softcap"):
        flashcore.attention(qb, kb, vb, softcap="x")
    with pytest.raises(ValueError, match="softcap"):
        flashcore.attention(qb, kb, vb, softcap=1e39)
    with pytest.raises(ValueError, match="softcap"):
        flashcore.flash_attn_func(q, k, v, softcap=1e39)
    with pytest.raises(TypeError, match="scale"):
        flashcore.attention(qb, kb, vb, scale="x")
    torch.testing.assert_close(flashcore.attention(qb, kb, vb, softcap=None), want, rtol=0, atol=0)


def test_function_classes_apply_as_flash_attn():
    """flash-attn's autograd Function classes, called as FlashAttnFunc.apply(...) with flash-attn 2.8's positional
    arguments: the same outputs and gradients as the functions; is_grad_enabled=False records no graph."""
    q, k, v = (t.requires_grad_() for t in _inputs(2, 9, 11, H=2, Hk=2))
    args = (0.0, None, True, (-1, -1), 0.0, None, False)
    out = fai.FlashAttnFunc.apply(q, k, v, *args, False, True)
    want = flashcore.flash_attn_func(q, k, v, *args, False)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    g1 = torch.autograd.grad(out.sum(), (q, k, v))
    g2 = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not fai.FlashAttnFunc.apply(q, k, v, *args, False, False).requires_grad
    out, lse, probs = fai.FlashAttnFunc.apply(q, k, v, *args, True, True)
    assert lse.shape == (2, 2, 9) and probs.shape == (0,)

    qkv = torch.stack(_inputs(2, 7, 7, H=2, Hk=2), dim=2).requires_grad_()
    out = fai.FlashAttnQKVPackedFunc.apply(qkv, *args, False, True)
    torch.testing.assert_close(out, flashcore.flash_attn_qkvpacked_func(qkv, *args), rtol=0, atol=0)
    kv = torch.stack((k, v), dim=2)
    out = fai.FlashAttnKVPackedFunc.apply(q, kv, *args, False, True)
    torch.testing.assert_close(out, flashcore.flash_attn_kvpacked_func(q, kv, *args), rtol=0, atol=0)

    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    qv, kv_, vv = (t.reshape(-1, *t.shape[2:])[:9] for t in _inputs(1, 9, 9, H=2, Hk=2))
    out = fai.FlashAttnVarlenFunc.apply(qv, kv_, vv, cu, cu, 5, 5, *args, False, None, True)
    torch.testing.assert_close(out, flashcore.flash_attn_varlen_func(qv, kv_, vv, cu, cu, 5, 5, *args), rtol=0,
                               atol=0)
    packed = torch.stack((qv, kv_, vv), dim=1)
    out = fai.FlashAttnVarlenQKVPackedFunc.apply(packed, cu, 5, *args, False, True)
    torch.testing.assert_close(out, flashcore.flash_attn_varlen_qkvpacked_func(packed, cu, 5, *args), rtol=0, atol=0)
    kvp = torch.stack((kv_, vv), dim=1)
    out = fai.FlashAttnVarlenKVPackedFunc.apply(qv, kvp, cu, cu, 5, 5, *args, False, True)
    torch.testing.assert_close(out, flashcore.flash_attn_varlen_kvpacked_func(qv, kvp, cu, cu, 5, 5, *args), rtol=0,
                               atol=0)


def test_kvcache_is_outside_autograd():
    """flash_attn_with_kvcache as flash-attn's (a plain kernel call): its output carries no autograd history even
    when q, k or v require grad, the appended cache does not join the graph (no history that grows a decode step at
    a time), and a cache that itself requires grad can be appended to."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(D, D, generator=g, dtype=torch.float64, requires_grad=True)
    k_cache = torch.zeros(1, 16, 2, D, dtype=torch.float64)
    v_cache = torch.zeros(1, 16, 2, D, dtype=torch.float64, requires_grad=True)
    for t in range(3):
        x = torch.randn(1, 1, 2, D, generator=g, dtype=torch.float64)
        out = flashcore.flash_attn_with_kvcache(x @ w, k_cache, v_cache, x @ w, x @ w, cache_seqlens=t)
        assert not out.requires_grad and out.grad_fn is None
        assert k_cache.grad_fn is None and not k_cache.requires_grad and v_cache.grad_fn is None
    assert torch.count_nonzero(k_cache[0, :3]) > 0 and torch.count_nonzero(k_cache[0, 3:]) == 0


def test_kvcache_window_and_softcap_as_flash_attn():
    """flash_attn_with_kvcache takes a negative window side as unbounded and a softcap <= 0 as off, as flash-attn's
    mha_fwd_kvcache does; a NaN softcap raises, naming it."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 4, D, generator=g, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(2, 20, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
    lens = torch.tensor([9, 20], dtype=torch.int32)
    call = lambda **kw: flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, **kw)
    torch.testing.assert_close(call(window_size=(-3, -2)), call(), rtol=0, atol=0)
    torch.testing.assert_close(call(window_size=(4, -9), causal=True), call(window_size=(4, -1), causal=True),
                               rtol=0, atol=0)
    torch.testing.assert_close(call(softcap=-2.0), call(softcap=0.0), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="softcap"):
        call(softcap=float("nan"))


def test_paged_varlen_backward_raises():
    """flash_attn_varlen_func with a block_table (paged prefill) has no backward: with inputs that require grad the
    forward runs and a backward through it raises NotImplementedError naming block_table (flash-attn's varlen
    backward rejects it as well), instead of a silent None gradient."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, 2, D, generator=g, dtype=torch.float64, requires_grad=True)
    pages = torch.randn(3, 16, 1, D, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32)
    table = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
    out = flashcore.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 3, 20, causal=True, block_table=table)
    with torch.no_grad():
        ref = flashcore.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 3, 20, causal=True, block_table=table)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="block_table"):
        out.sum().backward()


def test_paged_varlen_forward_refuses_key_splits():
    """flash-attn's _flash_attn_varlen_forward refuses num_splits > 1 with a block_table (its paged varlen kernel
    has no key splits); 0 and 1 run."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(5, 2, D, generator=g)
    pages = torch.randn(3, 16, 2, D, generator=g)
    bt = torch.tensor([[2, 0]], dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="num_splits"):
        fai._flash_attn_varlen_forward(q, pages, pages, cu_q, cu_k, 5, 20, 0.0, None, False, block_table=bt,
                                       num_splits=2)
    outs = [fai._flash_attn_varlen_forward(q, pages, pages, cu_q, cu_k, 5, 20, 0.0, None, False, block_table=bt,
                                           num_splits=n)[0] for n in (0, 1)]
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0]).all()


def test_kvcache_int_lengths_that_do_not_fit_raise_runtime_error():
    """New tokens past the capacity at an int cache_seqlens raise an error that is a ValueError and, as flash-attn's
    check, a RuntimeError naming block_table for a paged cache."""
    g = torch.Generator().manual_seed(6)
    pages = torch.randn(4, 16, 1, D, generator=g)
    q, new = torch.randn(1, 1, 1, D, generator=g), torch.randn(1, 1, 1, D, generator=g)
    bt = torch.tensor([[3, 1]], dtype=torch.int32)
    for err in (RuntimeError, ValueError):
        with pytest.raises(err, match="block_table"):
            fai.flash_attn_with_kvcache(q, pages.clone(), pages.clone(), new, new, cache_seqlens=32, block_table=bt)
    out = fai.flash_attn_with_kvcache(q, pages.clone(), pages.clone(), new, new, cache_seqlens=31, block_table=bt)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_paged_varlen_lengths_past_the_pages_name_the_argument():
    """On the CPU (no sync to pay) a paged varlen call whose key lengths exceed what block_table addresses is refused
    naming cu_seqlens_k (or seqused_k) and block_table."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(5, 2, D, generator=g)
    pages = torch.randn(4, 16, 2, D, generator=g)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    cu_q = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_k.*block_table"):
        fai.flash_attn_varlen_func(q, pages, pages, cu_q, torch.tensor([0, 40], dtype=torch.int32), 5, 40,
                                   block_table=bt)
    with pytest.raises(RuntimeError, match=r"seqused_k.*block_table"):
        fai._flash_attn_varlen_forward(q, pages, pages, cu_q, torch.tensor([0, 32], dtype=torch.int32), 5, 32, 0.0,
                                       None, False, block_table=bt, seqused_k=torch.tensor([33], dtype=torch.int32))
    out = fai.flash_attn_varlen_func(q, pages, pages, cu_q, torch.tensor([0, 32], dtype=torch.int32), 5, 32,
                                     block_table=bt)
    assert torch.isfinite(out).all()


def test_flash_attn_alias_runs_flash_attn_imports():
    """install_flash_attn_alias(): code importing flash_attn (the package, its interface, bert_padding,
    layers.rotary and ops.triton.rotary, the extension flash_attn_2_cuda) runs on flashcore unchanged; idempotent; a flash_attn imported before is refused. In a
    subprocess, so the alias does not leak into the other tests."""
    import subprocess
    import sys
    code = r'''
import sys, types, torch, flashcore
fa = flashcore.install_flash_attn_alias()
assert flashcore.install_flash_attn_alias() is fa
import importlib.util
import flash_attn
assert importlib.util.find_spec("flash_attn") is not None  # availability checks answer instead of raising
assert importlib.util.find_spec("flash_attn.layers") is not None
from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn.flash_attn_interface import _flash_attn_forward
from flash_attn.bert_padding import unpad_input, pad_input, IndexFirstAxisResidual, index_first_axis_residual
from flash_attn.layers.rotary import apply_rotary_emb, RotaryEmbedding, ApplyRotaryEmb, ApplyRotaryEmbQKV_
from flash_attn.ops.triton.rotary import apply_rotary
import flash_attn_2_cuda
from flash_attn.flash_attn_interface import flash_attn_gpu, _get_block_size_n, USE_TRITON_ROCM
assert flash_attn_gpu is flash_attn_2_cuda and not USE_TRITON_ROCM
import importlib.metadata
assert importlib.metadata.version("flash_attn") == importlib.metadata.version("flash-attn") == flash_attn.__version__
assert "flash-attn" in importlib.metadata.packages_distributions()["flash_attn"]
assert importlib.util.find_spec("flash_attn.ops.triton.rotary") is not None
assert apply_rotary is flashcore.layers.rotary.apply_rotary
major_minor = tuple(int(x) for x in flash_attn.__version__.split("+")[0].split(".")[:2])
assert major_minor >= (2, 8) and flash_attn_func is flashcore.flash_attn_func
q, k, v = (torch.randn(2, 5, 4, 16, dtype=torch.float64) for _ in range(3))
out = flash_attn_func(q, k, v, causal=True)
want = flashcore.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
torch.testing.assert_close(out, want, rtol=0, atol=0)
del sys.modules["flash_attn"]
sys.modules["flash_attn"] = types.ModuleType("flash_attn")
try:
    flashcore.install_flash_attn_alias()
    raise SystemExit("a foreign flash_attn was replaced")
except RuntimeError as e:
    assert "already imported" in str(e)
print("ok")
'''
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
