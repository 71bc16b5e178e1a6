"""flashcore as a Hugging Face transformers attention backend.

    import flashcore.integrations.transformers as fct   # registers the backend on import (fct.register() again: no-op)

    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fcore")   # fct.NAME == "fcore"
    model.set_attn_implementation("fcore")                                           # or switch an existing model

Every attention layer of a model whose attention goes through transformers' ``AttentionInterface`` (Llama, Mistral,
Qwen2/3, Gemma 2/3, GPT-OSS and most decoder models of transformers 5.x) then runs on flashcore.attention or
flashcore.varlen_attention. Tested with transformers 5.24.

The name is "fcore", not "flashcore": transformers 5.x treats any attn_implementation containing "flash" as a
flash-attn flavour (``is_flash_attention_requested``: ``"flash" in name``) and, unless it is one of the
``flash_attention_2/3/4`` packages installed locally, tries to load it as a kernel from the Hugging Face Hub
(``lazy_import_flash_attention`` -> ``load_and_register_attn_kernel``), so ``from_config(..., attn_implementation=
"flashcore")`` fails with "Could not find the currently requested flash attention implementation at `flashcore`".

What transformers passes, and what this backend does with it (the semantics of the ``flash_attention_2`` backend,
which it reproduces on flashcore's kernels; the results equal the ``eager``/``sdpa`` backends' up to rounding):

* padding: the registered mask function (flash-attn's) hands the attention a 2-D (batch, kv_len) padding mask, or
  None when nothing is padded. With a mask, q/k/v are unpadded into packed sequences, attention runs on
  flashcore.varlen_attention and the output is padded back (padded query rows are zeros). Left and right padding.
  Non-causal attention without a window (encoders, cross-attention) unpads only the keys: the mask is the keys',
  and every query row attends to its row's keys as under eager/sdpa.
* KV cache (generation, Sq < Sk): causal masking and sliding windows are aligned bottom-right (query i of a sequence
  with Sq queries and Sk keys sees keys j <= i + Sk - Sq), through the varlen op. Static caches work too: the mask
  function then gives a mask of the cache's capacity, False past the keys written so far, and the unwritten slots
  are not attended to.
* packed sequences (padding-free training, ``DataCollatorWithFlattening``): the ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` kwargs when given; otherwise ``position_ids`` (a step other than +1 starts a new sequence)
  split each row into sequences where transformers' masks split them for eager and sdpa (no cache, no
  attention_mask: the mask function hands transformers' sequence ids to the attention function), and, for models
  whose masks do not see position_ids (GPT-OSS), where they restart, flash_attention_2's rule. Either runs the
  varlen op. The mask function's parts are read outside tracing only, so under torch.compile only the
  cu_seq_lens kwargs pack (a forward with no padding mask and no static cache then compiles with fullgraph=True;
  flash_attention_2's own position_ids check breaks the graph); position_ids that restart inside a row without
  them raise there (a device-side check) rather than attend across the sequences. Padding masks and static
  caches under torch.compile stay on the device where the valid keys of a row are one run (left padding, a
  static cache's written slots, an encoder's right padding): the run goes to the varlen op in place
  (cu_seqlens_k at its start, seqused_k its length), so a compiled static-cache generate (transformers compiles
  its decoding step) runs with fullgraph=True and no recompilation per step; a mask of another form (right
  padding with new tokens after it) raises on the device. A padded causal batch with as many queries as keys
  (training) is unpadded on the host as flash_attention_2 does: a graph break (fullgraph=False compiles around
  it). That holds for any 2-D mask on such a call, a tokenizer's mask of ones included (whether it pads is data):
  ``torch.compile(model, fullgraph=True)`` of a prefill or training forward wants ``attention_mask=None`` there.
* ``sliding_window=w``: query i sees keys i - w + 1 .. i (flash-attn's window_size=(w - 1, w - 1), exactly as
  transformers' flash_attention_2 converts it; w keys in all, transformers' mask convention). Non-causal windows
  follow the same rule (|i - j| < w), as flash_attention_2 does: models that build bidirectional windowed masks
  of |i - j| <= w pass w + 1 for flash-attn (ModernBert, Gemma 3), and those that do not (T5Gemma's encoder,
  Gemma 4 with ``use_bidirectional_attention``) see one key fewer a side than under eager/sdpa, as with
  flash_attention_2.
* ``softcap`` (Gemma 2), ``s_aux`` (GPT-OSS's attention sinks, differentiable), ``scaling``, GQA/MQA (k/v with fewer
  heads, never repeated), ``is_causal`` (encoders / bidirectional attention), a value head dim smaller than the
  query's (padded, output cropped).
* ``dropout`` > 0 (a model in training mode with attention_dropout > 0) raises NotImplementedError: flashcore has no
  attention dropout. Set ``config.attention_dropout = 0.0`` or use another backend.
* dtypes: on CPU float32/float64/float16/bfloat16 run as they are. flashcore's CUDA kernels take float16/bfloat16
  only: float32 CUDA inputs are cast to the autocast dtype under torch.autocast, or to the dtype of the layer's
  weights when those are half precision (PEFT keeps norms in float32), as flash-attn's backend does, and the output
  stays in that dtype; otherwise (a float32 model on CUDA) TypeError, asking for dtype=torch.bfloat16 or autocast.
* not supported: 4-D (custom) attention masks (TypeError). Of the mask patterns transformers builds, this backend
  applies padding, causality and the sliding window; a pattern that would hide keys from a query raises rather
  than being dropped: an ``and_mask_function`` it does not know (e.g. ESM C's sequence ids), chunked attention past
  one chunk (Llama 4; ValueError, as transformers raises for flash-attn) and block-wise prefix-LM masks whose blocks
  are present in the input (PaliGemma, Gemma 3 image tokens; text-only input runs). An ``or_mask_function`` it does
  not know only widens the mask, and is ignored with a warning, as flash-attn's backend does. Attention kwargs that
  change scores or the keys a query sees raise NotImplementedError: a T5-style ``position_bias``, ``block_indices``
  and ``indices`` (sparse attention), per-token ``sinks``, and a value head dim larger than the query's.
  ``output_attentions`` returns None as weights. Paged attention / continuous batching is not wired up. Head dims
  above 256 (Gemma 4's global layers, 512) raise, as they do with flash-attn. Gemma 4 with KV-shared layers
  (``num_kv_shared_layers``) fails in transformers' own code with any 2-D mask: it slices masks as 4-D unless the
  implementation's name contains "flash" (``_maybe_slice_kv_shared_inputs``), which this name cannot (above).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import numpy as np  # a dependency of transformers: host-side work on a mask costs less than torch's CPU ops
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.utils import logging as _hf_logging
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "flashcore.integrations.transformers needs the `transformers` package (Hugging Face transformers >= 5.0); "
        "install it with `pip install transformers`. Original error: " + str(e)
    ) from e

from ..flash_attn_interface import _attention_bshd
from ..ops import attention as _attention
from ..ops import varlen_attention as _varlen_attention

__all__ = ["NAME", "register", "attention_forward", "padding_mask"]

NAME = "fcore"
"""The attn_implementation name this module registers (see the module docstring for why it avoids "flash")."""

logger = _hf_logging.get_logger(__name__)

_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# Mask function
# ----------------------------------------------------------------------------------------------------------------


# transformers' own mask functions and combinators (masking_utils), by qualified-name prefix: the patterns this
# backend applies itself (causal, bidirectional, sliding window, padding, offsets) or inspects (chunked,
# block-wise, packed sequences).
_KNOWN_MASK_PARTS = (
    "and_masks.", "or_masks.", "causal_mask_function", "bidirectional_mask_function", "sliding_window_overlay.",
    "sliding_window_bidirectional_overlay.", "sliding_window_causal_mask_function", "padding_mask_function.",
    "add_offsets_to_mask_function.", "remap_positions_for_packed_sequence.", "packed_sequence_mask_function.",
    "chunked_overlay.", "chunked_causal_mask_function", "blockwise_overlay.",
    "sliding_window_bidirectional_mask_function",
)


def _mask_parts(fn, restricting=True, depth=0):
    """(qualified name, function, restricting) of every function a transformers mask function is composed of
    (and_masks / or_masks and the overlays keep their parts in closure cells; functools.partial objects their func
    and arguments). `restricting`: the part can only remove keys from the mask (it is reached through and_masks, not
    through or_masks), so a backend that ignores it would attend to keys the model hides."""
    if depth > 12 or not callable(fn):
        return []
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    parts = [(name, fn, restricting)]
    if name.startswith("or_masks."):
        restricting = False
    children = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            children.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    if hasattr(fn, "func") and hasattr(fn, "args"):  # functools.partial
        children += [fn.func, *fn.args]
    for value in children:
        for part in value if isinstance(value, (tuple, list)) else (value,):
            if callable(part) and not isinstance(part, torch.Tensor):
                parts += _mask_parts(part, restricting, depth + 1)
    return parts


def _closure_tensor(fn):
    """The tensor an overlay closes over (blockwise_overlay's block_sequence_ids), or None."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, torch.Tensor):
            return value
    return None


def _check_mask_function(parts, kv_length, kv_offset, kwargs):
    """Raises for mask patterns the kernels cannot apply, where ignoring them would change results; warns once
    for patterns that only widen the mask (or_mask_function), which flash_attention_2 ignores too. parts: the mask
    function's _mask_parts."""
    names = [name for name, _, _ in parts]
    if any(n.startswith("chunked_overlay") for n in names) and kv_length + kv_offset > kwargs.get("local_size", 0):
        raise ValueError(
            f"attn_implementation={NAME!r} (flashcore) cannot apply chunked attention (attention_chunk_size="
            f"{kwargs.get('local_size')}) and the key-value length {kv_length + kv_offset} exceeds one chunk; use "
            "attn_implementation='sdpa' or 'eager' for this model."
        )
    for name, fn, _ in parts:
        if name.startswith("blockwise_overlay"):
            ids = _closure_tensor(fn)
            # Only tokens of a block (id >= 0: image tokens) attend beyond the causal mask; text-only input (all
            # -1, e.g. Gemma 3's token_type_ids of a text prompt) needs nothing else. One sync, outside tracing.
            if ids is None or torch.compiler.is_compiling() or bool((ids >= 0).any()):
                raise NotImplementedError(
                    f"attn_implementation={NAME!r} (flashcore) cannot apply this model's block-wise (prefix-LM) "
                    "attention mask (bidirectional blocks of image tokens, block_sequence_ids: PaliGemma, Gemma 3); "
                    "use attn_implementation='sdpa' or 'eager' for inputs with such blocks."
                )
    unknown = [(name, restricting) for name, _, restricting in parts if not name.startswith(_KNOWN_MASK_PARTS)]
    hiding = [name for name, restricting in unknown if restricting]
    if hiding:
        raise NotImplementedError(
            f"attn_implementation={NAME!r} (flashcore) applies only padding, causal and sliding-window masks; this "
            f"model restricts attention further with a custom mask function ({hiding[0]}, an and_mask_function), "
            "which the kernels cannot apply. Use attn_implementation='sdpa' or 'eager' for it."
        )
    if unknown:
        logger.warning_once(
            f"attn_implementation={NAME!r} (flashcore) applies only padding, causal and sliding-window masks; the "
            f"custom mask pattern this model adds ({unknown[0][0]}, an or_mask_function) is ignored, as with "
            "flash_attention_2. Use attn_implementation='sdpa' or 'eager' if the model needs it."
        )


def _packed_sequence_ids(parts):
    """The (batch, seq_len) sequence index of every token, as int32, when transformers found packed sequences (it
    adds packed_sequence_mask_function to the mask only where eager and sdpa apply it: position_ids that restart,
    no cache and no attention_mask), else None. The attention function takes an int32 mask as these ids, so that
    flashcore packs exactly where eager and sdpa do (reading position_ids there instead packed under a cache too)."""
    for name, fn, _ in parts:
        if name.startswith("packed_sequence_mask_function."):
            ids = _closure_tensor(fn)
            if ids is not None and ids.dim() == 2:
                return ids.to(torch.int32)
    return None


_ATTENTION_INTERFACE_MODELS: dict = {}  # config class -> whether its model runs attention through AttentionInterface


def _model_classes_of(config_class) -> list:
    """transformers' model classes built from config_class: the auto mapping's, or, for a sub-model's config that
    the mapping does not list (AlignTextConfig, ClapTextConfig: the mask function sees the text tower's config),
    the PreTrainedModel classes of the config's modeling module whose config_class it is. [] for a custom model."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING
        classes = MODEL_MAPPING[config_class]  # a class, or a tuple of them (Funnel)
        return list(classes) if isinstance(classes, (tuple, list)) else [classes]
    except Exception:
        pass
    module = getattr(config_class, "__module__", "")
    if not module.startswith("transformers.models.") or ".configuration_" not in module:
        return []
    try:
        import importlib

        from transformers import PreTrainedModel
        modeling = importlib.import_module(module.replace(".configuration_", ".modeling_"))
    except Exception:
        return []
    return [c for c in vars(modeling).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
            and getattr(c, "config_class", None) is config_class]


def _check_model_uses_attention_interface(config):
    """Models that declare neither _supports_attention_backend nor _supports_flash_attn (BLOOM, XGLM, MPT, T5, ...)
    either compute attention themselves, adding this backend's padding mask (None, or 2-D) to their scores as if it
    were theirs (dropping causality), or pass terms no backend applies; transformers accepts a registered
    attn_implementation for them, so refuse here."""
    if config is None:
        return
    key = type(config)
    if key not in _ATTENTION_INTERFACE_MODELS:
        classes = _model_classes_of(key)  # none: a custom model, nothing to check against
        _ATTENTION_INTERFACE_MODELS[key] = all(
            getattr(c, "_supports_attention_backend", False) or getattr(c, "_supports_flash_attn", False)
            for c in classes)
    if not _ATTENTION_INTERFACE_MODELS[key]:
        raise NotImplementedError(
            f"attn_implementation={NAME!r}: {key.__name__.removesuffix('Config')} models declare no support for "
            "transformers' attention backends (_supports_attention_backend, _supports_flash_attn): they compute "
            "attention themselves or pass it terms a backend cannot apply (T5's position_bias); use "
            "attn_implementation='eager' (or 'sdpa' where the model supports it)")


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """The mask function registered with AttentionMaskInterface: the 2-D (batch, kv_len) bool padding mask sliced to
    the keys of this layer, or None when no key is padded (flash-attn's rule: causality and windows are applied by
    the kernel). With a static cache, a mask of the cache's capacity, False past the keys written so far (the
    unwritten slots are never attended to), built on the device. A causal mask's right padding among the call's
    queries is marked valid (_keys_end_at_the_last_query), so that every row's keys end at its queries. Patterns
    the kernels cannot apply
    raise instead of being dropped (_check_mask_function): chunked attention longer than a chunk (Llama 4;
    transformers raises the same for flash-attn), block-wise prefix masks with blocks in the input (PaliGemma,
    Gemma 3 images) and custom and_mask_function restrictions."""
    # Under torch.compile the mask function is a closure built inside the traced code, whose parts dynamo cannot
    # inspect: the patterns are checked in eager calls only (run a model once eagerly to validate it).
    if not torch.compiler.is_compiling():
        _check_model_uses_attention_interface(kwargs.get("config"))
    if mask_function is not None and not torch.compiler.is_compiling():
        parts = _mask_parts(mask_function)
        _check_mask_function(parts, kv_length, kv_offset, kwargs)
        packed = _packed_sequence_ids(parts)
        if packed is not None:
            return packed
    written = q_offset + q_length
    # Causal masks only (create_bidirectional_mask, also used for cross-attention, passes allow_is_bidirectional_skip)
    causal = "allow_is_bidirectional_skip" not in kwargs and not isinstance(kv_length, torch.Tensor)
    from_start = kv_offset == 0 and causal
    if from_start and (isinstance(written, torch.Tensor) or written < kv_length):
        # A static cache (a tensor offset; kv_length its capacity): a mask of all kv_length slots, False past the
        # keys written so far, built on the device. Its shape is the same at every step, so a compiled decoding
        # step (transformers builds this mask outside it and passes it in) is neither recompiled nor re-recorded
        # in a CUDA graph per length, and no host read is needed (_masked_attention_in_graph takes it as it is).
        device = written.device if isinstance(written, torch.Tensor) else kwargs.get("device")
        if attention_mask is not None:
            device = attention_mask.device
        limit = written.reshape(-1)[:1, None] if isinstance(written, torch.Tensor) else written
        mask = (torch.arange(kv_length, device=device)[None, :] < limit).expand(batch_size, kv_length)
        if attention_mask is not None:
            given = attention_mask[:, :kv_length].bool()
            if given.shape[1] < kv_length:
                given = F.pad(given, (0, kv_length - given.shape[1]))
            mask = mask & given
        return _keys_end_at_the_last_query(mask, limit, q_length)
    if attention_mask is not None:
        if from_start and attention_mask.shape[1] > written:
            attention_mask = attention_mask[:, :written]  # slots past the written keys: never attended to
        # Slice from the right for sliding-window caches (a no-op for full attention).
        attention_mask = attention_mask[:, -kv_length:].bool()
        if causal and q_length < attention_mask.shape[1]:  # queries after cached keys: the last q_length columns
            attention_mask = _keys_end_at_the_last_query(attention_mask, attention_mask.shape[1], q_length)
        if (not torch.compiler.is_compiling() and attention_mask.shape[1] == kv_length
                and bool(attention_mask.all())):
            attention_mask = None
        # bool: the attention function reads an int32 mask as packed sequence ids (_packed_sequence_ids)
        return attention_mask
    return None


def _keys_end_at_the_last_query(mask, written, q_length):
    """A causal (batch, L) key mask whose columns [written - q_length, written) hold the call's queries (written: an
    int or a (1, 1) tensor): a row's padding after its last token (right padding) inside those columns becomes True.
    Under the causal mask no token of the row sees those keys, so no valid output changes, and every row's keys
    then end at the last query column, where the attention aligns its queries (bottom-right: the eager unpadding
    and _masked_attention_in_graph alike); the padded queries attend like the others instead of giving 0. A row
    without tokens keeps none before the query columns."""
    pos = torch.arange(mask.shape[1], device=mask.device)[None, :]
    last = torch.where(mask, pos, -1).amax(dim=1, keepdim=True)
    return mask | ((pos > last) & (pos >= written - q_length) & (pos < written))


# ----------------------------------------------------------------------------------------------------------------
# Attention function
# ----------------------------------------------------------------------------------------------------------------


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def _equal_lengths(batch: int, length: int, device) -> torch.Tensor:
    """cu_seqlens of `batch` sequences of `length` rows each (int32)."""
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


def _target_dtype(query: torch.Tensor, module) -> torch.dtype:
    """The half dtype a float32/float64 CUDA query runs in, as transformers' flash-attn backend picks it."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if dtype in _HALF:
            return dtype
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "_is_quantized", False):  # quantized weights (uint8 / int8 storage)
        dtype = getattr(config, "dtype", None)  # the compute dtype, as transformers' flash-attn backend takes it
        if dtype in _HALF:
            return dtype
    weight = next((m.weight for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    if weight is not None and weight.dtype in _HALF:
        return weight.dtype
    raise TypeError(
        f"attn_implementation={NAME!r}: flashcore's CUDA kernels take float16 or bfloat16; got a {query.dtype} "
        "query on CUDA. Load the model with dtype=torch.bfloat16 (or float16), run it under "
        "torch.autocast('cuda', dtype=torch.bfloat16), or use attn_implementation='sdpa' for float32 on GPU."
    )


def _position_steps(position_ids, batch_size, seq_len):
    """torch.diff of position_ids (batch, seq_len) along the tokens, or None where they cannot describe packed rows
    (none given, one token, or another shape: e.g. the 3-D multimodal rotary ids of Qwen2-VL)."""
    if position_ids is None or not isinstance(position_ids, torch.Tensor) or seq_len <= 1:
        return None
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.dim() != 2 or position_ids.shape[-1] != seq_len or position_ids.shape[0] not in (1, batch_size):
        return None
    return torch.diff(position_ids.expand(batch_size, seq_len), dim=-1)


def _packed_from_position_ids(position_ids, batch_size, seq_len):
    """Sequence ids (1, seq_len) from position_ids that restart (decrease somewhere) in a one-row batch: a
    flattened batch, as flash_attention_2 detects it (_is_packed_sequence, whatever the cache), a step other than +1
    starting a new sequence (transformers' find_packed_sequence_indices); None otherwise. Rows of a larger batch
    stay one sequence each here, as eager attends them under a cache (without one, its mask function splits them,
    and _packed_sequence_ids follows it). For the models whose mask functions do not see position_ids, e.g.
    GPT-OSS. One sync."""
    if batch_size != 1:
        return None
    steps = _position_steps(position_ids, batch_size, seq_len)
    if steps is None or not bool((steps < 0).any()):
        return None
    return F.pad((steps != 1).cumsum(-1, dtype=torch.int32), (1, 0))


_PACKED_UNDER_COMPILE = (
    f"attn_implementation={NAME!r} under torch.compile: position_ids restart inside a row (packed sequences) but no "
    "cu_seq_lens_q/k and max_length_q/k kwargs were given; pass them (DataCollatorWithFlattening("
    "return_flash_attn_kwargs=True)) or run the model eagerly"
)


def _restarts_in_graph(position_ids, batch_size, seq_len):
    """Under tracing: a 0-d bool tensor, whether position_ids restart somewhere (_packed_from_position_ids's test,
    kept on the device), or None where they cannot describe packed rows."""
    steps = _position_steps(position_ids, batch_size, seq_len)
    return None if steps is None else (steps < 0).any()


def _packed_from_sequence_ids(ids):
    """cu_seqlens (int32) over the flattened (batch * seq_len) rows and the longest length, for per-token sequence
    ids (batch, seq_len): a new sequence starts at every row and wherever the id changes. Reads the boundaries on
    the host (one sync), as flash-attn's backend does with position_ids."""
    B, S = ids.shape
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = starts.flatten().nonzero().flatten().to(torch.int32)
    total = torch.tensor([B * S], dtype=torch.int32, device=starts.device)
    cu = torch.cat([starts, total])
    return cu, int((cu[1:] - cu[:-1]).max())


# Attention kwargs of transformers models that change which keys a query sees or how scores are formed, which this
# backend cannot apply: refused, never silently dropped (flashcore's own sinks come as s_aux).
_UNSUPPORTED_KWARGS = {
    "block_indices": "block-sparse attention, e.g. MiniMax-M3's sparse layers",
    "indices": "top-k sparse attention, e.g. DeepSeek-V3.2's indexer",
    "sinks": "a sink logit per query token, e.g. Inkling 2 (s_aux, a sink per head, is supported)",
    "attention_bias": "an additive score bias",
    "alibi": "an additive ALiBi bias tensor",
}


def _refuse_unsupported(dropout, kwargs):
    """What flashcore cannot apply raises NotImplementedError naming it (attention dropout, T5-style position bias,
    _UNSUPPORTED_KWARGS); output_attentions only warns, as transformers' own flash backends do."""
    if kwargs.get("output_attentions", False):
        logger.warning_once(f"attn_implementation={NAME!r} (flashcore) does not return attention weights "
                            "(output_attentions=True); use attn_implementation='eager' for them.")
    if dropout:
        raise NotImplementedError(
            f"attn_implementation={NAME!r}: attention dropout={dropout} is not supported (flashcore has no attention "
            "dropout). Set the model's attention dropout to 0 (config.attention_dropout, or "
            "attention_probs_dropout_prob / attn_pdrop, by model), call model.eval(), or use "
            "attn_implementation='sdpa'."
        )
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            f"attn_implementation={NAME!r}: this model adds a position_bias to its attention scores (T5-style relative "
            "position bias), which flashcore cannot apply; use attn_implementation='sdpa' or 'eager' for it."
        )
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"attn_implementation={NAME!r}: this model passes `{name}` to its attention ({_UNSUPPORTED_KWARGS[name]}), "
                "which flashcore cannot apply; use attn_implementation='sdpa' or 'eager' for it."
            )


def _padded_attention(q, k, v, attention_mask, aligned, varlen):
    """A batch with a 2-D padding mask: unpad, attend per sequence (bottom-right aligned), pad back. q (B, Sq, Hq, D)
    and k/v (B, Sk, Hkv, D) BSHD views; aligned: causal or windowed, whose queries are the last Sq of the mask's
    positions. Returns out (B, Sq, Hq, D)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    mask = attention_mask.to(device=q.device, dtype=torch.bool)
    if mask.shape[1] < Sk:  # a mask shorter than the cache: the keys beyond it were never written
        k, v, Sk = k[:, : mask.shape[1]], v[:, : mask.shape[1]], mask.shape[1]
    elif mask.shape[1] > Sk:
        mask = mask[:, -Sk:]
    lengths_k = mask.sum(dim=-1, dtype=torch.int32)
    idx_k = mask.flatten().nonzero().flatten()
    k_rows, v_rows = k[idx_k // Sk, idx_k % Sk], v[idx_k // Sk, idx_k % Sk]  # the valid keys only: no cache copy
    cu_k, max_k = _cu_seqlens(lengths_k), int(lengths_k.max())
    if not aligned:
        # Encoders and cross-attention: the mask is the keys'; every query attends to its row's keys (padded query
        # rows too, as under eager/sdpa), so the queries are not unpadded (a cross-attention's are not the keys').
        idx_q, max_q = None, Sq
        cu_q = _equal_lengths(B, Sq, q.device)
    elif Sq == Sk:
        idx_q, cu_q, max_q = idx_k, cu_k, max_k
    elif Sq == 1:  # decoding: one query per sequence, its last position
        idx_q = torch.arange(B, device=q.device)
        cu_q, max_q = torch.arange(B + 1, dtype=torch.int32, device=q.device), 1
    else:
        # Several new queries against a cache: the last Sq of the written keys, which end at the last column any
        # row holds (a static cache's mask covers its capacity, False past them; padding_mask marks a row's
        # trailing padding among the queries, so every row's keys end there). Found on the device: the unpadding's
        # own host reads below are the only ones.
        cols = torch.arange(Sk, device=q.device)
        end = torch.where(mask.any(dim=0), cols, -1).max() + 1
        mask_q = mask.gather(1, (end - Sq + torch.arange(Sq, device=q.device)).clamp(0, Sk - 1).expand(B, Sq))
        lengths_q = mask_q.sum(dim=-1, dtype=torch.int32)
        idx_q = mask_q.flatten().nonzero().flatten()
        cu_q, max_q = _cu_seqlens(lengths_q), int(lengths_q.max())
    q_rows = q.reshape(B * Sq, Hq, D) if idx_q is None else q[idx_q // Sq, idx_q % Sq]
    out = _varlen_attention(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k, **varlen)
    if idx_q is not None:
        out = out.new_zeros(B * Sq, Hq, D).index_copy(0, idx_q, out)
    out = out.view(B, Sq, Hq, D)
    return out


_MASK_NOT_ONE_RUN = (
    f"attn_implementation={NAME!r} under torch.compile: a padding mask whose valid keys are not one run per row "
    "ending at the queries (right padding followed by new tokens); pad on the left for generation, or run the "
    "model eagerly"
)


def _key_rows(k, v):
    """k/v (B, Sk, Hkv, D) BSHD views as the varlen op's (rows, Hkv, D) tensors, and `step`: entry b's keys start at
    row b x step. A cache in transformers' (B, Hkv, capacity, D) memory is read in place: the view's row stride is
    one key's, so entry b starts at row b x (batch stride / key stride) and the rows between two entries (other
    heads' keys, unwritten slots) are skipped through seqused_k, which the caller passes; its last row is entry
    B-1's last key, so it spans the tensors' memory exactly. Rows are copied (step Sk) where the strides do not allow
    it, and where gradients flow (the view overlaps itself; its backward would scatter through a slow path)."""
    B, Sk, Hkv, D = k.shape
    s, step = k.stride(1), (k.stride(0) // k.stride(1) if k.stride(1) > 0 else 0)
    in_place = (B > 1 and s > 0 and k.stride() == v.stride() and k.shape == v.shape and k.stride(0) % s == 0
                and Sk <= step and B * step < 2**31
                and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)))
    if not in_place:
        return k.reshape(B * Sk, Hkv, D), v.reshape(B * Sk, Hkv, D), Sk
    rows = (B - 1) * step + Sk
    view = lambda t: t.as_strided((rows, Hkv, D), (s, t.stride(2), t.stride(3)))  # noqa: E731
    return view(k), view(v), step


def _mask_fitted(mask, Sk):
    """A (B, L) bool padding mask as one of Sk keys: the slots past a shorter mask were never written (False); a
    longer one's last Sk columns."""
    if mask.shape[1] < Sk:
        return F.pad(mask, (0, Sk - mask.shape[1]))
    return mask[:, -Sk:] if mask.shape[1] > Sk else mask


def _mask_runs(q, attention_mask, Sk, aligned):
    """The padding mask fitted to Sk keys as one run of valid keys a row: (first, count) int32 (B,), and a 0-d bool
    tensor, whether the mask is of that form (for aligned calls, every row's run ending at the same column, the last
    query's, or empty). On the device: no host read."""
    mask = _mask_fitted(attention_mask.to(device=q.device, dtype=torch.bool), Sk)
    count = mask.sum(dim=-1, dtype=torch.int32)
    first = mask.to(torch.int32).argmax(dim=-1).to(torch.int32)  # 0 for a row without keys (count 0)
    pos = torch.arange(Sk, device=q.device, dtype=torch.int32)[None, :]
    end = first + count
    ok = ((pos >= first[:, None]) & (pos < end[:, None]) == mask).all()
    if aligned:  # the queries are the last Sq columns of every row's run
        ok = ok & ((end == end.max()) | (count == 0)).all()
    return first, count, ok


class _Runs:
    """A mask found to be one run of keys a row (on the host: first and count, int64 numpy arrays (B,)), and the
    varlen inputs built from it, kept for the later layers' calls with the same mask tensor: per key layout,
    (cu_seqlens_q, cu_seqlens_k, seqused_k) on the device, uploaded together in one copy. An eager decoding step is
    bound by the host's time, where a small device op costs more than the copy."""

    def __init__(self, first, count, device):
        self.first, self.count, self.device = first, count, device
        self._inputs = {}

    def varlen_inputs(self, step, rows, Sq):
        """(cu_q, cu_k, seqused_k) int32 on the device for keys whose entry b starts at row b x step of `rows` rows
        (_key_rows), Sq queries a row."""
        key = (step, rows, Sq)
        if key not in self._inputs:
            B = self.first.shape[0]
            host = np.concatenate([np.arange(B + 1) * Sq, np.arange(B) * step + self.first, [rows], self.count])
            host = torch.from_numpy(host.astype(np.int32))
            if self.device.type == "cuda":
                host = host.pin_memory()
            both = host.to(self.device, non_blocking=True)
            self._inputs[key] = (both[: B + 1], both[B + 1: 2 * B + 2], both[2 * B + 2:])
        return self._inputs[key]


# Masks of more elements on a GPU are checked there and only the result copied back (_runs_to_host): numpy's passes
# cost ~1.8 us a thousand elements (64 x 32k: 2.1 ms a step), the device ops' launches a roughly constant few
# hundred us of host time.
_HOST_RUNS_MAX_ELEMENTS = 1 << 18


def _runs_to_host(q, attention_mask, Sk, aligned):
    """_host_runs' answer from _mask_runs on the mask's device, its result copied back in one copy (for large masks
    on a GPU)."""
    first, count, ok = _mask_runs(q, attention_mask, Sk, aligned)
    B = first.shape[0]
    found = torch.cat([first.long(), count.long(), ok.long().view(1)]).cpu().numpy()
    return (found[:B], found[B:2 * B]) if found[-1] else None


def _host_runs(attention_mask, Sk, aligned):
    """_mask_runs' verdict on the host, for eager calls: (first, count) int64 numpy arrays where the mask, fitted to
    Sk keys, is one run of valid keys a row (for aligned calls, every non-empty row's run ending at the same
    column), else None. One copy of the mask to the host (the step's one sync) and a few numpy passes."""
    mask = _mask_fitted(attention_mask.to(device="cpu", dtype=torch.bool), Sk).numpy()
    count = mask.sum(axis=1, dtype=np.int64)
    first = mask.argmax(axis=1).astype(np.int64)  # the first True; 0 for a row without keys
    last = Sk - 1 - mask[:, ::-1].argmax(axis=1).astype(np.int64)
    empty = count == 0
    if not (empty | (last - first + 1 == count)).all():
        return None
    end = first + count
    if aligned and not (empty | (end == end.max())).all():
        return None
    return first, count


def _one_run_a_row(q, attention_mask, Sk, aligned):
    """Eagerly: a _Runs of the mask where it is one run of keys a row, else None. Found once per mask: transformers
    hands every layer the same mask tensor, so the layers after the first take the verdict stored on it (keyed by
    Sk, alignment, device and the tensor's version counter, which in-place writes bump; not for inference tensors,
    which have none) instead of each reading it on the host, a sync that would stall the host's run-ahead every
    layer."""
    # An inference tensor (a mask built under torch.inference_mode) has no version counter to key on: no reuse.
    key = None if attention_mask.is_inference() else (Sk, aligned, q.device, attention_mask._version)
    stored = getattr(attention_mask, "_fcore_runs", None)
    if key is not None and stored is not None and stored[0] == key:
        return stored[1]
    if attention_mask.device.type != "cpu" and attention_mask.numel() > _HOST_RUNS_MAX_ELEMENTS:
        found = _runs_to_host(q, attention_mask, Sk, aligned)
    else:
        found = _host_runs(attention_mask, Sk, aligned)
    runs = None if found is None else _Runs(*found, q.device)
    if key is not None:
        try:
            attention_mask._fcore_runs = (key, runs)
        except (AttributeError, RuntimeError):  # a tensor subclass without a __dict__: no reuse
            pass
    return runs


def _masked_attention_in_graph(q, k, v, attention_mask, aligned, varlen, runs=None):
    """_padded_attention without host reads, for torch.compile, and eagerly for left-padded calls against a cache
    (no gather of the cache's valid keys): the valid keys of each row must form one run (left padding, a static
    cache's written slots, an encoder's right padding; a causal mask's right padding among the queries is made part
    of the run by padding_mask), given to the varlen op in place as a sequence that starts at the run (cu_seqlens_k)
    and uses its length (seqused_k), with every query row of the row. aligned (causal or windowed): the queries are
    the run's last Sq positions (bottom-right), so every row's run must end at the same column, the last query's;
    padded query rows before a left-padded run see no key and give 0. The longest lengths passed are the shapes'
    (bounds, as the op allows). A mask of another form fails a device-side check (on CUDA a device assert, which
    ends the process's CUDA context: run such inputs eagerly). runs: the _Runs of a mask the caller has found to be
    of that form.
    q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D) BSHD views; returns out (B, Sq, Hq, D)."""
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    k_rows, v_rows, step = _key_rows(k, v)
    if runs is None:
        first, count, ok = _mask_runs(q, attention_mask, Sk, aligned)
        torch._assert_async(ok, _MASK_NOT_ONE_RUN)
        entries = torch.arange(B, device=q.device, dtype=torch.int32)
        cu_k = torch.cat([entries * step + first, entries.new_full((1,), k_rows.shape[0])])
        cu_q = _equal_lengths(B, Sq, q.device)
    else:  # found on the host by the caller
        cu_q, cu_k, count = runs.varlen_inputs(step, k_rows.shape[0], Sq)
    out = _varlen_attention(q.reshape(B * Sq, Hq, D), k_rows, v_rows, cu_q, cu_k, Sq, Sk, seqused_k=count, **varlen)
    return out.view(B, Sq, Hq, D)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered with AttentionInterface. query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D) as
    transformers' attention modules pass them; returns (attn_output (B, Sq, Hq, Dv), None)."""
    _refuse_unsupported(dropout, kwargs)
    packed_ids = None
    if attention_mask is not None and attention_mask.dtype == torch.int32 and attention_mask.dim() == 2:
        packed_ids, attention_mask = attention_mask, None  # from padding_mask (_packed_sequence_ids)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise TypeError(
            f"attn_implementation={NAME!r}: got a {attention_mask.dim()}-D attention mask; flashcore takes 2-D "
            "(batch, seq_len) padding masks only (its mask function builds those). Pass a 2-D attention_mask, or use "
            "attn_implementation='sdpa'/'eager' for custom 4-D masks."
        )
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)

    B, Hq, Sq, D = query.shape
    Hkv, Sk, Dv = key.shape[1], key.shape[2], value.shape[-1]

    if query.is_cuda and query.dtype not in _HALF:
        target = _target_dtype(query, module)
        query, key, value = query.to(target), key.to(target), value.to(target)
    elif key.dtype != query.dtype or value.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    if Dv > D:
        raise NotImplementedError(
            f"attn_implementation={NAME!r}: a value head dim ({Dv}) larger than the query/key head dim ({D}) is not "
            "supported; use attn_implementation='sdpa' or 'eager'."
        )
    if Dv != D:  # e.g. MLA: pad V to the query head dim, crop the output
        value = F.pad(value, (0, D - Dv))

    window = None
    if sliding_window is not None and 0 < sliding_window < Sk:  # a window of w keys, as transformers' masks
        window = (sliding_window - 1, sliding_window - 1)
    options = dict(is_causal=is_causal, scale=scaling, window_size=window, softcap=float(softcap or 0.0),
                   sinks=None if s_aux is None else s_aux.float().contiguous())
    varlen = dict(options)

    # BSHD views; the varlen op takes (total, H, D) rows.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    aligned = is_causal or window is not None
    if attention_mask is not None and torch.compiler.is_compiling() and (Sq < Sk or not aligned):
        # Decoding against a cache, a static cache's prefill, encoders: no host reads under tracing. (Causal
        # self-attention over a padded batch with Sq == Sk keeps the unpadding below: a right-padded row is one
        # run, but its queries are not the run's last.)
        out = _masked_attention_in_graph(q, k, v, attention_mask, aligned, varlen)
    elif attention_mask is not None:
        # Against a cache, a mask of one run a row (left padding) reads the cache in place; otherwise the valid keys
        # are gathered (one host read either way).
        runs = _one_run_a_row(q, attention_mask, Sk, aligned) if Sq < Sk else None
        if runs is not None:
            out = _masked_attention_in_graph(q, k, v, attention_mask, aligned, varlen, runs)
        else:
            out = _padded_attention(q, k, v, attention_mask, aligned, varlen)
    elif all(x is not None for x in (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)):
        # Padding-free batch with precomputed boundaries (DataCollatorWithFlattening(return_flash_attn_kwargs=True)).
        cu_q = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
        cu_k = cu_seq_lens_k.to(device=query.device, dtype=torch.int32)
        out = _varlen_attention(q.reshape(B * Sq, Hq, D), k.reshape(B * Sk, Hkv, D), v.reshape(B * Sk, Hkv, D),
                                cu_q, cu_k, int(max_length_q), int(max_length_k), **varlen).view(B, Sq, Hq, D)
    elif Sq == Sk and ((packed_ids is not None and tuple(packed_ids.shape) == (B, Sq)) or (
            not torch.compiler.is_compiling()
            and (packed_ids := _packed_from_position_ids(position_ids, B, Sq)) is not None)):
        # Padding-free batch described by position_ids only: as transformers' mask found it (padding_mask), or, for
        # models whose masks do not see position_ids, where they restart (flash_attention_2's rule).
        cu, max_len = _packed_from_sequence_ids(packed_ids)
        out = _varlen_attention(q.reshape(B * Sq, Hq, D), k.reshape(B * Sk, Hkv, D), v.reshape(B * Sk, Hkv, D),
                                cu, cu, max_len, max_len, **varlen).view(B, Sq, Hq, D)
    elif Sq == Sk or (not is_causal and window is None):
        # Dense: top-left and bottom-right alignment agree; BHSD views are read in place.
        if Sq == Sk and torch.compiler.is_compiling():
            # Under torch.compile the restart test above cannot read the ids on the host, and a graph with both
            # forms (torch.cond) did not compile (inductor mislaid the branches' operand strides). Packed rows
            # without the cu_seq_lens kwargs would attend across their sequences here: the device refuses them.
            if (restarts := _restarts_in_graph(position_ids, B, Sq)) is not None:
                torch._assert_async(~restarts, _PACKED_UNDER_COMPILE)
        out = _attention(query, key, value, enable_gqa=Hq != Hkv, **options).transpose(1, 2)
    else:
        # Dense against a cache (Sq != Sk), bottom-right aligned as flash_attn_func is (transformers'
        # flash_attention_2 calls it here): the dense op reads the cache's (B, Hkv, Sk, D) tensors in place (a
        # decoding step or a few queries under GQA run the KV-cache kernel, more the packed varlen kernel:
        # attention_cuda.cpp); packing them into varlen rows would copy the whole cache every step.
        out = _attention_bshd(q, k, v, 0.0, scaling, is_causal, window or (-1, -1), options["softcap"], None, False,
                              False, f"attn_implementation={NAME!r}", sinks=options["sinks"])

    if Dv != D:
        out = out[..., :Dv]
    return out, None


# ----------------------------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------------------------


def register(name: str = NAME) -> str:
    """Registers flashcore's attention and mask functions with transformers under `name` (idempotent); returns the
    name, to pass as attn_implementation. Done on import with the default name."""
    if "flash" in name or "/" in name or "sdpa" in name or name in ("eager", "flex_attention"):
        raise ValueError(f"register: {name!r} is not usable: transformers treats names containing 'flash' or '/' as "
                         "hub kernels and 'sdpa', 'eager', 'flex_attention' as its own backends")
    if AttentionInterface._global_mapping.get(name) is not attention_forward:
        AttentionInterface.register(name, attention_forward)
    if AttentionMaskInterface._global_mapping.get(name) is not padding_mask:
        AttentionMaskInterface.register(name, padding_mask)
    return name


register()
