"""flash-attn's helper modules that attention code imports beside the kernels: flashcore.bert_padding (unpad /
pad a batch for the varlen functions) and flashcore.layers.rotary (apply_rotary_emb), used the way flash-attn's own
tests use them. CPU (CI) tests; the helpers are PyTorch ops, the same on every device."""

import pytest
import torch

import flashcore
from flashcore.bert_padding import (index_first_axis, index_put_first_axis, pad_input, unpad_input,
                                    unpad_input_for_concatenated_sequences)
from flashcore.layers.rotary import (RotaryArgumentError, apply_rotary, apply_rotary_emb, apply_rotary_emb_func,
                                     apply_rotary_emb_torch)


def _mask(lengths, seqlen, left=False):
    """(batch, seqlen) bool mask with lengths[b] tokens, at the start (right padding) or the end (left padding)."""
    pos = torch.arange(seqlen)
    lens = torch.tensor(lengths)[:, None]
    return pos >= seqlen - lens if left else pos < lens


@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
def test_unpad_pad_round_trip(left):
    g = torch.Generator().manual_seed(0)
    lengths, seqlen = [5, 0, 8, 3], 8
    x = torch.randn(4, seqlen, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = _mask(lengths, seqlen, left)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    assert x_unpad.shape == (sum(lengths), 3, 6)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 5, 5, 13, 16]
    assert max_seqlen == 8 and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == lengths
    torch.testing.assert_close(x_unpad, x[mask], rtol=0, atol=0)
    back = pad_input(x_unpad, indices, 4, seqlen)
    assert back.shape == x.shape
    torch.testing.assert_close(back, torch.where(mask[..., None, None], x, 0.0), rtol=0, atol=0)
    # gradients flow through both directions: d(sum(pad(unpad(x)) * w)) / dx = w on tokens, 0 on padding
    w = torch.randn(back.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((back * w).sum(), x)
    torch.testing.assert_close(grad, torch.where(mask[..., None, None], w, 0.0), rtol=0, atol=0)
    assert torch.equal(index_first_axis(x.flatten(0, 1), indices), x_unpad)
    assert torch.equal(index_put_first_axis(x_unpad, indices, 4 * seqlen).unflatten(0, (4, seqlen)), back)


def test_unpad_input_with_unused_tokens():
    """unused_mask: tokens allocated but unused stay in the packed rows (cu_seqlens counts them), seqused does
    not, as flash-attn's unpad_input returns them for seqused_k."""
    mask = _mask([3, 2], 6)
    unused = torch.zeros(2, 6, dtype=torch.bool)
    unused[0, 3], unused[1, 2:4] = True, True
    x = torch.arange(12.0).reshape(2, 6, 1)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert cu_seqlens.tolist() == [0, 4, 8] and seqused.tolist() == [3, 2] and max_seqlen == 4
    assert x_unpad.flatten().tolist() == [0, 1, 2, 3, 6, 7, 8, 9]


def test_unpad_input_for_concatenated_sequences():
    """flash-attn's docstring example: rows holding several samples each become one sequence per sample."""
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.arange(18.0).reshape(3, 6, 1)
    x_unpad, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu_seqlens.tolist() == [0, 2, 5, 8, 10, 16] and max_seqlen == 6
    assert x_unpad.flatten().tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]


@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_through_varlen_matches_dense(causal):
    """flash-attn's pattern for a padded batch: unpad q/k/v with the key padding mask, run the varlen function,
    pad the output back; each sequence equals the dense function on its tokens alone."""
    g = torch.Generator().manual_seed(1)
    lengths, seqlen, H, D = [7, 2, 11], 11, 2, 16
    q, k, v = (torch.randn(3, seqlen, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    mask = _mask(lengths, seqlen)
    q_u, idx, cu, max_s, _ = unpad_input(q, mask)
    k_u, v_u = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out_u = flashcore.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=causal)
    out = pad_input(out_u, idx, 3, seqlen)
    for b, n in enumerate(lengths):
        want = flashcore.flash_attn_func(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal)
        torch.testing.assert_close(out[b:b + 1, :n], want, rtol=1e-12, atol=1e-12)
        assert not out[b, n:].any()


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_apply_rotary_emb_matches_reference(interleaved, rotary_dim):
    """apply_rotary_emb against flash-attn's torch reference, with int and per-sequence offsets, rotary_dim below
    headdim (the rest passes through), fp16 rounded once from a float32 computation."""
    g = torch.Generator().manual_seed(2)
    B, S, H, D, seqlen_ro = 3, 5, 2, 16, 12
    x = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    angles = torch.rand(seqlen_ro, rotary_dim // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = angles.cos(), angles.sin()
    for offsets in (0, 4, torch.tensor([0, 7, 3], dtype=torch.int32)):
        pos = torch.arange(S)[None, :] + (offsets[:, None] if isinstance(offsets, torch.Tensor) else offsets)
        pos = pos.expand(B, S).long()
        want = apply_rotary_emb_torch(x, cos[pos], sin[pos], interleaved)
        got = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
        got16 = apply_rotary_emb(x.half(), cos.float(), sin.float(), interleaved, seqlen_offsets=offsets)
        assert got16.dtype == torch.float16
        torch.testing.assert_close(got16.double(), want, rtol=2e-3, atol=2e-3)
    assert apply_rotary_emb_func is apply_rotary_emb


def test_apply_rotary_emb_varlen_inplace_and_past_the_table():
    """Packed sequences (cu_seqlens) rotate each from its own position 0 (+ offset); inplace writes into x;
    positions past seqlen_ro stay unrotated; gradients are the rotation's transpose (gradcheck)."""
    g = torch.Generator().manual_seed(3)
    lens, H, D = [4, 1, 6], 2, 8
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    x = torch.randn(sum(lens), H, D, generator=g, dtype=torch.float64)
    angles = torch.rand(8, D // 2, generator=g, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    offsets = torch.tensor([0, 2, 3])
    got = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=6)
    for b in range(2):
        s, e = int(cu[b]), int(cu[b + 1])
        want = apply_rotary_emb(x[None, s:e], cos, sin, seqlen_offsets=int(offsets[b]))[0]
        torch.testing.assert_close(got[s:e], want, rtol=0, atol=0)
    # sequence 2's tokens sit at positions 3..8: position 8 is past the 8-row table and stays as it is (a tensor of
    # offsets is not checked: flash-attn's kernel loads cos 1, sin 0 there); as an int offset it is refused
    want = apply_rotary_emb(x[None, 5:10], cos, sin, seqlen_offsets=3)[0]
    torch.testing.assert_close(got[5:10], want, rtol=0, atol=0)
    torch.testing.assert_close(got[10], x[10], rtol=0, atol=0)
    assert not torch.allclose(got[9], x[9])
    with pytest.raises(RotaryArgumentError, match="seqlen_offsets"):
        apply_rotary_emb(x[None, 5:11], cos, sin, seqlen_offsets=3)
    y = x.clone()
    out = apply_rotary_emb(y, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=6, inplace=True)
    assert out.data_ptr() == y.data_ptr() and torch.equal(y, got)
    xg = x[:5].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, cos, sin, cu_seqlens=cu[:3], max_seqlen=4), (xg,))


def test_rotary_tables_checked_as_flash_attn_asserts():
    """apply_rotary_emb refuses what flash-attn's apply_rotary asserts (an error that is both a ValueError and an
    AssertionError): a table shorter than the sequences (or than max_seqlen), an int offset that runs past it, and
    cu_seqlens without max_seqlen; the error names the argument."""
    x = torch.randn(2, 6, 2, 8, dtype=torch.float64)
    angles = torch.rand(6, 4, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    assert issubclass(RotaryArgumentError, ValueError) and issubclass(RotaryArgumentError, AssertionError)
    with pytest.raises(RotaryArgumentError, match="seqlen_ro"):
        apply_rotary_emb(x, cos[:5], sin[:5])
    with pytest.raises(RotaryArgumentError, match="seqlen_offsets"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=1)
    packed, cu = x.flatten(0, 1), torch.tensor([0, 6, 12], dtype=torch.int32)
    with pytest.raises(RotaryArgumentError, match="max_seqlen"):
        apply_rotary_emb(packed, cos, sin, cu_seqlens=cu)
    with pytest.raises(RotaryArgumentError, match="max_seqlen"):
        apply_rotary_emb(packed, cos[:4], sin[:4], cu_seqlens=cu, max_seqlen=6)
    with pytest.raises(RotaryArgumentError, match="rotary_dim"):
        apply_rotary_emb(x, torch.ones(6, 5, dtype=torch.float64), torch.zeros(6, 5, dtype=torch.float64))
    torch.testing.assert_close(apply_rotary_emb(packed, cos, sin, cu_seqlens=cu, max_seqlen=6),
                               apply_rotary_emb(x, cos, sin).flatten(0, 1), rtol=0, atol=0)


def test_apply_rotary_kernel_function():
    """flash_attn.ops.triton.rotary.apply_rotary: apply_rotary_emb's rotation outside autograd, in place or not,
    conjugate=True rotating back (the transpose)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    angles = torch.rand(9, 3, generator=g, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    offsets = torch.tensor([1, 4])
    for interleaved in (False, True):
        got = apply_rotary(x, cos, sin, seqlen_offsets=offsets, interleaved=interleaved)
        assert got.grad_fn is None and not got.requires_grad
        torch.testing.assert_close(got, apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets).detach(),
                                   rtol=0, atol=0)
        back = apply_rotary(got, cos, sin, seqlen_offsets=offsets, interleaved=interleaved, conjugate=True)
        torch.testing.assert_close(back, x.detach(), rtol=1e-12, atol=1e-12)
        y = x.detach().clone()
        assert apply_rotary(y, cos, sin, seqlen_offsets=offsets, interleaved=interleaved, inplace=True) is y
        torch.testing.assert_close(y, got, rtol=0, atol=0)


def test_kvcache_rotary_matches_apply_rotary_emb():
    """flash-attn's kvcache test builds its reference with apply_rotary_emb(k, cos, sin, seqlen_offsets=
    cache_seqlens): the new keys flash_attn_with_kvcache writes into the cache are exactly those."""
    g = torch.Generator().manual_seed(4)
    B, Sn, Hkv, D, cap = 2, 3, 1, 16, 12
    k_cache = torch.zeros(B, cap, Hkv, D, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(B, Sn, 2, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Sn, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    angles = torch.rand(cap, D // 4, generator=g, dtype=torch.float64) * 4
    lens = torch.tensor([2, 7], dtype=torch.int32)
    for interleaved in (False, True):
        kc, vc = k_cache.clone(), v_cache.clone()
        flashcore.flash_attn_with_kvcache(q, kc, vc, k, v, angles.cos(), angles.sin(), lens, causal=True,
                                          rotary_interleaved=interleaved)
        k_rot = apply_rotary_emb(k, angles.cos(), angles.sin(), interleaved, seqlen_offsets=lens)
        for b in range(B):
            s = int(lens[b])
            torch.testing.assert_close(kc[b, s:s + Sn], k_rot[b], rtol=1e-12, atol=1e-12)


def _rotate_reference(x, cos, sin, offsets, interleaved):
    """x (B, S, H, D) rotated at rows s + offsets[b] of cos/sin by flash-attn's PyTorch reference, row by row."""
    rows = [apply_rotary_emb_torch(x[b:b + 1], cos[offsets[b]:offsets[b] + x.shape[1]],
                                   sin[offsets[b]:offsets[b] + x.shape[1]], interleaved) for b in range(x.shape[0])]
    return torch.cat(rows)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["3heads", "3heads_permuted", "gqa"])
@pytest.mark.parametrize("k_tables", ["xpos", "shared"])
def test_apply_rotary_emb_qkv_and_kv_in_place(interleaved, layout, k_tables):
    """flash-attn's in-place packed forms: apply_rotary_emb_qkv_ rotates Q and K of a packed qkv ((B, S, 3, H, D), or
    (B, S, Hq + 2 Hk, D) with num_heads_q) and leaves V; cos_k/sin_k rotate K apart (XPos), without them Q and K take
    cos/sin in one pass where one view holds both (not for a (B, S, 3, H, D) view whose heads are not adjacent: then
    one pass each); apply_rotary_emb_kv_ rotates K of (B, S, 2, H, D); gradients flow through the in-place writes."""
    from flashcore.layers.rotary import apply_rotary_emb_kv_, apply_rotary_emb_qkv_
    g = torch.Generator().manual_seed(4)
    B, S, D, ro = 2, 5, 16, 12
    cos, sin = torch.randn(S + 3, ro // 2, generator=g, dtype=torch.float64), torch.randn(S + 3, ro // 2, generator=g,
                                                                                          dtype=torch.float64)
    cos_k, sin_k = (cos * 0.5, sin * 0.5) if k_tables == "xpos" else (None, None)
    offsets = torch.tensor([0, 3])
    shape, nq = ((B, S, 3, 2, D), None) if layout.startswith("3heads") else ((B, S, 4 + 2 * 2, D), 4)
    base = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    qkv = base * 1.0  # a non-leaf, so the in-place rotation is recorded by autograd
    if layout == "3heads_permuted":  # the same values in (B, S, H, 3, D) memory
        qkv = qkv.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    q0, k0, v0 = (base[:, :, i] for i in range(3)) if nq is None else (base[:, :, :4], base[:, :, 4:6], base[:, :, 6:])
    out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved=interleaved, seqlen_offsets=offsets,
                                num_heads_q=nq)
    assert out is qkv
    q1, k1, v1 = (out[:, :, i] for i in range(3)) if nq is None else (out[:, :, :4], out[:, :, 4:6], out[:, :, 6:])
    torch.testing.assert_close(q1, _rotate_reference(q0, cos, sin, offsets.tolist(), interleaved))
    torch.testing.assert_close(k1, _rotate_reference(k0, cos if cos_k is None else cos_k,
                                                     sin if sin_k is None else sin_k, offsets.tolist(), interleaved))
    torch.testing.assert_close(v1, v0, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), base)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    kv = torch.randn(B, S, 2, 2, D, generator=g, dtype=torch.float64)
    k_want = _rotate_reference(kv[:, :, 0], cos, sin, [0, 0], interleaved)
    v_want = kv[:, :, 1].clone()
    assert apply_rotary_emb_kv_(kv, cos, sin, interleaved=interleaved) is kv
    torch.testing.assert_close(kv[:, :, 0], k_want)
    torch.testing.assert_close(kv[:, :, 1], v_want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(torch.zeros(B, S, 8, D), cos, sin)


@pytest.mark.parametrize("scale_base", [None, 8.0])
def test_rotary_embedding_module(scale_base):
    """flash-attn's RotaryEmbedding: tables of cos/sin of position x base^(-2i/dim) (float32, in the input's dtype),
    with XPos's scale (Q up, K down) when scale_base is given; forward rotates qkv in place (or q and kv), taking
    seqlen_offset as an int or a (batch,) tensor with max_seqlen."""
    from flashcore.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(6)
    B, S, H, D, dim = 2, 6, 3, 16, 8
    rope = RotaryEmbedding(dim, base=100.0, interleaved=False, scale_base=scale_base)
    qkv = torch.randn(B, S, 3, H, D, generator=g)
    want_qkv = qkv.clone()
    rope(qkv, seqlen_offset=2)
    t = torch.arange(S + 2, dtype=torch.float32)
    freqs = torch.outer(t, 1.0 / 100.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    cos_k, sin_k = cos, sin
    if scale_base is not None:
        scale = (torch.arange(0, dim, 2, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
        xpos = scale ** ((t - (S + 2) // 2) / scale_base)[:, None]
        cos, sin, cos_k, sin_k = cos * xpos, sin * xpos, cos / xpos, sin / xpos
    torch.testing.assert_close(qkv[:, :, 0], _rotate_reference(want_qkv[:, :, 0], cos, sin, [2, 2], False))
    torch.testing.assert_close(qkv[:, :, 1], _rotate_reference(want_qkv[:, :, 1], cos_k, sin_k, [2, 2], False))
    torch.testing.assert_close(qkv[:, :, 2], want_qkv[:, :, 2], rtol=0, atol=0)
    # q and kv apart, a tensor offset (the tables grown to max_seqlen first)
    q, kv = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, 2, H, D, generator=g)
    q0, kv0 = q.clone(), kv.clone()
    rope2 = RotaryEmbedding(dim, base=100.0, interleaved=True)
    q_out, kv_out = rope2(q, kv, seqlen_offset=torch.tensor([1, 4]), max_seqlen=S + 4)
    assert q_out is q and kv_out is kv
    t = torch.arange(S + 4, dtype=torch.float32)
    freqs = torch.outer(t, 1.0 / 100.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    torch.testing.assert_close(q, _rotate_reference(q0, torch.cos(freqs), torch.sin(freqs), [1, 4], True))
    torch.testing.assert_close(kv[:, :, 0], _rotate_reference(kv0[:, :, 0], torch.cos(freqs), torch.sin(freqs),
                                                               [1, 4], True))
    torch.testing.assert_close(kv[:, :, 1], kv0[:, :, 1], rtol=0, atol=0)


def test_padding_function_classes():
    """flash-attn's IndexFirstAxis / IndexPutFirstAxis names: .apply as the functions."""
    from flashcore.bert_padding import IndexFirstAxis, IndexPutFirstAxis
    x = torch.arange(12.0).view(6, 2)
    idx = torch.tensor([4, 1])
    assert torch.equal(IndexFirstAxis.apply(x, idx), x[idx])
    assert torch.equal(IndexPutFirstAxis.apply(x[idx], idx, 6)[idx], x[idx])


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_rotary_on_a_leaf_that_requires_grad(inplace, interleaved):
    """flash-attn's own rotary tests: x a leaf that requires grad, rotated with inplace=True (its functions are
    autograd Functions writing into x), then out.backward(g) against the PyTorch reference's gradients; the same
    for apply_rotary_emb_qkv_ (3-head and GQA layouts, XPos tables for K) and apply_rotary_emb_kv_ on leaves."""
    from flashcore.layers.rotary import apply_rotary_emb_kv_, apply_rotary_emb_qkv_
    g = torch.Generator().manual_seed(7)
    B, S, H, D, ro = 2, 9, 3, 16, 8
    x = torch.randn(B, S, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    x_pt = x.detach().clone().requires_grad_()
    angles = torch.rand(S + 4, ro // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = angles.cos(), angles.sin()
    offsets = torch.tensor([0, 3])
    out = apply_rotary_emb(x, cos, sin, interleaved, inplace, seqlen_offsets=offsets)
    out_pt = _rotate_reference(x_pt, cos, sin, offsets.tolist(), interleaved)
    torch.testing.assert_close(out, out_pt)
    if inplace:
        torch.testing.assert_close(x.detach(), out_pt.detach())  # written into the leaf
    grad = torch.randn(out.shape, generator=g, dtype=out.dtype)
    out.backward(grad)
    out_pt.backward(grad.clone())
    torch.testing.assert_close(x.grad, x_pt.grad)
    if not inplace:
        return  # the packed forms below are in place only

    base = torch.randn(2 * B, S, H, D, generator=g, dtype=torch.float64)
    view = base[:B].requires_grad_()  # a view made a leaf itself
    view_pt = view.detach().clone().requires_grad_()
    out = apply_rotary_emb(view, cos, sin, interleaved, True)
    out_pt = _rotate_reference(view_pt, cos, sin, [0] * B, interleaved)
    torch.testing.assert_close(base[:B], out_pt.detach())
    out.transpose(-1, -2).sum().backward()  # a non-contiguous gradient
    out_pt.transpose(-1, -2).sum().backward()
    torch.testing.assert_close(view.grad, view_pt.grad)

    for nq, shape in ((None, (B, S, 3, 2, D)), (4, (B, S, 8, D))):
        qkv = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
        qkv_pt = qkv.detach().clone().requires_grad_()
        cos_k, sin_k = cos * 0.5, sin * 0.5
        out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets=offsets, num_heads_q=nq)
        if nq is None:
            parts = [_rotate_reference(qkv_pt[:, :, 0], cos, sin, offsets.tolist(), interleaved),
                     _rotate_reference(qkv_pt[:, :, 1], cos_k, sin_k, offsets.tolist(), interleaved), qkv_pt[:, :, 2]]
            out_pt = torch.stack(parts, dim=2)
        else:
            parts = [_rotate_reference(qkv_pt[:, :, :4], cos, sin, offsets.tolist(), interleaved),
                     _rotate_reference(qkv_pt[:, :, 4:6], cos_k, sin_k, offsets.tolist(), interleaved),
                     qkv_pt[:, :, 6:]]
            out_pt = torch.cat(parts, dim=2)
        torch.testing.assert_close(out, out_pt)
        grad = torch.randn(out.shape, generator=g, dtype=out.dtype)
        out.backward(grad)
        out_pt.backward(grad.clone())
        torch.testing.assert_close(qkv.grad, qkv_pt.grad)

    kv = torch.randn(B, S, 2, 2, D, generator=g, dtype=torch.float64, requires_grad=True)
    kv_pt = kv.detach().clone().requires_grad_()
    out = apply_rotary_emb_kv_(kv, cos, sin, interleaved)
    out_pt = torch.stack([_rotate_reference(kv_pt[:, :, 0], cos, sin, [0, 0], interleaved), kv_pt[:, :, 1]], dim=2)
    torch.testing.assert_close(out, out_pt)
    out.backward(torch.ones_like(out))
    out_pt.backward(torch.ones_like(out_pt))
    torch.testing.assert_close(kv.grad, kv_pt.grad)


def test_padding_helpers_take_int32_indices_and_the_residual_form():
    """flash-attn's pad_input writes with output[indices] = values, which takes int32 indices as well as int64;
    index_first_axis_residual returns the gathered rows and the input, gradients reaching it through both."""
    from flashcore.bert_padding import IndexFirstAxisResidual, index_first_axis_residual
    x = torch.randn(3, 8, dtype=torch.float64)
    for dtype in (torch.int32, torch.int64):
        idx = torch.tensor([0, 1, 4], dtype=dtype)
        y = pad_input(x, idx, 2, 3)
        assert y.shape == (2, 3, 8) and torch.equal(y.view(6, 8)[idx.long()], x)
        assert not y.view(6, 8)[[2, 3, 5]].any()
        torch.testing.assert_close(index_first_axis(y.view(6, 8), idx), x, rtol=0, atol=0)
    inp = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    rows, residual = IndexFirstAxisResidual.apply(inp, torch.tensor([1, 3]))
    assert index_first_axis_residual is IndexFirstAxisResidual.apply
    torch.testing.assert_close(rows, inp[[1, 3]], rtol=0, atol=0)
    (rows.sum() * 2 + residual.sum()).backward()
    want = torch.tensor([1.0, 3.0, 1.0, 3.0, 1.0], dtype=torch.float64)[:, None].expand(5, 4)
    torch.testing.assert_close(inp.grad, want)
