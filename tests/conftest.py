"""Shared helpers of the flashcore test suite.

Reference: attention computed in float64 (explicit scores, mask, softmax), the exact answer up to float64
rounding. One tolerance rule for every numerical check (check_close), forward and backward, CPU and GPU, out and
LSE: flashcore's error against the float64 reference may be at most twice the error of PyTorch's own computation
in the input dtype (SDPA, or autograd through it, on the same inputs), plus a floor that scales with the
reference's magnitude (a quarter unit roundoff for float16/bfloat16: for results PyTorch happens to get exactly).
The error is measured three ways: its largest value, its root-mean-square and its bias (the relative scale of the
error along the reference), so a kernel that is off everywhere by a little (a wrong scale, a lost normalization)
fails even where its largest error hides among rounding errors. NaN or inf never passes; rows that see no key
must give exactly out = 0 and lse = -inf.

Every kernel output is poisoned: FLASHCORE_POISON=1 (switches.h) makes the ops fill their outputs and workspaces
with NaN before the kernels run, so an element a kernel never writes fails the checks.
"""

from __future__ import annotations

import json
import math
import os
import zlib

import pytest
import torch
import torch.nn.functional as F

import flashcore

os.environ.setdefault("FLASHCORE_POISON", "1")

# Unit roundoff (half an ulp of 1) of each dtype, and the floor of the rule in those units times the reference's
# magnitude: a quarter for the 16-bit dtypes, whose errors are the final rounding and the rounding of P (below that a
# wrong kernel could hide); 32 for float32/float64 (~2e-6 of the magnitude in float32), whose errors on both sides
# are sums of many roundings (thousands of keys, block rescales), so that the largest one of a tensor varies several
# times between random draws while the RMS stays put. Any real bug is orders of magnitude above either.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
FLOOR_UNITS = {torch.float64: 32.0, torch.float32: 32.0, torch.float16: 0.25, torch.bfloat16: 0.25}
FACTOR = 2.0  # flash-attn's rule: at most twice PyTorch's own error


def make_generator(request_or_name, device="cpu") -> torch.Generator:
    """A generator seeded from the test id: random inputs, reproducible per test."""
    name = request_or_name if isinstance(request_or_name, str) else request_or_name.node.nodeid
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(name.encode()))
    return g


def randn(shape, dtype, gen, device="cpu", layout="bhsd", scale=1.0):
    """Random (B, H, S, D) tensor; layout "bshd" returns a (B, H, S, D) view of a (B, S, H, D) tensor."""
    B, H, S, D = shape
    if layout == "bshd":
        t = torch.randn(B, S, H, D, generator=gen, device=device, dtype=torch.float32).mul_(scale).to(dtype)
        return t.transpose(1, 2)
    if layout == "padded":  # a slice of a wider tensor: every stride differs from the contiguous one
        t = torch.randn(B, H, S + 3, D + 8, generator=gen, device=device, dtype=torch.float32).mul_(scale).to(dtype)
        return t[:, :, 1 : S + 1, :D]
    return torch.randn(B, H, S, D, generator=gen, device=device, dtype=torch.float32).mul_(scale).to(dtype)


def visible_mask(Sq, Sk, causal=False, offset=0, window=(-1, -1), device="cpu"):
    """(Sq, Sk) bool: key j visible from query i (mask.h): with d = j - i - offset, d <= 0 when causal,
    -left <= d when left >= 0, d <= right when right >= 0."""
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Sk, device=device)[None, :]
    d = j - i - offset
    vis = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        vis &= d <= 0
    elif right >= 0:
        vis &= d <= right
    if left >= 0:
        vis &= d >= -left
    return vis


def reference_attention(q, k, v, causal=False, scale=None, causal_offset=0, window=(-1, -1), softcap=0.0,
                        sinks=None, alibi=None, alibi_offset=None):
    """float64 attention: returns (out, lse). Masks as visible_mask; softcap caps the scaled score
    (softcap * tanh(score / softcap)); alibi (Hq,) or (B, Hq) slopes add -slope * |j - i - alibi_offset|
    (alibi_offset defaults to Sk - Sq, flash-attn's); sinks (Hq,) add exp(sink) to each row's denominator.
    A row that sees no key (and no sink) gets out = 0 and lse = -inf (flashcore's convention)."""
    qd, kd, vd = q.double(), k.double(), v.double()
    group = qd.size(-3) // kd.size(-3)
    if group > 1:
        kd = kd.repeat_interleave(group, dim=-3)
        vd = vd.repeat_interleave(group, dim=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    s = (qd @ kd.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    Sq, Sk = s.shape[-2:]
    if alibi is not None:
        off = Sk - Sq if alibi_offset is None else alibi_offset
        dist = (torch.arange(Sk, device=s.device)[None, :] - torch.arange(Sq, device=s.device)[:, None] - off).abs()
        slopes = alibi.double()
        slopes = slopes[:, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        s = s - slopes * dist.double()
    s = s.masked_fill(~visible_mask(Sq, Sk, causal, causal_offset, window, s.device), float("-inf"))
    if sinks is not None:
        sink_col = sinks.double()[:, None, None].expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink_col], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ vd, lse


def sdpa(q, k, v, causal=False, scale=None):
    """PyTorch's own computation in the input dtype (the error yardstick)."""
    group = q.size(-3) // k.size(-3)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=group > 1)


def _lowp_sdpa_call(q, k, v, causal, scale, causal_offset, window, softcap, sinks, alibi):
    """SDPA's keyword arguments where lowp_attention's answer is one SDPA call, else None. SDPA scales after
    masking: a zero or negative scale turns its -inf into NaN or +inf, so those run step by step."""
    if softcap or sinks is not None or alibi is not None or tuple(window) != (-1, -1) or (scale is not None
                                                                                           and scale <= 0):
        return None
    call = {"scale": scale, "enable_gqa": q.size(-3) != k.size(-3)}
    if causal and causal_offset != 0:
        call["attn_mask"] = visible_mask(q.size(-2), k.size(-2), causal, causal_offset, window, q.device)
    else:
        call["is_causal"] = causal
    return call


def lowp_sdpa_backend(q, k, v, causal=False, scale=None, causal_offset=0, window=(-1, -1), softcap=0.0, sinks=None,
                      alibi=None):
    """The SDPA backend (torch.nn.attention.SDPBackend's value) that lowp_attention's call takes on these inputs, or
    None where lowp_attention runs step by step."""
    call = _lowp_sdpa_call(q, k, v, causal, scale, causal_offset, window, softcap, sinks, alibi)
    if call is None:
        return None
    return torch._fused_sdp_choice(q, k, v, call.get("attn_mask"), 0.0, call.get("is_causal", False), scale=scale,
                                   enable_gqa=call["enable_gqa"])


def lowp_attention(q, k, v, causal=False, scale=None, causal_offset=0, window=(-1, -1), softcap=0.0, sinks=None,
                   alibi=None, step_by_step=False):
    """PyTorch's own low-precision answer for any variant: SDPA in the input dtype, with the mask, softcap, ALiBi
    and sinks expressed as SDPA arguments (a boolean or additive float mask; softcap and sinks as explicit ops in
    the input dtype). Rows that see nothing give 0 (SDPA gives NaN there). step_by_step: the general path even
    where one SDPA call would do (flash-attn's own tests' yardstick: attention written out in the input dtype)."""
    Sq, Sk = q.size(-2), k.size(-2)
    gqa = q.size(-3) != k.size(-3)
    sdpa_call = _lowp_sdpa_call(q, k, v, causal, scale, causal_offset, window, softcap, sinks, alibi)
    if sdpa_call is not None and not step_by_step:
        return F.scaled_dot_product_attention(q, k, v, **sdpa_call).nan_to_num(0.0)
    vis = visible_mask(Sq, Sk, causal, causal_offset, window, q.device)
    # The general case in the input dtype, step by step as a PyTorch user would write it.
    if gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        dist = (torch.arange(Sk, device=q.device)[None, :] - torch.arange(Sq, device=q.device)[:, None] - (Sk - Sq))
        slopes = alibi.to(q.dtype)
        slopes = slopes[:, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        s = s - slopes * dist.abs().to(q.dtype)
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(q.dtype)[:, None, None].expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


def _norms(x):
    x = x.double()
    if x.numel() == 0:
        return 0.0, 0.0
    return x.abs().max().item(), x.pow(2).mean().sqrt().item()


# Optional report of every check (FLASHCORE_TEST_REPORT=path): name, errors, bounds; for calibrating tolerances
# on a new GPU without rerunning failures one by one.
_REPORT = os.environ.get("FLASHCORE_TEST_REPORT")


def _report(record):
    if _REPORT:
        with open(_REPORT, "a") as f:
            f.write(json.dumps(record) + "\n")


def _bias(x, ref):
    """Least-squares relative scale of the error along the reference: sum((x - ref) ref) / sum(ref^2). Rounding
    leaves it near 0; a kernel off by a factor (a wrong scale, a lost normalization) shows it whole."""
    den = ref.pow(2).sum().item()
    return ((x - ref) * ref).sum().item() / den if den > 0 else 0.0


def _rows_bias_chance(ref64, dtype):
    """Three standard deviations of the bias that rounding one probability a row gives a gradient: a backward rounds
    P = exp(s - lse), just below 1 where a row's probability sits on one key (a single query's dV = P dO, a steep
    ALiBi slope), to the input dtype before its GEMMs, as every FlashAttention kernel does, and that one rounding, up
    to a unit, scales the whole row of the result. Rows (the last dim) weighted by their share of |ref64|^2: with N
    rows of equal weight the term falls as 1 / sqrt(N), so only tensors of a few dominant rows get more than the
    RMS-based allowance. 0 for floats kernels keep in float32. (Not for forward outputs: there the dominant key's
    unnormalized probability is exp(0) = 1, exact.)"""
    if dtype not in (torch.float16, torch.bfloat16) or ref64.dim() < 2 or ref64.numel() == 0:
        return 0.0
    w = ref64.double().nan_to_num(0.0, 0.0, 0.0).pow(2).sum(-1).flatten()
    total = w.sum().item()
    if total == 0:
        return 0.0
    return 3 * UNIT_ROUNDOFF[dtype] / math.sqrt(3) * w.pow(2).sum().sqrt().item() / total


def check_close(name, got, ref64, ref_lowp, dtype=None, factor=FACTOR, magnitude=None, rows_rounding=False):
    """The suite's one tolerance rule, on three statistics of the error against ref64: its largest value, its RMS
    and its bias (relative scale along ref64). Each must be at most factor x the same statistic of PyTorch's own
    low-precision result ref_lowp, plus a floor of UNIT_ROUNDOFF x FLOOR_UNITS x the reference's magnitude in that
    statistic (its max, its RMS, 1). `magnitude` (a tensor) replaces ref64 as the magnitude where ref64 may be
    exactly zero (gradients of rows that see one key: the scale of the other gradients is the natural one).
    NaN/inf in got fail where ref64 is finite, as does any difference where ref64 is infinite. rows_rounding: the
    chance bias of rounded probabilities scaling whole rows (_rows_bias_chance) is allowed too (gradients)."""
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    dtype = dtype or got.dtype
    got, ref64, ref_lowp = got.double(), ref64.double(), ref_lowp.double()
    rows_chance = _rows_bias_chance(ref64, dtype) if rows_rounding else 0.0
    finite = torch.isfinite(ref64)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: non-finite values where the reference is finite " \
        f"({(torch.isfinite(got) != finite).sum().item()} elements)"
    if not finite.all():
        assert torch.equal(got[~finite], ref64[~finite]), f"{name}: infinities differ from the reference's"
        got, ref64, ref_lowp = got[finite], ref64[finite], ref_lowp[finite]
    ref_lowp = torch.where(torch.isfinite(ref_lowp), ref_lowp, ref64)  # a yardstick, not the tested output
    err_max, err_rms = _norms(got - ref64)
    pt_max, pt_rms = _norms(ref_lowp - ref64)
    ref_max, ref_rms = _norms(ref64 if magnitude is None else magnitude)
    err_bias, pt_bias = abs(_bias(got, ref64)), abs(_bias(ref_lowp, ref64))
    floor = UNIT_ROUNDOFF[dtype] * FLOOR_UNITS[dtype]
    bound_max = factor * pt_max + floor * ref_max
    bound_rms = factor * pt_rms + floor * ref_rms
    # Random errors within the RMS bound have a bias of std bound_rms / |ref64| (|.|: the 2-norm): three of those
    # are chance, not a systematic error (it matters only for small tensors: a row of dQ, a vector of dsinks); so, in
    # gradients, is the rounding of a few dominant rows' probabilities (_rows_bias_chance), independent of the first.
    ref_norm = ref64.double().norm().item()
    chance = 3 * bound_rms / ref_norm if ref_norm > 0 else 0.0
    bound_bias = factor * pt_bias + floor + math.hypot(chance, rows_chance)
    _report({"name": name, "test": os.environ.get("PYTEST_CURRENT_TEST", ""), "dtype": str(dtype),
             "err_max": err_max, "bound_max": bound_max, "err_rms": err_rms, "bound_rms": bound_rms,
             "err_bias": err_bias, "bound_bias": bound_bias})
    assert err_max <= bound_max, (f"{name}: max error {err_max:.3e} > bound {bound_max:.3e} (PyTorch's own error "
                                  f"{pt_max:.3e}, reference magnitude {ref_max:.3e})")
    assert err_rms <= bound_rms, (f"{name}: RMS error {err_rms:.3e} > bound {bound_rms:.3e} (PyTorch's own RMS "
                                  f"error {pt_rms:.3e})")
    assert err_bias <= bound_bias, (f"{name}: the error is biased: relative scale {err_bias:.3e} along the "
                                    f"reference > bound {bound_bias:.3e} (PyTorch's own {pt_bias:.3e})")
    return err_max


def check_gradients(got, ref, lowp, dtype=None, names=("dq", "dk", "dv")):
    """check_close on each gradient, with the largest reference gradient as the magnitude of the floor: a gradient
    that is exactly zero (dQ of rows that see a single key) is measured on the scale of the others."""
    largest = max(ref, key=lambda r: r.double().abs().max().item() if r.numel() else 0.0)
    for name, a, r, low in zip(names, got, ref, lowp):
        assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        check_close(name, a, r, low, dtype=dtype, magnitude=largest, rows_rounding=True)


def lowp_lse(q, k, causal=False, scale=None, causal_offset=0, window=(-1, -1), softcap=0.0, sinks=None, alibi=None,
             alibi_by_key=False):
    """PyTorch's own log-sum-exp of the rows, in float32 (the LSE's dtype) from the low-precision inputs: the
    precision of SDPA's fused kernels, which keep scores in float32. PyTorch has no fused softcap; its own is
    lowp_attention's `softcap * tanh(s / softcap)` on the scores in the input dtype, and so is this yardstick's."""
    if softcap:
        s = _lowp_capped_scores(q, k, scale, softcap).float()
        return reference_lse(q, k, causal, scale, causal_offset, window, softcap, sinks, alibi, dtype=torch.float32,
                             scores=s, alibi_by_key=alibi_by_key)
    return reference_lse(q.float(), k.float(), causal, scale, causal_offset, window, softcap, sinks, alibi,
                         dtype=torch.float32, alibi_by_key=alibi_by_key)


def _lowp_capped_scores(q, k, scale, softcap):
    """Softcapped scores as PyTorch computes them in the input dtype (Gemma 2's eager attention)."""
    if q.size(-3) != k.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    return softcap * torch.tanh(s / softcap)


def reference_lse(q, k, causal=False, scale=None, causal_offset=0, window=(-1, -1), softcap=0.0, sinks=None,
                  alibi=None, dtype=torch.float64, scores=None, alibi_by_key=False):
    """The rows' log-sum-exp in dtype; `scores` (already scaled and capped) replaces q.k where given. ALiBi adds
    -slope * |j - i - (Sk - Sq)|, or with alibi_by_key +slope * j: flash-attn 2's causal kernel, whose LSE its
    interface returns (the same softmax under a causal mask)."""
    if scores is None:
        qd, kd = q.to(dtype), k.to(dtype)
        group = qd.size(-3) // kd.size(-3)
        if group > 1:
            kd = kd.repeat_interleave(group, dim=-3)
        scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
        s = (qd @ kd.transpose(-1, -2)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
    else:
        s = scores.to(dtype)
    Sq, Sk = s.shape[-2:]
    if alibi is not None:
        dist = (torch.arange(Sk, device=s.device)[None, :] - torch.arange(Sq, device=s.device)[:, None] - (Sk - Sq))
        slopes = alibi.to(dtype)
        slopes = slopes[:, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        if alibi_by_key:
            s = s + slopes * torch.arange(Sk, device=s.device).to(dtype)
        else:
            s = s - slopes * dist.abs().to(dtype)
    s = s.masked_fill(~visible_mask(Sq, Sk, causal, causal_offset, window, s.device), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(dtype)[:, None, None].expand(*s.shape[:-1], 1)], dim=-1)
    return torch.logsumexp(s, dim=-1)


def sink_gradient_terms(out, dout, lse, sinks):
    """The per-row terms of d sink[h] = -sum over rows of exp(sink - lse) * rowsum(dO * O), as fused backwards
    compute it from their stored output: (B, H, S), in float64."""
    weight = torch.exp(sinks.double()[None, :, None] - lse.double()).nan_to_num(0.0)
    return -weight * (dout.double() * out.double()).sum(-1)


def lowp_dsinks(out_lowp, lse_lowp, out64, lse64, dout, sinks):
    """PyTorch's own low-precision error on d sinks, as a yardstick value ref + error per head. Its terms come from
    PyTorch's rounded output, as SDPA's fused backwards take rowsum(dO * O) from their stored output (autograd through
    lowp_attention's float32 softmax never rounds O, a precision no fused backward has: with float16 and a large sink,
    O is subnormal). The error of a sum over all rows is taken as the root-sum-square of its rows' errors, the
    expected size of their sum, not the realized sum, which cancels by chance in a vector of a few heads."""
    exact = sink_gradient_terms(out64, dout, lse64, sinks)
    row_err = sink_gradient_terms(out_lowp, dout, lse_lowp, sinks) - exact
    return exact.sum(dim=(0, 2)) + row_err.pow(2).sum(dim=(0, 2)).sqrt()


def check_lse(got, q, k, **mask):
    """The rule on the LSE (float32; float64 for float64 inputs): rows that see no key exactly -inf, the others
    within 2x PyTorch's log-sum-exp error in that dtype (+ the floor)."""
    ref = reference_lse(q, k, **mask)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    low = ref if lse_dtype == torch.float64 else lowp_lse(q, k, **mask)
    assert got.dtype == lse_dtype, f"lse has dtype {got.dtype}, expected {lse_dtype}"
    check_close("lse", got, ref, low, dtype=lse_dtype)


def cuda_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not flashcore._has_cuda_kernels():
        return "flashcore was built without CUDA kernels"
    return None


requires_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")

# ---------------------------------------------------------------------------------------------------------------
# Skips: CI sets FLASHCORE_ALLOWED_SKIPS (a '|'-separated list of reason prefixes, e.g. "no CUDA device"); a skip
# for any other reason then fails the session, so a missing tool or a broken build cannot pass as skipped tests.
# ---------------------------------------------------------------------------------------------------------------

_bad_skips: list[str] = []


def pytest_runtest_logreport(report):
    allowed = os.environ.get("FLASHCORE_ALLOWED_SKIPS")
    if allowed is None or not report.skipped:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not any(reason.startswith(p) for p in allowed.split("|") if p):
        _bad_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _bad_skips:
        print(f"\n{len(_bad_skips)} test(s) skipped for a reason FLASHCORE_ALLOWED_SKIPS does not allow:")
        for line in _bad_skips[:20]:
            print("  " + line)
        session.exitstatus = 1


# ---------------------------------------------------------------------------------------------------------------
# GPU fixtures: the kernel family a test forces (and then asserts ran, through flashcore.last_kernel)
# ---------------------------------------------------------------------------------------------------------------


def gpu_families():
    fams = ["sm80"]
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        fams.append("sm90")
    return fams


@pytest.fixture
def one_thread():
    """One intra-op thread, so that the CPU forward's packed query heads (fwd_cpu.cpp: heads_per_task, taken where
    the packed tasks keep every thread busy) run whatever the machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(params=["sm80", "sm90"])
def family(request, monkeypatch):
    """A forward kernel family, forced (FLASHCORE_FORCE_KERNEL); tests assert it ran (assert_ran)."""
    if request.param not in gpu_families():
        pytest.skip(f"{request.param} kernels need a compute capability 9.0 GPU")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", request.param)
    return request.param


@pytest.fixture(params=["sm80", "sm90", "composite"])
def bwd_path(request, monkeypatch):
    """The fused mma.sync and wgmma backwards and the composite (ATen) one, each forced."""
    if request.param == "sm90" and "sm90" not in gpu_families():
        pytest.skip("sm90 kernels need a compute capability 9.0 GPU")
    monkeypatch.setenv("FLASHCORE_FORCE_BWD", request.param)
    return request.param


def assert_ran(pass_, family):
    """The last call of `pass_` ("fwd"/"bwd") ran `family` (flashcore.last_kernel), not a fallback."""
    ran = flashcore.last_kernel(pass_)
    assert ran.split()[0] == family, f"{pass_}: expected the {family} kernel, {ran} ran"
    return ran


def pack_gqa_heads(group, max_seqlen_q, block_m):
    """The query heads a block of the Hopper varlen forward packs (csrc/.../sm90/fwd_sm90_pack_gqa.h): the divisor g
    of the group, block_m / g a multiple of 16, that computes the fewest padded rows (ties to the smaller g), if that
    saves at least an eighth of the unpacked rows; 1 under FLASHCORE_PACK_GQA=0, the largest such divisor under
    FLASHCORE_PACK_GQA=always."""
    mode = os.environ.get("FLASHCORE_PACK_GQA")
    if mode == "0":
        return 1
    fits = [g for g in range(2, group + 1) if group % g == 0 and block_m % (16 * g) == 0]
    if mode == "always":
        return max(fits, default=1)
    rows = lambda g: -(-max_seqlen_q // (block_m // g)) * block_m * (group // g)
    best = 1
    for g in fits:
        if rows(g) < rows(best):
            best = g
    return best if 8 * rows(best) <= 7 * rows(1) else 1


def packed_varlen_grid(batch, heads_q, heads_kv, max_seqlen_q, block_m):
    """The Hopper varlen forward's grid (sm90/fwd_sm90_pack_gqa.h: VarlenFwdPack): (heads packed a block, blocks,
    whether its blocks are more than half queries)."""
    g = pack_gqa_heads(heads_q // heads_kv, max_seqlen_q, block_m)
    rows = block_m // g
    return g, batch * (heads_q // g) * -(-max_seqlen_q // rows), 2 * g * min(max_seqlen_q, rows) > block_m


def capture_graph(fn):
    """fn captured in a CUDA graph after a warm-up call on a side stream: (graph, fn's outputs in the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static
