"""The ops inside CUDA graphs and in back-to-back launches (programmatic dependent launch): replays recompute,
and no kernel reads its inputs before the previous kernel wrote them."""

import pytest
import torch

import flashcore
from conftest import assert_ran, capture_graph, cuda_skip_reason, make_generator, randn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")]

DEV = "cuda"


def test_cuda_graph_capture(request, family):
    g = make_generator(request, DEV)
    q, k, v = (randn((2, 4, 256, 64), torch.float16, g, DEV) for _ in range(3))
    eager = flashcore.attention(q, k, v, is_causal=True)
    graph, static_out = capture_graph(lambda: flashcore.attention(q, k, v, is_causal=True))
    assert_ran("fwd", family)
    q.copy_(randn((2, 4, 256, 64), torch.float16, g, DEV))
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, flashcore.attention(q, k, v, is_causal=True))
    assert not torch.equal(static_out, eager)


# (B, H, Sq, Sk, D), causal, bottom_right: a short grid on part of the SMs (one-warpgroup sm90 blocks); a
# persistent sm90 grid (blocks walk several tiles, the next Q loading behind a tile's tail); query rows that see no
# key (bottom-right mask, Sq > Sk).
CHAINS = {
    "small": ((1, 8, 512, 512, 64), True, False),
    "persistent": ((4, 16, 1024, 1024, 64), False, False),
    "empty_rows": ((1, 4, 300, 100, 64), True, True),
}


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", list(CHAINS))
def test_back_to_back_calls_see_previous_outputs(request, family, in_graph, case):
    """Forward kernels start before the previous kernel of the stream ends (programmatic dependent launch): each
    call here reads the previous call's output as its query, and its output reuses the memory of the output
    before that (freed, so the allocator hands it out again). A kernel touching memory before the previous one
    completed would read a stale query or overwrite one still being read; the synchronized chain is the truth.
    The graph case is the one that catches a missing wait (eager calls rarely overlap: the host is slower)."""
    g = make_generator(request, DEV)
    (B, H, Sq, Sk, D), causal, bottom_right = CHAINS[case]
    q0 = randn((B, H, Sq, D), torch.float16, g, DEV)
    k, v = (randn((B, H, Sk, D), torch.float16, g, DEV) for _ in range(2))
    steps = 8

    def chain(sync):
        y = q0
        for _ in range(steps):
            # back to back (no kernel between), scale 2: sharp rows, so each output is far from the last
            y, _ = torch.ops.flashcore.fwd(y, k, v, 2.0, causal, bottom_right)
            if sync:
                torch.cuda.synchronize()
        return y

    expected = chain(sync=True)
    assert_ran("fwd", family)
    if in_graph:
        graph, static_out = capture_graph(lambda: chain(sync=False))
        graph.replay()
        torch.cuda.synchronize()
        got = static_out
    else:
        got = chain(sync=False)
    assert torch.isfinite(expected).all() and not torch.equal(expected, q0)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_backward_cuda_graph_capture(request, deterministic):
    """The backward op captured in a CUDA graph recomputes the gradients of new inputs on replay."""
    g = make_generator(request, DEV)
    shape, scale = (2, 4, 300, 64), 0.125
    q, k, v, dout = (randn(shape, torch.float16, g, DEV) for _ in range(4))
    out, lse = torch.ops.flashcore.fwd(q, k, v, scale, True)

    def bwd():
        return torch.ops.flashcore.bwd(dout, q, k, v, out, lse, scale, True, deterministic=deterministic)

    before = bwd()
    graph, static_grads = capture_graph(bwd)
    dout.copy_(randn(shape, torch.float16, g, DEV))
    for t in static_grads:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want, old in zip(static_grads, bwd(), before):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3)  # dQ's fp32 atomics may reorder: 1 ulp
        assert not torch.equal(got, old)
