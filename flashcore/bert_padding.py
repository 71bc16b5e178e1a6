"""flash-attn 2.x's padding helpers (`flash_attn.bert_padding`), so that code which unpads a batch for the varlen
functions runs by changing its imports:

    from flashcore.bert_padding import pad_input, unpad_input   # was: from flash_attn.bert_padding import ...
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out_unpad = flashcore.flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens, max_seqlen, ...)
    out = pad_input(out_unpad, indices, batch, seqlen)

Same names, arguments and returns as flash-attn 2.8; plain PyTorch indexing (gradients flow through both
directions). `unpad_input` and `unpad_input_for_concatenated_sequences` read the longest length on the host, as
flash-attn's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["index_first_axis", "index_put_first_axis", "index_first_axis_residual", "unpad_input",
           "unpad_input_for_concatenated_sequences", "pad_input", "IndexFirstAxis", "IndexPutFirstAxis",
           "IndexFirstAxisResidual"]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """input[indices] along the first axis: (first_axis_dim, ...) -> (len(indices), ...). indices int64 or int32."""
    return input.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A (first_axis_dim, ...) tensor of zeros with values[i] at row indices[i] (the inverse of index_first_axis).
    indices int64 or int32."""
    output = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return output.index_copy(0, indices.long(), values)


def index_first_axis_residual(input: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input[indices], input): flash-attn's form for a fused layer that also needs the whole input as a residual;
    gradients from both outputs reach input."""
    return index_first_axis(input, indices), input


class IndexFirstAxis:
    """flash-attn's autograd-function name for index_first_axis: IndexFirstAxis.apply(input, indices)."""
    apply = staticmethod(index_first_axis)


class IndexPutFirstAxis:
    """flash-attn's autograd-function name for index_put_first_axis: IndexPutFirstAxis.apply(values, indices, n)."""
    apply = staticmethod(index_put_first_axis)


class IndexFirstAxisResidual:
    """flash-attn's autograd-function name for index_first_axis_residual: IndexFirstAxisResidual.apply(input,
    indices)."""
    apply = staticmethod(index_first_axis_residual)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen), 1 or True for a token, 0 for padding;
    unused_mask (batch, seqlen): tokens allocated but unused, kept in the packed rows but not counted in seqused.

    Returns (hidden_states (total_nnz, ...), indices (total_nnz,) int64 into the flattened (batch * seqlen) rows,
    cu_seqlens (batch + 1,) int32, max_seqlen_in_batch (int), seqused (batch,) int32: the tokens of attention_mask
    alone)."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max()) if seqlens_in_batch.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return (index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen_in_batch,
            used_seqlens_in_batch)


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Several short samples packed into each row: attention_mask_in_length (batch, seqlen) holds the lengths of the
    row's samples in its first entries, then zeros (e.g. [2, 3, 0, 0, 0, 0]: two samples of 2 and 3 tokens). Every
    sample becomes its own sequence. Returns (hidden_states (total_nnz, ...), indices, cu_seqlens (samples + 1,)
    int32, max_seqlen_in_batch)."""
    length = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.size(-1)
    positions = torch.arange(seqlen, device=length.device, dtype=length.dtype)
    attention_mask_2d = positions.expand(len(length), seqlen) < length.unsqueeze(1)
    flat_lengths = attention_mask_in_length.flatten()
    seqlens_in_batch = flat_lengths[torch.nonzero(flat_lengths, as_tuple=False).flatten()]
    indices = torch.nonzero(attention_mask_2d.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max()) if seqlens_in_batch.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: (total_nnz, ...) rows back to (batch, seqlen, ...), zeros where no token was."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.unflatten(0, (batch, seqlen))
