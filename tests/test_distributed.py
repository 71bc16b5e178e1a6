"""Ring attention (flashcore.distributed) in several processes: gloo on the CPU, 2 and 4 ranks, causal (zigzag) and
not, GQA, float32 and float64; the output and the gradients of q, k and v match single-process flashcore on the
whole sequence (float64: to rounding; float32: the suite's rule against the float64 reference)."""

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashcore


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, causal, gqa, dtype, result_dir):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import check_close, reference_attention

    from flashcore.distributed import ring_attention, zigzag_shard, zigzag_unshard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(1234)
        B, Hq, Hkv, S, D = 2, 4, (2 if gqa else 4), 16 * world, 32
        q = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64).to(dtype)
        k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64).to(dtype)
        v = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64).to(dtype)
        dout = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64).to(dtype)

        def shard(t):
            return zigzag_shard(t, 2) if causal else t.chunk(world, dim=2)[rank]

        def unshard(t):
            if causal:
                return zigzag_unshard(t, 2)
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            return torch.cat(parts, dim=2)

        ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, causal=causal, enable_gqa=gqa)
        grads = torch.autograd.grad(out, (ql, kl, vl), shard(dout))
        full = [unshard(out.detach())] + [unshard(gr) for gr in grads]
        if rank == 0:
            qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
            single = flashcore.attention(qf, kf, vf, is_causal=causal, enable_gqa=gqa)
            single_grads = torch.autograd.grad(single, (qf, kf, vf), dout)
            q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref = reference_attention(q64, k64, v64, causal)[0]
            ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
            for name, got, one, r in zip(("out", "dq", "dk", "dv"), full, [single, *single_grads],
                                         [ref, *ref_grads]):
                # single-process flashcore is the yardstick here: the ring must be as exact as it is
                check_close(name, got, r, one.detach(), dtype=dtype)
            open(os.path.join(result_dir, "ok"), "w").close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_ring_attention_gloo(world, causal, gqa, dtype):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, _free_port(), causal, gqa, dtype, d), nprocs=world, join=True)
        assert os.path.exists(os.path.join(d, "ok"))
