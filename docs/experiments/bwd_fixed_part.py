"""How much of the Hopper backward's time is per-block fixed cost, and how much is per query step?

The backward runs one block per (key block, kv head); a block walks Sq / 64 query blocks ("steps"). With the grid
a whole number of waves on the GPU, time ≈ waves × (fixed + steps × step_time), where `fixed` is a block's launch,
K/V load, pipeline fill and dK/dV epilogue. This script times flashcore's backward op alone
(`torch.ops.flashcore.bwd`: pre-pass, main kernel, dQ conversion) per call inside a replayed CUDA graph of 20
calls (graph time, so the host's autograd and launch time stay out), at Sk = 8192, head dim 128, non-causal, with
enough heads for `--waves` full waves, for Sq from 64 to 4096, and fits the line. The fixed part bounds what a
persistent backward (one that hides a block's prologue and epilogue under the next block's) could recover.
On the H100: 12.7 µs a wave fixed + 2.75 µs a query step (docs/PERFORMANCE.md, "Open problems").

    PYTHONPATH=$PWD python docs/experiments/bwd_fixed_part.py [--dtype fp16] [--waves 4]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import torch

import flashcore  # noqa: F401  (loads the extension: torch.ops.flashcore)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from bench import capture_graph, time_graph  # noqa: E402  (the benchmark's graph timing, not a copy of it)


def time_ms(fn, n: int = 20) -> float:
    """Per-call GPU time (ms) of fn in a replayed CUDA graph of n calls (median of 5 replays)."""
    return time_graph(capture_graph(fn, n, contextlib.nullcontext), n, replays=5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--waves", type=int, default=4, help="full waves of blocks (default 4)")
    p.add_argument("--sk", type=int, default=8192)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    key_blocks = args.sk // 128  # head dim 128: 128 keys a block (two consumer warpgroups of 64)
    heads = max(1, sms * args.waves // key_blocks)
    waves = heads * key_blocks / sms
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; Sk {args.sk}, head dim 128, {heads} heads, "
          f"{heads * key_blocks} blocks = {waves:.2f} waves; backward op ms per call in a CUDA graph")
    xs, ys = [], []
    scale = 1.0 / math.sqrt(128)
    for sq in (64, 128, 256, 512, 1024, 2048, 4096):
        q = torch.randn(1, heads, sq, 128, device="cuda", dtype=dtype)
        k = torch.randn(1, heads, args.sk, 128, device="cuda", dtype=dtype)
        v = torch.randn(1, heads, args.sk, 128, device="cuda", dtype=dtype)
        dout = torch.randn_like(q)
        out, lse = torch.ops.flashcore.fwd(q, k, v, scale, False)
        bwd_ms = time_ms(lambda: torch.ops.flashcore.bwd(dout, q, k, v, out, lse, scale, False))
        steps = sq // 64
        per_wave_us = bwd_ms * 1e3 / waves
        xs.append(steps)
        ys.append(per_wave_us)
        print(f"  Sq {sq:5d}: {steps:3d} steps a block, bwd {bwd_ms:8.3f} ms, {per_wave_us:8.2f} us a wave")
        del q, k, v, dout, out, lse
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    print(f"fit: {fixed:.2f} us a block fixed + {slope:.3f} us a step (the pre-pass and the dQ conversion run "
          f"once a call and grow with Sq: they blur both numbers a little)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
