"""The windowed backward against FlashAttention-4's, per block and per step.

Times the backward (t(fwd+bwd) - t(fwd), CUDA events, best of three rounds of ten calls) of flashcore and, where
`flash_attn.cute` imports, FA4 at 2x16x16384x128 bf16, causal with windows (W, 0), BSHD storage. Both kernels run
the same 4 096 blocks (128 keys a block, 64-row query steps; ncu shows FA4's grid and block are ours), so a fit of
time against the steps a block walks (per SM: blocks / 132 x fixed + steps / 132 x step) separates a block's
fixed part from a step's cost. On the H100, windows 512, 1024 and 4096: flashcore 2.47 us a block-step and
18.4 us a block, FA4 2.26 us and 13.3 us (docs/PERFORMANCE.md, "Open problems").

    PYTHONPATH=$PWD python docs/experiments/window_bwd_vs_fa4.py [0,512,1024,4096]
"""

import sys

import torch

import flashcore

B, H, S, D = 2, 16, 16384, 128


def timeit(fn, n=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / n)
    return best


def main():
    windows = [int(w) for w in (sys.argv[1] if len(sys.argv) > 1 else "0,512,1024,4096").split(",")]
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError as e:
        fa4 = None
        print(f"FA4 not importable ({e}): flashcore only")

    def run_flashcore(w):
        t = lambda x: x.transpose(1, 2)  # noqa: E731  (BSHD storage, (B, H, S, D) views)
        return t(flashcore.attention(t(q), t(k), t(v), is_causal=True, window_size=(w, 0) if w else None))

    def run_fa4(w):
        out = fa4(q, k, v, causal=True, window_size=(w, 0) if w else (None, None))
        return out[0] if isinstance(out, tuple) else out

    for w in windows:
        pairs = sum(min(i + 1, w + 1) if w else i + 1 for i in range(S))
        flops = 4 * B * H * pairs * D
        row = [f"window {w:5d}"]
        for name, fn in (("flashcore", run_flashcore), ("fa4", run_fa4 if fa4 else None)):
            if fn is None:
                continue
            t_fwd = timeit(lambda: fn(w))
            t_bwd = timeit(lambda: torch.autograd.grad(fn(w), (q, k, v), do)) - t_fwd
            row.append(f"{name} bwd {t_bwd:.3f} ms {2.5 * flops / t_bwd / 1e9:.0f} TFLOP/s")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
