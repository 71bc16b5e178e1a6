"""flash-attn 2's raw extension entry points (`flash_attn_2_cuda`, which its interface imports as `flash_attn_gpu`) on
flashcore: fwd, varlen_fwd, bwd, varlen_bwd and fwd_kvcache with the C++ functions' positional arguments and list
returns (csrc/flash_attn/flash_api.cpp: mha_fwd, mha_varlen_fwd, mha_bwd, mha_varlen_bwd, mha_fwd_kvcache), for code
that calls the extension directly instead of the Python interface. Each runs the interface's lower-level function
(flash_attn_interface), which applies flash-attn's C++ rewrites of windows and scales; the outputs are written into
`out` / `dq` / `dk` / `dv` where given, as the C++ does. The RNG slot must be None (flash-attn's current rule; flashcore
has no dropout)."""

from __future__ import annotations

import torch

from . import flash_attn_interface as _fai


def _no_generator(generator, fn):
    if generator is not None:
        raise RuntimeError(f"flash_attn_gpu.{fn}: the RNG `generator` argument is no longer supported and must be "
                           "None (flashcore has no dropout)")


def _into(dst, src):
    """src written into the caller's dst where given (the C++ functions' optional out tensors), else src."""
    if dst is None:
        return src
    dst.copy_(src)
    return dst


def fwd(q, k, v, out, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
        return_softmax, generator=None):
    """mha_fwd: [out, softmax_lse, S_dmask, rng_state]."""
    _no_generator(generator, "fwd")
    o, lse, s_dmask, rng = _fai._flash_attn_forward(q, k, v, p_dropout, softmax_scale, is_causal, window_size_left,
                                                    window_size_right, softcap, alibi_slopes, return_softmax)
    return [_into(out, o), lse, s_dmask, rng]


def varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, return_softmax, generator=None, num_splits=0):
    """mha_varlen_fwd: [out, softmax_lse, S_dmask, rng_state]."""
    _no_generator(generator, "varlen_fwd")
    o, lse, s_dmask, rng = _fai._flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, block_table, leftpad_k, seqused_k,
        zero_tensors, num_splits)
    return [_into(out, o), lse, s_dmask, rng]


def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, deterministic, generator=None, rng_state=None):
    """mha_bwd: [dq, dk, dv, softmax_d], the gradients written into dq/dk/dv where given."""
    _no_generator(generator, "bwd")
    dq, dk, dv = (torch.empty_like(x) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v)))
    softmax_d = _fai._flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, p_dropout, softmax_scale,
                                          is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                          deterministic, rng_state)
    return [dq, dk, dv, softmax_d]


def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
               max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left, window_size_right,
               softcap, deterministic, generator=None, rng_state=None):
    """mha_varlen_bwd: [dq, dk, dv, softmax_d], the gradients written into dq/dk/dv where given."""
    _no_generator(generator, "varlen_bwd")
    dq, dk, dv = (torch.empty_like(x) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v)))
    softmax_d = _fai._flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                                 cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale,
                                                 is_causal, window_size_left, window_size_right, softcap,
                                                 alibi_slopes, deterministic, rng_state, zero_tensors)
    return [dq, dk, dv, softmax_d]


def fwd_kvcache(q, kcache, vcache, k, v, seqlens_k, rotary_cos, rotary_sin, cache_batch_idx, leftpad_k, block_table,
                alibi_slopes, out, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
                is_rotary_interleaved, num_splits):
    """mha_fwd_kvcache: [out, softmax_lse], k/v appended into kcache/vcache in place first."""
    o, lse = _fai.flash_attn_with_kvcache(q, kcache, vcache, k, v, rotary_cos, rotary_sin, seqlens_k, cache_batch_idx,
                                          leftpad_k, block_table, softmax_scale, is_causal,
                                          (window_size_left, window_size_right), softcap, is_rotary_interleaved,
                                          alibi_slopes, num_splits, return_softmax_lse=True)
    return [_into(out, o), lse]
