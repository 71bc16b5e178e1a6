"""Context-parallel scaling of flashcore.distributed.ring_attention: one long causal sequence sharded over the ranks
(zigzag), forward+backward time per step against one GPU running the whole sequence, and against PyTorch's
`context_parallel` with SDPA on the same ranks when it is available.

    torchrun --nproc-per-node 2 benchmarks/ring_bench.py --seqlen 131072        # GPUs (NCCL)
    torchrun --nproc-per-node 2 benchmarks/ring_bench.py --cpu --seqlen 2048    # a smoke run with gloo
    torchrun --nproc-per-node 2 benchmarks/ring_bench.py --timeline             # + where each step's time goes

    torchrun --nproc-per-node 2 benchmarks/ring_bench.py --seqlen 262144 --layers 20 --no-cp --iters 1
                                                                 # a model's worth of activations one GPU cannot hold

--timeline profiles one ring step on every rank and prints its kernels (start, duration) and how busy the GPU was
between its first and last attention kernel; --trace-dir saves the Chrome traces. --layers L chains L attention
layers (each reads the previous one's output) so that all their activations live until the backward; a single-device
run that does not fit prints "out of memory".

Scaling efficiency = t(one device) / (N * t(ring)); the issue's target is >= 0.9 at 128k tokens, hd128, bf16.
Rank 0 prints one line per backend; times are medians over --iters steps after --warmup, each step a fwd+bwd.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # an in-place build (not pip-installed) is found too
    sys.path.append(ROOT)

import flashcore  # noqa: E402
from flashcore.distributed import ring_attention  # noqa: E402


def _timed(step, iters, warmup, device):
    """(median step time of the slowest rank in s, the largest peak of allocated memory over the ranks in GiB)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    # the step of the slowest rank is the step's time
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    t = torch.tensor([statistics.median(times), peak], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(t.tolist())


def _union(intervals):
    """Sorted, merged [start, end) intervals."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals):
    return sum(b - a for a, b in intervals)


def _timeline(step, device, trace_dir):
    """One profiled step on this rank: a summary line and the kernels of 1 ms or more (NCCL kernels always), with
    start and duration in ms from the step's first kernel. NCCL kernels run from their launch, also while one rank waits for the other, so a rank that starts earlier shows
    long NCCL kernels: the hard numbers are
    the compute span (first to last attention kernel), how busy the GPU was in it, and the tail after it."""
    from torch.profiler import ProfilerActivity, profile, record_function

    step()
    torch.cuda.synchronize(device)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.barrier()  # the profilers start at different times: line the ranks up inside the profiled region
        torch.cuda.synchronize(device)
        with record_function("ring step"):
            step()
        torch.cuda.synchronize(device)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace_dir, f"ring_rank{dist.get_rank()}.json"))
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    begin = next(e.time_range.start for e in prof.events() if e.name == "ring step")
    seen, mine = set(), []
    for e in kernels:  # the step's kernels once each: not the barrier's, not the annotation's own GPU range
        key = (e.name, e.time_range.start)
        if e.time_range.start >= begin and e.name != "ring step" and key not in seen:
            seen.add(key)
            mine.append(e)
    kernels = mine
    is_comm = ["nccl" in e.name.lower() for e in kernels]
    comp = _union([(e.time_range.start, e.time_range.end) for e, c in zip(kernels, is_comm) if not c])
    t0, comp_end = comp[0][0], comp[-1][1]
    end = max(e.time_range.end for e in kernels)
    span = comp_end - t0
    lines = [f"compute span {span / 1e3:8.2f} ms, attention/elementwise kernels busy {_length(comp) / 1e3:8.2f} ms "
             f"({100 * _length(comp) / span:.1f} %), tail after it (last dK/dV hop) {(end - comp_end) / 1e3:6.2f} ms"]
    for e, c in zip(kernels, is_comm):
        dur = e.time_range.end - e.time_range.start
        if c or dur >= 1000:
            name = "NCCL send/recv" if c else e.name.split("<")[0].replace("void ", "")
            lines.append(f"    {(e.time_range.start - t0) / 1e3:8.2f} +{dur / 1e3:7.2f}  {name}")
    return lines


def _layers_step(attn, q, k, v, dout, layers):
    """Forward and backward through `layers` attention layers. Each layer's q/k/v are made from the previous layer's
    output, so every layer's activations stay alive until the backward, as in a model (--layers 1: one op)."""
    out = attn(q, k, v)
    hkv = k.size(1)
    for _ in range(layers - 1):
        out = attn(out * 0.5, out[:, :hkv] * 0.25, out[:, :hkv] * 0.75)
    torch.autograd.grad(out, (q, k, v), dout)


def _context_parallel_sdpa(make, H, S, world, device, args):
    """PyTorch's context parallelism with SDPA (a private API: torch.distributed.tensor.experimental)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(device.type, (world,))
    # context_parallel shards full buffers in place (so they must not require grad) and restores them on exit
    qc, kc, vc = (make(H, S).detach() for _ in range(3))
    doutc = torch.randn_like(qc)

    def cp_step():
        with context_parallel(mesh, buffers=[qc, kc, vc, doutc], buffer_seq_dims=[2, 2, 2, 2]):
            a, b, c = (t.detach().requires_grad_() for t in (qc, kc, vc))
            out = torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)
            torch.autograd.grad(out, (a, b, c), doutc)

    return _timed(cp_step, args.iters, args.warmup, device)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=1, help="attention layers per step (activations of all kept)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke run of the script)")
    p.add_argument("--no-single", action="store_true", help="skip the one-device baseline")
    p.add_argument("--no-cp", action="store_true", help="skip context_parallel + SDPA")
    p.add_argument("--timeline", action="store_true", help="profile one ring step: compute vs communication")
    p.add_argument("--trace-dir", default="", help="with --timeline: save each rank's Chrome trace here")
    args = p.parse_args()

    backend = "gloo" if args.cpu else "nccl"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    B, S, H, Hkv, D = args.batch, args.seqlen, args.heads, args.kv_heads, args.headdim
    g = torch.Generator(device=device).manual_seed(0)

    def make(heads, s):
        return torch.randn(B, heads, s, D, generator=g, device=device, dtype=dtype).requires_grad_()

    # Each rank builds only its shard (the full sequence may not fit one device).
    q, k, v = make(H, S // world), make(Hkv, S // world), make(Hkv, S // world)
    dout = torch.randn_like(q)

    def ring(a, b, c):
        return ring_attention(a, b, c, causal=True, enable_gqa=H != Hkv)

    def single(a, b, c):
        return flashcore.attention(a, b, c, is_causal=True, enable_gqa=H != Hkv)

    def ring_step():
        _layers_step(ring, q, k, v, dout, args.layers)

    results = {"ring": _timed(ring_step, args.iters, args.warmup, device)}
    if args.timeline and device.type == "cuda":
        every = [None] * world
        dist.all_gather_object(every, _timeline(ring_step, device, args.trace_dir))
        if rank == 0:
            print("timeline of one ring step (forward + backward), per rank:")
            for r, lines in enumerate(every):
                print(f"  rank {r}: " + "\n".join(lines))
    del q, k, v, dout
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if not args.no_single:
        oom = torch.zeros(1, device=device)
        if rank == 0:
            try:
                qf, kf, vf = make(H, S), make(Hkv, S), make(Hkv, S)
                doutf = torch.randn_like(qf)
                _layers_step(single, qf, kf, vf, doutf, args.layers)
            except torch.OutOfMemoryError:
                oom.fill_(1)
                qf = kf = vf = doutf = None
                torch.cuda.empty_cache()
        dist.broadcast(oom, 0)  # every rank takes the same branch (the timing below has collectives)
        if oom.item():
            if rank == 0:
                print(f"one device: out of memory (B={B} S={S} Hq={H} D={D}, {args.layers} layer(s))")
        else:

            def single_step():
                if rank == 0:
                    _layers_step(single, qf, kf, vf, doutf, args.layers)

            results["one device"] = _timed(single_step, args.iters, args.warmup, device)
        qf = kf = vf = doutf = None
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if not args.no_cp:
        try:
            results["context_parallel + SDPA"] = _context_parallel_sdpa(make, H, S, world, device, args)
        except Exception as e:  # noqa: BLE001 - report why the comparison is missing, do not fail the benchmark
            if rank == 0:
                print(f"context_parallel + SDPA: n/a ({type(e).__name__}: {str(e)[:120]})")

    if rank == 0:
        flops = 4 * B * H * S * S * D / 2 * 3.5 * args.layers  # causal fwd (4·S²·D/2 per head) + bwd (2.5x)
        print(f"B={B} S={S} Hq={H} Hkv={Hkv} D={D} {args.dtype}, causal, {args.layers} layer(s), {world} ranks "
              f"({backend}); forward+backward")
        for name, (t, peak) in results.items():
            gpus = 1 if name == "one device" else world
            line = (f"{name:<26} {t * 1e3:9.2f} ms/step  {flops / t / 1e12 / gpus:7.1f} TFLOP/s per GPU  "
                    f"peak memory {peak:6.2f} GiB")
            if name == "ring" and "one device" in results:
                line += f"  scaling efficiency {results['one device'][0] / (world * t):.2f}"
            print(line)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
