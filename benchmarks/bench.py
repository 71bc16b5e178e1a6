#!/usr/bin/env python3
"""Benchmark flashcore against PyTorch SDPA's backends, in the same run.

GPU: flashcore vs SDPA default / flash (FA2) / cuDNN / efficient, CUDA-event and CUDA-graph timing, backends
interleaved round-robin over several rounds. CPU (no CUDA, or --device cpu): flashcore vs SDPA on the CPU, wall
clock. See benchmarks/README.md for the method and the meaning of the columns; `--list` prints the shape lists.

    python benchmarks/bench.py                         # GPU: --shapes anchors; CPU: --shapes cpu
    python benchmarks/bench.py --shapes small,decode --modes fwd
    python benchmarks/bench.py --shapes sweep --plot sweep.png
    python benchmarks/bench.py --shape 4,32,8,8192,8192,128,bf16,causal
    python benchmarks/bench.py --shapes variants --backends flashcore,fa4,sdpa   # window, softcap
    python benchmarks/bench.py --compare before.json after.json                 # an A/B of two runs
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:  # an in-place build (not pip-installed) is found too
    sys.path.append(os.path.dirname(HERE))

try:  # the benchmark must run (SDPA only) even when flashcore is not built
    import flashcore

    FLASHCORE_IMPORT_ERROR: Optional[str] = None
except Exception as e:  # noqa: BLE001
    flashcore = None
    FLASHCORE_IMPORT_ERROR = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - very old torch
    SDPBackend = sdpa_kernel = None

DTYPES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
# max |flashcore - SDPA default| above which a row is marked WRONG (forward output; gradients: times max|grad|)
TOLERANCE = {torch.float16: 0.05, torch.bfloat16: 0.05, torch.float32: 1e-3, torch.float64: 1e-6}
FWD, FWDBWD = "fwd", "fwdbwd"
BWD_FLOP_FACTOR = 2.5  # backward = 2.5x forward FLOPs (5 GEMMs vs 2); fwd+bwd = 3.5x


# ---------------------------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    dtype: str  # "fp16", "bf16", "fp32", "fp64"
    causal: bool
    fwd_only: bool = False  # decode: a backward of one query token is not a workload anyone runs
    window: tuple = (-1, -1)  # sliding window (left, right), -1 = unbounded; aligned like is_causal (Sq = Sk here)
    softcap: float = 0.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def gqa(self) -> bool:
        return self.Hq != self.Hkv

    @property
    def variant(self) -> bool:
        return self.window != (-1, -1) or self.softcap > 0

    def label(self) -> str:
        heads = f"{self.Hq}" if self.Hq == self.Hkv else f"{self.Hq}/{self.Hkv}"
        seq = f"{self.Sq}" if self.Sq == self.Sk else f"{self.Sq}/{self.Sk}"
        extra = (f" w{self.window[0]},{self.window[1]}" if self.window != (-1, -1) else "") + (
            f" cap{self.softcap:g}" if self.softcap > 0 else "")
        return f"{self.B}x{heads}x{seq}x{self.D}{extra}"

    def visible_pairs(self) -> int:
        """(query, key) pairs computed. Causal is top-left aligned (SDPA): query i sees keys 0..i; a window
        counts only the pairs it shows (exactly, top-left aligned)."""
        if self.window != (-1, -1):
            left, right = self.window
            right = 0 if self.causal else right
            i = torch.arange(self.Sq, dtype=torch.int64)
            hi = (i + right).clamp(max=self.Sk - 1) if right >= 0 else torch.full_like(i, self.Sk - 1)
            lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
            return int((hi - lo + 1).clamp(min=0).sum())
        if not self.causal:
            return self.Sq * self.Sk
        if self.Sq == self.Sk:
            return self.Sq * self.Sk // 2  # the usual convention: half of S*S
        n = min(self.Sq, self.Sk)
        return n * (n + 1) // 2 + max(0, self.Sq - self.Sk) * self.Sk

    def io_bytes(self) -> int:
        """Bytes of Q, K, V and O, each read or written once (the memory floor; decode is bound by it)."""
        elt = torch.empty((), dtype=self.torch_dtype).element_size()
        return elt * self.B * self.D * (2 * self.Hq * self.Sq + 2 * self.Hkv * self.Sk)


def flops(shape: Shape, mode: str) -> float:
    """FLOPs of one call: forward 4*B*Hq*pairs*D (two GEMMs), fwd+bwd 3.5x that."""
    fwd = 4.0 * shape.B * shape.Hq * shape.visible_pairs() * shape.D
    return fwd if mode == FWD else fwd * (1.0 + BWD_FLOP_FACTOR)


def _both(B, H, S, D, dtype, Hkv=None):
    Hkv = H if Hkv is None else Hkv
    return [Shape(B, H, Hkv, S, S, D, dtype, False), Shape(B, H, Hkv, S, S, D, dtype, True)]


def _one(B, H, S, D, dtype, causal, Hkv=None):
    return Shape(B, H, H if Hkv is None else Hkv, S, S, D, dtype, causal)


SHAPE_LISTS: dict[str, list[Shape]] = {
    # the original L4 study's shapes: mostly launch/latency bound (graph column is the GPU time)
    "small": [
        _one(1, 8, 512, 64, "fp16", False),
        _one(4, 8, 512, 64, "fp16", False),
        _one(1, 8, 128, 64, "fp16", False),
        _one(1, 32, 1024, 128, "fp16", False),
    ],
    # grids of one to three waves of blocks on a 132-SM H100, where the forward's block height (rows a block)
    # decides how full the last wave is (fwd_sm90_launch.cuh, pick_consumer_warpgroups)
    "mid": [
        _one(1, 8, 4096, 64, "bf16", False),
        _one(1, 4, 8192, 64, "fp16", False),
        _one(1, 12, 4096, 64, "fp16", False),
        _one(1, 8, 4096, 64, "fp16", True),
        _one(1, 8, 4096, 96, "fp16", False),
        _one(1, 8, 4096, 128, "fp16", False),
        _one(2, 8, 4096, 128, "bf16", True),
    ],
    # /work/shared/anchors-h100.md: the long shapes of the first table, then head dims 96/256 and GQA 32/8
    "anchors": [
        _one(16, 16, 2048, 64, "fp16", False),
        _one(16, 16, 2048, 128, "fp16", False),
        *_both(4, 16, 8192, 128, "fp16"),
        _one(2, 16, 16384, 64, "fp16", False),
        _one(2, 16, 16384, 128, "fp16", True),
        _one(16, 16, 2048, 128, "bf16", False),
        *_both(4, 16, 8192, 128, "bf16"),
        _one(4, 16, 8192, 96, "fp16", False),
        *_both(4, 16, 8192, 256, "fp16"),
        *_both(4, 32, 8192, 128, "fp16", Hkv=8),
        _one(4, 16, 8192, 256, "bf16", False),
        _one(4, 32, 8192, 128, "bf16", False, Hkv=8),
    ],
    # the attention variants beside the dense kernels they build on (window 4096 at 16k causal, softcap 30 at 8k)
    "variants": [
        _one(2, 16, 16384, 128, "bf16", True),
        Shape(2, 16, 16, 16384, 16384, 128, "bf16", True, window=(4096, 0)),
        _one(4, 16, 8192, 128, "bf16", False),
        Shape(4, 16, 16, 8192, 8192, 128, "bf16", False, softcap=30.0),
        _one(4, 16, 8192, 128, "bf16", True),
        Shape(4, 16, 16, 8192, 8192, 128, "bf16", True, softcap=30.0),
    ],
    # one query token against a long KV cache (GQA 32/8): memory bound, forward only
    "decode": [Shape(8, 32, 8, 1, 8192, 128, "fp16", False, fwd_only=True)],
    # sequence-length sweep for the plot: B*S = 32k tokens, H = 16
    "sweep": [
        Shape(32768 // S, 16, 16, S, S, D, "fp16", causal)
        for D in (64, 128)
        for causal in (False, True)
        for S in (512, 1024, 2048, 4096, 8192, 16384)
    ],
    # CPU: small enough for ~1-2 minutes on 2 cores (both backends, both modes)
    "cpu": [
        Shape(B, H, H, S, S, D, dt, c)
        for (B, H, S, D) in ((1, 8, 128, 64), (1, 8, 512, 64), (4, 8, 512, 64), (2, 8, 1024, 64))
        for dt in ("fp32", "bf16")
        for c in (False, True)
    ],
    "cpu-quick": [
        _one(1, 4, 128, 64, "fp32", False),
        _one(1, 4, 256, 64, "fp32", True),
        _one(1, 4, 256, 64, "bf16", True),
    ],
}


def parse_bool(s: str) -> bool:
    s = s.strip().lower()
    if s in ("1", "true", "yes", "y", "causal", "c"):
        return True
    if s in ("0", "false", "no", "n", "none", "full", ""):
        return False
    raise ValueError(f"not a boolean: {s!r}")


def parse_shape(text: str) -> Shape:
    """B,Hq,Hkv,Sq,Sk,D,dtype,causal  (or the short form B,H,S,D,dtype,causal), then optional variant fields
    softcap=C and window=LEFT:RIGHT."""
    f = [x.strip() for x in text.split(",")]
    extra = {}
    while f and "=" in f[-1]:
        key, _, value = f.pop().partition("=")
        extra[key.strip()] = value.strip()
    try:
        variant = {}
        for key, value in extra.items():
            if key == "softcap":
                variant["softcap"] = float(value)
            elif key == "window":
                left, right = value.split(":")
                variant["window"] = (int(left), int(right))
            else:
                raise ValueError(f"unknown field {key!r} (softcap=C, window=LEFT:RIGHT)")
        if len(f) == 8:
            B, Hq, Hkv, Sq, Sk, D = (int(x) for x in f[:6])
        elif len(f) == 6:
            B, Hq, S, D = (int(x) for x in f[:4])
            Hkv, Sq, Sk = Hq, S, S
        else:
            raise ValueError("expected 8 (or 6) comma-separated fields")
        dtype = DTYPE_NAMES[DTYPES[f[-2].lower()]]
        causal = parse_bool(f[-1])
    except (ValueError, KeyError) as e:
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: {e}; use B,Hq,Hkv,Sq,Sk,D,dtype,causal e.g. 4,32,8,8192,8192,128,fp16,1"
        ) from e
    return Shape(B, Hq, Hkv, Sq, Sk, D, dtype, causal, fwd_only=(Sq == 1), **variant)


# ---------------------------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Backend:
    name: str
    call: Callable  # call(q, k, v, shape) -> out
    context: Callable = contextlib.nullcontext  # entered around every call of this backend (timing included)
    unavailable: Optional[str] = None  # reason, when the backend cannot run at all on this machine
    prepare: Optional[Callable] = None  # prepare(q, k, v) -> the inputs this backend is timed on (its layout)


_WINDOW_MASKS: dict = {}


def window_mask(shape: Shape, device) -> torch.Tensor:
    """The boolean (Sq, Sk) mask of a windowed shape, for SDPA (cached: one per shape)."""
    key = (shape.Sq, shape.Sk, shape.window, shape.causal, str(device))
    if key not in _WINDOW_MASKS:
        i = torch.arange(shape.Sq, device=device)[:, None]
        j = torch.arange(shape.Sk, device=device)[None, :]
        left, right = shape.window
        right = 0 if shape.causal else right
        vis = torch.ones(shape.Sq, shape.Sk, dtype=torch.bool, device=device)
        if left >= 0:
            vis &= j >= i - left
        if right >= 0:
            vis &= j <= i + right
        _WINDOW_MASKS.clear()
        _WINDOW_MASKS[key] = vis
    return _WINDOW_MASKS[key]


def _sdpa(q, k, v, shape):
    if shape.softcap > 0:
        raise NotImplementedError("SDPA has no softcap")
    if shape.window != (-1, -1):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(shape, q.device), enable_gqa=shape.gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=shape.gqa)


def _flashcore(q, k, v, shape, deterministic=False):
    variant = {}
    if shape.window != (-1, -1):
        variant["window_size"] = shape.window
    if shape.softcap > 0:
        variant["softcap"] = shape.softcap
    return flashcore.attention(q, k, v, is_causal=shape.causal, enable_gqa=shape.gqa, deterministic=deterministic,
                               **variant)


try:  # FlashAttention-4 (the flash-attn-4 package, CuTe-DSL kernels): an optional anchor, BSHD inputs
    from flash_attn.cute import flash_attn_func as _fa4_func

    FA4_IMPORT_ERROR: Optional[str] = None
except Exception as e:  # noqa: BLE001
    _fa4_func = None
    FA4_IMPORT_ERROR = f"flash_attn.cute cannot be imported ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


def _fa4(q, k, v, shape):
    window = tuple(None if w < 0 else w for w in shape.window)
    out = _fa4_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=shape.causal,
                    window_size=window, softcap=shape.softcap)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def bshd_storage(q, k, v):
    """BHSD views of BSHD-contiguous copies (leaves, requiring grad as the originals): FA4's native layout."""
    return tuple(t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad).transpose(1, 2)
                 for t in (q, k, v))


def flashcore_status(device: str) -> Optional[str]:
    """None when flashcore can run on `device`, else the reason it cannot."""
    if flashcore is None:
        return f"flashcore cannot be imported ({FLASHCORE_IMPORT_ERROR})"
    if device == "cuda":
        try:
            has = flashcore._has_cuda_kernels()
        except Exception as e:  # noqa: BLE001
            return f"flashcore._has_cuda_kernels() failed: {e}"
        if not has:
            return "this flashcore build has no CUDA kernels (flashcore._has_cuda_kernels() is False)"
    return None


def backend_registry(device: str) -> dict[str, Backend]:
    """All known backends. 'sdpa' is SDPA's default dispatch (no context); the others force one backend."""
    reg = {
        "flashcore": Backend("flashcore", _flashcore, unavailable=flashcore_status(device)),
        # the bitwise-reproducible backward (deterministic=True); same forward
        "flashcore-deterministic": Backend("flashcore-deterministic", functools.partial(_flashcore, deterministic=True),
                                           unavailable=flashcore_status(device)),
        "sdpa": Backend("sdpa", _sdpa),
        "fa4": Backend("fa4", _fa4, unavailable=FA4_IMPORT_ERROR or (None if device == "cuda" else "GPU only"),
                       prepare=bshd_storage),
    }
    forced = {
        "sdpa-flash": "FLASH_ATTENTION",
        "sdpa-cudnn": "CUDNN_ATTENTION",
        "sdpa-efficient": "EFFICIENT_ATTENTION",
        "sdpa-math": "MATH",
    }
    for name, member in forced.items():
        be = getattr(SDPBackend, member, None) if SDPBackend is not None else None
        if be is None:
            reg[name] = Backend(name, _sdpa, unavailable=f"SDPBackend.{member} not in this torch")
        else:
            reg[name] = Backend(name, _sdpa, context=(lambda b=be: sdpa_kernel(b)))
    return reg


def switch_settings(name: str) -> dict:
    """The switches of a 'flashcore@NAME=VALUE[+NAME=VALUE]' backend name, as {NAME: VALUE}."""
    return dict(kv.split("=", 1) for kv in name.split("@", 1)[1].split("+"))


@contextlib.contextmanager
def environment(env: dict):
    """os.environ updated with env inside the block, restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def switched_flashcore(base: Backend, name: str) -> Backend:
    """'flashcore@NAME=VALUE[+NAME=VALUE]': flashcore with run-time switches (csrc/flashcore/switches.h) set around
    each of its calls, for an A/B of two paths in the same interleaved rounds, e.g.
    flashcore,flashcore@FLASHCORE_BWD_WIDE_STEPS=0."""
    env = switch_settings(name)
    return dataclasses.replace(base, name=name, context=lambda: environment(env))


DEFAULT_BACKENDS = {
    "cuda": ["flashcore", "sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"] + (["fa4"] if _fa4_func else []),
    "cpu": ["flashcore", "sdpa"],
}


# ---------------------------------------------------------------------------------------------------------------
# Inputs and the timed step
# ---------------------------------------------------------------------------------------------------------------


def make_inputs(shape: Shape, device: str, requires_grad: bool, seed: int = 0):
    """torch.randn BHSD contiguous q (B,Hq,Sq,D), k and v (B,Hkv,Sk,D)."""
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, dtype=shape.torch_dtype, generator=g)
    q = torch.randn(shape.B, shape.Hq, shape.Sq, shape.D, **kw)
    k = torch.randn(shape.B, shape.Hkv, shape.Sk, shape.D, **kw)
    v = torch.randn(shape.B, shape.Hkv, shape.Sk, shape.D, **kw)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def make_step(backend: Backend, shape: Shape, inputs, mode: str, dout=None) -> Callable:
    """One call of the workload: forward, or forward + backward (autograd.grad: fresh grads, no accumulation)."""
    q, k, v = inputs
    if mode == FWD:
        return lambda: backend.call(q, k, v, shape)

    def step():
        out = backend.call(q, k, v, shape)
        return torch.autograd.grad(out, (q, k, v), grad_outputs=dout)

    return step


def _sdpa_why(caught_warnings) -> str:
    """SDPA explains a refused backend in UserWarnings ('... does not support ...'): keep the specific lines."""
    why = []
    for w in caught_warnings:
        m = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(w.message))
        m = " ".join(m.split())
        if m and not m.endswith("because:") and m not in why:
            why.append(m)
    return "; ".join(why)


def short_reason(exc: BaseException, caught_warnings=()) -> str:
    """One line for the table: the exception's first line, or SDPA's 'why not' warnings when it has no kernel."""
    msg = (str(exc).strip().splitlines() or [""])[0]
    why = _sdpa_why(caught_warnings)
    if why and ("No available kernel" in msg or "No viable backend" in msg):
        msg = why
    elif isinstance(exc, torch.cuda.OutOfMemoryError):
        msg = "out of memory"
    else:
        msg = f"{type(exc).__name__}: {msg}"
    return msg if len(msg) <= 200 else msg[:197] + "..."


def probe(backend: Backend, shape: Shape, inputs, mode: str, dout=None):
    """Run the step once. Returns (result or None, reason or None)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with backend.context():
                return make_step(backend, shape, inputs, mode, dout)(), None
        except Exception as e:  # noqa: BLE001
            return None, short_reason(e, caught)


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


def peak_extra_mib(step: Callable, context) -> float:
    """GPU memory one call needs above what is already allocated (its outputs, workspaces and, for fwd+bwd, the
    tensors saved for backward), from the caching allocator's peak counter."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with context():
        res = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del res
    return peak / 2**20


def time_events(step: Callable, n: int) -> list[float]:
    """n calls back to back, each bracketed alone by CUDA events; one synchronize at the end. Returns ms."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        s.record()
        step()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def time_wall(step: Callable, n: int) -> list[float]:
    """CPU: n calls, each timed alone with time.perf_counter. Returns ms."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def capture_graph(step: Callable, n: int, context) -> torch.cuda.CUDAGraph:
    """Capture n calls into one CUDA graph (warm-up on a side stream first, as the torch docs show)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with context(), torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with context(), torch.cuda.graph(graph):
        for _ in range(n):
            step()
    torch.cuda.synchronize()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, n: int, replays: int = 1) -> float:
    """Per-call time (ms) inside a replay of the captured n-call graph: one warm replay, then the timed ones."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------------------
# Running one shape
# ---------------------------------------------------------------------------------------------------------------


def max_abs_err(a, b) -> float:
    if isinstance(a, (tuple, list)):
        return max(max_abs_err(x, y) for x, y in zip(a, b))
    return (a.float() - b.float()).abs().max().item()


def grad_tolerance(ref, tol) -> float:
    """Gradients are not O(1): scale the tolerance with the largest reference gradient."""
    return tol * max(1.0, max(g.float().abs().max().item() for g in ref))


def kernel_name(shape: Shape, device: str) -> str:
    """flashcore.fwd_kernel_name for this shape (honours FLASHCORE_FORCE_KERNEL), or n/a."""
    if flashcore_status(device):
        return "n/a"
    inputs = make_inputs(shape, device, False)
    try:
        q, k, v = inputs
        return str(flashcore.fwd_kernel_name(q, k, v, shape.causal))
    except Exception as e:  # noqa: BLE001
        return f"n/a ({short_reason(e)})"


def run_mode(shape: Shape, mode: str, backends: list[Backend], args, device: str) -> dict:
    """Probe + correctness, then the interleaved rounds for one (shape, mode). Returns the raw record."""
    inputs = make_inputs(shape, device, requires_grad=(mode == FWDBWD))
    dout = None
    if mode == FWDBWD:
        gen = torch.Generator(device=device).manual_seed(1)
        dout = torch.randn(shape.B, shape.Hq, shape.Sq, shape.D, device=device, dtype=shape.torch_dtype,
                           generator=gen)
    rec = {"mode": mode, "flops": flops(shape, mode), "backends": {}}
    tol = TOLERANCE[shape.torch_dtype]

    # 1. probe every backend once; the first output of SDPA default is the reference
    results, live = {}, []
    own_inputs = {be.name: be.prepare(*inputs) if be.prepare and not be.unavailable else inputs for be in backends}
    for be in backends:
        r = {"status": "ok"}
        if be.unavailable:
            r.update(status="n/a", reason=be.unavailable)
        else:
            res, reason = probe(be, shape, own_inputs[be.name], mode, dout)
            if reason:
                r.update(status="n/a", reason=reason)
            else:
                results[be.name] = res
                live.append(be)
                if be.name.startswith("flashcore") and hasattr(flashcore, "last_kernel"):  # the kernels that ran
                    r["kernel"] = flashcore.last_kernel("fwd") + (
                        f" / bwd {flashcore.last_kernel('bwd')}" if mode == FWDBWD else "")
        rec["backends"][be.name] = r
    ref_name = "sdpa" if "sdpa" in results else next((n for n in results if n != "flashcore"), None)
    rec["reference"] = ref_name
    if ref_name is not None:
        ref = results[ref_name]
        for name, res in results.items():
            if name == ref_name:
                continue
            err = max_abs_err(res, ref)
            limit = tol if mode == FWD else grad_tolerance(ref, tol)
            rec["backends"][name]["max_abs_err"] = err
            rec["backends"][name]["tolerance"] = limit
            if not (err <= limit):  # also catches NaN
                rec["backends"][name]["wrong"] = True
    del results

    # 2. per-backend steps, peak memory and (GPU) graphs
    cuda = device == "cuda"
    steps = {be.name: make_step(be, shape, own_inputs[be.name], mode, dout) for be in live}
    if cuda:
        for be in live:
            rec["backends"][be.name]["peak_mib"] = peak_extra_mib(steps[be.name], be.context)
    n_iters = {}
    for be in live:  # calls per batch: --iters, fewer for long calls (--batch-ms)
        with be.context():
            t = time_wall(lambda: (steps[be.name](), torch.cuda.synchronize() if cuda else None), 1)[0]
        n = args.iters
        if args.batch_ms > 0:
            n = max(args.min_iters, min(n, int(args.batch_ms / max(t, 1e-3))))
        n_iters[be.name] = n
        rec["backends"][be.name]["iters"] = n
    graphs = {}
    if cuda and args.graph:
        for be in live:
            try:
                graphs[be.name] = capture_graph(steps[be.name], n_iters[be.name], be.context)
            except Exception as e:  # noqa: BLE001
                rec["backends"][be.name]["graph_reason"] = "graph capture failed: " + short_reason(e)
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()

    # 3. rounds: backends interleaved round-robin, rotated each round so none always runs first
    raw = {be.name: {"calls": [], "round_medians": [], "graph_round": [], "round_clocks": []} for be in live}
    clock_log = getattr(args, "clock_log", None)
    for rnd in range(args.rounds):
        order = live[rnd % len(live):] + live[:rnd % len(live)] if live else []
        for be in order:
            step, n, r = steps[be.name], n_iters[be.name], raw[be.name]
            try:
                with be.context():
                    for _ in range(args.warmup):
                        step()
                    t_round = time.perf_counter()
                    if cuda:
                        torch.cuda.synchronize()
                        calls = time_events(step, n)
                    else:
                        calls = time_wall(step, n)
                if clock_log is not None:
                    r["round_clocks"].append(clock_log.window(t_round, time.perf_counter()))
                r["calls"].extend(calls)
                r["round_medians"].append(statistics.median(calls))
                if be.name in graphs:
                    r["graph_round"].append(time_graph(graphs[be.name], n))
            except Exception as e:  # noqa: BLE001
                rec["backends"][be.name].update(status="n/a", reason="failed while timing: " + short_reason(e))
                graphs.pop(be.name, None)
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
    graphs.clear()

    # 4. statistics
    for be in live:
        r, out = raw[be.name], rec["backends"][be.name]
        if out["status"] != "ok" or not r["calls"]:
            continue
        out.update(raw_calls_ms=r["calls"], round_medians_ms=r["round_medians"], graph_round_ms=r["graph_round"])
        if r["round_clocks"]:  # --log-clocks: the GPU's SM clock and power while each round's calls ran
            out["round_clocks"] = r["round_clocks"]
        out["p50_ms"] = statistics.median(r["calls"])
        out["median_of_rounds_ms"] = statistics.median(r["round_medians"])
        out["rounds_min_ms"], out["rounds_max_ms"] = min(r["round_medians"]), max(r["round_medians"])
        out["tflops"] = rec["flops"] / (out["p50_ms"] * 1e-3) / 1e12
        if r["graph_round"]:
            out["graph_ms"] = statistics.median(r["graph_round"])
            out["graph_min_ms"], out["graph_max_ms"] = min(r["graph_round"]), max(r["graph_round"])
            out["graph_tflops"] = rec["flops"] / (out["graph_ms"] * 1e-3) / 1e12
        if shape.Sq <= 16:  # decode-like: report the memory rate
            out["io_tb_s"] = shape.io_bytes() / (out["p50_ms"] * 1e-3) / 1e12
            if "graph_ms" in out:
                out["graph_io_tb_s"] = shape.io_bytes() / (out["graph_ms"] * 1e-3) / 1e12
    add_ratios(rec)
    return rec


def add_ratios(rec: dict) -> None:
    """speedup vs SDPA default = t(sdpa) / t(backend), > 1 means the backend is faster. Also per-round ratios
    (same round, interleaved: the honest noise band of the ratio) and, for flashcore, t(flashcore)/t(sdpa)."""
    base = rec["backends"].get("sdpa", {})
    if "p50_ms" not in base:
        return
    for name, r in rec["backends"].items():
        if "p50_ms" not in r:
            continue
        r["speedup_vs_sdpa"] = base["p50_ms"] / r["p50_ms"]
        pairs = list(zip(base["round_medians_ms"], r["round_medians_ms"]))
        if pairs:
            per_round = [b / x for b, x in pairs]
            r["speedup_rounds_min"], r["speedup_rounds_max"] = min(per_round), max(per_round)
        if "graph_ms" in r and "graph_ms" in base:
            r["graph_speedup_vs_sdpa"] = base["graph_ms"] / r["graph_ms"]
        r["time_ratio_vs_sdpa"] = r["p50_ms"] / base["p50_ms"]


def add_backward(shape_rec: dict, shape: Shape) -> None:
    """Backward-only time = t(fwd+bwd) - t(fwd) (p50s), TFLOP/s with 2.5x the forward FLOPs."""
    modes = {m["mode"]: m for m in shape_rec["modes"]}
    if FWD not in modes or FWDBWD not in modes:
        return
    bwd_flops = flops(shape, FWD) * BWD_FLOP_FACTOR
    for name, r in modes[FWDBWD]["backends"].items():
        f = modes[FWD]["backends"].get(name, {})
        if "p50_ms" in r and "p50_ms" in f:
            t = r["p50_ms"] - f["p50_ms"]
            r["bwd_ms"] = t
            r["bwd_tflops"] = bwd_flops / (t * 1e-3) / 1e12 if t > 0 else None
            if "graph_ms" in r and "graph_ms" in f and r["graph_ms"] > f["graph_ms"]:
                r["graph_bwd_tflops"] = bwd_flops / ((r["graph_ms"] - f["graph_ms"]) * 1e-3) / 1e12


def run_shape(shape: Shape, backends: list[Backend], args, device: str) -> dict:
    rec = {"shape": dataclasses.asdict(shape), "label": shape.label(), "modes": []}
    rec["flashcore_kernel"] = kernel_name(shape, device)
    for mode in args.modes:
        if mode == FWDBWD and shape.fwd_only:
            continue
        try:
            rec["modes"].append(run_mode(shape, mode, backends, args, device))
        except Exception as e:  # noqa: BLE001  (e.g. out of memory making the inputs)
            rec["modes"].append({"mode": mode, "error": short_reason(e), "backends": {}})
            if args.verbose:
                traceback.print_exc()
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
    add_backward(rec, shape)
    return rec


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------

COLUMNS = [  # (header, width)
    ("shape", 19), ("dtype", 5), ("causal", 6), ("mode", 6), ("backend", 14), ("p50 ms", 9), ("spread", 13),
    ("graph us", 9), ("TFLOP/s", 7), ("speedup", 7), ("per-round", 11), ("g.speedup", 9), ("bwd TF/s", 8),
    ("notes", 0),
]


def _fmt(x, spec, na="-"):
    return na if x is None else format(x, spec)


def _num(x, na="-"):
    """Three significant digits, no exponent for the usual ranges: 612, 61.2, 6.12, 0.612, 0.0612."""
    if x is None:
        return na
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{max(0, 2 - int(math.floor(math.log10(abs(x)))))}f}" if x else "0"


def table_rows(shape_rec: dict) -> list[list[str]]:
    s = shape_rec["shape"]
    rows = []
    for m in shape_rec["modes"]:
        if "error" in m:
            rows.append([shape_rec["label"], s["dtype"], "yes" if s["causal"] else "no", m["mode"], "(all)"]
                        + ["-"] * 8 + ["failed: " + m["error"]])
            continue
        for name, r in m["backends"].items():
            notes = []
            if r.get("wrong"):
                notes.append(f"WRONG (max err {r['max_abs_err']:.3g} > {r['tolerance']:.3g})")
            if r["status"] != "ok":
                notes.append("n/a: " + r.get("reason", ""))
            elif "graph_reason" in r:
                notes.append("graph n/a: " + r["graph_reason"])
            if name == "flashcore" and "time_ratio_vs_sdpa" in r:
                notes.append(f"fc/sdpa time {r['time_ratio_vs_sdpa']:.2f}")
            if "peak_mib" in r:
                notes.append(f"peak {r['peak_mib']:.0f} MiB")
            if "io_tb_s" in r:
                notes.append(f"{r.get('graph_io_tb_s', r['io_tb_s']):.2f} TB/s")
            if r.get("round_clocks"):
                notes.append("SM MHz by round " + "/".join(f"{c['sm_mhz_median']:.0f}" if c else "?"
                                                           for c in r["round_clocks"]))
            spread = "-"
            if "p50_ms" in r and r["median_of_rounds_ms"] > 0:
                med = r["median_of_rounds_ms"]
                spread = f"{100 * (r['rounds_min_ms'] / med - 1):+.1f}/{100 * (r['rounds_max_ms'] / med - 1):+.1f}%"
            per_round = "-"
            if "speedup_rounds_min" in r and name != "sdpa":
                per_round = f"{r['speedup_rounds_min']:.2f}..{r['speedup_rounds_max']:.2f}"
            rows.append([
                shape_rec["label"], s["dtype"], "yes" if s["causal"] else "no", m["mode"],
                name + (" *" if r.get("wrong") else ""),
                _num(r.get("p50_ms")),
                spread,
                _num(r["graph_ms"] * 1e3 if "graph_ms" in r else None),
                _num(r.get("tflops")),
                _fmt(r.get("speedup_vs_sdpa"), ".2f"),
                per_round,
                _fmt(r.get("graph_speedup_vs_sdpa"), ".2f"),
                _num(r.get("bwd_tflops")),
                "; ".join(notes),
            ])
    return rows


def format_rows(rows: list[list[str]], header: bool) -> str:
    lines = []
    if header:
        lines.append("  ".join(h.ljust(w) if w else h for h, w in COLUMNS))
        lines.append("  ".join(("-" * w) if w else "-----" for _, w in COLUMNS))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if w else c for c, (_, w) in zip(row, COLUMNS)).rstrip())
    return "\n".join(lines)


def shape_summary(shape_rec: dict) -> str:
    """The per-shape progress line: kernel, correctness and flashcore vs SDPA per mode."""
    s = shape_rec["shape"]
    parts = [f"{shape_rec['label']} {s['dtype']} {'causal' if s['causal'] else 'non-causal'}",
             f"flashcore kernel: {shape_rec['flashcore_kernel']}"]
    for m in shape_rec["modes"]:
        fc = m["backends"].get("flashcore", {})
        if "kernel" in fc:
            parts.append(f"{m['mode']} ran {fc['kernel']}")
        if "max_abs_err" in fc:
            parts.append(f"{m['mode']} max|fc-{m['reference']}| {fc['max_abs_err']:.2e}"
                         + (" WRONG" if fc.get("wrong") else ""))
        if "speedup_vs_sdpa" in fc:
            parts.append(f"{m['mode']} speedup {fc['speedup_vs_sdpa']:.2f}")
    return " | ".join(parts)


def report(records: list[dict], device: str) -> str:
    rows = [row for rec in records for row in table_rows(rec)]
    text = format_rows(rows, header=True)
    if device == "cpu":
        lines = ["", "CPU: flashcore time / SDPA time (p50; target <= 1.5, i.e. 'within 1.5x')"]
        worst = 0.0
        for rec in records:
            for m in rec["modes"]:
                r = m["backends"].get("flashcore", {})
                if "time_ratio_vs_sdpa" in r:
                    t = r["time_ratio_vs_sdpa"]
                    worst = max(worst, t)
                    lines.append(f"  {rec['label']:<16} {rec['shape']['dtype']:<5} "
                                 f"{'causal' if rec['shape']['causal'] else 'full':<7} {m['mode']:<7}"
                                 f"{t:6.2f}  {'ok' if t <= 1.5 else 'SLOWER than 1.5x'}")
        if worst:
            lines.append(f"  worst {worst:.2f} ({'all within 1.5x' if worst <= 1.5 else 'NOT all within 1.5x'})")
        text += "\n".join(lines)
    return text


def plot(records: list[dict], path: str) -> str:
    """TFLOP/s vs sequence length per backend, one panel per (dtype, heads, D, causal, mode) that has >= 2 lengths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"plot skipped: matplotlib not available ({type(e).__name__})"
    groups: dict[tuple, dict[str, list]] = {}
    for rec in records:
        s = rec["shape"]
        if s["Sq"] != s["Sk"]:
            continue
        for m in rec["modes"]:
            key = (s["dtype"], s["Hq"], s["Hkv"], s["D"], s["causal"], m["mode"])
            for name, r in m["backends"].items():
                if r.get("tflops"):
                    groups.setdefault(key, {}).setdefault(name, []).append((s["Sq"], r["tflops"], r.get("wrong")))
    groups = {k: v for k, v in groups.items() if len({p[0] for pts in v.values() for p in pts}) >= 2}
    if not groups:
        return "plot skipped: no shape group with >= 2 sequence lengths (try --shapes sweep)"
    n = len(groups)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), squeeze=False)
    for ax, (key, series) in zip(axes.flat, sorted(groups.items(), key=lambda kv: str(kv[0]))):
        dtype, hq, hkv, d, causal, mode = key
        for name, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                    linewidth=2.2 if name == "flashcore" else 1.2)
            for p in pts:
                if p[2]:
                    ax.annotate("WRONG", (p[0], p[1]), color="red", fontsize=7)
        heads = f"H={hq}" if hq == hkv else f"Hq/Hkv={hq}/{hkv}"
        ax.set_title(f"{mode} {dtype} {heads} D={d} {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s" + (" (fwd+bwd, 3.5x fwd FLOPs)" if mode == FWDBWD else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def metadata(args, device: str, backends: list[str]) -> dict:
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "flashcore_version": getattr(flashcore, "__version__", None),
        "flashcore_import_error": FLASHCORE_IMPORT_ERROR,
        "flashcore_unavailable": flashcore_status(device),
        "FLASHCORE_FORCE_KERNEL": os.environ.get("FLASHCORE_FORCE_KERNEL"),
        "backends": backends,
        "modes": args.modes,
        "rounds": args.rounds,
        "iters": args.iters,
        "warmup": args.warmup,
        "batch_ms": args.batch_ms,
        "graph": bool(args.graph and device == "cuda"),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        meta.update(gpu=torch.cuda.get_device_name(0), sm_count=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", gpu_memory_gb=round(p.total_memory / 2**30, 1))
    return meta


def header(meta: dict) -> str:
    dev = meta.get("gpu", f"CPU ({meta['cpu']}, {meta['threads']} threads)")
    lines = [
        f"flashcore benchmark  {meta['date']}",
        f"device: {dev}  torch {meta['torch']}  CUDA {meta['cuda']}  cuDNN {meta['cudnn']}  python {meta['python']}",
        f"flashcore: {meta['flashcore_version'] or '-'}"
        + (f"  ** NOT BENCHMARKED: {meta['flashcore_unavailable']} -- SDPA only **" if meta["flashcore_unavailable"]
           else ""),
        f"FLASHCORE_FORCE_KERNEL={meta['FLASHCORE_FORCE_KERNEL'] or '(unset)'}",
        f"backends: {', '.join(meta['backends'])}  ('sdpa' = SDPA's default dispatch; sdpa-X forces one backend)",
        f"method: {meta['rounds']} rounds, backends interleaved round-robin; per round {meta['warmup']} warm-up then"
        f" up to {meta['iters']} calls each timed alone"
        + (" (CUDA events)" if meta["device"] == "cuda" else " (perf_counter wall clock)")
        + (", plus per-call time in a replayed CUDA graph of the same calls" if meta["graph"] else ""),
        "columns: p50 ms = median of all calls; spread = min/max of the round medians vs their median;"
        " TFLOP/s from p50 (4*B*Hq*pairs*D, causal = visible pairs; fwdbwd = 3.5x fwd);",
        "         speedup = t(sdpa default) / t(backend), > 1 means FASTER than SDPA default; per-round = min..max of"
        " that ratio within single rounds (noise band); g.speedup = same from graph times;",
        "         bwd TF/s = 2.5x fwd FLOPs / (t(fwdbwd) - t(fwd)); WRONG = max|out - sdpa default| above tolerance",
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated shape lists: {', '.join(SHAPE_LISTS)} (default: anchors on GPU, cpu on CPU)")
    p.add_argument("--shape", action="append", type=parse_shape, default=[],
                   help="custom shape B,Hq,Hkv,Sq,Sk,D,dtype,causal[,softcap=C][,window=L:R] (repeatable), "
                        "e.g. 8,32,8,1,8192,128,fp16,0 or 4,16,8192,128,bf16,0,softcap=30")
    p.add_argument("--modes", default="fwd,fwdbwd", help="fwd, fwdbwd or both (default fwd,fwdbwd)")
    p.add_argument("--backends", default=None,
                   help="comma-separated: flashcore, sdpa (default dispatch), sdpa-flash, sdpa-cudnn, "
                        "sdpa-efficient, sdpa-math, fa4, flashcore@NAME=VALUE[+NAME=VALUE] (flashcore with switches "
                        "set around its calls, for A/B) (default: all but math on GPU; flashcore,sdpa on CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (GPU 5, CPU 3)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per backend per round (GPU 30, CPU 5)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per backend per round (GPU 5, CPU 1)")
    p.add_argument("--batch-ms", type=float, default=None,
                   help="cap on the time of one batch of calls: long calls get fewer iterations (at least "
                        "--min-iters); 0 = always --iters (GPU default 400, CPU 300)")
    p.add_argument("--min-iters", type=int, default=None, help="floor for --batch-ms (GPU 10, CPU 2)")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph timing")
    p.add_argument("--log-clocks", action="store_true",
                   help="GPU: sample the SM clock and power (NVML, benchmarks/gpu_clocks.py) while each round's "
                   "calls run; per-round medians go into the JSON and the notes column")
    p.add_argument("--json", default=None, help="raw results (default benchmarks/results/<timestamp>.json)")
    p.add_argument("--plot", default=None,
                   help="PNG of TFLOP/s vs sequence length (default: next to the JSON when there is a sweep)")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch.set_num_threads (default: torch's)")
    p.add_argument("--list", action="store_true", help="print the shape lists and exit")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="print two results side by side (ratio per row, changes beyond the measured spread "
                        "marked) and exit; --backends filters the rows")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks for failures")
    args = p.parse_args(argv)
    args.modes = [m.strip().replace("+", "").replace("-", "") for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in (FWD, FWDBWD):
            p.error(f"--modes: unknown mode {m!r} (fwd, fwdbwd)")
    return p, args


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    if args.compare:
        print(compare(*args.compare, backends=args.backends.split(",") if args.backends else None))
        return 0
    if args.list:
        for name, shapes in SHAPE_LISTS.items():
            print(f"{name}:")
            for s in shapes:
                print(f"  {s.label():<20} {s.dtype} {'causal' if s.causal else 'non-causal'}"
                      + ("  (fwd only)" if s.fwd_only else ""))
        return 0

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = device == "cuda"
    args.rounds = args.rounds or (5 if gpu else 3)
    args.iters = args.iters or (30 if gpu else 5)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    args.batch_ms = args.batch_ms if args.batch_ms is not None else (400.0 if gpu else 300.0)
    args.min_iters = args.min_iters or (10 if gpu else 2)
    args.graph = args.graph and gpu
    args.clock_log = None
    if args.log_clocks and gpu:
        try:
            from gpu_clocks import ClockLog

            args.clock_log = ClockLog(torch.cuda.current_device())
        except Exception as e:  # noqa: BLE001  (no NVML library, a driver without the queries)
            print(f"note: --log-clocks unavailable: {short_reason(e)}", flush=True)

    shape_lists = args.shapes.split(",") if args.shapes else ([] if args.shape else ["anchors" if gpu else "cpu"])
    shapes: list[Shape] = []
    for name in shape_lists:
        name = name.strip()
        if name not in SHAPE_LISTS:
            parser.error(f"--shapes: unknown list {name!r}; known: {', '.join(SHAPE_LISTS)}")
        shapes += SHAPE_LISTS[name]
    shapes += args.shape
    shapes = list(dict.fromkeys(shapes))  # drop duplicates, keep order

    registry = backend_registry(device)
    names = args.backends.split(",") if args.backends else DEFAULT_BACKENDS[device]
    names = [n.strip() for n in names if n.strip()]
    for n in names:
        if n.startswith(("flashcore@", "flashcore-deterministic@")):
            registry[n] = switched_flashcore(registry[n.split("@", 1)[0]], n)
        if n not in registry:
            parser.error(f"--backends: unknown backend {n!r}; known: {', '.join(registry)}")
    if "sdpa" not in names:
        print("note: 'sdpa' (SDPA default) not in --backends: no speedup column", flush=True)
    backends = [registry[n] for n in names]

    meta = metadata(args, device, names)
    print(header(meta), flush=True)
    print(f"{len(shapes)} shapes from {', '.join(shape_lists + (['--shape'] if args.shape else []))}; "
          f"modes {','.join(args.modes)}", flush=True)
    print(flush=True)

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = args.json or os.path.join(HERE, "results", f"{stamp}.json")
    records: list[dict] = []
    t_start = time.perf_counter()
    for i, shape in enumerate(shapes, 1):
        t0 = time.perf_counter()
        rec = run_shape(shape, backends, args, device)
        rec["seconds"] = time.perf_counter() - t0
        records.append(rec)
        print(f"[{i}/{len(shapes)}] {shape_summary(rec)} | {rec['seconds']:.1f}s", flush=True)
        print(format_rows(table_rows(rec), header=(i == 1)), flush=True)
        save_json(json_path, meta, records, complete=False)
    meta["total_seconds"] = time.perf_counter() - t_start

    print("\n" + "=" * 40 + " summary " + "=" * 40, flush=True)
    print(header(meta))
    print(report(records, device), flush=True)
    save_json(json_path, meta, records, complete=True)
    print(f"\nJSON written to {json_path}")
    plot_path = args.plot or os.path.splitext(json_path)[0] + ".png"
    msg = plot(records, plot_path)
    if args.plot or not msg.startswith("plot skipped: no shape group"):
        print(msg)
    print(f"total {meta['total_seconds']:.1f}s", flush=True)
    if args.clock_log is not None:
        args.clock_log.close()
    return 0


def compare(path_a: str, path_b: str, backends: Optional[list[str]] = None) -> str:
    """Two JSON results side by side: per (shape, mode, backend) in both, the p50 times (backward-only time for
    fwdbwd rows that have it), B's speed relative to A (t_A / t_B, > 1: B faster), and '*' where that change is
    larger than the rounds' spread measured in either run (their min..max of the round medians)."""
    runs = []
    for path in (path_a, path_b):
        with open(path) as f:
            runs.append(json.load(f))

    def rows_of(doc):
        out = {}
        for rec in doc["results"]:
            s = rec["shape"]
            for m in rec.get("modes", []):
                for name, r in m.get("backends", {}).items():
                    if "p50_ms" not in r or (backends and name not in backends):
                        continue
                    spread = max(r["median_of_rounds_ms"] / r["rounds_min_ms"] - 1,
                                 r["rounds_max_ms"] / r["median_of_rounds_ms"] - 1)
                    t, what = (r["bwd_ms"], "bwd") if r.get("bwd_ms") else (r["p50_ms"], m["mode"])
                    key = (rec["label"], s["dtype"], "causal" if s["causal"] else "full", what, name)
                    out[key] = (t, spread, r.get("bwd_tflops") if what == "bwd" else r.get("tflops"))
        return out

    a, b = rows_of(runs[0]), rows_of(runs[1])
    lines = [f"A: {path_a} ({runs[0]['meta'].get('gpu', runs[0]['meta'].get('device'))}, "
             f"{runs[0]['meta'].get('date')})",
             f"B: {path_b} ({runs[1]['meta'].get('gpu', runs[1]['meta'].get('device'))}, "
             f"{runs[1]['meta'].get('date')})",
             "speed B/A = t(A) / t(B): > 1 means B is faster; * = change beyond the larger round spread",
             f"{'shape':<28} {'dtype':<5} {'mask':<6} {'mode':<6} {'backend':<12} {'A ms':>9} {'B ms':>9} "
             f"{'A TF/s':>7} {'B TF/s':>7} {'B/A':>6} {'spread':>7}"]
    for key in a:
        if key not in b:
            continue
        (ta, sa, fa), (tb, sb, fb) = a[key], b[key]
        ratio, spread = ta / tb, max(sa, sb)
        mark = "*" if abs(ratio - 1) > spread else ""
        lines.append(f"{key[0]:<28} {key[1]:<5} {key[2]:<6} {key[3]:<6} {key[4]:<12} {ta:9.4f} {tb:9.4f} "
                     f"{_num(fa):>7} {_num(fb):>7} {ratio:6.3f} {100 * spread:6.1f}% {mark}")
    missing = [k for k in a if k not in b] + [k for k in b if k not in a]
    if missing:
        lines.append(f"({len(missing)} rows in only one of the runs)")
    return "\n".join(lines)


def save_json(path: str, meta: dict, records: list[dict], complete: bool) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "complete": complete, "results": records}, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
