"""KV-cache attention: flashcore.flash_attn_interface.flash_attn_with_kvcache (flash-attn 2.x's function) and the op
under it, torch.ops.flashcore.kvcache_fwd. Each batch entry's output must equal attention over that entry's keys
alone, gathered from the cache after the append by independent code (a Python loop over positions and pages), by
the suite's one rule (float64 reference, PyTorch's own low-precision answer as the yardstick), out and lse. The
caches after the append must equal an independent append (dropped writes included) exactly; rotated keys within
a rounding of the float64 rotation. Covers dense and paged caches, cache_batch_idx, cache_leftpad, decode and
chunked prefill, GQA/MQA/MHA, rotary embeddings in both forms (flash-attn's position rule), every variant, mixed
cache lengths (0 and full), tokens past the capacity, errors naming the argument, opcheck, torch.compile and CUDA
graphs."""

import inspect
import math

import pytest
import torch

import flashcore

from conftest import (UNIT_ROUNDOFF, capture_graph, check_close, cuda_skip_reason, lowp_attention, lowp_lse,
                      make_generator, packed_varlen_grid, reference_attention)
from flashcore.flash_attn_interface import _append, _append_slots, flash_attn_with_kvcache

requires_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")

FULL = 10**9  # in a list of cache lengths, FULL - n stands for the capacity minus n (paged capacities vary)


# ---------------------------------------------------------------------------------------------------------------
# Cases and the independent reference
# ---------------------------------------------------------------------------------------------------------------


def make_case(request, device, dtype, *, B, Sq, Hq, Hkv, D, capacity, lens, Sn=0, page_size=None, leftpad=None,
              batch_idx=False, rotary=None, rotary_dim=None, int_lens=False, causal=False, window=(-1, -1),
              softcap=0.0, sinks=False, alibi=None, num_splits=0, seqlen_ro=None):
    """Inputs of one call as (args, kwargs) of flash_attn_with_kvcache. lens: the cache lengths before the append
    (a list, FULL - n meaning capacity - n; an int with int_lens; None: none); leftpad: a list; rotary:
    "interleaved" or "neox" (rotary_dim dims, default D rounded down to even); alibi: "head" or "batch". A paged
    cache's pages are scattered over a pool larger than the batch needs (block_table a random permutation); a dense
    one with batch_idx has extra rows, entries mapped to a random permutation of them."""
    g = make_generator(request, device)
    gcpu = make_generator(request)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    scale_qk = 3.0 if softcap else 1.0
    q = rnd(B, Sq, Hq, D, scale=scale_qk)
    kw = dict(causal=causal, window_size=window, softcap=softcap, num_splits=num_splits, return_softmax_lse=True)
    if page_size:
        max_pages = -(-capacity // page_size)
        num_pages = B * max_pages + 5
        k_cache, v_cache = rnd(num_pages, page_size, Hkv, D, scale=scale_qk), rnd(num_pages, page_size, Hkv, D)
        perm = torch.randperm(num_pages, generator=gcpu)[: B * max_pages].view(B, max_pages)
        kw["block_table"] = perm.to(torch.int32).to(device)
    else:
        rows = B + 3 if batch_idx else B
        k_cache, v_cache = rnd(rows, capacity, Hkv, D, scale=scale_qk), rnd(rows, capacity, Hkv, D)
        if batch_idx:
            kw["cache_batch_idx"] = torch.randperm(rows, generator=gcpu)[:B].to(torch.int32).to(device)
    cap = k_cache.size(1) * kw["block_table"].size(1) if page_size else capacity
    if lens is not None and not int_lens:
        lens = [cap - (FULL - x) if x >= FULL // 2 else x for x in lens]
        kw["cache_seqlens"] = torch.tensor(lens, dtype=torch.int32, device=device)
    elif lens is not None:
        kw["cache_seqlens"] = lens
    if leftpad is not None:
        kw["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=device)
    if Sn:
        kw["k"], kw["v"] = rnd(B, Sn, Hkv, D, scale=scale_qk), rnd(B, Sn, Hkv, D)
    if rotary:
        rd = rotary_dim if rotary_dim is not None else D // 2 * 2
        angle = torch.rand(seqlen_ro or cap, rd // 2, generator=g, device=device) * 2 * math.pi
        kw["rotary_cos"], kw["rotary_sin"] = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
        kw["rotary_interleaved"] = rotary == "interleaved"
    if sinks:
        kw["sinks"] = torch.randn(Hq, generator=g, device=device) * 2
    if alibi:
        kw["alibi_slopes"] = torch.rand((Hq,) if alibi == "head" else (B, Hq), generator=g, device=device) * 0.3
    return (q, k_cache, v_cache), kw


def capacity_of(k_cache, kw):
    bt = kw.get("block_table")
    return k_cache.size(1) * bt.size(1) if bt is not None else k_cache.size(1)


def entry_slots(k_cache, kw, b):
    """(cache index, position) of every position of entry b's sequence: a Python list (independent of the append)."""
    bt, idx = kw.get("block_table"), kw.get("cache_batch_idx")
    if bt is not None:
        ps, pages = k_cache.size(1), bt[b].tolist()
        return [(pages[p // ps], p % ps) for p in range(capacity_of(k_cache, kw))]
    row = b if idx is None else int(idx[b])
    return [(row, p) for p in range(k_cache.size(1))]


def lens_list(kw, B, k_cache):
    lens = kw.get("cache_seqlens")
    if lens is None:
        return [capacity_of(k_cache, kw)] * B
    return [lens] * B if isinstance(lens, int) else [int(x) for x in lens]


def reference_rotary(x, cos, sin, positions, interleaved):
    """float64 rotation as a complex product (x0 + i x1) * (cos + i sin) per pair, rounded to x's dtype: pairs
    (x[2j], x[2j+1]) interleaved (GPT-J), (x[j], x[j + rotary_dim/2]) otherwise (GPT-NeoX). positions (B, S)."""
    half = cos.size(1)
    xd = x.double()
    r = xd[..., : 2 * half]
    pairs = r.unflatten(-1, (half, 2)) if interleaved else torch.stack((r[..., :half], r[..., half:]), -1)
    w = torch.complex(cos.double()[positions], sin.double()[positions])[:, :, None, :]  # (B, S, 1, half)
    z = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * w)
    rot = z.flatten(-2) if interleaved else torch.cat((z[..., 0], z[..., 1]), -1)
    return torch.cat((rot, xd[..., 2 * half:]), -1).to(x.dtype)


def expected(inputs, kw):
    """The reference of one call: the caches after an independent append, the mask of the slots it wrote, and per
    entry the float64 attention (out, lse) and PyTorch's own low-precision answer, packed like flashcore's output."""
    q, k_cache, v_cache = inputs
    B, Sq, Hq, D = q.shape
    cap = capacity_of(k_cache, kw)
    lens = lens_list(kw, B, k_cache)
    k_new, v_new = kw.get("k"), kw.get("v")
    Sn = 0 if k_new is None else k_new.size(1)
    causal = kw["causal"]
    left, right = (int(x) for x in kw["window_size"])
    right = 0 if causal else right
    left, right = (-1 if left >= cap else left), (-1 if right >= cap else right)  # flash-attn's mha_fwd_kvcache
    if kw.get("rotary_cos") is not None:
        cos, sin, inter = kw["rotary_cos"], kw["rotary_sin"], kw["rotary_interleaved"]
        last = cos.size(0) - 1
        local = causal or left >= 0 or right >= 0
        pos_q = torch.tensor([[min(max(lens[b] + (i if local else 0), 0), last) for i in range(Sq)] for b in range(B)])
        pos_k = torch.tensor([[min(max(lens[b] + i, 0), last) for i in range(Sn)] for b in range(B)])
        q = reference_rotary(q, cos, sin, pos_q.to(q.device), inter)
        k_new = reference_rotary(k_new, cos, sin, pos_k.to(q.device), inter)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    for b in range(B):
        slots = entry_slots(k_cache, kw, b)
        for i in range(Sn):
            p = lens[b] + i
            if 0 <= p < cap:  # else dropped: past the capacity
                k_ref[slots[p]] = k_new[b, i]
                v_ref[slots[p]] = v_new[b, i]
                written[slots[p]] = True
    pad = kw.get("cache_leftpad")
    ref_out, ref_lse, low_out, low_lse = [], [], [], []
    for b in range(B):
        hi = min(lens[b] + Sn, cap)
        lo = 0 if pad is None else int(pad[b])
        slots = torch.tensor(entry_slots(k_ref, kw, b)[lo:hi], dtype=torch.long).view(-1, 2).to(k_ref.device)
        keys, vals = k_ref[slots[:, 0], slots[:, 1]], v_ref[slots[:, 0], slots[:, 1]]
        qb, kb, vb = q[b].transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None]
        alibi = kw.get("alibi_slopes")
        mask = dict(causal=causal, causal_offset=kb.size(2) - Sq, window=(left, right), softcap=kw["softcap"],
                    sinks=kw.get("sinks"),
                    alibi=None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b:b + 1]))
        o, l = reference_attention(qb, kb, vb, **mask)
        # flash-attn's causal kernel adds slope * j instead of -slope * |i + Sk - Sq - j|: its LSE is larger by
        # slope * (i + Sk - Sq) (flash_attn_interface._shift_alibi_lse); not with sinks, which flash-attn lacks
        shift = 0.0
        if alibi is not None and kw.get("sinks") is None and left < 0 and right == 0:
            slopes = (alibi if alibi.dim() == 1 else alibi[b]).double()
            shift = slopes[:, None] * (torch.arange(Sq, device=q.device) + kb.size(2) - Sq).double()
        ref_out.append(o[0].transpose(0, 1))
        ref_lse.append(l[0] + shift)
        low_out.append(lowp_attention(qb, kb, vb, **mask)[0].transpose(0, 1))
        low_lse.append((l[0] if q.dtype == torch.float64 else lowp_lse(qb, kb, **mask)[0]) + shift)
    return dict(k_cache=k_ref, v_cache=v_ref, written=written, out=torch.stack(ref_out), lse=torch.stack(ref_lse),
                low_out=torch.stack(low_out), low_lse=torch.stack(low_lse))


def check_caches(k_cache, v_cache, want, rotary):
    """v exactly; k exactly too, except rotated keys (flashcore rotates in float32): within two roundings."""
    assert torch.equal(v_cache, want["v_cache"]), "v_cache after the append differs from the reference append"
    if not rotary:
        assert torch.equal(k_cache, want["k_cache"]), "k_cache after the append differs from the reference append"
        return
    w = want["written"]
    assert torch.equal(k_cache[~w], want["k_cache"][~w]), "the append changed k_cache slots it must not write"
    if not w.any():  # every new token fell past the capacity
        return
    got, ref = k_cache[w].double(), want["k_cache"][w].double()
    u = UNIT_ROUNDOFF[k_cache.dtype] if k_cache.dtype != torch.float64 else UNIT_ROUNDOFF[torch.float32]
    torch.testing.assert_close(got, ref, rtol=2 * u, atol=8 * u * ref.abs().max().item())


def run_case(inputs, kw, check_cache=True, layout=None):
    """flash_attn_with_kvcache on copies of the caches, checked against expected(): out, lse, the caches, and that
    the caller's cache_seqlens is unchanged. layout: the copies' memory layout (cache_layout), else contiguous."""
    q, k_cache, v_cache = inputs
    want = expected(inputs, kw)
    kc, vc = (k_cache.clone(), v_cache.clone()) if layout is None else (cache_layout(k_cache, layout),
                                                                        cache_layout(v_cache, layout))
    lens = kw.get("cache_seqlens")
    lens_before = lens.clone() if isinstance(lens, torch.Tensor) else lens
    out, lse = flash_attn_with_kvcache(q, kc, vc, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    assert lse.shape == (q.size(0), q.size(2), q.size(1)) and lse.dtype == lse_dtype
    check_close("out", out, want["out"], want["low_out"])
    check_close("lse", lse, want["lse"], want["low_lse"], dtype=lse_dtype)
    if isinstance(lens, torch.Tensor):
        assert torch.equal(lens, lens_before), "cache_seqlens was modified"
    if check_cache:
        check_caches(kc, vc, want, kw.get("rotary_cos") is not None)
    return out, lse, kc, vc, want


def cache_layout(cache, layout):
    """A copy of a dense (B, capacity, Hkv, D) cache in another memory layout: "heads_first" ((B, Hkv, capacity, D)
    memory, as transformers keeps its caches), "padded" (a slice of a longer capacity: a batch stride of more than
    capacity rows; the slots past the slice hold NaN, which no read may reach)."""
    B, cap, H, D = cache.shape
    if layout == "heads_first":
        return cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert layout == "padded", layout
    wide = torch.full((B, cap + 37, H, D), float("nan"), dtype=cache.dtype, device=cache.device)
    wide[:, :cap] = cache
    return wide[:, :cap]


# ---------------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------------

CAP = 40  # dense capacity; paged: 5 pages of 8
CPU_CASES = {
    # decode against a filled cache (no append): empty, partial and full entries
    "dense_decode": dict(B=3, Sq=1, Hq=4, Hkv=2, lens=[0, 17, CAP]),
    "paged_decode_mqa": dict(B=3, Sq=1, Hq=4, Hkv=1, lens=[CAP, 0, 9], page_size=8),
    "none_lens_mha": dict(B=2, Sq=3, Hq=2, Hkv=2, lens=None),
    # decode with the append of one token
    "dense_append_decode": dict(B=3, Sq=1, Sn=1, Hq=4, Hkv=2, lens=[0, 17, CAP - 1], causal=True),
    "paged_append_decode": dict(B=3, Sq=1, Sn=1, Hq=4, Hkv=2, lens=[7, 0, 31], page_size=8, causal=True),
    # chunked prefill: Sq = Sn new tokens, causal; a chunk crossing pages
    "paged_prefill": dict(B=3, Sq=6, Sn=6, Hq=4, Hkv=2, lens=[0, 5, 34], page_size=8, causal=True),
    "dense_prefill_int_lens": dict(B=2, Sq=5, Sn=5, Hq=4, Hkv=2, lens=12, int_lens=True, causal=True),
    "dense_queries_more_than_new": dict(B=3, Sq=5, Sn=2, Hq=4, Hkv=2, lens=[3, 0, 20], causal=True),
    # rotary, both forms; q positions per token (causal, local) or all at cache_seqlens (neither)
    "rotary_neox_causal": dict(B=3, Sq=4, Sn=4, Hq=4, Hkv=2, lens=[0, 9, 30], page_size=8, causal=True,
                               rotary="neox"),
    "rotary_interleaved_noncausal": dict(B=3, Sq=3, Sn=2, Hq=4, Hkv=2, lens=[1, 20, 38], rotary="interleaved"),
    "rotary_partial_local": dict(B=2, Sq=3, Sn=3, Hq=4, Hkv=2, lens=[5, 22], rotary="neox", rotary_dim=8,
                                 window=(6, 1)),
    # a window as long as the cache is unbounded in flash-attn: not local, so q rotates at cache_seqlens
    "rotary_window_as_long_as_cache": dict(B=2, Sq=3, Sn=1, Hq=2, Hkv=1, lens=[4, 30], rotary="interleaved",
                                           window=(CAP, -1)),
    "rotary_right_window_as_long_as_cache": dict(B=2, Sq=3, Sn=2, Hq=2, Hkv=1, lens=[4, 30], rotary="neox",
                                                 window=(-1, CAP + 5)),
    "rotary_longer_table": dict(B=2, Sq=2, Sn=2, Hq=2, Hkv=2, lens=[3, 11], rotary="neox", seqlen_ro=3 * CAP,
                                causal=True),
    # cache rows and left padding (positions and rotary are absolute: leftpad does not shift them)
    "batch_idx_leftpad": dict(B=3, Sq=2, Sn=2, Hq=4, Hkv=2, lens=[10, 3, 25], leftpad=[4, 3, 0], batch_idx=True,
                              causal=True, rotary="interleaved"),
    "paged_leftpad_alibi": dict(B=3, Sq=3, Sn=1, Hq=4, Hkv=2, lens=[19, 2, 30], leftpad=[9, 0, 17], page_size=8,
                                alibi="batch", causal=True),
    # variants
    "softcap_sinks": dict(B=3, Sq=4, Sn=2, Hq=4, Hkv=2, lens=[0, 13, 30], softcap=8.0, sinks=True, causal=True),
    "window_alibi_head": dict(B=2, Sq=5, Sn=3, Hq=4, Hkv=2, lens=[6, 25], window=(7, 2), alibi="head"),
    "all_variants": dict(B=3, Sq=3, Sn=3, Hq=4, Hkv=1, lens=[2, 16, 33], page_size=8, window=(9, -1), causal=True,
                         softcap=10.0, sinks=True, alibi="batch", rotary="neox", num_splits=3),
    # tokens past the capacity: dropped, never written; the attention sees the capacity's keys
    "overflow_dense": dict(B=4, Sq=4, Sn=4, Hq=4, Hkv=2, lens=[CAP - 2, CAP, CAP - 4, 0], causal=True),
    "overflow_paged_rotary": dict(B=3, Sq=3, Sn=3, Hq=4, Hkv=2, lens=[CAP - 1, CAP, 5], page_size=8, causal=True,
                                  rotary="interleaved"),
    # and before position 0 (a negative length: the tokens at negative positions are dropped)
    "overflow_negative_lens": dict(B=2, Sq=3, Sn=3, Hq=4, Hkv=2, lens=[-2, 6], causal=True),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_kvcache_cpu(request, case, dtype):
    c = dict(CPU_CASES[case])
    inputs, kw = make_case(request, "cpu", dtype, D=20, capacity=CAP, **c)
    out, lse, kc, vc, want = run_case(inputs, kw)
    if c.get("Sn"):
        assert want["written"].any(), "the case appends nothing"
    if case.startswith("overflow"):  # some tokens were dropped: fewer slots written than tokens given
        assert want["written"].sum().item() < c["B"] * c["Sn"]


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_invalid_indices_are_not_written_cpu(request, paged):
    """The CPU call refuses an out-of-range page (or cache row) before it writes anything; the append a GPU call
    runs (which reads no index on the host) writes such a token nowhere, in particular not to the page or row the
    index is clamped to."""
    inputs, kw = make_case(request, "cpu", torch.float32, B=3, Sq=2, Sn=2, Hq=2, Hkv=1, D=8, capacity=CAP,
                           lens=[7, 3, 15], page_size=8 if paged else None, batch_idx=not paged, causal=True)
    q, kc, vc = inputs
    if paged:  # entry 0 writes positions 7 and 8: page slots 0 and 1; entry 2 writes positions 15, 16: slots 1, 2
        kw["block_table"][0, 0], kw["block_table"][2, 2] = -1, 10**6
        dropped = [(0, [0]), (2, [1])]
    else:
        kw["cache_batch_idx"][1] = kc.size(0) + 3
        dropped = [(1, [0, 1])]
    kc2, vc2 = kc.clone(), vc.clone()
    with pytest.raises(RuntimeError, match="block_table|cache_batch_idx"):
        flash_attn_with_kvcache(q, kc2, vc2, **kw)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    capacity = kw["block_table"].size(1) * kc.size(1) if paged else kc.size(1)
    slots = _append_slots(kw["cache_seqlens"], 2, capacity, kc2, kw.get("block_table"), kw.get("cache_batch_idx"))
    _append(kc2, kw["k"], *slots)
    _append(vc2, kw["v"], *slots)
    want_k, want_v = kc.clone(), vc.clone()
    for b in range(3):
        skip = dict(dropped).get(b, [])
        for i in range(2):
            if i in skip:
                continue
            p = int(kw["cache_seqlens"][b]) + i
            slot = entry_slots(kc, kw, b)[p]
            want_k[slot], want_v[slot] = kw["k"][b, i], kw["v"][b, i]
    assert not torch.equal(want_k, kc)
    assert torch.equal(kc2, want_k) and torch.equal(vc2, want_v)


def test_kvcache_rotary_positions_differ_cpu(request):
    """The q rotary rule matters: the same call with the positions of the other rule gives a different output (the
    test above can tell the two apart), and causal rotates q per token."""
    inputs, kw = make_case(request, "cpu", torch.float64, B=2, Sq=3, Sn=1, Hq=2, Hkv=1, D=16, capacity=CAP,
                           lens=[4, 30], rotary="neox")
    out_noncausal = expected(inputs, kw)["out"]
    kw_local = dict(kw, window_size=(CAP - 1, -1))  # local now: q tokens at cache_seqlens + i
    out_local = expected(inputs, kw_local)["out"]
    assert not torch.allclose(out_noncausal, out_local)
    run_case(inputs, kw_local)


def test_kvcache_matches_dense_attention_cpu(request):
    """A full dense cache without append is flash_attn_func on the cache itself (bottom-right causal)."""
    from flashcore.flash_attn_interface import flash_attn_func

    inputs, kw = make_case(request, "cpu", torch.float32, B=2, Sq=7, Hq=4, Hkv=2, D=32, capacity=CAP, lens=[CAP, CAP],
                           causal=True)
    q, kc, vc = inputs
    out = flash_attn_with_kvcache(q, kc, vc, causal=True)
    torch.testing.assert_close(out, flash_attn_func(q, kc, vc, causal=True), rtol=0, atol=0)


def test_kvcache_empty_new_tokens_cpu(request):
    """k/v with seqlen_new = 0 append nothing: the same as no k/v."""
    inputs, kw = make_case(request, "cpu", torch.float32, B=2, Sq=2, Hq=2, Hkv=2, D=16, capacity=CAP, lens=[3, 9],
                           causal=True)
    q, kc, vc = inputs
    e = kc.new_zeros(2, 0, 2, 16)
    kc2, vc2 = kc.clone(), vc.clone()
    a = flash_attn_with_kvcache(q, kc2, vc2, e, e, **kw)
    b = flash_attn_with_kvcache(q, kc, vc, **kw)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    run_case(inputs, dict(kw, k=e, v=e))


def test_kvcache_signature():
    """flash-attn 2.x's positional order and defaults; sinks keyword-only; out alone by default."""
    sig = inspect.signature(flash_attn_with_kvcache)
    assert list(sig.parameters) == [
        "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
        "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size", "softcap", "rotary_interleaved",
        "alibi_slopes", "num_splits", "return_softmax_lse", "sinks"]
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    assert defaults == dict(k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                            num_splits=0, return_softmax_lse=False, sinks=None)
    assert sig.parameters["sinks"].kind is inspect.Parameter.KEYWORD_ONLY
    import flashcore.flash_attn_interface as fai

    assert "flash_attn_with_kvcache" in fai.__all__
    q, c = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 2, 8)
    out = flash_attn_with_kvcache(q, c, c, cache_seqlens=3)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    # positional flash-attn call: softmax_scale, causal, window_size as a tensor
    out2 = flash_attn_with_kvcache(q, c, c, None, None, None, None, 3, None, None, None, 0.5, True,
                                   torch.tensor([-1, -1]))
    want, _ = reference_attention(q.transpose(1, 2), c[:, :3].transpose(1, 2), c[:, :3].transpose(1, 2), scale=0.5)
    torch.testing.assert_close(out2, want.transpose(1, 2).float(), rtol=1e-5, atol=1e-6)


def _small(device="cpu", dtype=torch.float32, paged=False):
    q = torch.randn(2, 3, 4, 16, device=device, dtype=dtype)
    if paged:
        kc = torch.randn(6, 8, 2, 16, device=device, dtype=dtype)
        extra = dict(block_table=torch.arange(6, dtype=torch.int32, device=device).view(2, 3))
    else:
        kc = torch.randn(2, 24, 2, 16, device=device, dtype=dtype)
        extra = {}
    k = torch.randn(2, 3, 2, 16, device=device, dtype=dtype)
    return q, kc, kc.clone(), k, k.clone(), extra


BAD_CALLS = {
    "q_3d": (lambda q, kc, vc, k, v, x: ((q[0], kc, vc), {}), "q must be 4-D"),
    "k_cache_3d": (lambda q, kc, vc, k, v, x: ((q, kc[0], vc), {}), "k_cache must be 4-D"),
    "k_without_v": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k), dict(cache_seqlens=3)), "got only k"),
    "v_without_k": (lambda q, kc, vc, k, v, x: ((q, kc, vc, None, v), dict(cache_seqlens=3)), "got only v"),
    "k_heads": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k[:, :, :1], v[:, :, :1]), dict(cache_seqlens=3)),
                "k must have shape"),
    "v_shape": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k, v[:, :2]), dict(cache_seqlens=3)), "v must have shape"),
    "k_batch": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k[:1], v[:1]), dict(cache_seqlens=3)), "k must have shape"),
    "k_dtype": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k.double(), v.double()), dict(cache_seqlens=3)),
                "k must have q's dtype"),
    "k_cache_dtype": (lambda q, kc, vc, k, v, x: ((q, kc.double(), vc), dict(cache_seqlens=3)),
                      "k_cache has dtype torch.float64"),
    "v_cache_dtype": (lambda q, kc, vc, k, v, x: ((q, kc, vc.half()), dict(cache_seqlens=3)),
                      "v_cache has dtype torch.float16"),
    "v_cache_shape": (lambda q, kc, vc, k, v, x: ((q, kc, vc[:, :5]), dict(cache_seqlens=3)),
                      "v_cache must have k_cache's shape"),
    "head_dim": (lambda q, kc, vc, k, v, x: ((q[..., :8], kc, vc), dict(cache_seqlens=3)), "head dim"),
    "lens_dtype": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(cache_seqlens=torch.tensor([3, 4]))),
                   "cache_seqlens must be int32"),
    "lens_device": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(cache_seqlens=torch.zeros(2, dtype=torch.int32,
                                                                                          device="meta"))),
                    "cache_seqlens is on meta"),
    "lens_shape": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(cache_seqlens=torch.tensor([3], dtype=torch.int32))),
                   "cache_seqlens must have shape"),
    "lens_type": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(cache_seqlens=[3, 4])), "cache_seqlens must be an int"),
    "lens_none_with_k": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k, v), {}), "cache_seqlens is required"),
    "int_lens_too_long": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k, v), dict(cache_seqlens=22)),
                          "cache_seqlens = 22 plus 3 new tokens"),
    "int_lens_negative": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(cache_seqlens=-1)), "cache_seqlens = -1"),
    "k_longer_than_cache": (lambda q, kc, vc, k, v, x: ((q, kc[:, :2], vc[:, :2], k, v),
                                                        dict(cache_seqlens=torch.zeros(2, dtype=torch.int32))),
                            "seqlen_new = 3"),
    "table_with_batch_idx": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(
        cache_seqlens=3, block_table=torch.zeros(2, 3, dtype=torch.int32),
        cache_batch_idx=torch.zeros(2, dtype=torch.int32))), "cache_batch_idx cannot be combined with block_table"),
    "table_dtype": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(cache_seqlens=3,
                                                                  block_table=torch.zeros(2, 3).long())),
                    "block_table must be int32"),
    "table_1d": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(cache_seqlens=3,
                                                               block_table=torch.zeros(2, dtype=torch.int32))),
                 "block_table must have shape"),
    "batch_idx_dtype": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(cache_seqlens=3,
                                                                      cache_batch_idx=torch.zeros(2).long())),
                        "cache_batch_idx must be int32"),
    "leftpad_shape": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(cache_seqlens=3,
                                                                    cache_leftpad=torch.zeros(3, dtype=torch.int32))),
                      "cache_leftpad must have shape"),
    "cos_without_sin": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k, v), dict(cache_seqlens=3,
                                                                            rotary_cos=torch.ones(24, 4))),
                        "got only rotary_cos"),
    "sin_without_cos": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k, v), dict(cache_seqlens=3,
                                                                            rotary_sin=torch.ones(24, 4))),
                        "got only rotary_sin"),
    "rotary_dim_too_large": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k, v), dict(
        cache_seqlens=3, rotary_cos=torch.ones(24, 9), rotary_sin=torch.ones(24, 9))), "rotary_dim = 2 \\* rotary_cos"),
    "rotary_table_short": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k, v), dict(
        cache_seqlens=3, rotary_cos=torch.ones(20, 4), rotary_sin=torch.ones(20, 4))), "seqlen_ro"),
    "rotary_shapes_differ": (lambda q, kc, vc, k, v, x: ((q, kc, vc, k, v), dict(
        cache_seqlens=3, rotary_cos=torch.ones(24, 4), rotary_sin=torch.ones(24, 2))), "rotary_cos and rotary_sin"),
    "rotary_without_k": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(
        cache_seqlens=3, rotary_cos=torch.ones(24, 4), rotary_sin=torch.ones(24, 4))), "need the new k and v"),
    "window_type": (lambda q, kc, vc, k, v, x: ((q, kc, vc), dict(cache_seqlens=3, window_size=5)), "window_size"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_kvcache_errors_name_the_argument(name):
    """Bad arguments raise before anything is written: the caches are unchanged after the error."""
    make, match = BAD_CALLS[name]
    q, kc, vc, k, v, _ = _small()
    args, kwargs = make(q, kc, vc, k, v, None)
    before = [t.clone() for t in args[1:3]]
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        flash_attn_with_kvcache(*args, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(args[1:3], before)), "a failed call modified the cache"


def test_kvcache_op_validates_values_cpu():
    """The op on the CPU validates the index tensors' values (the CUDA op clamps them instead)."""
    q, kc, vc, _, _, extra = _small(paged=True)
    op = torch.ops.flashcore.kvcache_fwd
    lens = torch.tensor([5, 24], dtype=torch.int32)
    bt = extra["block_table"]
    with pytest.raises(RuntimeError, match="cache_seqlens\\[1\\] = 25"):
        op(q, kc, vc, lens + 1, bt, None, None, 0.25)
    with pytest.raises(RuntimeError, match="block_table\\[0, 0\\] = 6"):
        op(q, kc, vc, lens, bt + 6, None, None, 0.25)
    with pytest.raises(RuntimeError, match="cache_leftpad\\[0\\] = 6"):
        op(q, kc, vc, lens, bt, None, torch.tensor([6, 0], dtype=torch.int32), 0.25)
    q, kc, vc, _, _, _ = _small()
    with pytest.raises(RuntimeError, match="cache_batch_idx\\[1\\] = 2"):
        op(q, kc, vc, lens, None, torch.tensor([0, 2], dtype=torch.int32), None, 0.25)
    with pytest.raises(RuntimeError, match="key_cache has dtype"):
        op(q, kc.double(), vc, lens, None, None, None, 0.25)
    with pytest.raises(RuntimeError, match="num_splits"):
        op(q, kc, vc, lens, None, None, None, 0.25, num_splits=-1)


def _opcheck_args(device, dtype=torch.float32):
    g = torch.Generator(device=device).manual_seed(7)
    q = torch.randn(3, 2, 4, 16, generator=g, device=device).to(dtype)
    kc = torch.randn(3, 20, 2, 16, generator=g, device=device).to(dtype)
    vc = torch.randn(3, 20, 2, 16, generator=g, device=device).to(dtype)
    pk = torch.randn(9, 8, 2, 16, generator=g, device=device).to(dtype)
    pv = torch.randn(9, 8, 2, 16, generator=g, device=device).to(dtype)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    bt = i32([[4, 0, 7], [1, 8, 2], [3, 5, 6]])
    sinks = torch.randn(4, generator=g, device=device)
    return [
        (q, kc, vc, i32([0, 11, 20]), None, None, None, 0.25, True, -1, -1, 0.0, None, None, 0),
        (q, kc, vc, i32([5, 11, 20]), None, i32([2, 0, 1]), i32([1, 0, 7]), 0.3, False, 4, 1, 5.0, sinks, None, 3),
        (q, pk, pv, i32([24, 0, 9]), bt, None, None, 0.25, True, 6, -1, 0.0, None,
         torch.rand(3, 4, generator=g, device=device) * 0.2, 1),
    ]


def test_kvcache_opcheck_cpu():
    for args in _opcheck_args("cpu"):
        torch.library.opcheck(torch.ops.flashcore.kvcache_fwd.default, args)


def _step_kwargs(request, device, dtype):
    inputs, kw = make_case(request, device, dtype, B=3, Sq=2, Sn=2, Hq=4, Hkv=2, D=16, capacity=32,
                           lens=[0, 13, 31], page_size=8, causal=True, rotary="neox")
    return inputs, kw


def test_kvcache_compile_fullgraph_cpu(request):
    """torch.compile(fullgraph=True) of flash_attn_with_kvcache with the append (in-place cache writes, a dropped
    token), rotary and a paged cache: the same output and caches as eager, for two different cache_seqlens."""
    inputs, kw = _step_kwargs(request, "cpu", torch.float32)
    q, kc, vc = inputs
    fn = lambda q, kc, vc, lens, k, v: flash_attn_with_kvcache(q, kc, vc, k, v, kw["rotary_cos"], kw["rotary_sin"],
                                                               lens, block_table=kw["block_table"], causal=True,
                                                               rotary_interleaved=False, return_softmax_lse=True)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    for lens in (kw["cache_seqlens"], torch.tensor([4, 30, 7], dtype=torch.int32)):
        kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        want = fn(q, kc1, vc1, lens, kw["k"], kw["v"])
        got = compiled(q, kc2, vc2, lens, kw["k"], kw["v"])
        assert not torch.equal(kc1, kc), "the eager call appended nothing"
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1), "the compiled append differs from eager"
    # and with the reference
    run_case(inputs, kw)


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------

GPU_CAP = 1000  # dense capacity (not a multiple of any tile); paged: ceil(1000 / page_size) pages
GPU_HEADS = [(32, 8), (8, 1), (4, 4)]  # GQA, MQA, MHA
GPU_DIMS = [64, 128, 256, 96, 100]  # 100: padded to 104
GPU_MODES = {  # B, Sq, Sn, cache lengths before the append: mixed, 0 and full (FULL - Sn: full after the append)
    "decode": dict(B=8, Sq=1, Sn=0, lens=[0, 1, 17, 255, 256, 511, 999, FULL]),
    "decode_append": dict(B=8, Sq=1, Sn=1, lens=[0, 1, 16, 255, 300, 640, 998, FULL - 1]),
    "chunk3": dict(B=3, Sq=3, Sn=3, lens=[0, 129, FULL - 3]),
    "chunk64": dict(B=3, Sq=64, Sn=64, lens=[0, 200, FULL - 64]),
    "chunk200": dict(B=1, Sq=200, Sn=200, lens=[513]),
}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("mode", list(GPU_MODES))
@pytest.mark.parametrize("page_size", [None, 16, 64, 256], ids=lambda p: f"page{p}" if p else "dense")
@pytest.mark.parametrize("head_dim", GPU_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("loader", ["default", "tma", "stages3"])
def test_kvcache_cuda(request, monkeypatch, mode, page_size, head_dim, dtype, loader):
    """Decode and chunked prefill against dense and paged caches, causal, with the append of the new tokens; the
    head configuration rotates over GQA 32/8, MQA 8/1 and MHA 4/4 so that each meets every mode. Each case runs
    with the default K/V loader, with TMA forced wherever it can address the cache (Hopper; elsewhere the same
    cp.async path twice) and with the cp.async loader's three-stage pipeline forced (where it fits)."""
    set_loader(monkeypatch, loader)
    i = list(GPU_MODES).index(mode) + GPU_DIMS.index(head_dim)
    Hq, Hkv = GPU_HEADS[i % 3]
    inputs, kw = make_case(request, "cuda", dtype, Hq=Hq, Hkv=Hkv, D=head_dim, capacity=GPU_CAP,
                           page_size=page_size, causal=True, **GPU_MODES[mode])
    run_case(inputs, kw)
    check_loader_ran(loader)


def set_loader(monkeypatch, loader):
    """The decode kernel's K/V loader for a test: "default" (decode_launch.cu's choice), "tma" (forced wherever
    TMA can address the cache), "cp.async" (forced, its default stage count) or "stages3" (cp.async, three
    stages)."""
    if loader in ("tma", "cp.async", "stages3"):
        monkeypatch.setenv("FLASHCORE_DECODE_TMA", "1" if loader == "tma" else "0")
    if loader == "stages3":
        monkeypatch.setenv("FLASHCORE_DECODE_STAGES", "3")


def check_loader_ran(loader):
    """On Hopper (every pipeline fits its shared memory) a forced three-stage pipeline is what the decode kernel
    ran (the default's stage count depends on the memory's rate: decode_launch.cu)."""
    ran = flashcore.last_kernel("fwd")
    if loader == "stages3" and torch.cuda.get_device_capability() == (9, 0) and ran.startswith("decode"):
        assert "stages3" in ran, ran


GPU_VARIANTS = {  # on top of GQA 8/2, head dim 128, a paged cache of 16-row pages (dense with batch_idx), causal
    "noncausal": dict(causal=False),
    "window": dict(window=(100, 0), causal=False),
    "window_both": dict(window=(50, 20), causal=False),
    "window_causal": dict(window=(70, -1)),
    "softcap": dict(softcap=20.0, causal=False),
    "sinks": dict(sinks=True, causal=False),
    "sinks_causal": dict(sinks=True),
    "alibi_head": dict(alibi="head", causal=False),
    "alibi_batch": dict(alibi="batch"),
    "all": dict(window=(300, -1), softcap=30.0, sinks=True, alibi="batch"),
    "batch_idx": dict(batch_idx=True, page_size=None),
    "leftpad": dict(leftpad=True, page_size=None),
    "paged_leftpad": dict(leftpad=True, page_size=64),
    "page24": dict(page_size=24),  # not a multiple of 16: the loader's lookup a row
    "rotary_interleaved": dict(rotary="interleaved"),
    "rotary_neox_partial": dict(rotary="neox", rotary_dim=64),
    "rotary_noncausal": dict(rotary="neox", causal=False),
    "rotary_batch_idx_leftpad": dict(rotary="interleaved", batch_idx=True, leftpad=True, page_size=None),
    "splits1": dict(num_splits=1),
    "splits3": dict(num_splits=3),
    "splits_many": dict(num_splits=100),
    "head_dim59": dict(head_dim=59, rotary="neox", rotary_dim=32),
    "overflow": dict(overflow=True, rotary="interleaved"),
}
NEEDS_NEW_TOKENS = ("rotary", "overflow")
GPU_VARIANT_PARAMS = [(v, m) for v in GPU_VARIANTS for m in ("decode", "decode_append", "chunk64")
                      if m != "decode" or not any(x in GPU_VARIANTS[v] for x in NEEDS_NEW_TOKENS)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant,mode", GPU_VARIANT_PARAMS, ids=[f"{v}-{m}" for v, m in GPU_VARIANT_PARAMS])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_kvcache_variants_cuda(request, variant, mode, dtype):
    v = {"causal": True, "head_dim": 128, "page_size": 16, **GPU_VARIANTS[variant]}
    m = dict(GPU_MODES[mode])
    if v.pop("leftpad", False):
        v["leftpad"] = [min(x, 7 * i) if x < FULL // 2 else 7 * i for i, x in enumerate(m["lens"])]
    if v.pop("overflow", False):  # tokens past the capacity: dropped
        m["lens"] = [FULL - 1, FULL, FULL - m["Sn"] + 1][: m["B"]] + m["lens"][3:]
    inputs, kw = make_case(request, "cuda", dtype, Hq=8, Hkv=2, D=v.pop("head_dim"), capacity=GPU_CAP, **m, **v)
    run_case(inputs, kw)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [0, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("page_size", [None, 16], ids=lambda p: f"page{p}" if p else "dense")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kvcache_longest_first_cuda(request, monkeypatch, num_splits, page_size, head_dim):
    """A decode step whose grid has more blocks than resident slots (200 entries x 8 kv heads) and entries of
    different lengths, ties included: blocks take their entries longest first (decode_kernel.cuh). Checked against
    the reference, and bitwise against the index order (FLASHCORE_DECODE_LONGEST_FIRST=0): which block computes an
    entry must not change its result."""
    B = 200
    pick = torch.randint(0, 6, (B,), generator=make_generator(request)).tolist()
    lens = [[0, 1, 333, 640, 999, FULL][i] for i in pick]
    inputs, kw = make_case(request, "cuda", torch.bfloat16, B=B, Sq=1, Hq=32, Hkv=8, D=head_dim, capacity=GPU_CAP,
                           lens=lens, page_size=page_size, causal=True, num_splits=num_splits)
    out, lse, *_ = run_case(inputs, kw)
    assert "longest-first" in flashcore.last_kernel("fwd")
    monkeypatch.setenv("FLASHCORE_DECODE_LONGEST_FIRST", "0")
    q, k_cache, v_cache = inputs
    out_index_order, lse_index_order = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), **kw)
    assert "longest-first" not in flashcore.last_kernel("fwd")
    assert torch.equal(out, out_index_order) and torch.equal(lse, lse_index_order)


@pytest.mark.gpu
@requires_cuda
def test_dense_decode_step_keeps_index_order_cuda(request):
    """The dense op's decode step (one query against dense K/V: every entry full, no lengths) over more blocks than
    resident slots is not ranked longest first, which would only cost the ranking's load round (decode_launch.cu);
    exact against the reference."""
    B, Hq, Hkv, Sk, D = 200, 32, 8, 1024, 128
    g = make_generator(request, "cuda")
    q = torch.randn(B, Hq, 1, D, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Sk, D, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    out = flashcore.attention(q, k, v, enable_gqa=True)
    ran = flashcore.last_kernel("fwd")
    assert "decode" in ran and "longest-first" not in ran, ran
    kr, vr = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), kr.double(), vr.double())
    check_close("out", out, want, lowp_attention(q, kr, vr, False, 1 / math.sqrt(D), 0))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [2, 3, 5, 8], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("variant", ["plain", "all"])
@pytest.mark.parametrize("page_size", [None, 16], ids=lambda p: f"page{p}" if p else "dense")
@pytest.mark.parametrize("head_dim", [64, 128, 256, 100])
def test_kvcache_cluster_merge_cuda(request, monkeypatch, num_splits, variant, page_size, head_dim):
    """A decode step's splits merged in a thread-block cluster (sm_90: decode_kernel.cuh merge_splits_in_cluster),
    empty splits and entries included (lengths 0 and 1 leave most splits no key), against the reference and against
    the combine kernel's merge of the same splits (FLASHCORE_DECODE_CLUSTER=0), bitwise."""
    v = GPU_VARIANTS.get(variant, {})
    # 5 entries x 2 kv heads x 8 splits at most: 80 blocks, which every Hopper part holds at once in clusters of
    # one block an SM (decode_launch.cu: merge_in_clusters), so the merge is taken at every split count here.
    inputs, kw = make_case(request, "cuda", torch.float16, B=5, Sq=1, Hq=8, Hkv=2, D=head_dim, capacity=GPU_CAP,
                           lens=[0, 1, 70, 333, FULL], page_size=page_size, causal=True, num_splits=num_splits,
                           **{k: x for k, x in v.items() if k != "causal"})
    out, lse, *_ = run_case(inputs, kw)
    if torch.cuda.get_device_capability()[0] == 9:
        assert "cluster" in flashcore.last_kernel("fwd"), flashcore.last_kernel("fwd")
    monkeypatch.setenv("FLASHCORE_DECODE_CLUSTER", "0")
    q, k_cache, v_cache = inputs
    out_combine, lse_combine = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), **kw)
    assert "cluster" not in flashcore.last_kernel("fwd")
    # The same arithmetic in the same order (decode_kernel.cuh): bitwise equal, so a plan's choice of merge (which
    # the residency can change) never changes a result.
    assert torch.equal(out, out_combine) and torch.equal(lse, lse_combine)


PREFILL_MODE = dict(B=3, Sq=96, Sn=96, lens=[0, 200, FULL - 96])
PREFILL_HEADS = (48, 6)  # 3 x 48 blocks: enough to fill an H100's or H200's SMs
PREFILL_VARIANTS = ["plain", "noncausal", "window", "window_both", "window_causal", "softcap", "sinks",
                    "sinks_causal", "alibi_head", "alibi_batch", "all", "rotary_interleaved"]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", PREFILL_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [None, 16, 48, 256], ids=lambda p: f"page{p}" if p else "dense")
def test_kvcache_prefill_cuda(request, variant, dtype, page_size):
    """Chunked prefill of more than 64 new tokens against a dense or paged cache: on Hopper the Hopper varlen forward
    runs it (each entry a sequence of cache_seqlens[b] keys of its cache row, or of its pages through the block
    table: pages scattered over a larger pool, 48 keys a page not a power of two); the same semantics as the decode
    kernel's, with every score variant, an empty entry, a full one and the append of the new tokens."""
    v = {"causal": True, **GPU_VARIANTS.get(variant, {}), "page_size": page_size}
    mode = PREFILL_MODE if page_size is None or page_size % 64 == 0 else PREFILL_MODE_SMALL_PAGES
    inputs, kw = make_case(request, "cuda", dtype, Hq=PREFILL_HEADS[0], Hkv=PREFILL_HEADS[1], D=128,
                           capacity=GPU_CAP, **mode, **v)
    run_case(inputs, kw)
    ran = flashcore.last_kernel("fwd")
    on_varlen = prefill_on_varlen(page_size, mode["Sq"])
    assert ran.startswith("sm90") and "varlen" in ran if on_varlen else ran.startswith("decode"), ran


# Pages under 64 keys take the Hopper kernel from 64 new tokens (attention_cuda.cpp, kPagedSmallPagesMinTokens); a
# full 128-row block of new tokens here.
PREFILL_MODE_SMALL_PAGES = dict(B=3, Sq=128, Sn=128, lens=[0, 200, FULL - 128])


def prefill_on_varlen(page_size=None, new_tokens=PREFILL_MODE["Sq"], batch=PREFILL_MODE["B"], heads=PREFILL_HEADS,
                      walk_keys=GPU_CAP):
    """Whether a head-dim-128 prefill runs on the Hopper varlen forward here (prefill_route)."""
    return prefill_route(page_size, new_tokens, batch, heads, walk_keys)[0]


def prefill_route(page_size, new_tokens, batch, heads, walk_keys):
    """(on the Hopper varlen forward, its key splits) for a head-dim-128 prefill (128-row blocks), as
    attention_cuda.cpp routes it: Hopper; 33 new tokens or more, or fewer where the packed blocks are more than half
    queries, or from 16 where the kernel splits its keys in two (walks, the cache or a window bounded on both
    sides plus a tile's 128 rows, of 1024 keys or more, and a grid of at most half as many blocks as SMs; walk_keys
    is the caller's: a paged cache's capacity is whole pages); a grid, query heads packed and split blocks counted,
    of at least a third as many blocks as SMs; paged caches with pages of a multiple of 64 keys, or of 16 from 64
    new tokens."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, blocks, mostly_full = packed_varlen_grid(batch, *heads, new_tokens, 128)
    splits = 2 if walk_keys >= 1024 and 2 * blocks <= sms else 1
    pages_fit = page_size is None or page_size % 64 == 0 or (page_size % 16 == 0 and new_tokens >= 64)
    enough_rows = new_tokens >= 33 or mostly_full or (splits > 1 and new_tokens >= 16)
    on_varlen = (torch.cuda.get_device_capability() == (9, 0) and enough_rows and 3 * blocks * splits >= sms
                 and pages_fit)
    return on_varlen, splits


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", ["plain", "window_causal", "softcap", "sinks_causal", "all"])
@pytest.mark.parametrize("page_size", [None, 64], ids=lambda p: f"page{p}" if p else "dense")
@pytest.mark.parametrize("new_tokens", [16, 24])
def test_kvcache_prefill_key_split_cuda(request, variant, page_size, new_tokens):
    """A chunked prefill of a few sequences over long caches: too few Hopper blocks for the SMs (four query heads of
    16 or 24 tokens a block), so the kernel splits each query tile's keys over a cluster of two blocks, and from 16
    new tokens takes the prefill from the decode kernel; a window of a few hundred keys leaves it to the decode
    kernel. Every score variant, an entry of no keys, one of fewer than a tile, a full one, and the append."""
    B, heads, cap = 6, (32, 8), 3000
    mode = dict(B=B, Sq=new_tokens, Sn=new_tokens, lens=[0, 40, 2000, 1000, 2900, FULL - new_tokens])
    v = {"causal": True, **GPU_VARIANTS.get(variant, {}), "page_size": page_size}
    inputs, kw = make_case(request, "cuda", torch.bfloat16, Hq=heads[0], Hkv=heads[1], D=128, capacity=cap, **mode,
                           **v)
    run_case(inputs, kw)
    ran = flashcore.last_kernel("fwd")
    left, right = v.get("window", (-1, -1))
    right = 0 if v["causal"] else right
    walk = min(cap, left + right + 128) if left >= 0 and right >= 0 else cap  # + a tile's rows, as the launcher
    on_varlen, splits = prefill_route(page_size, new_tokens, B, heads, walk)
    if on_varlen:
        assert ran.startswith("sm90") and "varlen" in ran and (" splits2" in ran) == (splits == 2), ran
    else:
        assert ran.startswith("decode"), ran


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
@pytest.mark.parametrize("layout", ["heads_first", "padded"])
@pytest.mark.parametrize("new_tokens", [1, 24, 96])
def test_kvcache_cache_layouts(request, device, layout, new_tokens):
    """Dense caches in (B, Hkv, capacity, D) memory and with a padded batch stride: read and appended to in place,
    the same results as a contiguous cache; on Hopper a chunked prefill reads them on the Hopper varlen forward
    (packed_batch_rows), as it does a contiguous cache."""
    B, heads, cap = (6, (32, 8), 3000) if device == "cuda" else (3, (4, 2), 200)
    mode = dict(B=B, Sq=new_tokens, Sn=new_tokens, lens=[0, 40, FULL - new_tokens] + [cap // 2] * (B - 3))
    inputs, kw = make_case(request, device, torch.bfloat16, Hq=heads[0], Hkv=heads[1], D=128, capacity=cap,
                           causal=True, **mode)
    run_case(inputs, kw, layout=layout)
    if device == "cuda":
        ran = flashcore.last_kernel("fwd")
        splits = prefill_route(None, new_tokens, B, heads, cap)
        assert (ran.startswith("sm90") and "varlen" in ran) == (new_tokens > 1 and splits[0]), ran
        # Lengths past the capacity (unchecked on the device) read the capacity's keys, never the rows past it: the
        # padded layout's NaN slots, or the next entry's rows in (B, Hkv, capacity, D) memory.
        q, k_cache, v_cache = inputs
        kc, vc = cache_layout(k_cache, layout), cache_layout(v_cache, layout)
        full = {key: val for key, val in kw.items() if key not in ("k", "v", "cache_seqlens")}
        want = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.full((B,), cap, dtype=torch.int32,
                                                                            device=device), **full)
        got = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.full((B,), cap + 30, dtype=torch.int32,
                                                                           device=device), **full)
        assert torch.isfinite(got[0]).all() and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@requires_cuda
def test_kvcache_opcheck_cuda():
    for args in _opcheck_args("cuda", torch.bfloat16):
        torch.library.opcheck(torch.ops.flashcore.kvcache_fwd.default, args)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("loader", ["default", "tma"])
def test_kvcache_cuda_graph(request, monkeypatch, page_size, loader):
    """One decode step (append with rotary, then attention) captured in a CUDA graph: replays with new cache_seqlens
    and new q/k/v (copied into the captured tensors) give the eager result and the eager caches bitwise, and the
    replay is right by the reference. Default K/V loader, and TMA forced (Hopper)."""
    if loader == "tma":
        monkeypatch.setenv("FLASHCORE_DECODE_TMA", "1")
    inputs, kw = make_case(request, "cuda", torch.bfloat16, B=4, Sq=1, Sn=1, Hq=16, Hkv=4, D=128, capacity=512,
                           lens=[0, 100, 511, 300], page_size=page_size, causal=True, rotary="neox")
    q, kc, vc = inputs
    lens = kw["cache_seqlens"]
    step = lambda kc, vc: flash_attn_with_kvcache(q, kc, vc, **kw)
    graph, static = capture_graph(lambda: step(kc, vc))
    g = make_generator(request, "cuda")
    for new_lens in ([5, 101, 0, 511], [300, 0, 17, 250]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        for t in (q, kw["k"], kw["v"]):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        kc_before, vc_before = kc.clone(), vc.clone()
        kc_eager, vc_eager = kc.clone(), vc.clone()
        want = step(kc_eager, vc_eager)
        for t in static:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static[0], want[0]) and torch.equal(static[1], want[1])
        assert torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager)
        run_case((q, kc_before, vc_before), kw)


def poison_outside_entries(inputs, kw):
    """NaN in every cache slot that no entry's keys occupy: before an entry's left pad, past its length, pages and
    rows no entry maps (a serving engine's pool holds anything there)."""
    q, k_cache, v_cache = inputs
    valid = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    pads = kw.get("cache_leftpad")
    for b, n in enumerate(lens_list(kw, q.size(0), k_cache)):
        start = int(pads[b]) if pads is not None else 0
        for slot in entry_slots(k_cache, kw, b)[start:n]:
            valid[slot] = True
    k_cache[~valid] = float("nan")
    v_cache[~valid] = float("nan")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("loader", ["default", "tma", "cp.async", "stages3"])
@pytest.mark.parametrize("page_size", [None, 16, 48, 64, 256], ids=lambda p: f"page{p}" if p else "dense")
@pytest.mark.parametrize("mode", ["decode", "chunk64", "chunk200", "prefill"])
def test_kvcache_nan_past_length_cuda(request, monkeypatch, loader, page_size, mode):
    """Cache slots outside every entry's keys hold NaN (a serving engine's pool holds anything there): the kernel
    reads whole tiles and pages, so the keys and values past each entry's length must never reach the output. Each
    loader: TMA (Hopper; loads what the cache holds, so the kernel zeroes V past the end) forced on every cache it
    can address, cp.async (zero-fills) forced, and the default choice between them."""
    set_loader(monkeypatch, loader)
    m = dict(PREFILL_MODE if mode == "prefill" else GPU_MODES[mode], Sn=0)
    Hq, Hkv = PREFILL_HEADS if mode == "prefill" else (8, 2)
    inputs, kw = make_case(request, "cuda", torch.bfloat16, Hq=Hq, Hkv=Hkv, D=128, capacity=GPU_CAP,
                           page_size=page_size, causal=True, **m)
    poison_outside_entries(inputs, kw)
    run_case(inputs, kw, check_cache=False)
    hopper, ran = torch.cuda.get_device_capability() == (9, 0), flashcore.last_kernel("fwd")
    routed = mode == "prefill" and prefill_on_varlen(page_size, m["Sq"])  # on Hopper the varlen forward
    if mode == "prefill" and (page_size is None or routed):
        assert ("varlen" in ran) == routed, ran
    elif "varlen" in ran:
        raise AssertionError(ran)
    else:  # the default is the cp.async loader everywhere
        assert ("tma" in ran) == (hopper and loader == "tma"), ran
        check_loader_ran(loader)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page_size", [64, 16])
def test_kvcache_prefill_bad_pages_stay_in_bounds_cuda(request, page_size):
    """A paged prefill on the Hopper varlen forward (where it runs there) with page ids out of range and lengths
    past the capacity or negative: TMA zero-fills what lies outside the cache, so nothing is read outside it
    (compute-sanitizer runs this test separately); the outputs are finite."""
    mode = PREFILL_MODE_SMALL_PAGES
    inputs, kw = make_case(request, "cuda", torch.bfloat16, Hq=PREFILL_HEADS[0], Hkv=PREFILL_HEADS[1], D=128,
                           capacity=GPU_CAP, page_size=page_size, causal=True, **dict(mode, Sn=0))
    q, kc, vc = inputs
    bt = kw["block_table"].clone()
    bt[0, 0], bt[1, -1], bt[2, 1] = -1, 10**6, 2**31 - 1
    lens = torch.tensor([10**6, -7, 2**31 - 1], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, **dict(kw, block_table=bt, cache_seqlens=lens))
    torch.cuda.synchronize()
    assert ("varlen" in flashcore.last_kernel("fwd")) == prefill_on_varlen(page_size, mode["Sq"])
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page_size", [64, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("variant", ["plain", "softcap", "alibi"])
def test_kvcache_tile_aligned_pages_cuda(request, page_size, head_dim, variant):
    """Pages of whole 64-key tiles: an entry whose left pad is a multiple of 64 reads each tile as consecutive rows
    of one page (the cp.async loader's strided copies), one whose pad is not gathers its rows through the table;
    lengths end inside a tile, on a tile edge and on a page edge; several splits cross pages."""
    lens = [1000, 64 + 128, 900, 769, page_size + 64, 2 * page_size]
    leftpad = [0, 64, 5, 3 * 64, 64, 63]
    inputs, kw = make_case(request, "cuda", torch.bfloat16, B=len(lens), Sq=1, Hq=32, Hkv=8, D=head_dim,
                           capacity=1024, lens=lens, leftpad=leftpad, page_size=page_size, causal=True,
                           softcap=30.0 if variant == "softcap" else 0.0, alibi="head" if variant == "alibi" else None)
    poison_outside_entries(inputs, kw)  # the pads and the tails of whole tiles read must not reach the output
    for splits in (1, 3):
        run_case(inputs, dict(kw, num_splits=splits), check_cache=False)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page_size", [None, 16, 256], ids=lambda p: f"page{p}" if p else "dense")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kvcache_residency_cuda(request, monkeypatch, page_size, head_dim):
    """How many blocks an SM runs (FLASHCORE_DECODE_BLOCKS_PER_SM caps it through padded shared memory) changes
    where the decode step's blocks run, never what they compute: with the splits fixed, 1, 2 and 3 blocks an SM
    give bitwise the same out and lse, checked against the reference; each padded launch must be valid. (Head dim
    256 fits one block an SM: nothing to cap.)"""
    lens = [1000, 0, 333, FULL, 64, 999, 640, 1]
    inputs, kw = make_case(request, "cuda", torch.bfloat16, B=len(lens), Sq=1, Hq=32, Hkv=8, D=head_dim,
                           capacity=GPU_CAP, lens=lens, page_size=page_size, causal=True, num_splits=3)
    out, lse, *_ = run_case(inputs, kw)
    q, k_cache, v_cache = inputs
    for n in (1, 2, 3):
        monkeypatch.setenv("FLASHCORE_DECODE_BLOCKS_PER_SM", str(n))
        out_n, lse_n = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), **kw)
        assert torch.equal(out_n, out) and torch.equal(lse_n, lse), f"{n} blocks an SM"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("blocks_per_sm", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kvcache_one_wave_grids_cuda(request, blocks_per_sm, head_dim):
    """Decode steps whose unsplit grid (batch x kv heads) is 2, 3 or 4 blocks an SM of this GPU: around the point
    where the plan runs one wave of two-stage blocks unsplit (decode_launch.cu) instead of splitting keys over
    waves of three-stage ones; the result is checked against the reference. On Hopper, where a dense decode step
    takes three stages (the memory outruns a two-stage block, as on the H200), a grid of exactly the two-stage
    kernel's residency (four blocks an SM at head dim 64, three at 128: DecodeTraits::kMinBlocksPerSm) must run
    as that one wave."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B = max(1, sms * blocks_per_sm // 8)
    lens = torch.randint(1, 1001, (B,), generator=make_generator(request)).tolist()
    probe, probe_kw = make_case(request, "cuda", torch.bfloat16, B=1, Sq=1, Hq=32, Hkv=8, D=head_dim,
                                capacity=1000, lens=[1000], causal=True)
    flash_attn_with_kvcache(*probe, **probe_kw)
    three_stages = "stages3" in flashcore.last_kernel("fwd")
    inputs, kw = make_case(request, "cuda", torch.bfloat16, B=B, Sq=1, Hq=32, Hkv=8, D=head_dim, capacity=1000,
                           lens=lens, causal=True)
    run_case(inputs, kw)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if hopper and three_stages and blocks_per_sm == {64: 4, 128: 3}[head_dim]:
        assert flashcore.last_kernel("fwd") == f"decode hdim{head_dim}", flashcore.last_kernel("fwd")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page_size", [16, 48, 80])
@pytest.mark.parametrize("head_dim", [256, 160])
def test_kvcache_run_pages_cuda(request, page_size, head_dim):
    """Head-dim tile 256 through pages of a multiple of 16 keys: an entry whose left pad is a multiple of 16 reads
    each tile as four 16-key runs, each inside one page, starting anywhere in it (the cp.async loader's runs); a
    pad off a 16-key edge gathers row by row. Lengths end inside a run, on a run edge and on a page edge; NaN in
    every slot outside the entries; 1 and 3 splits."""
    leftpad = [16, 16, 32, 48, 0, 7, 0]
    lens = [1000, 16 + 200, 32 + 517, 48 + 64, 777, 2 * page_size + 5, 3 * page_size]
    inputs, kw = make_case(request, "cuda", torch.bfloat16, B=len(lens), Sq=1, Hq=32, Hkv=8, D=head_dim,
                           capacity=1024, lens=lens, leftpad=leftpad, page_size=page_size, causal=True)
    poison_outside_entries(inputs, kw)
    for splits in (1, 3):
        run_case(inputs, dict(kw, num_splits=splits), check_cache=False)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("page_size", [None, 16, 48, 64])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_kvcache_bad_indices_stay_in_bounds_cuda(request, append, page_size, head_dim):
    """cache_seqlens past the capacity or negative, page ids out of range, cache_batch_idx out of range, left pads
    past the length or negative: nothing is read or written outside the tensors (compute-sanitizer runs this test
    separately); the outputs are finite and nothing crashes."""
    B = 4
    inputs, kw = make_case(request, "cuda", torch.float16, B=B, Sq=2, Sn=2 if append else 0, Hq=8, Hkv=2,
                           D=head_dim, capacity=64, lens=[0, 0, 0, 0], page_size=page_size, causal=True,
                           rotary="neox" if append else None)
    q, kc, vc = inputs
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")
    lying_pads = [70, -3, 5, 2**31 - 1]
    # The third set gives the entries with negative page ids keys (partial tiles: strided through pages of 64, as
    # 16-key runs through pages of 16 and 48 at head dim 256, gathered otherwise).
    for lens, pads in (([100, -5, 2**31 - 1, -2**31], lying_pads), ([64, 65, 63, -1], lying_pads),
                       ([40, 64, 63, 30], [0, -3, 5, 0])):
        call = dict(kw, cache_seqlens=i32(lens), cache_leftpad=i32(pads))
        if page_size:
            bt = call["block_table"].clone()
            bt[0, 0], bt[1, -1], bt[2, -1], bt[3, 0] = -1, 10**6, 2**31 - 1, -2**31
            call["block_table"] = bt
        else:
            call["cache_batch_idx"] = i32([-1, B + 100, 0, 2**31 - 1])
        out, lse = flash_attn_with_kvcache(q, kc, vc, **call)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
        assert torch.isfinite(kc).all() and torch.isfinite(vc).all()


# ---- flash_attn_varlen_func with block_table (paged prefill) ----


def _paged_varlen_case(device, dtype, page_size, causal, window, gqa, seed=0, D=32, long_keys=False):
    """Packed queries and the same keys twice: packed (total_k, Hkv, D) and in shuffled pages with a block table.
    long_keys: sequences of several key tiles (the producer's ring wraps)."""
    g = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [3, 0, 17, 1, 9], [40, 5, 17, 0, 33]
    Hq, Hkv = (4, 2) if gqa else (2, 2)
    if long_keys:  # and enough queries and heads for the Hopper varlen forward's grid (kvcache_prefill_on_varlen)
        lens_q, lens_k, Hq, Hkv = [200, 0, 130, 70, 260], [700, 5, 257, 0, 1033], 16, 4
    q = torch.randn(sum(lens_q), Hq, D, generator=g).to(device, dtype)
    k = torch.randn(sum(lens_k), Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(sum(lens_k), Hkv, D, generator=g).to(device, dtype)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    max_pages = max(-(-n // page_size) for n in lens_k)
    num_pages = len(lens_k) * max_pages + 2
    perm = torch.randperm(num_pages, generator=g)
    table = perm[: len(lens_k) * max_pages].view(len(lens_k), max_pages).to(torch.int32)
    k_pages = torch.randn(num_pages, page_size, Hkv, D, generator=g).to(device, dtype)  # garbage where unused
    v_pages = torch.randn(num_pages, page_size, Hkv, D, generator=g).to(device, dtype)
    start = 0
    for b, n in enumerate(lens_k):
        for j in range(n):
            page, row = int(table[b, j // page_size]), j % page_size
            k_pages[page, row], v_pages[page, row] = k[start + j], v[start + j]
        start += n
    args = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                causal=causal, window_size=window, return_attn_probs=True)
    return q, k, v, k_pages, v_pages, table.to(device), args


@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_varlen_paged_matches_packed_cpu(page_size, causal, window, gqa):
    """Paged prefill through flash_attn_varlen_func(block_table=...) gives what the packed keys give (float64), with
    sequences of 0 queries or 0 keys, Sq != Sk, and lse -inf on rows outside every sequence."""
    from flashcore.flash_attn_interface import flash_attn_varlen_func

    q, k, v, kp, vp, table, args = _paged_varlen_case("cpu", torch.float64, page_size, causal, window, gqa)
    q = torch.cat([q, torch.randn(2, *q.shape[1:], dtype=q.dtype)])  # two rows outside every sequence
    want, want_lse, _ = flash_attn_varlen_func(q, k, v, **args)
    got, got_lse, _ = flash_attn_varlen_func(q, kp, vp, block_table=table, **args)
    inside = slice(0, q.size(0) - 2)
    torch.testing.assert_close(got[inside], want[inside], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-10, atol=1e-10)
    assert torch.isinf(got_lse[:, -2:]).all() and (got_lse[:, -2:] < 0).all()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("head_dim,long_keys", [(32, False), (64, True), (96, True), (128, True), (256, True)])
def test_varlen_paged_matches_packed_cuda(dtype, page_size, head_dim, long_keys):
    """Paged keys against the same keys packed, on the Hopper varlen forward where it runs (one producer thread at
    head-dim tiles 64 and 96, two at 128 and 256), sequences of one or several key tiles."""
    from flashcore.flash_attn_interface import flash_attn_varlen_func

    q, k, v, kp, vp, table, args = _paged_varlen_case("cuda", dtype, page_size, True, (-1, -1), True, D=head_dim,
                                                      long_keys=long_keys)
    want, want_lse, _ = flash_attn_varlen_func(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                               **{**args, "cu_seqlens_q": args["cu_seqlens_q"].cpu(),
                                                  "cu_seqlens_k": args["cu_seqlens_k"].cpu()})
    lowp, _, _ = flash_attn_varlen_func(q, k, v, **args)
    got, got_lse, _ = flash_attn_varlen_func(q, kp, vp, block_table=table, **args)
    if long_keys and torch.cuda.get_device_capability() == (9, 0):  # 260 queries, 16 heads: the Hopper grid
        ran = flashcore.last_kernel("fwd")
        assert ran.startswith("sm90") and "varlen" in ran, ran
    check_close("out", got.cpu(), want, lowp.cpu(), dtype=dtype)
    torch.testing.assert_close(got_lse.cpu().double(), want_lse, rtol=2e-3, atol=2e-3)
