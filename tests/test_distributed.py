"""Ring attention (flashcore.distributed) in several processes: gloo on the CPU, 2 and 4 ranks, causal (zigzag) and
not, GQA, float32 and float64; NCCL on every pair/quad/octet of GPUs present, float16 and bfloat16. The output and the
gradients of q, k and v match single-process flashcore on the whole sequence (the suite's rule against the float64
reference, with single-process flashcore's error as the yardstick)."""

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


def _worker(rank, world, port, causal, gqa, dtype, result_dir, backend="gloo"):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import check_close, reference_attention

    from flashcore.distributed import ring_attention, zigzag_shard, zigzag_unshard

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(1234)
        B, Hq, Hkv, S, D = (2, 4, (2 if gqa else 4), 16 * world, 32) if backend == "gloo" else \
            (1, 8, (2 if gqa else 8), 512 * world, 128)
        q, k, v, dout = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(device, dtype)
                         for H in (Hq, Hkv, Hkv, Hq))

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


def _run(world, causal, gqa, dtype, backend):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, _free_port(), causal, gqa, dtype, d, backend), nprocs=world, join=True)
        assert os.path.exists(os.path.join(d, "ok"))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_ring_attention_gloo(world, causal, gqa, dtype):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    _run(world, causal, gqa, dtype, "gloo")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_group_of_one(causal):
    """A group of one rank: no ring at all, the single-device result."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    _run(1, causal, True, torch.float32, "gloo")


def _gpu_pair_skip_reason(world):
    from conftest import cuda_skip_reason

    reason = cuda_skip_reason()
    if reason is None and torch.cuda.device_count() < world:
        reason = f"needs {world} CUDA devices, {torch.cuda.device_count()} present"
    if reason is None and not dist.is_nccl_available():
        reason = "torch.distributed has no NCCL in this torch build"
    return reason


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_ring_attention_nccl(world, causal, gqa, dtype):
    reason = _gpu_pair_skip_reason(world)
    if reason is not None:
        pytest.skip(reason)
    _run(world, causal, gqa, dtype, "nccl")
