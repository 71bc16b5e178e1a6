"""The Hugging Face transformers backend (flashcore.integrations.transformers, attn_implementation="fcore").

Tiny decoder models with random weights, built from configs (nothing is downloaded): Llama (GQA), Mistral (a sliding
window shorter than the sequences), Gemma 2 (attention logit softcapping, sliding window on alternate layers, a
non-default scaling) and GPT-OSS (attention sinks, sliding window on alternate layers, MoE). Each model under flashcore
must give the logits of the same weights under transformers' own `eager` (and `sdpa` where it supports the model)
backends, the same greedy generations from left-padded prompts (dynamic and static caches), and, in a padding-free
training step (a flattened batch as DataCollatorWithFlattening makes it), the loss and gradients of the padded batch.
CPU in float32; the GPU variants run in bfloat16.
"""

import copy
import inspect
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import (AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM,
                          DataCollatorWithFlattening, Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig)

import flashcore.integrations.transformers as fct
from conftest import cuda_skip_reason

requires_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")

KINDS = ["llama", "mistral", "gemma2", "gpt_oss"]
WINDOW = 8  # shorter than every sequence below, so the window changes the result

# initializer_range 0.1 (not 0.02): attention weights far from uniform, so masks, windows, softcap and sinks matter.
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, pad_token_id=0,
              bos_token_id=1, eos_token_id=None, attention_dropout=0.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models are tiny: threads only add synchronization (and slow down much on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_config(kind, **overrides):
    if kind == "llama":
        return LlamaConfig(**{**COMMON, **overrides})
    if kind == "mistral":  # MQA, every layer sliding
        return MistralConfig(**{**COMMON, "num_key_value_heads": 1, "sliding_window": WINDOW, **overrides})
    if kind == "gemma2":  # softcap 2 (scores reach ~5 here), scaling 1/sqrt(8) != 1/sqrt(head_dim)
        return Gemma2Config(**{**COMMON, "head_dim": 16, "sliding_window": WINDOW, "attn_logit_softcapping": 2.0,
                               "final_logit_softcapping": None, "query_pre_attn_scalar": 8, **overrides})
    if kind == "gpt_oss":  # 4 tiny experts, 2 per token
        return GptOssConfig(**{**COMMON, "intermediate_size": 32, "head_dim": 16, "sliding_window": WINDOW,
                               "num_local_experts": 4, "num_experts_per_tok": 2, **overrides})
    raise ValueError(kind)


def build(kind, impl, seed=0, dtype=torch.float32, device="cpu", **overrides):
    """A model of `kind` with seeded random weights (the same for every impl), in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind, **overrides), attn_implementation=impl)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):  # O(1) sinks (the init's 0.1 would hardly show)
                p.normal_()
    return model.to(device=device, dtype=dtype).eval()


def pair(kind, ref_impl="eager", **kw):
    return build(kind, ref_impl, **kw), build(kind, fct.NAME, **kw)


def prompts(lengths, device="cpu", seed=1, side="left"):
    """input_ids and attention_mask of prompts of these lengths, padded on `side` with pad id 0."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        cols = slice(S - n, S) if side == "left" else slice(0, n)
        ids[b, cols] = torch.randint(2, COMMON["vocab_size"], (n,), generator=g)
        mask[b, cols] = 1
    return ids.to(device), mask.to(device)


def assert_logits_close(got, ref, where=None, rel=1e-4):
    """float32: the largest difference at most `rel` of the logits' scale."""
    if where is not None:
        got, ref = got[where], ref[where]
    err, scale = (got.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
    assert err <= rel * scale, f"logits differ by {err:.3e} (scale {scale:.3e}, bound {rel * scale:.3e})"


class CallCounter:
    """Counts calls of the flashcore entry points the backend uses."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in ("_attention", "_varlen_attention", "_attention_bshd"):
            fn = getattr(fct, name)
            monkeypatch.setattr(fct, name, self._wrap(fn))

    def _wrap(self, fn):
        def wrapped(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return wrapped


# ---------------------------------------------------------------------------------------------------------------
# Registration and import
# ---------------------------------------------------------------------------------------------------------------


def test_register_is_idempotent():
    assert fct.register() == fct.NAME == "fcore"
    assert fct.register() == fct.NAME
    assert AttentionInterface._global_mapping[fct.NAME] is fct.attention_forward
    assert AttentionMaskInterface._global_mapping[fct.NAME] is fct.padding_mask
    # transformers 5 loads any name containing "flash" as a flash-attn kernel from the Hub: refused up front.
    with pytest.raises(ValueError, match="flash"):
        fct.register("flashcore")


def test_import_is_optional():
    """`import flashcore` never imports transformers; without transformers the integration names the package."""
    script = (
        "import sys\n"
        "import flashcore, flashcore.integrations\n"
        "assert 'transformers' not in sys.modules, 'import flashcore imported transformers'\n"
        "sys.modules['transformers'] = None  # as if not installed\n"
        "try:\n"
        "    import flashcore.integrations.transformers\n"
        "except ImportError as e:\n"
        "    assert '`transformers`' in str(e) and 'pip install transformers' in str(e), str(e)\n"
        "else:\n"
        "    raise AssertionError('no ImportError without transformers')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


FLASH_ATTENTION_2_SCRIPT = r"""
import copy, sys, torch, flashcore
flashcore.install_flash_attn_alias()  # before transformers: it caches what it finds installed
import flashcore.flash_attn_interface as fai
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig
from transformers.utils import import_utils
dev = sys.argv[1]
if dev == "cpu":
    # transformers offers flash_attention_2 only with CUDA; the alias's functions run on the CPU as well
    import_utils.is_torch_cuda_available = lambda: True
    import_utils.is_flash_attn_2_available.cache_clear()
assert import_utils.is_flash_attn_2_available()
calls = []
for name in ("_attention_bshd", "_varlen"):  # the bodies of flash_attn_func and flash_attn_varlen_func
    def counted(*a, _f=getattr(fai, name), **k):
        calls.append(_f)
        return _f(*a, **k)
    setattr(fai, name, counted)
cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, pad_token_id=0)
dtype = torch.bfloat16  # transformers' flash_attention_2 takes half dtypes only
torch.manual_seed(0)
# a config each: from_config writes the implementation into the config it is given
ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=dtype).to(dev).eval()
fa2 = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flash_attention_2", dtype=dtype)
fa2 = fa2.to(dev).eval()
fa2.load_state_dict(ref.state_dict())
ids = torch.randint(1, 128, (2, 24), device=dev)
mask = torch.ones_like(ids)
mask[0, :5] = 0  # left padding
with torch.no_grad():
    want = ref(ids, attention_mask=mask).logits
    assert not calls, "the sdpa model ran flashcore"
    got = fa2(ids, attention_mask=mask).logits
assert [f.__name__ for f in calls] == ["_varlen"] * 2, calls  # the padded batch: one varlen call a layer
err = (want - got)[mask.bool()].abs().max().item()
assert err <= 5e-2, err
# padding free: three sequences flattened into one row, as DataCollatorWithFlattening gives them (with the
# cu_seq_lens kwargs, and with position_ids alone), against each sequence alone under sdpa
seqs = [torch.randint(1, 128, (n,)).tolist() for n in (7, 12, 5)]
with torch.no_grad():
    want = torch.cat([ref(torch.tensor([s], device=dev)).logits[0] for s in seqs])
    for kwargs in (True, False):
        calls.clear()
        flat = DataCollatorWithFlattening(return_flash_attn_kwargs=kwargs)([{"input_ids": s} for s in seqs])
        flat = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in flat.items() if k != "labels"}
        got = fa2(**flat).logits[0]
        assert [f.__name__ for f in calls] == ["_varlen"] * 2, calls
        assert (want - got).abs().max().item() <= 5e-2, (kwargs, (want - got).abs().max().item())
gen_ref = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
gen = fa2.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
if not torch.equal(gen_ref, gen):
    # two 16-bit kernels round differently: tokens may part only at a near-tie of the float32 model's two choices
    ref32 = copy.deepcopy(ref).float()
    for b in range(gen.size(0)):
        differ = (gen[b] != gen_ref[b]).nonzero()
        if len(differ):
            i = int(differ[0])
            row_mask = torch.cat([mask[b], mask.new_ones(gen.size(1) - mask.size(1))])[None, :i]
            with torch.no_grad():
                logits = ref32(gen[b:b + 1, :i], attention_mask=row_mask).logits[0, -1]
            tie = (logits[gen[b, i]] - logits[gen_ref[b, i]]).abs().item()
            assert tie <= 0.1, (b, i, tie, gen_ref, gen)
assert ref.config._attn_implementation == "sdpa" and fa2.config._attn_implementation == "flash_attention_2"
print("ok", err)
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_flash_attention_2_through_the_alias(device):
    """Code written for transformers' own attn_implementation="flash_attention_2" runs on flashcore unchanged once
    install_flash_attn_alias() ran: transformers finds flash-attn installed (the alias's metadata), imports its
    functions from `flash_attn` and gets flashcore's; logits match sdpa's on a left-padded batch and on a
    padding-free one (DataCollatorWithFlattening), and greedy generation from left-padded prompts gives the same
    tokens. In a subprocess: the alias must come before transformers is imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, "-c", FLASH_ATTENTION_2_SCRIPT, device], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def test_from_config_and_set_attn_implementation(monkeypatch):
    """Both ways of selecting the backend run every attention layer through flashcore, with the same results."""
    counter = CallCounter(monkeypatch)
    ids, mask = prompts([13, 9], side="right")
    direct = build("llama", fct.NAME)
    assert direct.config._attn_implementation == fct.NAME
    switched = build("llama", "eager")
    with torch.no_grad():
        ref = switched(ids, attention_mask=mask).logits
    assert counter.calls == 0
    switched.set_attn_implementation(fct.NAME)
    assert switched.config._attn_implementation == fct.NAME
    for model in (direct, switched):
        counter.calls = 0
        with torch.no_grad():
            got = model(ids, attention_mask=mask).logits
        assert counter.calls == COMMON["num_hidden_layers"]
        assert_logits_close(got, ref, where=mask.bool())


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("v_dim", [16, 8])
def test_attention_forward_direct(is_causal, v_dim):
    """The registered function alone, as a model calls it: GQA, a value head dim below the query's (MLA), causal or
    bidirectional; the output layout (B, S, H, Dv) of transformers' sdpa backend."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = is_causal, 2
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 9, 16, generator=g)
    k = torch.randn(2, 2, 9, 16, generator=g)
    v = torch.randn(2, 2, 9, v_dim, generator=g)
    out, weights = fct.attention_forward(module, q, k, v, None, scaling=0.3)
    want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 9, 4, v_dim)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_dropout_raises():
    model = build("llama", fct.NAME, attention_dropout=0.1).train()
    ids, _ = prompts([8, 8])
    with pytest.raises(NotImplementedError, match="dropout"):
        model(ids, use_cache=False)
    model.eval()  # transformers passes dropout only in training: fine in eval mode
    with torch.no_grad():
        model(ids)


def test_4d_mask_raises():
    model = build("llama", fct.NAME)
    ids, _ = prompts([6, 6])
    mask4d = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(TypeError, match="2-D"), torch.no_grad():
        model(ids, attention_mask=mask4d)


def _seeded(cls, cfg, impl):
    torch.manual_seed(0)
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    return make(copy.deepcopy(cfg), attn_implementation=impl).eval()


@pytest.mark.parametrize("dec_len", [1, 5, 30])
def test_cross_attention_with_padded_encoder(dec_len):
    """Bart: the decoder's cross-attention takes the encoder's padding mask over its keys; its queries (decoder
    tokens, more or fewer than the encoder's) are not unpadded by it. Encoder self-attention is bidirectional."""
    from transformers import AutoModelForSeq2SeqLM, BartConfig

    cfg = BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=0.0,
                     attention_dropout=0.0, init_std=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     decoder_start_token_id=1, forced_eos_token_id=None, max_position_embeddings=128)
    ref, model = (_seeded(AutoModelForSeq2SeqLM, cfg, impl) for impl in ("eager", fct.NAME))
    ids, mask = prompts([21, 12], side="right")
    dec = torch.randint(3, 128, (2, dec_len), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        got = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    assert_logits_close(got, want)


def test_patterns_flashcore_cannot_apply_raise():
    """Masks or biases that would change every result raise instead of being dropped: T5's relative position bias,
    Llama 4's chunked attention past one chunk (transformers raises the same for flash-attn), PaliGemma's
    prefix-LM blocks; and a value head dim above the query's."""
    import transformers as T

    t5 = _seeded(T.AutoModelForSeq2SeqLM, T.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0), fct.NAME)
    ids, mask = prompts([9, 9])
    with pytest.raises(NotImplementedError, match="position_bias"), torch.no_grad():  # refused by its flags
        t5(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :3])

    llama4 = _seeded(AutoModelForCausalLM, T.Llama4TextConfig(
        **{**COMMON, "num_key_value_heads": 2}, head_dim=16, attention_chunk_size=8, intermediate_size_mlp=128,
        num_local_experts=2, no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"]), fct.NAME)
    with torch.no_grad():
        llama4(prompts([8, 8])[0])  # within one chunk: plain causal attention, runs
        with pytest.raises(ValueError, match="chunked"):
            llama4(prompts([21, 21])[0])

    module = torch.nn.Module()
    module.is_causal = True
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(NotImplementedError, match="value head dim"):
        fct.attention_forward(module, q, k, torch.randn(1, 2, 5, 32), None)

    if not hasattr(T, "PaliGemmaForConditionalGeneration"):
        return
    vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=16, patch_size=8, projection_dim=64)
    text = T.GemmaConfig(vocab_size=130, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, pad_token_id=0)
    pali = _seeded(T.PaliGemmaForConditionalGeneration, T.PaliGemmaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=129, projection_dim=64),
        fct.NAME)
    ids = torch.cat([torch.full((1, 4), 129), torch.randint(2, 128, (1, 10))], 1)
    token_types = torch.zeros_like(ids)
    token_types[:, -4:] = 1  # image + 6 prompt tokens: a bidirectional prefix; the last 4 causal
    with pytest.raises(NotImplementedError, match="prefix-LM"), torch.no_grad():
        pali(input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16), token_type_ids=token_types,
             attention_mask=torch.ones_like(ids))


# ---------------------------------------------------------------------------------------------------------------
# Forward: logits against transformers' own backends
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,ref_impl", [("llama", "eager"), ("llama", "sdpa"), ("mistral", "eager"),
                                           ("mistral", "sdpa"), ("gemma2", "eager"), ("gpt_oss", "eager")])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits(kind, ref_impl, padding):
    ref, model = pair(kind, ref_impl)
    ids, mask = prompts([21, 21] if padding == "none" else [21, 12], side="left" if padding == "none" else padding)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    assert_logits_close(got, want, where=mask.bool())


# Decoder families beyond the four above, built from their configs with the same small sizes (a sliding window of 6
# where the family has one): each runs attention through the registered function.
MORE_MODEL_TYPES = ["qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma3_text", "phi", "phi3", "mixtral",
                    "olmo", "olmo2", "cohere", "cohere2", "stablelm", "starcoder2", "granite", "gpt_neox", "gpt2",
                    "gpt_bigcode", "opt", "persimmon", "helium", "glm", "glm4", "exaone4", "smollm3", "ministral",
                    "arcee", "hunyuan_v1_dense", "seed_oss", "lfm2", "minimax", "apertus", "ernie4_5", "bitnet"]


@pytest.mark.parametrize("model_type", MORE_MODEL_TYPES)
def test_more_model_types_match_eager(model_type, monkeypatch):
    """Logits of a left-padded batch (valid positions) within float32 rounding of `eager`'s, and the same greedy
    tokens, for every decoder family above, its attention run by flashcore's ops (counted)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **COMMON)
    for name, value in (("sliding_window", 6), ("use_sliding_window", True), ("head_dim", 16)):
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    ref, got = (_seeded(AutoModelForCausalLM, cfg, impl) for impl in ("eager", fct.NAME))
    assert got.config._attn_implementation == fct.NAME
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, 128, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :7] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want, have = (m(ids, attention_mask=mask).logits for m in (ref, got))
    valid = mask.bool()
    torch.testing.assert_close(have[valid], want[valid], rtol=1e-4, atol=1e-4)
    counter = CallCounter(monkeypatch)
    tokens = [m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False) for m in (ref, got)]
    assert torch.equal(tokens[0], tokens[1]) and counter.calls >= 8  # a layer at least (MiniMax: one of two)


@pytest.mark.parametrize("positions", ["gaps", "repeat", "restart"])
@pytest.mark.parametrize("call", ["cache", "no_cache", "mask_of_ones"])
def test_position_ids_pack_where_eager_or_flash_attention_2_does(positions, call):
    """position_ids other than a +1 run. transformers' eager and sdpa treat them as packed sequences (each step other
    than +1 starting one) only without a cache and without an attention_mask; flashcore packs there too (the mask
    function hands it transformers' sequence ids), and otherwise only where they restart (decrease), as
    flash_attention_2 does whatever the cache: gaps and repeats under a cache or a mask are one sequence."""
    ref, model = pair("mistral")  # sliding layers too
    ids, _ = prompts([16], seed=4)
    pos = {"gaps": torch.arange(0, 32, 2), "repeat": torch.cat([torch.arange(4), torch.arange(3, 15)]),
           "restart": torch.cat([torch.arange(6), torch.arange(10)])}[positions][None]
    kwargs = {"cache": {}, "no_cache": {"use_cache": False},
              "mask_of_ones": {"attention_mask": torch.ones_like(ids), "use_cache": False}}[call]
    packs = call == "no_cache" or positions == "restart"
    with torch.no_grad():
        got = model(ids, position_ids=pos, **kwargs).logits
        packed = ref(ids, position_ids=pos, use_cache=False).logits  # eager's packed reading
        unpacked = ref(ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits
    assert (packed - unpacked).abs().max().item() > 1e-3, "the case does not tell packed from unpacked"
    assert_logits_close(got, packed if packs else unpacked)
    if not packs or call == "no_cache":  # eager itself, where it applies the same reading
        with torch.no_grad():
            assert_logits_close(got, ref(ids, position_ids=pos, **kwargs).logits)


@pytest.mark.parametrize("kind,change", [("mistral", {"sliding_window": None}), ("gemma2", {"sliding_window": 4096}),
                                         ("gemma2", {"attn_logit_softcapping": None}), ("gpt_oss", "sinks"),
                                         ("gpt_oss", {"sliding_window": 4096})])
def test_variant_matters(kind, change):
    """Each variant changes the logits (far beyond the tolerance), and flashcore follows the change like eager does:
    the window, the softcap and the sinks are really applied, not just accepted."""
    ids, mask = prompts([24, 17])
    base = build(kind, fct.NAME)
    if change == "sinks":
        ref, other = build(kind, "eager"), build(kind, fct.NAME)
        for m in (ref, other):
            with torch.no_grad():
                for layer in m.model.layers:
                    layer.self_attn.sinks.add_(3.0)
    else:
        ref, other = pair(kind, **change)
    with torch.no_grad():
        a = base(ids, attention_mask=mask).logits
        b = other(ids, attention_mask=mask).logits
        want = ref(ids, attention_mask=mask).logits
    valid = mask.bool()
    diff = (a - b)[valid].abs().max().item()
    assert diff > 1e-2 * a.abs().max().item(), f"{change} changed the logits by only {diff:.3e}"
    assert_logits_close(b, want, where=valid)


# ---------------------------------------------------------------------------------------------------------------
# KV cache: generation and chunked prefill (queries fewer than keys: bottom-right alignment)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [[11, 19], [15, 15]], ids=["left-padded", "unpadded"])
def test_generate(kind, cache, lengths):
    """Greedy generation of 32 tokens from left-padded prompts of different lengths (or unpadded ones), the cache
    outgrowing the sliding window: the same tokens as eager."""
    ref, model = pair(kind)
    ids, mask = prompts(lengths)
    kw = dict(attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False,
              cache_implementation=None if cache == "dynamic" else "static")
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = model.generate(ids, **kw)
    assert got.shape == (2, max(lengths) + 32)
    assert torch.equal(got, want), f"generations differ at {(got != want).nonzero().tolist()[:8]}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("padded", [False, True])
def test_cache_chunks(kind, padded):
    """Prefill in chunks of 10, 7 and 1 tokens through a dynamic cache: the logits of eager, chunk by chunk."""
    ref, model = pair(kind)
    ids, mask = prompts([18, 11] if padded else [18, 18])
    logits = {}
    # The cache argument is `cache` in newer transformers and `past_key_values` before (5.17); a name the model
    # does not take would land in **kwargs unused, and every chunk would run without its context.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for name, m in (("ref", ref), ("fcore", model)):
        cache, out = None, []
        with torch.no_grad():
            for lo, hi in ((0, 10), (10, 17), (17, 18)):
                res = m(ids[:, lo:hi], attention_mask=mask[:, :hi], use_cache=True, **{cache_arg: cache})
                cache = res.past_key_values
                out.append(res.logits)
        logits[name] = torch.cat(out, dim=1)
    assert_logits_close(logits["fcore"], logits["ref"], where=mask.bool())


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_right_padding_with_cached_keys(kind):
    """Right-padded rows whose padding falls among a later call's queries (a chunk after cached keys, a static
    cache's prefill; a last chunk of padding in every row; Mistral's sliding layers too): every row's keys are made
    to end at the queries (padding_mask marks a row's trailing padding among them), so the valid tokens get
    eager's logits, eagerly and, for the second chunk, compiled with fullgraph=True (no host reads)."""
    import torch._dynamo
    from transformers import StaticCache

    ref, model = pair(kind)
    ids, mask = prompts([18, 11, 14], side="right")
    ids, mask = F.pad(ids, (0, 1)), F.pad(mask, (0, 1))  # a 19th column of padding in every row
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for chunks, compiled in ((((0, 10), (10, 17), (17, 19)), False), (((0, 10), (10, 19)), True)):
        torch._dynamo.reset()
        logits = {}
        for name, m in (("ref", ref), ("fcore", model)):
            cache, out = None, []
            with torch.no_grad():
                for i, (lo, hi) in enumerate(chunks):
                    step = torch.compile(m, fullgraph=True, backend="eager") if compiled and i and m is model else m
                    res = step(ids[:, lo:hi], attention_mask=mask[:, :hi], use_cache=True, **{cache_arg: cache})
                    cache = res.past_key_values
                    out.append(res.logits)
            logits[name] = torch.cat(out, dim=1)
        assert_logits_close(logits["fcore"], logits["ref"], where=mask.bool())
    with torch.no_grad():  # a static cache's prefill: the mask covers the capacity
        want = ref(ids, attention_mask=mask, past_key_values=StaticCache(config=ref.config, max_cache_len=32)).logits
        got = model(ids, attention_mask=mask, past_key_values=StaticCache(config=model.config, max_cache_len=32)).logits
    assert_logits_close(got, want, where=mask.bool())


def test_compile_checks_restarting_position_ids_in_every_batch_size():
    """The host splits restarting position_ids in one-row batches only (flash_attention_2's rule), but under
    torch.compile, where the mask function's packing cannot be read, restarts in a batch of several rows raise too
    rather than attend across the sequences eager would split."""
    _, got = pair("llama")
    ids = prompts([12, 12])[0]
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]]).expand(2, -1)
    with torch.no_grad(), pytest.raises(RuntimeError, match="position_ids restart inside a row"):
        torch.compile(got)(ids, position_ids=pos, use_cache=False)


# ---------------------------------------------------------------------------------------------------------------
# Padding-free training (DataCollatorWithFlattening) against the padded batch
# ---------------------------------------------------------------------------------------------------------------


def training_step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens"])
def test_padding_free_training(kind, boundaries, monkeypatch):
    """A flattened batch (position_ids restarting per sequence; or also the cu_seq_lens_q/k and max_length_q/k
    kwargs) under flashcore gives the loss and gradients of the right-padded batch (labels -100 on padding) under
    eager, and of the padded batch under flashcore."""
    lengths = [12, 5, 16]  # longer and shorter than the window
    ids, mask = prompts(lengths, side="right", seed=3)
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=boundaries == "cu_seq_lens", return_tensors="pt")
    flat = collator([{"input_ids": ids[b, : n].tolist()} for b, n in enumerate(lengths)])
    assert flat["input_ids"].shape == (1, sum(lengths))
    assert ("cu_seq_lens_q" in flat) == (boundaries == "cu_seq_lens")
    if boundaries == "cu_seq_lens":  # the given boundaries are used, not inferred again from position_ids
        def unused(*args):
            raise AssertionError("the packed sequence ids were read although cu_seq_lens_q/k were given")
        monkeypatch.setattr(fct, "_packed_from_sequence_ids", unused)

    ref, model = pair(kind)
    ref.train()
    model.train()
    want_loss, want_grads = training_step(ref, padded)
    for batch in (flat, padded):
        loss, grads = training_step(model, batch)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
        assert grads.keys() == want_grads.keys()
        scale = max(g.abs().max().item() for g in want_grads.values())
        for name, g in grads.items():
            err = (g - want_grads[name]).abs().max().item()
            assert err <= 1e-4 * scale, f"{name}: gradient differs by {err:.3e} (largest gradient {scale:.3e})"
    if kind == "gpt_oss":  # the sinks are learned through flashcore's backward
        assert any(n.endswith("sinks") for n in grads)


# ---------------------------------------------------------------------------------------------------------------
# GPU (bfloat16): errors against float32 eager at most a few times eager's own bfloat16 error
# ---------------------------------------------------------------------------------------------------------------


def assert_within_eager_error(got, lowp, ref32, where=None, factor=3.0, floor=2.0**-8):
    """bfloat16: flashcore's error against the float32 reference at most `factor` x eager's own bfloat16 error, plus
    `floor` of the reference's scale."""
    if where is not None:
        got, lowp, ref32 = got[where], lowp[where], ref32[where]
    got, lowp, ref32 = got.float(), lowp.float(), ref32.float()
    err, own = (got - ref32).abs().max().item(), (lowp - ref32).abs().max().item()
    bound = factor * own + floor * ref32.abs().max().item()
    assert err <= bound, f"error {err:.3e} > bound {bound:.3e} (eager bfloat16's own error {own:.3e})"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_logits_and_generate(kind):
    ids, mask = prompts([21, 12], device="cuda")
    ref32 = build(kind, "eager", device="cuda")
    lowp = build(kind, "eager", dtype=torch.bfloat16, device="cuda")
    model = build(kind, fct.NAME, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        want32 = ref32(ids, attention_mask=mask).logits
        own = lowp(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
        assert got.dtype == torch.bfloat16
        assert_within_eager_error(got, own, want32, where=mask.bool())
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert gen.shape == (2, 21 + 32)
    assert torch.equal(gen[:, :21], ids)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_padding_free_training(kind):
    lengths = [12, 5, 16]
    ids, mask = prompts(lengths, side="right", seed=3, device="cuda")
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(
        [{"input_ids": ids[b, : n].tolist()} for b, n in enumerate(lengths)])
    flat = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    ref32 = build(kind, "eager", device="cuda").train()
    lowp = build(kind, "eager", dtype=torch.bfloat16, device="cuda").train()
    model = build(kind, fct.NAME, dtype=torch.bfloat16, device="cuda").train()
    loss32, grads32 = training_step(ref32, padded)
    own_loss, own_grads = training_step(lowp, padded)
    loss, grads = training_step(model, flat)
    assert_within_eager_error(loss, own_loss, loss32)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.embed_tokens.weight"):
        assert_within_eager_error(grads[name], own_grads[name], grads32[name], factor=4.0)


@pytest.mark.gpu
@requires_cuda
def test_gpu_float32_model():
    """flashcore's CUDA kernels take half precision: a float32 model raises a clear TypeError, and runs under
    autocast (in the autocast dtype)."""
    model = build("llama", fct.NAME, device="cuda")
    ids, mask = prompts([9, 6], device="cuda")
    with pytest.raises(TypeError, match="bfloat16"), torch.no_grad():
        model(ids, attention_mask=mask)
    ref = build("llama", "eager", device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        got = model(ids, attention_mask=mask).logits
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
    err = (got.float() - want).abs()[mask.bool()].max().item()
    assert err <= 0.05 * want.abs().max().item(), f"autocast logits differ by {err:.3e}"


def test_mask_function_patterns():
    """The mask function's verdict on the patterns transformers composes: a custom and_mask_function (it would hide
    keys) raises, also behind functools.partial; a custom or_mask_function (it only widens) is ignored with a
    warning; block-wise prefix-LM overlays raise only when the input has a block (an id >= 0), so text-only input
    of such a model runs."""
    import functools

    from transformers.masking_utils import and_masks, blockwise_overlay, causal_mask_function, or_masks

    def same_segment(b, h, q, kv):  # e.g. ESM C's sequence ids
        return (q // 4) == (kv // 4)

    kw = dict(batch_size=2, q_length=8, kv_length=8)
    for custom in (same_segment, functools.partial(lambda seg, b, h, q, kv: q // seg == kv // seg, 4)):
        with pytest.raises(NotImplementedError, match="and_mask_function"):
            fct.padding_mask(**kw, mask_function=and_masks(causal_mask_function, custom), use_vmap=True)
    assert fct.padding_mask(**kw, mask_function=or_masks(causal_mask_function, same_segment), use_vmap=True) is None
    text = torch.full((2, 8), -1)
    assert fct.padding_mask(**kw, mask_function=or_masks(causal_mask_function, blockwise_overlay(text))) is None
    image = text.clone()
    image[1, 2:5] = 0
    with pytest.raises(NotImplementedError, match="prefix-LM"):
        fct.padding_mask(**kw, mask_function=or_masks(causal_mask_function, blockwise_overlay(image)))


@pytest.mark.parametrize("name", ["indices", "block_indices", "sinks"])
def test_unsupported_attention_kwargs_raise(name):
    """Attention kwargs that change which keys a query sees or its scores (sparse indices, per-token sinks) raise
    NotImplementedError naming them, instead of being dropped."""
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(NotImplementedError, match=name):
        fct.attention_forward(module, q, q, q, None, **{name: torch.zeros(1, 2, 5, 1)})


def test_static_cache_with_a_mask_as_long_as_the_cache():
    """A prefill into a static cache with a caller's 2-D mask as long as the cache (zeros over the unwritten slots),
    and one longer than the prompt but shorter than the cache: the logits of eager."""
    from transformers import StaticCache

    ref, got = pair("llama")
    ids = prompts([10, 10])[0]
    for capacity, mask_len in ((16, 16), (32, 16)):
        mask = torch.cat([torch.ones(2, 10), torch.zeros(2, mask_len - 10)], 1).long()
        with torch.no_grad():
            want = ref(ids, attention_mask=mask, past_key_values=StaticCache(config=ref.config,
                                                                              max_cache_len=capacity)).logits
            out = got(ids, attention_mask=mask, past_key_values=StaticCache(config=got.config,
                                                                            max_cache_len=capacity)).logits
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_compile_fullgraph():
    """torch.compile(model, fullgraph=True) of a model on this backend, eval (with its dynamic cache) and a training
    forward: no graph break (the position_ids and mask-function inspections stay out of traced code), the logits
    of eager."""
    ref, got = pair("llama")
    ids = prompts([12, 12])[0]
    compiled = torch.compile(got, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    ref.train()
    got.train()
    compiled = torch.compile(got, fullgraph=True)
    torch.testing.assert_close(compiled(ids, use_cache=False).logits, ref(ids, use_cache=False).logits, rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_compiled_static_cache_generation_without_graph_breaks(kind):
    """generate(cache_implementation="static") under torch.compile(fullgraph=True) (transformers compiles the
    decoding step so on a GPU): the static cache's written length and the padding mask stay on the device
    (_masked_attention_in_graph), so no graph break and no recompilation per step; the tokens of eager from
    left-padded prompts (Mistral's window outgrown)."""
    import torch._dynamo
    from transformers import CompileConfig

    ref, model = pair(kind)
    ids, mask = prompts([7, 11, 4])
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
              cache_implementation="static")
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # transformers compiles the decoding step on accelerators only
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = model.generate(ids, compile_config=config, **kw)
    assert torch.equal(got, want), f"generations differ at {(got != want).nonzero().tolist()[:8]}"
    # not one per step or length (12 steps): sdpa compiles 1 (llama) and 2 (mistral) graphs here, this backend one
    # more for mistral, whose sliding layers switch to a window mask once the cache outgrows the window
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3


def test_compiled_padding_masks_in_graph():
    """Under torch.compile(fullgraph=True): an encoder's right-padded batch and a left-padded decode step read no
    lengths on the host and match eager (padded positions aside); a mask whose valid keys are not one run (right
    padding followed by a new token) is refused on the device, never attended wrongly."""
    import torch._dynamo
    import transformers as T

    small = dict(vocab_size=COMMON["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4)
    ids, mask = prompts([9, 5, 12], side="right")
    enc_ref, enc = (_seeded(T.BertModel, T.BertConfig(**small), impl) for impl in ("eager", fct.NAME))
    torch._dynamo.reset()
    with torch.no_grad():
        want = enc_ref(ids, attention_mask=mask).last_hidden_state
        got = torch.compile(enc, fullgraph=True, backend="eager")(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got * mask[..., None], want * mask[..., None], rtol=1e-4, atol=1e-4)

    ref, model = pair("llama")
    step = torch.compile(model, fullgraph=True, backend="eager")
    for side, refused in (("left", False), ("right", True)):
        ids, mask = prompts([9, 5, 12], side=side)
        new = torch.randint(2, 64, (3, 1))
        mask2 = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        with torch.no_grad():
            cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
            if refused:
                with pytest.raises(RuntimeError, match="not one run"):
                    step(new, attention_mask=mask2, past_key_values=cache, use_cache=True)
                continue
            ref_cache = ref(ids, attention_mask=mask, use_cache=True).past_key_values
            want = ref(new, attention_mask=mask2, past_key_values=ref_cache, use_cache=True).logits
            got = step(new, attention_mask=mask2, past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_restarting_position_ids_split_one_row_batches_only():
    """flash_attention_2's rule for position_ids that restart without a mask or boundaries (_is_packed_sequence): a
    one-row batch is a flattened batch of sequences (each attends within itself); rows of a batch of several are
    each one sequence, as eager attends them under a cache (its mask splits only without one)."""
    ref, got = pair("llama")
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    ids = prompts([12, 12])[0]
    with torch.no_grad():
        torch.testing.assert_close(got(ids, position_ids=pos.expand(2, -1), use_cache=True).logits,
                                   ref(ids, position_ids=pos.expand(2, -1), use_cache=True).logits,
                                   rtol=1e-4, atol=1e-4)
        one = got(ids[:1], position_ids=pos, use_cache=True).logits
        for a, b in ((0, 4), (4, 7), (7, 12)):
            alone = ref(ids[:1, a:b], position_ids=pos[:, a:b] - pos[0, a], use_cache=False).logits
            torch.testing.assert_close(one[:, a:b], alone, rtol=1e-4, atol=1e-4)


def test_compile_refuses_packed_position_ids_without_boundaries():
    """Under torch.compile the backend cannot read position_ids on the host: a flattened batch described by
    position_ids alone (DataCollatorWithFlattening's default) raises, naming the kwargs that pack it, instead of
    attending across its sequences; the same batch with the cu_seq_lens kwargs compiles and matches eager."""
    ref, got = pair("llama")
    lengths = [7, 5, 9]
    ids = prompts(lengths)[0]
    rows = [{"input_ids": ids[b, :n].tolist()} for b, n in enumerate(lengths)]
    flat = DataCollatorWithFlattening(return_tensors="pt")(rows)
    compiled = torch.compile(got)
    with torch.no_grad(), pytest.raises(RuntimeError, match="position_ids restart inside a row"):
        compiled(input_ids=flat["input_ids"], position_ids=flat["position_ids"], use_cache=False)
    kw = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(rows)
    kw.pop("labels", None)
    with torch.no_grad():
        want = ref(input_ids=kw["input_ids"], position_ids=kw["position_ids"], use_cache=False).logits
        torch.testing.assert_close(compiled(**kw, use_cache=False).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", ["bloom", "xglm"])
def test_models_outside_the_attention_interface_raise(config):
    """BLOOM and XGLM compute attention themselves and would add this backend's padding mask (None when nothing is
    padded) to their scores, silently non-causal; transformers accepts the registered name for them, so the
    backend's mask function refuses them, naming the model."""
    import transformers as T

    cfg = {"bloom": lambda: T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4),
           "xglm": lambda: T.XGLMConfig(vocab_size=64, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64)}[config]()
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation=fct.NAME)
    with pytest.raises(NotImplementedError, match="compute attention themselves"):  # the message names both cases
        model(torch.randint(0, 64, (1, 8)))


@pytest.mark.parametrize("tower", ["align", "clap"])
def test_sub_model_towers_outside_the_attention_interface_raise(tower):
    """ALIGN's and CLAP's text towers declare no backend support either, and their attention modules carry no
    is_causal: run anyway they would be causal. The mask function sees the tower's own config (AlignTextConfig),
    which the auto mapping does not list; the refusal finds the tower's model class through its modeling module."""
    import transformers as T

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    cls, cfg = {"align": (T.AlignTextModel, T.AlignTextConfig), "clap": (T.ClapTextModel, T.ClapTextConfig)}[tower]
    model = cls._from_config(cfg(**small), attn_implementation=fct.NAME)
    with pytest.raises(NotImplementedError, match="compute attention themselves"):
        model(torch.randint(2, 64, (2, 8)))
    assert fct._model_classes_of(T.LlamaConfig) and not fct._model_classes_of(type("Custom", (), {}))


def test_target_dtype_of_quantized_models():
    """A float32 query (fp32 norms of a k-bit training setup) on a quantized model runs in the config's compute
    dtype, as transformers' flash-attn backend picks it, not its first Linear's storage dtype (uint8 there)."""
    module = torch.nn.Module()
    module.proj = torch.nn.Linear(4, 4)
    module.proj.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.uint8), requires_grad=False)
    module.config = type("Config", (), {"_is_quantized": True, "dtype": torch.bfloat16})()
    assert fct._target_dtype(torch.zeros(1), module) == torch.bfloat16
    module.config._is_quantized = False
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        fct._target_dtype(torch.zeros(1), module)


def test_masked_attention_reads_a_static_cache_in_place():
    """Under torch.compile a masked call against a static cache gives the varlen op the cache's (B, Hkv, capacity,
    D) keys in place (_key_rows: entry b from row b x Hkv x capacity, the other heads' rows skipped through
    seqused_k), not a copy of the cache; the output is what contiguous rows give and what a float64 reference gives.
    Rows left-padded by different amounts, the slots past the written keys unwritten (garbage)."""
    B, Hq, Hkv, Sq, cap, D, written = 3, 4, 2, 2, 11, 8, 9
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Sq, Hq, D, generator=g)
    cache_k, cache_v = (torch.randn(B, Hkv, cap, D, generator=g) for _ in range(2))
    cache_k[:, :, written:], cache_v[:, :, written:] = 1e4, float("nan")  # never read
    k, v = cache_k.transpose(1, 2), cache_v.transpose(1, 2)  # transformers' BSHD views
    first = torch.tensor([0, 3, 6])
    cols = torch.arange(cap)
    mask = (cols[None, :] >= first[:, None]) & (cols[None, :] < written)
    k_rows, _, step = fct._key_rows(k, v)
    assert step == Hkv * cap and k_rows.data_ptr() == cache_k.data_ptr()
    options = dict(is_causal=True, scale=None, window_size=None, softcap=0.0, sinks=None)
    got = fct._masked_attention_in_graph(q, k, v, mask, True, options)
    copied = fct._masked_attention_in_graph(q, k.contiguous(), v.contiguous(), mask, True, options)
    torch.testing.assert_close(got, copied, rtol=0, atol=0)
    for b in range(B):  # query i (position written - Sq + i) sees keys first[b] .. written - Sq + i
        qb, kb, vb = (t[b].double().transpose(0, 1) for t in (q, k[:, first[b]:written], v[:, first[b]:written]))
        kb, vb = kb.repeat_interleave(Hq // Hkv, 0), vb.repeat_interleave(Hq // Hkv, 0)
        n = written - first[b]
        visible = torch.arange(n)[None, :] <= torch.arange(n - Sq, n)[:, None]
        want = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible).transpose(0, 1)
        torch.testing.assert_close(got[b].double(), want, rtol=1e-5, atol=1e-5)


def test_mask_verdict_found_once_per_mask(monkeypatch):
    """Eager calls against a cache with a left-padding mask: the first layer finds the mask one run a row (a host
    read) and stores the verdict on the mask tensor, with the varlen offsets built from it; the next layers, given
    the same tensor, reuse both (a cache of another layout builds its own offsets); an in-place
    change of the mask (its version counter) makes the next call look again, and a mask that is no longer one run a
    row then takes the gathering path, with the same output as a fresh mask tensor."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 1, 9, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, Sq, D, generator=g)
    k, v = (torch.randn(B, Hkv, Sk, D, generator=g) for _ in range(2))
    mask = torch.ones(B, Sk, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    calls = []
    monkeypatch.setattr(fct, "_host_runs", lambda *a: calls.append(1) or _host_runs(*a))
    module = torch.nn.Linear(1, 1)
    module.is_causal = True
    first = fct.attention_forward(module, q, k, v, mask)[0]
    second = fct.attention_forward(module, q, k, v, mask)[0]
    runs = mask._fcore_runs[1]
    assert len(calls) == 1 and torch.equal(first, second) and list(runs._inputs) == [(Hkv * Sk, (B - 1) * Hkv * Sk + Sk,
                                                                                      Sq)]
    cu_q, cu_k, used = runs._inputs[(Hkv * Sk, (B - 1) * Hkv * Sk + Sk, Sq)]
    assert cu_q.tolist() == [0, 1, 2] and cu_k.tolist() == [0, Hkv * Sk + 3, (B - 1) * Hkv * Sk + Sk]
    assert used.tolist() == [Sk, Sk - 3]
    # a cache in another layout (BSHD memory: read in place, entries Sk rows apart) with the same mask: its own
    # inputs, same out
    k_bshd, v_bshd = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    torch.testing.assert_close(fct.attention_forward(module, q, k_bshd, v_bshd, mask)[0], first, rtol=0, atol=0)
    assert len(calls) == 1 and len(runs._inputs) == 2
    mask[0, 4] = False  # no longer one run in row 0
    got = fct.attention_forward(module, q, k, v, mask)[0]
    assert len(calls) == 2
    torch.testing.assert_close(got, fct.attention_forward(module, q, k, v, mask.clone())[0], rtol=0, atol=0)
    assert not torch.equal(got, first)
    with torch.inference_mode():  # an inference tensor has no version counter: found every call, never stored
        inference_mask = mask.clone()
        inference_mask[0, 4] = True
        calls.clear()
        for _ in range(2):
            torch.testing.assert_close(fct.attention_forward(module, q, k, v, inference_mask)[0], first, rtol=0,
                                       atol=0)
        assert len(calls) == 2 and not hasattr(inference_mask, "_fcore_runs")


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_host_runs_match_the_device_rule(aligned, device):
    """The eager verdict (_host_runs on the host; _runs_to_host, which large masks on a GPU take) and the compiled
    one (_mask_runs, device ops) agree on every mask of a random family: left and right padding, holes, empty rows,
    runs ending at different columns, masks shorter and longer than the keys."""
    g = torch.Generator().manual_seed(3)
    for trial in range(300):
        B, L = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        Sk = max(1, L + int(torch.randint(-3, 4, (1,), generator=g)))
        first = torch.randint(0, L + 1, (B,), generator=g)
        end = torch.randint(0, L + 1, (B,), generator=g) if trial % 3 else torch.full((B,), L)
        cols = torch.arange(L)
        mask = (cols[None, :] >= first[:, None]) & (cols[None, :] < end[:, None])
        if trial % 5 == 0:
            mask[:, int(torch.randint(0, L, (1,), generator=g))] ^= True  # a hole or a stray key
        mask = mask.to(device)
        q = torch.zeros(B, 1, 1, 1, device=device)
        d_first, d_count, ok = fct._mask_runs(q, mask, Sk, aligned)
        host, copied = fct._host_runs(mask, Sk, aligned), fct._runs_to_host(q, mask, Sk, aligned)
        assert (host is not None) == (copied is not None) == bool(ok), (mask, Sk)
        if host is not None:
            assert host[1].tolist() == copied[1].tolist() and host[0].tolist() == copied[0].tolist(), (mask, Sk)
            assert host[0].tolist() == d_first.tolist() and host[1].tolist() == d_count.tolist(), (mask, Sk)


_host_runs = fct._host_runs


def test_inductor_passes_a_static_cache_in_place():
    """Under torch.compile with inductor (transformers' compiled decoding step), the static cache's rows reach the
    varlen op as a view of the graph's input (reinterpret_tensor), not a copy: the in-place read survives
    compilation. CPU inductor; the output matches eager."""
    from torch._inductor.utils import run_and_get_code
    B, Hq, Hkv, Sq, cap, D = 3, 4, 2, 1, 64, 8
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, Sq, Hq, D, generator=g)
    cache_k, cache_v = (torch.randn(B, Hkv, cap, D, generator=g) for _ in range(2))
    mask = torch.zeros(B, cap, dtype=torch.bool)
    mask[:, 5:20] = True
    options = dict(is_causal=True, scale=None, window_size=None, softcap=0.0, sinks=None)

    def step(q, ck, cv, mask):
        return fct._masked_attention_in_graph(q, ck.transpose(1, 2), cv.transpose(1, 2), mask, True, options)

    torch._dynamo.reset()
    with torch.no_grad():
        got, code = run_and_get_code(torch.compile(step, fullgraph=True), q, cache_k, cache_v, mask)
        torch.testing.assert_close(got, step(q, cache_k, cache_v, mask), rtol=0, atol=0)
    rows = (B - 1) * Hkv * cap + cap
    call = next(line for line in "\n".join(code).splitlines() if "flashcore.varlen_fwd" in line and "(" in line
                and "reinterpret_tensor" in line)
    assert call.count("reinterpret_tensor(arg") >= 3 and call.count(f"({rows}, {Hkv}, {D})") == 2, call
