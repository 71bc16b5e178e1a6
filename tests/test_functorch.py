"""flashcore.attention under torch.func transforms (grad, vjp, jacrev, vmap), as SDPA runs there: the C++ autograd
node is refused by functorch, so attention() takes a Python node while a transform is active (flashcore/functorch.py)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import flashcore
from conftest import make_generator, requires_cuda

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]


def _inputs(request, device, dtype, B=2, Hq=4, Hkv=2, Sq=9, Sk=11, D=16):
    g = make_generator(request, device)
    q, k, v = (torch.randn(B, h, s, D, generator=g, device=device).to(dtype)
               for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    sinks = torch.randn(Hq, generator=g, device=device)
    return q, k, v, sinks


@pytest.mark.parametrize("device", DEVICES)
def test_grad_and_vjp_match_autograd(request, device):
    """torch.func.grad / vjp give autograd's gradients (dq, dk, dv and the sinks'), with every variant on."""
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q, k, v, sinks = _inputs(request, device, dtype)
    weights = torch.linspace(-1, 1, q.size(-1), device=device, dtype=dtype)
    # deterministic: the CUDA backward's dQ additions in a fixed order, so both routes agree bitwise
    kw = dict(is_causal=True, enable_gqa=True, softcap=5.0, window_size=(4, 0), deterministic=True)

    def loss(q, k, v, s):
        return (flashcore.attention(q, k, v, sinks=s, **kw) * weights).float().sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert torch.equal(a, b), name
    attend = lambda q: flashcore.attention(q, k, v, enable_gqa=True, deterministic=True)  # noqa: E731
    out, vjp = torch.func.vjp(attend, q)
    (dq,) = vjp(torch.ones_like(out))
    leaf = q.detach().requires_grad_()
    assert torch.equal(dq, torch.autograd.grad(attend(leaf).sum(), leaf)[0])


def test_jacrev_and_per_sample_grads_cpu(request):
    """jacrev against torch.autograd.functional.jacobian, and vmap(grad) (per-sample gradients) against a loop, in
    float64; vmap of the forward against the batched call."""
    q, k, v, _ = _inputs(request, "cpu", torch.float64, B=2, Hq=2, Hkv=2, Sq=3, Sk=4, D=4)
    f = lambda q: flashcore.attention(q, k, v, is_causal=True)  # noqa: E731
    torch.testing.assert_close(torch.func.jacrev(f)(q), torch.autograd.functional.jacobian(f, q), rtol=0, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # functorch's note that the op has no batching rule (it loops)
        per_sample = torch.func.vmap(torch.func.grad(
            lambda q1, k1, v1: flashcore.attention(q1[None], k1[None], v1[None]).square().sum()))(q, k, v)
        batched = torch.func.vmap(lambda q1, k1, v1: flashcore.attention(q1, k1, v1))(q, k, v)
    for b in range(q.size(0)):
        leaf = q[b:b + 1].detach().requires_grad_()
        want = torch.autograd.grad(flashcore.attention(leaf, k[b:b + 1], v[b:b + 1]).square().sum(), leaf)[0]
        torch.testing.assert_close(per_sample[b], want[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(batched, flashcore.attention(q, k, v), rtol=0, atol=0)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(torch.func.vmap(f)(q[None])[0], ref, rtol=0, atol=1e-12)


def test_no_transform_keeps_the_cpp_node():
    """Outside transforms the output's grad_fn is the C++ node (no Python on the common path)."""
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = flashcore.attention(q, q, q)
    assert "FunctorchAttention" not in type(out.grad_fn).__name__, type(out.grad_fn).__name__
