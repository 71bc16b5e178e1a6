"""What code written for SDPA observes of flashcore.attention beyond the common shapes: broadcast batch and head
dims, a value head dim other than query's (the output is dense, in query's layout), an empty head dim, and rows
whose every score is -inf from the data (out 0, never NaN). CPU (CI) tests against SDPA and a float64 reference;
the -inf rows run on the GPU too."""

import pytest
import torch
import torch.nn.functional as F

import flashcore
from conftest import cuda_skip_reason


def _randn(*shape, g, dtype=torch.float64, device="cpu"):
    return torch.randn(*shape, generator=g, dtype=dtype).to(device)


# (query, key, value) shapes that SDPA broadcasts: batch dims as torch broadcasts them, one key/value head for
# every query head (with or without enable_gqa), one query head for every key/value head, key and value heads
# of 1 and n, fewer dims on one side.
BROADCAST_CASES = {
    "kv_batch_1": ((2, 4, 5, 8), (1, 4, 7, 8), (1, 4, 7, 8), {}),
    "q_batch_1": ((1, 4, 5, 8), (3, 4, 7, 8), (3, 4, 7, 8), {}),
    "value_batch_3": ((1, 2, 5, 8), (1, 2, 7, 8), (3, 2, 7, 8), {}),
    "one_kv_head": ((2, 4, 5, 8), (2, 1, 7, 8), (2, 1, 7, 8), {}),
    "one_kv_head_gqa": ((2, 4, 5, 8), (2, 1, 7, 8), (2, 1, 7, 8), {"enable_gqa": True}),
    "one_query_head": ((2, 1, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8), {}),
    "one_value_head": ((2, 2, 5, 8), (2, 2, 7, 8), (2, 1, 7, 8), {}),
    "query_3d": ((4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), {}),
    "query_2d": ((5, 8), (3, 7, 8), (3, 7, 8), {}),
    "5d": ((2, 1, 2, 5, 8), (1, 3, 2, 7, 8), (1, 3, 2, 7, 8), {}),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(BROADCAST_CASES))
def test_broadcast_dims_like_sdpa(case, causal):
    sq, sk, sv, kwargs = BROADCAST_CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (_randn(*s, g=g).requires_grad_() for s in (sq, sk, sv))
    out = flashcore.attention(q, k, v, is_causal=causal, **kwargs)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    dout = _randn(*out.shape, g=g)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q, k, v), dout)
    for a, b, name in zip(got, ref, "qkv"):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_smaller_value_head_dim_gives_a_dense_output(layout):
    """Dv < D runs zero-padded to D; the output is a dense tensor in query's layout, not a view into the padded
    buffer (.view works). SDPA's CPU math path returns such calls BHSD-contiguous whatever the input layout; its
    CUDA kernels keep query's, as flashcore does for every head dim."""
    g = torch.Generator().manual_seed(1)
    shapes = ((2, 3, 4, 16), (2, 3, 5, 16), (2, 3, 5, 8))
    if layout == "bshd":  # (B, S, H, D) tensors seen as (B, H, S, D)
        q, k, v = (_randn(s[0], s[2], s[1], s[3], g=g).transpose(1, 2) for s in shapes)
    else:
        q, k, v = (_randn(*s, g=g) for s in shapes)
    out = flashcore.attention(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    dense = out if layout == "bhsd" else out.transpose(1, 2)
    assert dense.is_contiguous() and dense.view(2, -1).shape == (2, 96)


def test_empty_head_dim_like_sdpa():
    """D = Dv = 0: SDPA returns an empty (…, 0) output; every score is 0, so lse is log(number of keys)."""
    z = torch.randn(2, 3, 4, 0, dtype=torch.float64)
    kz = torch.randn(2, 3, 6, 0, dtype=torch.float64)
    out, lse = flashcore.attention(z, kz, kz, return_lse=True)
    assert out.shape == F.scaled_dot_product_attention(z, kz, kz).shape == (2, 3, 4, 0)
    torch.testing.assert_close(lse, torch.full((2, 3, 4), float(torch.log(torch.tensor(6.0)))), check_dtype=False)


def _minus_inf_rows(g, device, dtype):
    """q whose row 1 (of every head) is -inf in its first column, against keys whose first column is 1: every score of
    that row is -inf (the other columns add -inf * 0 nowhere: they multiply finite values)."""
    q = _randn(2, 2, 6, 16, g=g, device=device).to(dtype)
    k = _randn(2, 2, 9, 16, g=g, device=device).to(dtype)
    v = _randn(2, 2, 9, 16, g=g, device=device).to(dtype)
    k[..., 0] = 1.0
    q[:, :, 1, 0] = float("-inf")
    return q, k, v


def _check_minus_inf_rows(device, dtype):
    g = torch.Generator().manual_seed(2)
    q, k, v = _minus_inf_rows(g, device, dtype)
    for causal in (False, True):
        out, lse = flashcore.attention(q, k, v, is_causal=causal, return_lse=True)
        assert not out.isnan().any()
        assert (out[:, :, 1] == 0).all() and (lse[:, :, 1] == float("-inf")).all()
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        rows = [0, 2, 3, 4, 5]
        tol = 1e-12 if dtype == torch.float64 else 2e-2
        torch.testing.assert_close(out[:, :, rows].double(), want[:, :, rows], rtol=tol, atol=tol)
        # the value gradient is defined there (P = 0 on the row): finite, and equal to the reference's
        vv = v.detach().requires_grad_()
        (dv,) = torch.autograd.grad(flashcore.attention(q, k, vv, is_causal=causal), vv, torch.ones_like(out))
        assert torch.isfinite(dv).all()


def test_rows_of_minus_inf_scores_give_zero_cpu():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        _check_minus_inf_rows("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")
def test_rows_of_minus_inf_scores_give_zero_cuda():
    for dtype in (torch.float16, torch.bfloat16):
        _check_minus_inf_rows("cuda", dtype)
