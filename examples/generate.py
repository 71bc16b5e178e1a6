"""Batched greedy generation with a small Llama-style decoder on flashcore's paged KV cache.

    python examples/generate.py                                    # CPU, float32, both backends, --check
    python examples/generate.py --device cuda --dtype bfloat16 --prompts 8 --new-tokens 64

The model (random weights from a seed: nothing is downloaded) has token embeddings, RMSNorm, rotary position
embeddings (GPT-NeoX halves, as Llama), grouped-query attention, a SwiGLU MLP and an lm_head. Backend "flashcore"
keeps K/V in a paged cache (pages of --page-size rows handed out from a free-page pool as sequences grow, one block
table row per sequence) and runs every attention through flash_attn_with_kvcache, which rotates q and the new k,
appends k/v into the cache and attends: each prompt is prefilled on its own (causal, seqlen_q = its length), then
all sequences decode together, one token per step (seqlen_q = 1, cache_seqlens a tensor). Backend "sdpa" runs the
same model with plain PyTorch: its own contiguous K/V tensors and torch.nn.functional.scaled_dot_product_attention.
--backend both generates with each and compares the tokens (--check makes a difference an error).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    from flashcore.flash_attn_interface import flash_attn_with_kvcache
except ImportError:  # run from a checkout without installing: examples/.. is the repository root
    sys.path.insert(0, __file__.rsplit("/examples/", 1)[0])
    from flashcore.flash_attn_interface import flash_attn_with_kvcache


@dataclass
class Config:
    vocab: int = 512
    dim: int = 256
    layers: int = 2
    heads: int = 4  # head dim = dim / heads = 64
    kv_heads: int = 2
    hidden: int = 512
    rope_theta: float = 10000.0
    eps: float = 1e-5
    # Conditioning for low precision: q and k weights this much larger than usual make attention sharp (score
    # spread ~qk_gain**2: one key dominates each row), so a row's output is that key's value, bitwise, whatever the
    # kernel's summation order; hidden states, and tokens, then agree between attention implementations instead of
    # flipping at near-ties of the argmax in bfloat16 (the logits are computed in float32 for the same reason).
    qk_gain: float = 200.0


class Model:
    """Weights drawn from `seed` (on the CPU, so every device gets the same model), cast to dtype on device."""

    def __init__(self, cfg: Config, device="cpu", dtype=torch.float32, seed=0):
        self.cfg, self.device, self.dtype, self.seed = cfg, torch.device(device), dtype, seed
        g = torch.Generator().manual_seed(seed)
        w = lambda *shape, std: (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)
        ones = lambda n: torch.ones(n, device=device, dtype=dtype)
        d, hd = cfg.dim, cfg.dim // cfg.heads
        self.embed = w(cfg.vocab, d, std=1.0)
        qk = cfg.qk_gain * d**-0.5
        self.blocks = [dict(attn_norm=ones(d), wq=w(d, cfg.heads * hd, std=qk),
                            wk=w(d, cfg.kv_heads * hd, std=qk), wv=w(d, cfg.kv_heads * hd, std=d**-0.5),
                            wo=w(cfg.heads * hd, d, std=d**-0.5), mlp_norm=ones(d),
                            w_gate=w(d, cfg.hidden, std=d**-0.5), w_up=w(d, cfg.hidden, std=d**-0.5),
                            w_down=w(cfg.hidden, d, std=cfg.hidden**-0.5))
                       for _ in range(cfg.layers)]
        self.norm = ones(d)
        self.lm_head = w(d, cfg.vocab, std=d**-0.5).float()

    def rope_tables(self, n):
        """cos and sin (n, head_dim / 2) of the rotary angles of positions 0..n-1, in the model's dtype."""
        hd = self.cfg.dim // self.cfg.heads
        inv_freq = 1.0 / self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        return angles.cos().to(self.device, self.dtype), angles.sin().to(self.device, self.dtype)

    def rms_norm(self, x, weight):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.eps)).to(x.dtype) * weight

    def forward(self, tokens, attend):
        """tokens (B, S) -> logits (B, S, vocab) in float32; attend(layer, q, k, v) -> (B, S, heads, head_dim),
        q/k/v (B, S, heads, head_dim) before the rotary embedding (each backend places and rotates them)."""
        cfg = self.cfg
        B, S = tokens.shape
        hd = cfg.dim // cfg.heads
        x = self.embed[tokens]
        for i, p in enumerate(self.blocks):
            h = self.rms_norm(x, p["attn_norm"])
            q = (h @ p["wq"]).view(B, S, cfg.heads, hd)
            k = (h @ p["wk"]).view(B, S, cfg.kv_heads, hd)
            v = (h @ p["wv"]).view(B, S, cfg.kv_heads, hd)
            x = x + attend(i, q, k, v).reshape(B, S, -1) @ p["wo"]
            h = self.rms_norm(x, p["mlp_norm"])
            x = x + (F.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        return self.rms_norm(x, self.norm).float() @ self.lm_head


class FlashcoreBackend:
    """K/V in a paged cache: per layer (num_pages, page_size, kv_heads, head_dim); pages come from a free list as
    sequences grow; block_table (batch, max_pages) int32 maps each sequence's positions to its pages."""

    def __init__(self, model: Model, batch: int, max_len: int, page_size: int = 16):
        cfg = model.cfg
        self.model, self.page_size = model, page_size
        self.max_pages = -(-max_len // page_size)
        num_pages = batch * self.max_pages
        shape = (num_pages, page_size, cfg.kv_heads, cfg.dim // cfg.heads)
        self.k = [torch.zeros(shape, device=model.device, dtype=model.dtype) for _ in range(cfg.layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.free = list(range(num_pages))
        self.pages = [[] for _ in range(batch)]  # host copy of each sequence's pages
        self.table = torch.zeros(batch, self.max_pages, dtype=torch.int32, device=model.device)
        self.cos, self.sin = model.rope_tables(self.max_pages * page_size)  # flash-attn: one row per cache slot

    def reserve(self, seq: int, length: int):
        """Pages for `length` tokens of sequence seq, taken from the free list (the block table is copied to the
        device only when a page was added)."""
        added = False
        while len(self.pages[seq]) * self.page_size < length:
            self.pages[seq].append(self.free.pop(0))
            added = True
        if added:
            self.table[seq, : len(self.pages[seq])] = torch.tensor(self.pages[seq], dtype=torch.int32)

    def step(self, tokens, seqs, lengths, lens):
        """Logits for `tokens` (B, S) of sequences `seqs` (a slice of the batch), whose caches hold `lengths` (a
        list) = `lens` (an int32 tensor on the device: read there, no host-to-device copy per step)."""
        table = self.table[seqs]

        def attend(i, q, k, v):
            return flash_attn_with_kvcache(q, self.k[i], self.v[i], k, v, rotary_cos=self.cos, rotary_sin=self.sin,
                                           cache_seqlens=lens, block_table=table,
                                           causal=True, rotary_interleaved=False)

        return self.model.forward(tokens, attend)


def rotate(x, cos, sin, positions):
    """GPT-NeoX rotary embedding of x (B, S, H, D) at positions (B, S), in float32, rounded once."""
    half = cos.size(1)
    c, s = cos[positions].float()[:, :, None], sin[positions].float()[:, :, None]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), -1).to(x.dtype)


class SdpaBackend:
    """Plain PyTorch: contiguous K/V per layer (batch, kv_heads, max_len, head_dim), SDPA with a length mask."""

    def __init__(self, model: Model, batch: int, max_len: int, page_size=None):
        cfg = model.cfg
        self.model = model
        shape = (batch, cfg.kv_heads, max_len, cfg.dim // cfg.heads)
        self.k = [torch.zeros(shape, device=model.device, dtype=model.dtype) for _ in range(cfg.layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.cos, self.sin = model.rope_tables(max_len)

    def reserve(self, seq, length):
        pass

    def step(self, tokens, seqs, lengths, lens):
        B, S = tokens.shape
        dev = self.model.device
        pos = torch.tensor(lengths, device=dev)[:, None] + torch.arange(S, device=dev)  # (B, S)
        end = max(lengths) + S
        # key j visible to query (b, i) when j <= lengths[b] + i: causal, and a shorter sequence's rows past its end
        # are masked
        mask = torch.arange(end, device=dev)[None, None, :] <= pos[:, :, None]

        def attend(i, q, k, v):
            q, k = rotate(q, self.cos, self.sin, pos), rotate(k, self.cos, self.sin, pos)
            kc, vc = self.k[i][seqs], self.v[i][seqs]  # views of these sequences' rows
            for b, n in enumerate(lengths):
                kc[b, :, n:n + S], vc[b, :, n:n + S] = k[b].transpose(0, 1), v[b].transpose(0, 1)
            # K/V heads repeated rather than enable_gqa=True, which with a mask takes CUDA tensors to the math
            # backend (scores in the input dtype, too coarse for the sharp attention in 16 bits)
            group = q.size(2) // kc.size(1)
            kr, vr = (t[:, :, :end].repeat_interleave(group, dim=1) for t in (kc, vc))
            out = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, attn_mask=mask[:, None])
            return out.transpose(1, 2)

        return self.model.forward(tokens, attend)


def reference_logits(model32: Model, prompt, tokens):
    """float32 logits at the position of each of `tokens` (generated after `prompt`): the model in float32 run over
    the whole sequence in one causal pass (teacher-forced along `tokens`), with SDPA."""
    seq = prompt + tokens[:-1]
    cache = SdpaBackend(model32, 1, len(seq))
    logits = cache.step(torch.tensor([seq], device=model32.device), slice(0, 1), [0],
                        torch.zeros(1, dtype=torch.int32, device=model32.device))
    return logits[0, len(prompt) - 1:]


def compare_tokens(model: Model, prompts, flash, sdpa, tol=0.1):
    """flashcore's tokens against SDPA's. Identical passes. In 16-bit types two attention kernels round
    differently, so a step whose two best logits are closer than that rounding may go either way: then the float32
    model (teacher-forced along flashcore's tokens) must rank both choices within `tol` of each other there, and
    every flashcore token must be within `tol` of the float32 argmax at its step (a wrong cache is not). Returns
    (ok, message)."""
    if flash == sdpa:
        return True, "tokens identical"
    model32 = Model(model.cfg, model.device, torch.float32, seed=model.seed)
    notes, ok = [], True
    for b, (prompt, f, s) in enumerate(zip(prompts, flash, sdpa)):
        ref = reference_logits(model32, prompt, f)
        worst = max((ref[i].max() - ref[i][t]).item() for i, t in enumerate(f))
        ok &= worst <= tol
        if f != s:
            i = next(i for i, (x, y) in enumerate(zip(f, s)) if x != y)
            tie = abs(ref[i][f[i]] - ref[i][s[i]]).item()
            ok &= tie <= tol
            notes.append(f"prompt {b} from step {i} (float32 logits of the two choices {tie:.3f} apart)")
        if worst > tol:
            notes.append(f"prompt {b}: a flashcore token {worst:.3f} below the float32 argmax")
    head = "tokens agree up to near-ties" if ok else "tokens DIFFER"
    return ok, f"{head}: " + "; ".join(notes)


def progress(done, total, start, width=30):
    rate = done / max(time.perf_counter() - start, 1e-9)
    bar = "#" * (width * done // total) + "." * (width - width * done // total)
    print(f"\r  [{bar}] {done}/{total} steps, {rate:.1f} steps/s", end="" if done < total else "\n", file=sys.stderr,
          flush=True)


def sync(device):
    torch.cuda.synchronize() if device.type == "cuda" else None


def generate(model: Model, prompts, new_tokens: int, backend="flashcore", page_size=16, show_progress=False):
    """Greedy generation: prefill each prompt alone, then decode all together. Returns (new tokens per prompt,
    timings dict)."""
    B = len(prompts)
    cache = (FlashcoreBackend if backend == "flashcore" else SdpaBackend)(
        model, B, max(len(p) for p in prompts) + new_tokens, page_size)
    lengths, last = [0] * B, []
    sync(model.device)
    t0 = time.perf_counter()
    for b, prompt in enumerate(prompts):
        cache.reserve(b, len(prompt))
        tokens = torch.tensor([prompt], device=model.device)
        logits = cache.step(tokens, slice(b, b + 1), [0], torch.zeros(1, dtype=torch.int32, device=model.device))
        lengths[b] = len(prompt)
        last.append(logits[0, -1].argmax())
    generated, nxt = [], torch.stack(last)
    lens = torch.tensor(lengths, dtype=torch.int32, device=model.device)
    sync(model.device)
    t1 = time.perf_counter()
    for step in range(new_tokens):
        generated.append(nxt)  # stays on the device: no sync per step
        if step == new_tokens - 1:
            break
        for b in range(B):
            cache.reserve(b, lengths[b] + 1)
        logits = cache.step(nxt[:, None], slice(0, B), lengths, lens)
        lengths = [n + 1 for n in lengths]
        lens += 1
        nxt = logits[:, -1].argmax(-1)
        if show_progress:
            progress(step + 1, new_tokens - 1, t1)
    out = torch.stack(generated, 1).tolist()
    t2 = time.perf_counter()
    return out, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prompt_tokens": sum(map(len, prompts)),
                 "decode_tokens": B * (new_tokens - 1)}


def random_prompts(n, vocab, min_len=3, max_len=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lens]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                    help="default: bfloat16 on CUDA (flashcore's CUDA kernels are 16-bit), float32 on the CPU")
    ap.add_argument("--backend", default="both", choices=["flashcore", "sdpa", "both"])
    ap.add_argument("--prompts", type=int, default=4, help="number of prompts (random tokens, lengths 3..max)")
    ap.add_argument("--max-prompt-len", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=Config.layers)
    ap.add_argument("--dim", type=int, default=Config.dim, help="model width (head dim = dim / heads)")
    ap.add_argument("--heads", type=int, default=Config.heads)
    ap.add_argument("--kv-heads", type=int, default=Config.kv_heads)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--qk-gain", type=float, default=1.0, help="q/k weight scale (the tests use sharper attention)")
    ap.add_argument("--check", action="store_true", help="with --backend both: exit 1 unless the tokens agree")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    cfg = Config(layers=args.layers, dim=args.dim, heads=args.heads, kv_heads=args.kv_heads, qk_gain=args.qk_gain)
    model = Model(cfg, args.device, dtype, seed=args.seed)
    prompts = random_prompts(args.prompts, cfg.vocab, max_len=args.max_prompt_len, seed=args.seed + 1)
    print(f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens, {args.new_tokens} new tokens each; "
          f"{cfg.layers} layers, dim {cfg.dim}, {cfg.heads}/{cfg.kv_heads} heads, {args.device} {dtype}")
    results = {}
    for name in (["flashcore", "sdpa"] if args.backend == "both" else [args.backend]):
        print(f"{name}:")
        tokens, t = generate(model, prompts, args.new_tokens, name, args.page_size, show_progress=True)
        results[name] = tokens
        print(f"  prefill {t['prompt_tokens'] / t['prefill_s']:.0f} tokens/s, decode "
              f"{t['decode_tokens'] / max(t['decode_s'], 1e-9):.1f} tokens/s; first sequence: {tokens[0][:16]}")
    if len(results) == 2:
        same, message = compare_tokens(model, prompts, results["flashcore"], results["sdpa"])
        print(message)
        if args.check and not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
