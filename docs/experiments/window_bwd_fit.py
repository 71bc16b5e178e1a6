"""Where does the windowed Hopper backward lose against the dense causal one?

Times flashcore's backward op (`torch.ops.flashcore.bwd`: pre-pass, main kernel, dQ conversion) in a replayed CUDA
graph for causal attention with windows (W, 0), W = 256 … 8192, and without a window, at 2×16×S×128 bf16, counts
each call's blocks and query steps (one 64-row query block against one 128-key block, masked or not) and fits
time = a × blocks + b × unmasked steps + c × masked steps (and prints TFLOP/s on visible FLOPs). The blocks are
the same for every window, so `a` takes the constant part (the pre-pass and dQ conversion as well); blocks and
masked steps are nearly collinear, so read a × blocks + c × masked steps as one constant. On the H100
(S = 16384) the op's time is 648 µs + 19.7 ns a step to within 3 % for every window (docs/PERFORMANCE.md, "Open
problems").

    PYTHONPATH=$PWD python docs/experiments/window_bwd_fit.py [--seqlen 16384]
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

B, H, D = 2, 16, 128
BLOCK_N, BLOCK_M = 128, 64  # the Hopper backward's key block and query step at head dim 128


def counts(S: int, W: int):
    """(blocks, unmasked steps, masked steps, visible pairs) of one head; W < 0: no window."""
    unmasked = masked = 0
    for n in range(S // BLOCK_N):
        j0, j1 = BLOCK_N * n, BLOCK_N * n + BLOCK_N - 1
        last = S - 1 if W < 0 else min(S - 1, j1 + W)
        for m in range(j0 // BLOCK_M, last // BLOCK_M + 1):
            i0, i1 = BLOCK_M * m, BLOCK_M * m + BLOCK_M - 1
            if i0 >= j1 and (W < 0 or i1 - W <= j0):
                unmasked += 1
            else:
                masked += 1
    visible = sum(i + 1 - (0 if W < 0 else max(0, i - W)) for i in range(S))
    return S // BLOCK_N, unmasked, masked, visible


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=16384)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    S = args.seqlen
    mk = lambda: torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v, dout = mk(), mk(), mk(), mk()
    scale = 1 / math.sqrt(D)
    rows = []
    for W in (-1, 8192, 4096, 2048, 1024, 512, 256):
        if W >= S:
            continue
        right = 0 if W >= 0 else -1
        out, lse = torch.ops.flashcore.fwd(q, k, v, scale, True, False, W, right)

        def step():
            torch.ops.flashcore.bwd(dout, q, k, v, out, lse, scale, True, False, W, right)

        ms = sorted(time_graph(capture_graph(step, 10, contextlib.nullcontext), 10, replays=5) for _ in range(3))[1]
        blocks, unmasked, masked, visible = (x * B * H for x in counts(S, W))
        tflops = 2.5 * 4 * visible * D / (ms * 1e-3) / 1e12
        rows.append((W, ms * 1e3, blocks, unmasked, masked))
        print(f"window {W:6d}: {ms * 1e3:9.1f} us  blocks {blocks}  steps {unmasked} + {masked} masked  "
              f"{tflops:6.1f} TFLOP/s (visible)", flush=True)
    # Least squares by the normal equations (3 unknowns), without numpy.
    X = [[r[2], r[3], r[4]] for r in rows]
    y = [r[1] for r in rows]
    A = [[sum(x[i] * x[j] for x in X) for j in range(3)] + [sum(x[i] * t for x, t in zip(X, y))] for i in range(3)]
    for i in range(3):
        piv = max(range(i, 3), key=lambda r: abs(A[r][i]))
        A[i], A[piv] = A[piv], A[i]
        for r in range(3):
            if r != i and A[i][i] != 0:
                f = A[r][i] / A[i][i]
                A[r] = [a - f * b for a, b in zip(A[r], A[i])]
    coef = [A[i][3] / A[i][i] if A[i][i] else 0.0 for i in range(3)]
    print(f"fit (us): {coef[0]:.4f} a block, {coef[1] * 1e3:.2f} ns an unmasked step, {coef[2] * 1e3:.2f} ns a masked "
          "step (blocks and masked steps are nearly collinear: read the sum)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
