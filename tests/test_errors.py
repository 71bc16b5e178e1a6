"""Bad input gets a clear error naming the argument; empty inputs behave as SDPA does."""

import math

import pytest
import torch
import torch.nn.functional as F

import flashcore
from conftest import cuda_skip_reason


def _qkv(B=1, Hq=2, Hkv=2, Sq=5, Sk=6, D=8, dtype=torch.float32, device="cpu"):
    return (torch.randn(B, Hq, Sq, D, dtype=dtype, device=device),
            torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device),
            torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device))


def _bad_cases():
    q, k, v = _qkv()
    return [
        ("int dtype", (q.int(), k.int(), v.int()), {}, r"query has dtype Int"),
        ("mixed dtype", (q, k, v.half()), {}, r"value has dtype Half but query has dtype Float"),
        ("mixed dtype key", (q.double(), k, v.double()), {}, r"key has dtype"),
        ("1-D", (q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]), {}, r"at least 2-D"),
        # batch dims that broadcast (SDPA's rule) are tested in test_sdpa_compat.py
        ("leading dims", (q[None].expand(3, -1, -1, -1, -1), k[None].expand(2, -1, -1, -1, -1),
                          v[None].expand(2, -1, -1, -1, -1)), {}, r"batch dims .* do not broadcast"),
        ("head dim", (q, *_qkv(D=4)[1:]), {}, r"key head_dim 4 does not match query head_dim 8"),
        ("heads without gqa", (q, *_qkv(Hkv=4)[1:]), {}, r"enable_gqa"),
        ("heads not multiple", (q, *_qkv(Hkv=3)[1:]), {"enable_gqa": True}, r"multiple of key/value heads"),
        ("key/value heads", (_qkv(Hq=6)[0], _qkv(Hkv=2)[1], _qkv(Hkv=3)[2]), {"enable_gqa": True},
         r"key has 2 heads and value 3"),
        ("kv length", (q, k, v[:, :, :3]), {}, r"value has sequence length 3 but key has 6"),
        ("head dim too big", _qkv(D=300), {}, r"head_dim 300"),
        ("value head dim too big", (q, k, _qkv(D=300)[2]), {}, r"value head_dim 300 \(value.size\(-1\)\)"),
        ("scale nan", (q, k, v), {"scale": float("nan")}, r"scale must be finite"),
        ("scale inf", (q, k, v), {"scale": math.inf}, r"scale must be finite"),
    ]


@pytest.mark.parametrize("name,args,kwargs,match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_raises_clear_error(name, args, kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        flashcore.attention(*args, **kwargs)


def test_op_rejects_what_attention_adapts():
    """flashcore.attention copies strided rows and pads a value head dim other than query's (SDPA takes both); the
    op itself takes neither and says so."""
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r"query must have a contiguous last dimension"):
        torch.ops.flashcore.fwd(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2), 0.3)
    with pytest.raises(RuntimeError, match=r"value head_dim 16"):
        torch.ops.flashcore.fwd(q, k, _qkv(D=16)[2], 0.3)


@pytest.mark.parametrize("kwargs,match", [
    ({"is_causal": None}, "is_causal must be a bool"), ({"is_causal": 1}, "is_causal must be a bool"),
    ({"is_causal": torch.tensor(True)}, "is_causal must be a bool"),
    ({"enable_gqa": None}, "enable_gqa must be a bool"), ({"scale": "0.5"}, "scale must be a float"),
    ({"window_size": "20"}, "window_size must be a pair"),
])
def test_argument_types_as_sdpa_checks_them(kwargs, match):
    """SDPA raises TypeError for these; flashcore does too (a string scale or window is not parsed)."""
    with pytest.raises(TypeError, match=match):
        flashcore.attention(*_qkv(), **kwargs)


def test_fake_kernels_check_unit_stride_rows():
    """The fake kernels refuse what the C++ ops refuse (rows of stride 1), so that a direct op call fails when
    torch.compile traces it, not at run time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _qkv()
    out, lse = torch.ops.flashcore.fwd(q, k, v, 0.3)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fq, fk, fv, fo, flse = (mode.from_tensor(t) for t in (q, k, v, out, lse))
        strided = mode.from_tensor(torch.randn(1, 2, 5, 16)[..., ::2])
        with pytest.raises(RuntimeError, match="query must have a contiguous last dimension"):
            torch.ops.flashcore.fwd(strided, fk, fv, 0.3)
        with pytest.raises(RuntimeError, match="grad_out must have a contiguous last dimension"):
            torch.ops.flashcore.bwd(strided, fq, fk, fv, fo, flse, 0.3, False, False, -1, -1, 0.0, False)
        torch.ops.flashcore.bwd(fo, fq, fk, fv, fo, flse, 0.3, False, False, -1, -1, 0.0, False)


def test_unsupported_sdpa_arguments():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="attn_mask"):
        flashcore.attention(q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flashcore.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        flashcore.attention([1.0], k, v)


def test_bwd_op_rejects_bad_lse():
    q, k, v = _qkv()
    out, lse = torch.ops.flashcore.fwd(q, k, v, 0.3)
    with pytest.raises(RuntimeError, match="lse must be float32"):  # float32 inputs: a float32 lse
        torch.ops.flashcore.bwd(out, q, k, v, out, lse.double(), 0.3, False, False, -1, -1, 0.0, False)
    with pytest.raises(RuntimeError, match="lse"):
        torch.ops.flashcore.bwd(out, q, k, v, out, lse[:, :, :2], 0.3, False, False, -1, -1, 0.0, False)
    with pytest.raises(RuntimeError, match="grad_out"):
        torch.ops.flashcore.bwd(out[:, :, :2], q, k, v, out, lse, 0.3, False, False, -1, -1, 0.0, False)


@pytest.mark.parametrize("kwargs,match", [
    ({"window_size": (-2, 0)}, r"window_left \(window_size\[0\]\) must be -1"),
    ({"window_size": (3, -5)}, r"window_right \(window_size\[1\]\) must be -1"),
    ({"window_size": (1, 2, 3)}, r"window_size must be a pair"),
    ({"softcap": -1.0}, r"softcap must be finite and >= 0"),
    ({"softcap": float("nan")}, r"softcap must be finite"),
    ({"sinks": torch.zeros(3)}, r"sinks must have shape \(heads_q,\) = \(2,\)"),
    ({"sinks": torch.zeros(2, dtype=torch.int32)}, r"sinks must be float32"),  # other float dtypes are cast
    ({"alibi_slopes": torch.zeros(2, 3)}, r"alibi_slopes must have shape \(heads_q,\) = \(2,\) or \(batch, heads_q\)"),
    ({"alibi_slopes": torch.zeros(2, dtype=torch.int64)}, r"alibi_slopes must be float32"),
])
def test_bad_variant_arguments_raise(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises((RuntimeError, TypeError), match=match):
        flashcore.attention(q, k, v, **kwargs)


def test_flash_attn_interface_refuses_dropout_by_name():
    from flashcore.flash_attn_interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

    q = torch.randn(1, 5, 2, 8)
    with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
        flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_qkvpacked_func(torch.stack([q, q, q], 2), 0.5)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_kvpacked_func(q, torch.stack([q, q], 2), 0.5)
    with pytest.raises(RuntimeError, match="qkv must be"):
        flash_attn_qkvpacked_func(q)


@pytest.mark.parametrize("shape_q,shape_kv", [((0, 2, 5, 8), (0, 2, 6, 8)), ((1, 2, 0, 8), (1, 2, 6, 8)),
                                              ((1, 2, 5, 8), (1, 2, 0, 8)), ((1, 0, 5, 8), (1, 0, 6, 8))],
                         ids=["batch0", "sq0", "sk0", "heads0"])
def test_empty_inputs_like_sdpa(shape_q, shape_kv):
    q = torch.randn(*shape_q, requires_grad=True)
    k = torch.randn(*shape_kv, requires_grad=True)
    v = torch.randn(*shape_kv, requires_grad=True)
    out, lse = flashcore.attention(q, k, v, return_lse=True)
    assert out.shape == shape_q and lse.shape == shape_q[:3]
    if shape_q[1] > 0:  # SDPA itself dies with SIGFPE on zero heads (torch 2.11, CPU), so compare elsewhere
        ref = F.scaled_dot_product_attention(q, k, v)
        assert torch.equal(out, ref)  # Sk = 0: SDPA gives zeros on CPU, flashcore too
    if shape_kv[2] == 0:
        assert torch.isneginf(lse).all()
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert torch.count_nonzero(q.grad) == 0 or q.numel() == 0


def test_no_keys_with_sinks_gives_the_sink():
    """Sk = 0 with sinks: out 0 and lse = the head's sink, as rows that see no key get when Sk > 0."""
    q = torch.randn(2, 3, 4, 8)
    k = v = torch.randn(2, 3, 0, 8)
    sinks = torch.tensor([0.5, -1.0, float("-inf")])
    out, lse = flashcore.attention(q, k, v, sinks=sinks, return_lse=True)
    assert not out.any()
    torch.testing.assert_close(lse, sinks.view(1, 3, 1).expand(2, 3, 4), rtol=0, atol=0)
    _, lse_window = flashcore.attention(q, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), sinks=sinks,
                                        window_size=(0, -1), is_causal=True, return_lse=True)  # rows 0..3 see keys
    assert torch.isfinite(lse_window[:, :2]).all()


def test_head_dim_one_single_element():
    """A (1, 1, 1, 1) grad_out has strides PyTorch calls contiguous ([0, 0, 0, 0] after a sum's expand); a last dim
    of size 1 has no stride to check."""
    q = torch.randn(1, 1, 1, 1, requires_grad=True, dtype=torch.float64)
    k = torch.randn(1, 1, 3, 1, requires_grad=True, dtype=torch.float64)
    v = torch.randn(1, 1, 3, 1, requires_grad=True, dtype=torch.float64)
    flashcore.attention(q, k, v).sum().backward()
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2).sum().backward()
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want)
    strided = torch.randn(1, 2, 5, 2, dtype=torch.float64)[..., :1]  # last stride 2, size 1
    out = flashcore.attention(strided, strided, strided)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(strided, strided, strided))


@pytest.mark.parametrize("heads", [2**31, 2**32], ids=["2^31", "2^32"])
def test_empty_inputs_with_huge_head_count(heads):
    # Zero-length sequences, so no kernel runs; the call's divisors (heads, group) are still built on the host
    # and must not divide by zero or overflow there.
    q, k, v = (torch.empty(1, heads, 0, 8) for _ in range(3))
    out, lse = flashcore.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]


@pytest.mark.gpu
@pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")
def test_mixed_devices_raise():
    q, k, v = _qkv(dtype=torch.float16)  # a dtype the CUDA kernels take, so the device check is what fires
    with pytest.raises(RuntimeError, match="key is on"):
        flashcore.attention(q.cuda(), k, v.cuda())
    with pytest.raises(RuntimeError, match="value is on"):
        flashcore.attention(q.cuda(), k.cuda(), v)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")
def test_cuda_unsupported_dtype_and_head_dim():
    q, k, v = _qkv(device="cuda")
    with pytest.raises(RuntimeError, match="query has dtype Float"):
        flashcore.attention(q, k, v)
    # The op takes head dims that are multiples of 8; flashcore.attention (like flash-attn) pads the others.
    q, k, v = _qkv(D=36, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="head_dim 36"):
        torch.ops.flashcore.fwd(q, k, v, 0.1)
    out = flashcore.attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == q.shape and (out.float() - ref.float()).abs().max() < 1e-2
    q, k, v = _qkv(D=264, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="head_dim 264"):
        flashcore.attention(q, k, v)


@pytest.mark.parametrize("name", ["sinks", "alibi_slopes"])
def test_meta_device_vector_with_real_query(name):
    """A meta-device sinks/alibi_slopes beside a CPU query would route the call to the fake kernel (uninitialised
    outputs); it raises, naming the argument."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match=f"flashcore: {name} is on meta but query is on cpu"):
        flashcore.attention(q, q, q, **{name: torch.zeros(2, device="meta")})


@pytest.mark.parametrize("case", ["heads", "head_dim", "dtype", "batch"])
def test_fake_kernel_checks_shapes(case):
    """On the meta device (and under torch.compile's fake tensors) a bad call fails with the C++ checks' message,
    not later at run time."""
    m = lambda *s, dtype=torch.float32: torch.empty(*s, device="meta", dtype=dtype)  # noqa: E731
    args, match = {
        "heads": ((m(1, 3, 5, 8), m(1, 2, 5, 8), m(1, 2, 5, 8)), r"multiple of key/value heads"),
        "head_dim": ((m(1, 2, 5, 8), m(1, 2, 5, 8), m(1, 2, 5, 4)), r"value head_dim 4"),
        "dtype": ((m(1, 2, 5, 8), m(1, 2, 5, 8, dtype=torch.float16), m(1, 2, 5, 8)), r"key has dtype"),
        "batch": ((m(1, 2, 5, 8), m(2, 2, 5, 8), m(2, 2, 5, 8)), r"key batch size 2"),
    }[case]
    with pytest.raises(RuntimeError, match=match):
        torch.ops.flashcore.fwd(*args, 0.3)



def test_argument_types_of_the_flash_attn_interface():
    """Flags are bools (a string such as 'no' would read as True), lengths ints (5.9 is not truncated, None is
    named), vectors tensors; integer-valued numpy and 0-d tensors are taken as flash-attn's callers pass them."""
    import numpy as np
    from flashcore.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn_func(q, q, q, causal="no")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attn_func(q, q, q, deterministic="yes")
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn_func(q, q, q, causal=1.0)
    # flash-attn's custom ops take integers, numpy bools and 0-d tensors for a bool; so does its interface here
    want = flash_attn_func(q, q, q, causal=True)
    for flag in (1, np.True_, np.int32(1), torch.tensor(True), torch.tensor(1)):
        assert torch.equal(flash_attn_func(q, q, q, causal=flag), want), flag
    assert torch.equal(flash_attn_func(q, q, q, causal=0), flash_attn_func(q, q, q, causal=False))
    with pytest.raises(TypeError, match="alibi_slopes must be a float32 tensor"):
        flash_attn_func(q, q, q, alibi_slopes=[0.1, 0.2])
    with pytest.raises(TypeError, match="sinks must be a float32 tensor"):
        flashcore.attention(*_qkv(), sinks=[0.0, 0.0])
    qv = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for bad, match in ((None, "max_seqlen_q must be an int; got None"), (5.9, "max_seqlen_q must be an int"),
                       ("5", "max_seqlen_q must be an int")):
        with pytest.raises(TypeError, match=match):
            flash_attn_varlen_func(qv, qv, qv, cu, cu, bad, 5)
    want = flash_attn_varlen_func(qv, qv, qv, cu, cu, 5, 5)
    for ok in (np.int64(5), torch.tensor(5)):
        assert torch.equal(flash_attn_varlen_func(qv, qv, qv, cu, cu, ok, ok), want)
    with pytest.raises(TypeError, match="seqused_k must be a torch.Tensor"):
        flashcore.varlen_attention(qv, qv, qv, cu, cu, 5, 5, seqused_k=[3, 5])
    kc = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="num_splits must be an int"):
        flash_attn_with_kvcache(q[:, :1], kc, kc, cache_seqlens=3, num_splits="a")
    with pytest.raises(TypeError, match="rotary_interleaved must be a bool"):
        flash_attn_with_kvcache(q[:, :1], kc, kc, cache_seqlens=3, rotary_interleaved="no")


def test_windows_and_caps_at_the_limits_of_their_types():
    """A window side beyond any sequence length (even past int64) is unbounded; a softcap too small for float32
    caps every logit to ~0 (uniform attention), as the float64 definition does, instead of rounding to no cap."""
    q, k, v = _qkv(Sq=6, Sk=6)
    want = flashcore.attention(q, k, v)
    for huge in (2**31, 2**63, 10**30):
        assert torch.equal(flashcore.attention(q, k, v, window_size=(huge, huge)), want)
    uniform = v.mean(dim=2, keepdim=True).expand_as(want)
    for cap in (1e-46, 1e-30):
        torch.testing.assert_close(flashcore.attention(q, k, v, softcap=cap), uniform, atol=1e-5, rtol=0)


def test_kvcache_refused_call_leaves_the_cache_unchanged():
    """flash_attn_with_kvcache checks everything before it appends the new k/v (flash-attn's order): a call that
    raises has not written the caches, so the caller can fix the argument and call again."""
    from flashcore.flash_attn_interface import flash_attn_with_kvcache
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    k0, v0 = kc.clone(), vc.clone()
    new = (torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16))
    bad = [({"sinks": torch.randn(3)}, "sinks"), ({"alibi_slopes": torch.randn(2, 5)}, "alibi_slopes"),
           ({"softcap": float("nan")}, "softcap"), ({"cache_leftpad": torch.tensor([0, 9], dtype=torch.int32)},
                                              "cache_leftpad"),
           ({"cache_batch_idx": torch.tensor([0, 5], dtype=torch.int32)}, "cache_batch_idx"),
           ({"num_splits": 300}, "num_splits")]
    for kwargs, name in bad:
        with pytest.raises((RuntimeError, TypeError), match=name):
            flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=3, **kwargs)
        assert torch.equal(kc, k0) and torch.equal(vc, v0), name
    with pytest.raises(RuntimeError, match="nheads"):
        flash_attn_with_kvcache(torch.randn(2, 1, 3, 16), kc, vc, *new, cache_seqlens=3)
    with pytest.raises(RuntimeError, match="seqlen_q = 10 .* at most 8 keys"):  # flash-attn's rule with new keys
        flash_attn_with_kvcache(torch.randn(2, 10, 4, 16), kc, vc, *new, cache_seqlens=3)
    assert torch.equal(kc, k0)
    flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=3)
    assert torch.equal(kc[:, 3], new[0][:, 0]) and torch.equal(vc[:, 3], new[1][:, 0])


def test_paged_varlen_checks_its_offsets():
    """flash_attn_varlen_func with block_table (run on the KV-cache op) checks cu_seqlens and max_seqlen as the
    varlen op does, naming them (the CPU reads the offsets' values too)."""
    from flashcore.flash_attn_interface import flash_attn_varlen_func
    q, kc = torch.randn(8, 4, 16), torch.randn(4, 4, 4, 16)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu, ck = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    cases = [((cu.long(), ck, 5, 4), "cu_seqlens_q must be int32"),
             ((cu, ck[None], 5, 4), "cu_seqlens_k must have shape"),
             ((cu, ck, 0, 4), "max_seqlen_q must be in \\[1"),
             ((cu, ck, 2, 4), "more than max_seqlen_q = 2"),
             ((torch.tensor([0, 3, 10], dtype=torch.int32), ck, 7, 4), "cu_seqlens_q\\[-1\\] = 10 exceeds"),
             ((torch.tensor([0, 5, 3], dtype=torch.int32), ck, 5, 4), "never decrease")]
    for args, match in cases:
        with pytest.raises(RuntimeError, match=match):
            flash_attn_varlen_func(q, kc, kc, *args, block_table=bt)
    want = flash_attn_varlen_func(q, kc, kc, cu, ck, 5, 4, block_table=bt)
    assert torch.equal(flash_attn_varlen_func(q, kc, kc, cu, ck, 10**9, 4, block_table=bt), want)  # no 10^9 rows


def test_packed_functions_name_their_own_arguments():
    """The packed functions' errors name what their caller passed (qkv's cu_seqlens and max_seqlen, kv), not the
    unpacked names of the shared body."""
    from flashcore.flash_attn_interface import (flash_attn_kvpacked_func, flash_attn_varlen_kvpacked_func,
                                                flash_attn_varlen_qkvpacked_func)
    qkv = torch.randn(8, 3, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cu_seqlens must be int32"):
        flash_attn_varlen_qkvpacked_func(qkv, cu.long(), 5)
    with pytest.raises(RuntimeError, match="max_seqlen must be in"):
        flash_attn_varlen_qkvpacked_func(qkv, cu, 0)
    q = torch.randn(8, 2, 16)
    with pytest.raises(RuntimeError, match="kv has dtype torch.float16"):
        flash_attn_varlen_kvpacked_func(q, torch.randn(8, 2, 2, 16).half(), cu, cu, 5, 5)
    with pytest.raises(RuntimeError, match="kv has head dim 8"):
        flash_attn_kvpacked_func(q[None], torch.randn(1, 8, 2, 2, 8))
