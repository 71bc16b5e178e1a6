"""The ops as PyTorch sees them: schemas and registrations (opcheck), torch.compile without graph breaks, and
use inside a model."""

import os
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flashcore
from conftest import make_generator, randn, requires_cuda


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]


def _opcheck_inputs(g, device):
    cases = []
    dtypes = (torch.float32, torch.float64, torch.bfloat16) if device == "cpu" else (torch.float16, torch.bfloat16,
                                                                                     torch.bfloat16)
    for (causal, hkv), dtype in zip(((False, 2), (True, 1), (True, 2)), dtypes):
        q = randn((1, 2, 9, 16), dtype, g, device).requires_grad_()
        k = randn((1, hkv, 12, 16), dtype, g, device).requires_grad_()
        v = randn((1, hkv, 12, 16), dtype, g, device).requires_grad_()
        cases.append((q, k, v, 0.25, causal))
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_fwd(request, device):
    g = make_generator(request, device)
    for args in _opcheck_inputs(g, device):
        torch.library.opcheck(torch.ops.flashcore.fwd.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_bwd(request, device):
    g = make_generator(request, device)
    for q, k, v, scale, causal in _opcheck_inputs(g, device):
        with torch.no_grad():
            out, lse = torch.ops.flashcore.fwd(q, k, v, scale, causal)
        dout = torch.randn_like(out)
        args = (dout, q.detach(), k.detach(), v.detach(), out, lse, scale, causal, False, -1, -1, 0.0, False)
        torch.library.opcheck(torch.ops.flashcore.bwd.default, args)


def test_compile_fullgraph_forward_backward(request):
    torch._dynamo.reset()
    g = make_generator(request)
    q, k, v = (randn((2, 4, 33, 32), torch.float32, g).requires_grad_() for _ in range(3))

    def f(q, k, v):
        return flashcore.attention(q, k, v, is_causal=True).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    loss_ref = f(q, k, v)
    grads_ref = torch.autograd.grad(loss_ref, (q, k, v))
    assert torch.allclose(loss, loss_ref)
    for a, b in zip(grads, grads_ref):
        assert torch.allclose(a, b)


def test_compile_inductor(request):
    torch._dynamo.reset()
    g = make_generator(request)
    q, k, v = (randn((1, 2, 40, 16), torch.float32, g) for _ in range(3))
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: inductor's CPU code generation needs one")
    f = torch.compile(lambda q, k, v: flashcore.attention(q, k, v) * 2.0, fullgraph=True)
    assert torch.allclose(f(q, k, v), flashcore.attention(q, k, v) * 2.0)


class Block(nn.Module):
    """A small pre-norm transformer block whose attention is pluggable."""

    def __init__(self, dim=32, heads=4, kv_heads=2, attn=None):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = nn.Linear(dim, dim)
        self.attn = attn

    def forward(self, x):
        B, S, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(B, S, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(B, S, 2, self.kv_heads, self.hd).unbind(2)
        y = self.attn(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return x + self.o(y.transpose(1, 2).reshape(B, S, -1))


def test_model_training_matches_sdpa():
    torch.manual_seed(0)
    a = Block(attn=flashcore.attention).double()
    b = Block(attn=F.scaled_dot_product_attention).double()
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    x = torch.randn(3, 20, 32, dtype=torch.float64)
    for _ in range(5):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-10)


def test_fwd_kernel_name_cpu():
    q = torch.randn(1, 1, 4, 8)
    assert flashcore.fwd_kernel_name(q, q, q) == "cpu"


def test_deterministic_argument_reaches_backward():
    """deterministic=True is carried from the forward call to flashcore::bwd (seen through a dispatch log)."""
    q, k, v = (torch.randn(1, 2, 9, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    seen = []

    class Log(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.flashcore.bwd.default:
                seen.append(args[12] if len(args) > 12 else (kwargs or {}).get("deterministic", False))
            return func(*args, **(kwargs or {}))

    for det in (True, False):
        out = flashcore.attention(q, k, v, is_causal=True, deterministic=det)
        with Log():
            grads = torch.autograd.grad(out.sum(), (q, k, v))
        ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), (q, k, v))
        for a, b in zip(grads, ref):
            assert torch.allclose(a, b)
    assert seen == [True, False]


def test_build_has_cuda_kernels_when_required():
    """FLASHCORE_CUDA=1 (CI sets it for the build and the tests) means the CUDA kernels must be in the extension: a
    build that fell back to CPU-only fails here instead of passing with every GPU test skipped."""
    if os.environ.get("FLASHCORE_CUDA", "auto").lower() not in ("1", "true", "yes", "on"):
        pytest.skip("FLASHCORE_CUDA=1 not set: a CPU-only build is allowed")
    assert flashcore._has_cuda_kernels(), "built with FLASHCORE_CUDA=1 but the extension has no CUDA kernels"


def test_double_backward_raises(request):
    """The backward is not differentiable (as in flash-attn): a gradient of gradients raises, naming flashcore,
    instead of giving zeros; the dense and the varlen op alike. An ordinary backward afterwards still works."""
    g = make_generator(request)
    q, k, v = (randn((1, 2, 9, 16), torch.float32, g).requires_grad_() for _ in range(3))
    (dq,) = torch.autograd.grad(flashcore.attention(q, k, v, is_causal=True).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="flashcore: the attention backward is not differentiable"):
        dq.sum().backward()
    qv, kv, vv = (torch.randn(10, 2, 16, generator=g).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out = flashcore.varlen_attention(qv, kv, vv, cu, cu, 6, 6, is_causal=True)
    (dk,) = torch.autograd.grad(out.sum(), kv, create_graph=True)
    with pytest.raises(RuntimeError, match="flashcore: the attention backward is not differentiable"):
        dk.sum().backward()
    flashcore.attention(q, k, v).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
