"""The tolerance rule itself (conftest.check_close) must reject wrong kernels: outputs of simulated bugs, computed by
flashcore's own kernels on perturbed problems, fail it wherever the bug moves the exact answer by twice the rule's
bound or more (below that the rule, 2x PyTorch's own error, allows it by definition: e.g. a 2^-8 output scale in
bf16 on the CPU, whose SDPA is less accurate than that)."""

import math

import pytest
import torch

import flashcore
from conftest import (FLOOR_UNITS, UNIT_ROUNDOFF, check_close, cuda_skip_reason, lowp_attention, make_generator, randn,
                      reference_attention)

# (B, H, Sq, Sk, D)
SHAPES = [(2, 4, 113, 113, 64), (1, 4, 1000, 777, 64), (1, 2, 1, 300, 64), (1, 2, 257, 64, 128),
          (1, 2, 7, 2048, 128), (2, 4, 300, 300, 128), (1, 8, 512, 512, 64)]


def bugged(name, q, k, v, causal, scale):
    """flashcore's output under a simulated bug, and the exact (float64) answer of that bug."""
    if name == "drop_last_key":
        k, v = k[:, :, :-1], v[:, :, :-1]
    if name == "scale_1pct":
        scale *= 1.01
    out = flashcore.attention(q, k, v, is_causal=causal, scale=scale)
    exact = reference_attention(q, k, v, causal, scale)[0]
    if name == "out_times_1_plus_2^-8":
        out = (out.double() * (1 + 2.0**-8)).to(q.dtype)
        exact = exact * (1 + 2.0**-8)
    return out, exact


def _rms(x):
    return x.double().pow(2).mean().sqrt().item()


def run_bugs(request, device, dtype):
    """Runs every bug on every shape; returns (rejected, changed, missed): how many bugged outputs the rule
    rejected, how many bugs changed the exact answer by a unit roundoff of its magnitude or more, and how many of
    those passed. Every bug that moves the answer by twice the rule's bound or more must be rejected (asserted
    here)."""
    rejected = changed = missed = 0
    for shape in SHAPES:
        B, H, Sq, Sk, D = shape
        g = make_generator(f"{request.node.nodeid}{shape}", device)
        q, k, v = (randn((B, H, S, D), dtype, g, device) for S in (Sq, Sk, Sk))
        scale = 1.0 / math.sqrt(D)
        for causal in (False, True):
            ref = reference_attention(q, k, v, causal, scale)[0]
            low = lowp_attention(q, k, v, causal, scale)
            good = flashcore.attention(q, k, v, is_causal=causal, scale=scale)
            check_close("out", good, ref, low)  # the unbugged kernel passes
            floor = UNIT_ROUNDOFF[dtype] * FLOOR_UNITS[dtype]
            bound_max = 2 * (low.double() - ref).abs().max().item() + floor * ref.abs().max().item()
            bound_rms = 2 * _rms(low.double() - ref) + floor * _rms(ref)
            for name in ("drop_last_key", "scale_1pct", "out_times_1_plus_2^-8"):
                out, exact = bugged(name, q, k, v, causal, scale)
                effect = exact - ref
                try:
                    check_close("out", out, ref, low)
                    passed = True
                except AssertionError:
                    passed = False
                rejected += not passed
                # a unit roundoff of the magnitude or more (the 2^-8 output scale is exactly one in bfloat16)
                changes = effect.abs().max().item() >= (1 - 1e-6) * UNIT_ROUNDOFF[dtype] * ref.abs().max().item()
                changed += changes
                missed += changes and passed
                if effect.abs().max().item() > 2 * bound_max or _rms(effect) > 2 * bound_rms:
                    assert not passed, f"{name} on {shape} causal={causal} passed the rule"
    return rejected, changed, missed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_checker_rejects_simulated_bugs_cpu(request, dtype):
    rejected, changed, missed = run_bugs(request, "cpu", dtype)
    assert rejected > 0


@pytest.mark.gpu
@pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_checker_rejects_simulated_bugs_cuda(request, dtype):
    # On the GPU PyTorch's own low-precision error is a flash kernel's: every bug that changes the answer beyond a
    # unit roundoff is rejected (the 2^-8 output scale through the bias statistic).
    rejected, changed, missed = run_bugs(request, "cuda", dtype)
    assert changed > 0 and missed == 0, f"{missed} of {changed} bugs that change the answer passed"


def test_checker_rejects_nan_and_unwritten_rows():
    ref = torch.randn(4, 8, dtype=torch.float64)
    low = ref.float().to(torch.bfloat16)
    got = low.clone()
    got[1, 3] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        check_close("out", got, ref, low)
    ref_lse = torch.tensor([1.0, float("-inf")], dtype=torch.float64)
    for bad in (float("nan"), float("inf"), 0.0):
        with pytest.raises(AssertionError):
            check_close("lse", torch.tensor([1.0, bad]), ref_lse, ref_lse.float(), dtype=torch.float32)
