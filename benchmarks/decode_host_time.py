#!/usr/bin/env python3
"""Host time of one eager KV-cache decode call: a loop of calls on a cache so small that the GPU outruns the host,
so the time a call is what the host spends launching it (argument checks, the plan, the launches). CUDA graphs
(decode_bench.py) hide this time; an eager generation loop pays it in every layer for every token.

    python benchmarks/decode_host_time.py      # flash_attn_with_kvcache and the kvcache_fwd op alone, µs a call

It also times the transformers backend's eager decoding step (if transformers is installed): `attention_forward`
called by eight layers that share one left-padding mask a model step (a new mask each step, as `generate` builds it),
against the same calls without a mask, µs a layer at 8 sequences of 8 192 keys (the kernel's own time included).
"""

import time

import torch

import flashcore
from flashcore.flash_attn_interface import flash_attn_with_kvcache


def timed(fn, n=3000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    if not torch.cuda.is_available():
        print("decode_host_time: no CUDA device (the CPU path has no launch to time)")
        return
    B, L, D = 1, 256, 128
    q = torch.randn(B, 1, 32, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, L, 8, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    op = torch.ops.flashcore.kvcache_fwd.default
    wrapper = min(timed(lambda: flash_attn_with_kvcache(q, k, k, cache_seqlens=lens, causal=True)) for _ in range(3))
    bare = min(timed(lambda: op(q, k, k, lens, None, None, None, D ** -0.5, True, -1, -1, 0.0, None, None, 0))
               for _ in range(3))
    print(f"{torch.cuda.get_device_name()}, B={B} L={L} Hq=32 Hkv=8 D={D} bf16, best of 3 loops of 3000 calls")
    print(f"flash_attn_with_kvcache {wrapper:.1f} us/call, kvcache_fwd op {bare:.1f} us/call "
          f"({flashcore.last_kernel('fwd')})")
    transformers_step()


def transformers_step(B=8, Sk=8192, layers=8, steps=20):
    try:
        import flashcore.integrations.transformers as fct
    except ImportError:
        print("transformers is not installed: no backend step timed")
        return
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, 8, Sk, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    first = torch.arange(B, device="cuda") * 37  # left padding, a different amount a row

    def step(masked):
        for _ in range(steps):
            mask = torch.arange(Sk, device="cuda")[None, :] >= first[:, None] if masked else None
            for _ in range(layers):
                fct.attention_forward(module, q, k, v, mask)

    for name, masked in (("left-padded mask", True), ("no mask", False)):
        step(masked)
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(masked)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t) / (steps * layers) * 1e6)
        print(f"transformers attention_forward, {layers} layers sharing a mask, B={B} Sk={Sk} one query, {name}: "
              f"{best:.1f} us a layer")


if __name__ == "__main__":
    main()
