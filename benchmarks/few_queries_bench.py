"""Few queries a sequence over long keys under GQA (a speculative-decoding check, a small chunk): flashcore's default
route against forced ones, in one process, each call timed in a CUDA graph (median of --rounds).

    python benchmarks/few_queries_bench.py                      # Hq 32 / Hkv 8, hd128 bf16, causal
    python benchmarks/few_queries_bench.py --rows 8x16x8192,2x32x8192
    python benchmarks/few_queries_bench.py --sweep --rounds 2 --iters 10   # the KV-cache kernel's route

Per row (batch x queries x keys): `flash_attn_varlen_func` on equal sequences by the default route and forced to
the Hopper kernels (FLASHCORE_FORCE_KERNEL=sm90) or the mma.sync ones (=sm80), and `flash_attn_func` on BSHD tensors by the default route and
with every GQA call packed (FLASHCORE_PACK_GQA=always), and on BHSD memory (BSHD views of (B, H, S, D) tensors, as
transformers passes its caches) by the default route and with packing off (FLASHCORE_PACK_GQA=0: the dense
kernels); the kernel each ran is printed beside its time.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # an in-place build (not pip-installed) is found too
    sys.path.append(ROOT)

import flashcore  # noqa: E402
from flashcore import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from bench import environment  # noqa: E402 (benchmarks/bench.py, next to this file)
from decode_bench import graph_time  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8x16x8192,8x8x8192,4x16x4096,8x32x8192,2x32x8192",
                    help="batch x queries a sequence x keys a sequence, comma-separated")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep", action="store_true",
                    help="instead of --rows: flash_attn_func over batch 1-8, 2-16 queries, 2k-32k keys (at most 64 "
                    "query rows a KV head), the default route against FLASHCORE_FORCE_KERNEL=sm90 (the dense kernels "
                    "or the packed varlen one, without the KV-cache kernel's route)")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    Hq, Hkv, D, causal = args.heads, args.kv_heads, args.head_dim, not args.no_causal
    print(f"{torch.cuda.get_device_name()}, Hq={Hq} Hkv={Hkv} D={D} {args.dtype} causal={causal}; us per call")
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.sweep:
        return sweep(Hq, Hkv, D, dtype, causal, args)
    for text in args.rows.split(","):
        B, Sq, Sk = (int(x) for x in text.split("x"))
        q = torch.randn(B * Sq, Hq, D, generator=gen, device="cuda").to(dtype)
        k = torch.randn(B * Sk, Hkv, D, generator=gen, device="cuda").to(dtype)
        v = torch.randn(B * Sk, Hkv, D, generator=gen, device="cuda").to(dtype)
        cu_q = torch.arange(B + 1, device="cuda", dtype=torch.int32) * Sq
        cu_k = torch.arange(B + 1, device="cuda", dtype=torch.int32) * Sk
        qd, kd, vd = q.view(B, Sq, Hq, D), k.view(B, Sk, Hkv, D), v.view(B, Sk, Hkv, D)
        # The same tensors in BHSD memory (SDPA's and transformers' caches), passed as BSHD views.
        qh, kh, vh = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (qd, kd, vd))
        calls = [
            ("varlen", {}, lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, Sq, Sk, causal=causal)),
            ("varlen@sm90", {"FLASHCORE_FORCE_KERNEL": "sm90"},
             lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, Sq, Sk, causal=causal)),
            ("varlen@sm80", {"FLASHCORE_FORCE_KERNEL": "sm80"},
             lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, Sq, Sk, causal=causal)),
            ("dense", {}, lambda: flash_attn_func(qd, kd, vd, causal=causal)),
            ("dense@pack-always", {"FLASHCORE_PACK_GQA": "always"}, lambda: flash_attn_func(qd, kd, vd, causal=causal)),
            ("dense-bhsd", {}, lambda: flash_attn_func(qh, kh, vh, causal=causal)),
            ("dense-bhsd@no-pack", {"FLASHCORE_PACK_GQA": "0"}, lambda: flash_attn_func(qh, kh, vh, causal=causal)),
        ]
        for name, env, fn in calls:
            with environment(env):
                t = graph_time(fn, args.iters, args.rounds) * 1e3
                print(f"{text:<14} {name:<18} {t:9.1f}  {flashcore.last_kernel('fwd')}", flush=True)


def sweep(Hq, Hkv, D, dtype, causal, args):
    print("batch queries keys | default us | forced sm90 us | forced / default | kernel")
    for B in (1, 2, 4, 8):
        for Sq in (2, 4, 8, 16):
            if Sq * (Hq // Hkv) > 64:
                continue
            for Sk in (2048, 4096, 8192, 16384, 32768):
                q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dtype)
                k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype)
                v = torch.randn_like(k)
                fn = lambda: flash_attn_func(q, k, v, causal=causal)  # noqa: E731
                t = graph_time(fn, args.iters, args.rounds) * 1e3
                ran = flashcore.last_kernel("fwd")
                with environment({"FLASHCORE_FORCE_KERNEL": "sm90"}):
                    forced = graph_time(fn, args.iters, args.rounds) * 1e3
                print(f"{B} {Sq} {Sk} | {t:.1f} | {forced:.1f} | {forced / t:.2f} | {ran}", flush=True)


if __name__ == "__main__":
    main()
