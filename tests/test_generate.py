"""examples/generate.py end to end: greedy generation of a small Llama-style model through flashcore's paged KV
cache (flash_attn_with_kvcache: prefill, then batched decode with rotary embeddings and the in-place append) must
give the same tokens as the same model on plain PyTorch (its own K/V tensors and SDPA)."""

import importlib.util
import pathlib
import sys

import pytest
import torch

from conftest import cuda_skip_reason

requires_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "generate.py"
_spec = importlib.util.spec_from_file_location("flashcore_example_generate", _PATH)
gen = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gen  # dataclasses look the module up there
_spec.loader.exec_module(gen)


def run_both(device, dtype, layers=2, new_tokens=8, page_size=16, prompts=None, dim=128, heads=2, kv_heads=1):
    cfg = gen.Config(layers=layers, dim=dim, heads=heads, kv_heads=kv_heads, hidden=2 * dim)
    model = gen.Model(cfg, device, dtype, seed=0)
    prompts = prompts or gen.random_prompts(3, cfg.vocab, max_len=40, seed=1)
    flash, timing = gen.generate(model, prompts, new_tokens, "flashcore", page_size)
    ref, _ = gen.generate(model, prompts, new_tokens, "sdpa")
    assert timing["decode_tokens"] == len(prompts) * (new_tokens - 1)
    return flash, ref, prompts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [16, 5])
def test_generate_matches_sdpa_cpu(dtype, page_size):
    flash, ref, prompts = run_both("cpu", dtype, page_size=page_size)
    assert [len(t) for t in flash] == [8, 8, 8]
    assert flash == ref, f"flashcore {flash} != sdpa {ref}"
    assert len({tuple(t) for t in flash}) == 3  # different prompts, different continuations


def test_generate_depends_on_the_context_cpu():
    """The tokens depend on the cached context, not only on the last token: prompts that differ only before their
    last token continue differently (so a cache that loses or misplaces keys cannot pass the comparison above)."""
    base = gen.random_prompts(1, 512, min_len=20, max_len=20, seed=7)[0]
    other = [(t + 1) % 512 for t in base[:-1]] + base[-1:]
    flash, ref, _ = run_both("cpu", torch.float32, prompts=[base, other])
    assert flash == ref
    assert flash[0] != flash[1]


def test_compare_tokens_rejects_a_wrong_token_cpu():
    """The near-tie rule of the GPU comparison is not a free pass: a token the float32 model ranks far below its
    argmax fails it."""
    cfg = gen.Config(layers=2, dim=128, heads=2, kv_heads=1, hidden=256, qk_gain=1.0)
    model = gen.Model(cfg, "cpu", torch.float32, seed=0)
    prompts = gen.random_prompts(2, cfg.vocab, max_len=20, seed=1)
    flash, _ = gen.generate(model, prompts, 6, "flashcore")
    assert gen.compare_tokens(model, prompts, flash, flash)[0]
    ref = gen.reference_logits(model, prompts[0], flash[0])
    wrong = [list(t) for t in flash]
    wrong[0][3] = int(ref[3].argmin())
    assert not gen.compare_tokens(model, prompts, wrong, flash)[0]


def test_generate_cli_check_cpu(capsys):
    assert gen.main(["--device", "cpu", "--prompts", "2", "--new-tokens", "4", "--layers", "1", "--check"]) == 0
    out = capsys.readouterr().out
    assert "tokens identical" in out and "tokens/s" in out


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [16, 256])
def test_generate_matches_sdpa_cuda(dtype, page_size):
    """Head dim 64, 4 prompts, 16 new tokens, ordinary attention (qk_gain 1). In 16 bits two attention kernels round
    differently, so tokens may part at a near-tie of the two best logits: compare_tokens accepts that only where the
    float32 model ranks both choices within 0.1, and checks every flashcore token against the float32 argmax."""
    cfg = gen.Config(layers=2, dim=256, heads=4, kv_heads=2, hidden=512, qk_gain=1.0)
    model = gen.Model(cfg, "cuda", dtype, seed=0)
    prompts = gen.random_prompts(4, cfg.vocab, max_len=40, seed=1)
    flash, _ = gen.generate(model, prompts, 16, "flashcore", page_size)
    ref, _ = gen.generate(model, prompts, 16, "sdpa")
    ok, message = gen.compare_tokens(model, prompts, flash, ref)
    assert ok, message
