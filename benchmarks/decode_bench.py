#!/usr/bin/env python3
"""KV-cache decoding: flashcore's KV-cache op (torch.ops.flashcore.kvcache_fwd, what flash_attn_with_kvcache runs)
against SDPA's default backend and FlashAttention-4, one
new token per sequence (or a few), dense and paged caches, timed in CUDA graphs (what serving engines replay) and
interleaved round-robin over rounds (median).

    python benchmarks/decode_bench.py                      # the issue's rows: B=8 x 8k, B=1 x 128k, B=64 x 2k, paged
    python benchmarks/decode_bench.py --rows 8x8192,8x8192p16 --heads 32 --kv-heads 8 --head-dim 128

Effective bandwidth = bytes of K and V the entries' lengths cover / time (the card's peak: 3.35 TB/s on an H100
SXM). Row syntax: BxL (dense cache of L keys each), BxL-mixed (lengths spread over [L/2, L]), a `pN` suffix pages
the cache in pages of N keys (block tables of shuffled pages). SDPA reads exactly each row's keys when every entry
has the same length (its q is (B, Hq, 1, D), k/v (B, Hkv, L, D), enable_gqa); mixed rows give it the padded cache
with a boolean mask, as a user of SDPA would. FA4 runs flash_attn_varlen_func with seqused_k and page_table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # an in-place build (not pip-installed) is found too
    sys.path.append(ROOT)

import flashcore  # noqa: E402 - registers torch.ops.flashcore
from bench import environment, switch_settings  # noqa: E402 (benchmarks/bench.py, next to this file)

# What flash_attn_with_kvcache calls once any new k/v are in the cache: the decode op itself.
kvcache_fwd = torch.ops.flashcore.kvcache_fwd.default
# flash_attn_varlen_func's op: a decode step as serving engines write it (one query a sequence, seqused_k).
varlen_fwd = torch.ops.flashcore.varlen_fwd.default
# flash_attn_func's op (the dense forward, bottom-right causal), on a cache whose entries are all full.
dense_fwd = torch.ops.flashcore.fwd.default

DEFAULT_ROWS = ["8x8192", "1x131072", "64x2048", "64x2048-mixed", "8x8192p16", "8x8192p256", "64x2048-mixedp16",
                "1x131072p256"]


def parse_row(text):
    page = None
    if "p" in text:
        text, page = text.split("p")
        page = int(page)
    mixed = text.endswith("-mixed")
    b, length = text.removesuffix("-mixed").split("x")
    return int(b), int(length), mixed, page


def make_cache(B, L, mixed, page, Hkv, D, dtype, gen):
    # Mixed lengths seeded by the row's B x L alone: a paged row reads the same lengths as its contiguous twin.
    lens_gen = torch.Generator().manual_seed(1_000_003 * B + L)
    lens = (torch.randint(L // 2, L + 1, (B,), generator=lens_gen) if mixed else torch.full((B,), L)).to(torch.int32)
    k = torch.randn(B, L, Hkv, D, generator=gen).to("cuda", dtype)
    v = torch.randn(B, L, Hkv, D, generator=gen).to("cuda", dtype)
    table = None
    if page:
        per = (L + page - 1) // page
        perm = torch.randperm(B * per, generator=gen)
        table = perm.view(B, per).to(torch.int32)
        kp = torch.empty(B * per, page, Hkv, D, dtype=dtype, device="cuda")
        vp = torch.empty_like(kp)
        pad = per * page - L
        kp[table.view(-1).cuda().long()] = F.pad(k, (0, 0, 0, 0, 0, pad)).view(B * per, page, Hkv, D)
        vp[table.view(-1).cuda().long()] = F.pad(v, (0, 0, 0, 0, 0, pad)).view(B * per, page, Hkv, D)
        return k, v, kp, vp, lens.cuda(), table.cuda()
    return k, v, k, v, lens.cuda(), None


def backend_variants(backends, kind):
    """(name, switches) of each `kind` or `kind@NAME=VALUE[+NAME=VALUE]` entry of the backend list."""
    return [(n, switch_settings(n) if "@" in n else {}) for n in backends if n.split("@", 1)[0] == kind]


def graph_time(fn, iters, rounds):
    """Median per-call ms of `iters` calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / iters)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=1, help="query tokens per sequence (Sq)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", default="flashcore,sdpa,fa4",
                    help="flashcore, flashcore@NAME=VALUE[+NAME=VALUE] (flashcore with switches set while its graph "
                         "is captured, e.g. flashcore@FLASHCORE_DECODE_TMA=0 for the cp.async loader), sdpa, fa4, "
                         "varlen[@NAME=VALUE] (the varlen op, one query a sequence, on the dense cache; "
                         "varlen@FLASHCORE_FORCE_KERNEL=sm80 for its mma.sync kernel), dense[@NAME=VALUE] (the "
                         "dense op, flash_attn_func, on rows of equal lengths; dense@FLASHCORE_FORCE_KERNEL=sm90 for "
                         "its own kernels)")
    ap.add_argument("--num-splits", default="0",
                    help="flashcore's num_splits (0: its heuristic); a comma list times each flashcore backend at "
                         "every count, labelled /sN")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    Hq, Hkv, D, Sq = args.heads, args.kv_heads, args.head_dim, args.new_tokens
    backends = args.backends.split(",")
    split_counts = [int(x) for x in args.num_splits.split(",")]
    fa4 = None
    if "fa4" in backends:
        try:
            from flash_attn.cute import flash_attn_varlen_func as fa4
        except Exception as e:  # noqa: BLE001
            print(f"fa4: unavailable ({type(e).__name__})")
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, Hq={Hq} Hkv={Hkv} D={D} Sq={Sq} {args.dtype}; TB/s = K/V bytes / time")
    print(f"{'row':<20} {'backend':<22} {'us':>9} {'TB/s':>7}  note")
    for text in args.rows.split(","):
        B, L, mixed, page = parse_row(text)
        k, v, kc, vc, lens, table = make_cache(B, L, mixed, page, Hkv, D, dtype, gen)
        q = torch.randn(B, Sq, Hq, D, generator=gen).to("cuda", dtype)
        kv_bytes = 2 * int(lens.sum()) * Hkv * D * k.element_size()
        runs = {}
        scale = D ** -0.5
        for name, env in backend_variants(backends, "flashcore"):  # switches set while its graph is captured
            for splits in split_counts:
                label = name if len(split_counts) == 1 else f"{name}/s{splits}"

                def call(env=env, splits=splits):
                    with environment(env):
                        return kvcache_fwd(q, kc, vc, lens, table, None, None, scale, True, -1, -1, 0.0, None, None,
                                           splits)
                runs[label] = call
        for name, env in backend_variants(backends, "dense"):  # flash_attn_func on the cache (equal lengths only)
            if page or mixed:
                continue
            qd, kd, vd = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

            def dense_call(env=env, qd=qd, kd=kd, vd=vd):
                with environment(env):
                    return dense_fwd(qd, kd, vd, scale, True, True)
            runs[name] = dense_call
        for name, env in backend_variants(backends, "varlen"):  # the varlen op on the same cache
            if page or Sq != 1:
                continue
            q_rows, k_rows, v_rows = q.view(B, Hq, D), k.view(B * L, Hkv, D), v.view(B * L, Hkv, D)
            cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
            cu_k = cu_q * L

            def varlen_call(env=env, q_rows=q_rows, k_rows=k_rows, v_rows=v_rows, cu_q=cu_q, cu_k=cu_k):
                with environment(env):
                    return varlen_fwd(q_rows, k_rows, v_rows, cu_q, cu_k, 1, L, scale, True, -1, -1, 0.0, False,
                                      None, None, lens)
            runs[name] = varlen_call
        if "sdpa" in backends and not page:
            qs = q.transpose(1, 2)
            ks, vs = k.transpose(1, 2), v.transpose(1, 2)
            if mixed:
                keep = torch.arange(L, device="cuda")[None, :] < lens[:, None]
                mask = keep[:, None, None, :]
                runs["sdpa (padded+mask)"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                                                   enable_gqa=True)
            else:
                runs["sdpa default"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        if fa4 is not None:
            def fa4_call():
                return fa4(q, kc, vc, seqused_k=lens, page_table=table, causal=True)
            runs["fa4"] = fa4_call
        times = {name: [] for name in runs}
        notes = {}
        labels = {}
        for _ in range(args.rounds):  # interleaved: each round times every backend once
            for name, fn in list(runs.items()):
                try:
                    times[name].append(graph_time(fn, args.iters, 1))
                    if name.startswith(("flashcore", "varlen", "dense")):
                        labels[name] = flashcore.last_kernel("fwd")
                except Exception as e:  # noqa: BLE001 - report, keep going
                    notes[name] = f"{type(e).__name__}: {str(e)[:80]}"
                    runs.pop(name)
        for name in times:
            if name in notes:
                print(f"{text:<20} {name:<22} {'-':>9} {'-':>7}  {notes[name]}")
                continue
            ms = statistics.median(times[name])
            print(f"{text:<20} {name:<22} {ms * 1e3:9.1f} {kv_bytes / (ms * 1e-3) / 1e12:7.2f}  {labels.get(name, '')}")
        del k, v, kc, vc


if __name__ == "__main__":
    main()
