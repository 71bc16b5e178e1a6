#!/usr/bin/env python3
"""Variable-length batches: flashcore.varlen_attention against FlashAttention-4's flash_attn_varlen_func, SDPA on
nested (jagged) tensors, SDPA on the padded batch, and flashcore's own dense op run sequence by sequence, in the same
process, interleaved round-robin over rounds (median of CUDA-event times).

    python benchmarks/varlen_bench.py                       # 16 causal sequences of 128..8192 tokens, hd128 bf16
    python benchmarks/varlen_bench.py --lens 512,512,4096 --heads 32 --head-dim 64 --no-causal
    python benchmarks/varlen_bench.py --short 10000          # 10 000 sequences of 1..64 tokens
    python benchmarks/varlen_bench.py --ab FLASHCORE_BWD_TMA_EPILOGUE=0   # A/B of a switch in the same rounds

TFLOP/s count the useful work: forward 4·H·D·(visible query-key pairs of each sequence), summed (causal: half of
each sequence's square); the backward 2.5x that over t(fwd+bwd) − t(fwd). "dense per-seq" is the sum over the
sequences of flashcore's dense op on each one alone (B=1): the speed a packed batch must match.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import flashcore
from bench import environment, switch_settings, time_events  # benchmarks/bench.py

DEFAULT_LENS = [128, 256, 512, 1024, 1536, 1536, 2048, 2560, 3072, 4608, 4608, 5120, 6144, 7168, 7168, 8192]


def try_fa4():
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401

        return flash_attn_varlen_func
    except Exception as e:  # not installed here
        return f"FA4 unavailable ({type(e).__name__})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_LENS)
    ap.add_argument("--short", type=int, default=0, help="instead: this many sequences of 1..64 tokens")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-dense", action="store_true", help="skip the per-sequence dense rows (slow for --short)")
    ap.add_argument("--ab", action="append", default=[], metavar="NAME=VALUE[+NAME=VALUE]",
                    help="also flashcore varlen with these switches (csrc/flashcore/switches.h) set around its calls, "
                         "in the same rounds (repeatable), e.g. --ab FLASHCORE_BWD_TMA_EPILOGUE=0")
    args = ap.parse_args()

    dev, dtype = "cuda", torch.bfloat16 if args.dtype == "bf16" else torch.float16
    causal = not args.no_causal
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 65, (args.short,), generator=g).tolist() if args.short else args.lens
    H, Hkv, D = args.heads, args.kv_heads or args.heads, args.head_dim
    total, B, max_len = sum(lens), len(lens), max(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q = torch.randn(total, H, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(total, Hkv, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(total, Hkv, D, device=dev, dtype=dtype, requires_grad=True)
    dout = torch.randn_like(q)
    pairs = sum(s * (s + 1) // 2 if causal else s * s for s in lens)
    fwd_flops = 4.0 * H * D * pairs

    def fc():
        return flashcore.varlen_attention(q, k, v, cu, cu, max_len, max_len, is_causal=causal)

    splits = [(int(cu[i]), int(cu[i + 1])) for i in range(B)]

    def dense_per_seq():
        outs = []
        for a, b in splits:
            outs.append(flashcore.attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                            v[a:b].transpose(0, 1)[None], is_causal=causal, enable_gqa=H != Hkv))
        return outs

    backends = {"flashcore varlen": fc}
    envs = {}  # the switched rows' settings, set around their forward and backward
    for ab in args.ab:
        envs[f"flashcore varlen @{ab}"] = switch_settings("@" + ab)
        backends[f"flashcore varlen @{ab}"] = fc
    if not args.no_dense:
        backends["flashcore dense per-seq"] = dense_per_seq
    fa4 = try_fa4()
    if callable(fa4):
        backends["FA4 varlen"] = lambda: fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                             max_seqlen_k=max_len, causal=causal)
    else:
        print(fa4)
    if H == Hkv:
        def nested():
            qn, kn, vn = (torch.nested.nested_tensor_from_jagged(t, cu.long()).transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal)
        backends["SDPA nested"] = nested
        if args.short == 0:
            pad = torch.zeros(B, max_len, H, D, device=dev, dtype=dtype)
            mask = torch.zeros(B, 1, max_len, max_len, device=dev, dtype=torch.bool)
            for i, s in enumerate(lens):
                mask[i, 0, :s, :s] = torch.ones(s, s, device=dev).tril().bool() if causal else True
            qp = pad.clone().requires_grad_()

            def padded():
                return F.scaled_dot_product_attention(qp.transpose(1, 2), qp.transpose(1, 2), qp.transpose(1, 2),
                                                      attn_mask=mask)
            backends["SDPA padded"] = padded

    # fwd+bwd: the packed output's gradient (the dense rows: each sequence's), for q, k and v; SDPA's nested and
    # padded rows are forward only (the anchors are).
    dout_per_seq = [dout[a:b].transpose(0, 1)[None] for a, b in splits]

    def grad_step(f):
        out = f()
        if isinstance(out, list):
            torch.autograd.grad(out, (q, k, v), dout_per_seq)
            return
        out = out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)
        torch.autograd.grad(out, (q, k, v), dout)

    def switched(name, step):
        env = envs.get(name, {})

        def run():
            with environment(env):
                return step()
        return run

    fwd_steps = {name: switched(name, f) for name, f in backends.items()}
    bwd_steps = {name: switched(name, lambda f=f: grad_step(f)) for name, f in backends.items()
                 if not name.startswith("SDPA")}

    results = {name: {"fwd": [], "fwdbwd": []} for name in backends}
    for mode, steps in (("fwd", fwd_steps), ("fwdbwd", bwd_steps)):
        for name, s in steps.items():  # warm-up (FA4 compiles, nested tensors build their caches)
            try:
                s()
                torch.cuda.synchronize()
            except Exception as e:
                print(f"{name} {mode}: {type(e).__name__}: {str(e)[:120]}")
                results[name][mode] = None
        for _ in range(args.rounds):
            for name, s in steps.items():
                if results[name][mode] is None:
                    continue
                results[name][mode].extend(time_events(s, args.iters))

    print(f"{B} sequences, {total} tokens (max {max_len}), H={H}/{Hkv}, D={D}, {args.dtype}, causal={causal}; "
          f"{torch.cuda.get_device_name()}")
    print(f"{'backend':44s} {'fwd ms':>9s} {'fwd TFLOP/s':>12s} {'bwd ms':>9s} {'bwd TFLOP/s':>12s}")
    for name in backends:
        f = results[name]["fwd"]
        fb = results[name].get("fwdbwd")
        tf = statistics.median(f) if f else None
        tfb = statistics.median(fb) if fb else None
        tb = tfb - tf if tfb and tf else None
        print(f"{name:44s} {tf or float('nan'):9.3f} {fwd_flops / tf / 1e9 if tf else float('nan'):12.1f} "
              f"{tb or float('nan'):9.3f} {2.5 * fwd_flops / tb / 1e9 if tb else float('nan'):12.1f}")


if __name__ == "__main__":
    main()
