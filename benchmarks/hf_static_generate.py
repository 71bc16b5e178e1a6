"""transformers' static-cache generation on the flashcore backend against SDPA, in one process: a Llama-style
model with random weights (no download), left-padded prompts, greedy decoding with
`cache_implementation="static"`, which transformers compiles (its default CompileConfig: inductor,
reduce-overhead, i.e. CUDA graphs) on a GPU. Prints per backend the first call's time (compilation included), the
best of three further calls, the GPU's busy time in one more (kernel time, which a small model's host-bound wall
time hides), graph breaks and compiled graphs, then how many new tokens agree (bf16 greedy
decoding of random weights drifts on near-ties; tests/test_transformers.py checks equality in float32).

    python benchmarks/hf_static_generate.py [--batch 4 --prompt 512 --new 64 --layers 8 --hidden 1024]
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
import torch._dynamo


def gpu_busy(fn) -> tuple[float, int]:
    """Seconds the GPU spends in kernels during fn (torch.profiler's CUDA activity: the sum of kernel times, CUDA
    graphs' kernels included) and their count. A small model's generation is bound by the host's per-step work, so
    its wall time hides the attention's cost; this is the part the attention backend changes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in events) * 1e-6, len(events)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512, help="prompt length (rows b > 0 left-padded)")
    p.add_argument("--new", type=int, default=64, help="new tokens")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hf_static_generate.py: needs a GPU (transformers compiles static-cache generation there)")
    warnings.filterwarnings("ignore")
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    import flashcore.integrations.transformers as fct

    transformers.logging.set_verbosity_error()
    heads = args.hidden // 64
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                      max_position_embeddings=4 * (args.prompt + args.new), pad_token_id=0, bos_token_id=1,
                      eos_token_id=None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, cfg.vocab_size, (args.batch, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, args.batch):  # left padding of different lengths
        pad = int(torch.randint(1, args.prompt // 2, (1,), generator=g))
        ids[b, :pad], mask[b, :pad] = 0, 0
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
              cache_implementation="static")
    tokens = {}
    print(f"{torch.cuda.get_device_name()}, Llama {args.layers} x {args.hidden} bf16, batch {args.batch}, prompt "
          f"{args.prompt} (left-padded), {args.new} new tokens, static cache")
    for impl in ("sdpa", fct.NAME):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation=impl)
        model = model.to("cuda", torch.bfloat16).eval()
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        with torch.no_grad():
            t = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            first = time.perf_counter() - t
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                tokens[impl] = model.generate(ids, **kw)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            busy, kernels = gpu_busy(lambda: model.generate(ids, **kw))
        counters = torch._dynamo.utils.counters
        print(f"{impl:6s} first call {first:6.1f} s, then {best * 1e3:7.1f} ms ({args.batch * args.new / best:6.0f} "
              f"tokens/s), GPU busy {busy * 1e3:6.1f} ms in {kernels} kernels; graph breaks "
              f"{sum(counters['graph_break'].values())}, graphs {counters['stats']['unique_graphs']}")
    new_a, new_b = tokens["sdpa"][:, args.prompt:], tokens[fct.NAME][:, args.prompt:]
    print(f"new tokens equal to SDPA's: {(new_a == new_b).float().mean().item():.3f}")


if __name__ == "__main__":
    main()
