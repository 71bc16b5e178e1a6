"""A/B of several builds of the extension in one run: each `_C.abi3.so` is swapped into `flashcore/` in turn and
`bench.py` runs in a fresh process; variants alternate over --reps rounds, so drift on a shared GPU falls on all
of them alike. The summary gives, per shape and mode, flashcore's TFLOP/s (forward, or backward for fwdbwd) and
its ratio to a reference backend measured in the same process, median over the rounds.

    python benchmarks/ab_builds.py base.so variant.so --reps 2 -- \\
        --shape 4,16,16,8192,8192,128,bf16,0 --modes fwd --backends flashcore,sdpa-cudnn --no-graph

A build may carry environment settings for its runs, `path.so@NAME=VALUE[,NAME=VALUE]`, so that switches read per
call (FLASHCORE_KEY_SPLITS, FLASHCORE_FORCE_KERNEL, ...) can be compared within one build:

    python benchmarks/ab_builds.py fc.so@FLASHCORE_KEY_SPLITS=1 fc.so --graph -- --shapes small --modes fwd

Build the variants first (a dev build of each variant tree, `strip --strip-debug` the `.so` to a new name). The
installed `.so` is restored at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INSTALLED = os.path.join(ROOT, "flashcore", "_C.abi3.so")


def metric(rec_mode: dict, backend: str, graph: bool) -> float | None:
    """TFLOP/s (backward-only for fwdbwd when bench.py ran fwd too, else fwd+bwd), or with graph the per-call
    time in a CUDA graph in microseconds."""
    r = rec_mode.get("backends", {}).get(backend) or {}
    if graph:
        return r["graph_ms"] * 1e3 if r.get("graph_ms") else None
    if rec_mode.get("mode") == "fwdbwd" and r.get("bwd_tflops"):
        return r["bwd_tflops"]
    return r.get("tflops")


def reference(rec_mode: dict, wanted: str | None) -> str:
    names = [n for n in rec_mode.get("backends", {}) if n != "flashcore"]
    if wanted:
        return wanted
    for n in ("sdpa-cudnn", "sdpa"):
        if n in names:
            return n
    return names[0] if names else "sdpa"


def main() -> int:
    argv = sys.argv[1:]
    bench_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("builds", nargs="+", help="extension files (.so) to compare, each optionally with @NAME=VALUE[,...] "
                   "environment settings for its runs; the first is the baseline")
    p.add_argument("--reps", type=int, default=2, help="rounds over all builds (default 2)")
    p.add_argument("--ref", default=None, help="reference backend for the ratio (default: sdpa-cudnn if run, "
                   "else sdpa, else the first other backend)")
    p.add_argument("--graph", action="store_true", help="compare per-call time in a CUDA graph (microseconds, "
                   "lower is better) instead of TFLOP/s; bench.py must not get --no-graph")
    p.add_argument("--keep", default=None, metavar="DIR", help="write the raw JSON of every run into DIR")
    p.add_argument("--pytest", default=None, metavar="ARGS",
                   help="before the first round, run `pytest ARGS` with each build installed (e.g. "
                   "\"tests/test_cuda_forward.py "
                   "-q -x -k sm90\"); a build whose tests fail is reported and left out of the timing")
    args = p.parse_args(argv)
    if len(set(args.builds)) != len(args.builds):
        p.error("a build is listed twice")
    envs = {}
    for b in args.builds:
        path, _, settings = b.partition("@")
        if not os.path.isfile(path):
            p.error(f"no such build: {path}")
        env = dict(os.environ)
        for item in filter(None, settings.split(",")):
            name, eq, value = item.partition("=")
            if not eq or not name:
                p.error(f"{b}: environment settings are NAME=VALUE, comma-separated")
            env[name] = value
        envs[b] = (path, env)

    out_dir = args.keep or tempfile.mkdtemp(prefix="flashcore_ab_")
    os.makedirs(out_dir, exist_ok=True)
    backup = os.path.join(tempfile.mkdtemp(prefix="flashcore_ab_backup_"), "installed.so")
    if os.path.exists(INSTALLED):
        shutil.copy2(INSTALLED, backup)
    runs: dict[str, list[dict]] = {b: [] for b in args.builds}
    failed = []
    try:
        if args.pytest:
            for build in args.builds:
                shutil.copy2(envs[build][0], INSTALLED)
                print(f"== pytest {args.pytest} with {build}", flush=True)
                rc = subprocess.run([sys.executable, "-m", "pytest", *shlex.split(args.pytest)], cwd=ROOT,
                                    env=envs[build][1]).returncode
                if rc != 0:
                    print(f"!! tests failed with {build} (exit {rc}): left out of the timing", flush=True)
                    failed.append(build)
                    runs.pop(build)
        for rep in range(args.reps):
            for i, build in enumerate(args.builds):
                if build in failed:
                    continue
                shutil.copy2(envs[build][0], INSTALLED)
                path = os.path.join(out_dir, f"v{i}_r{rep}.json")
                print(f"== {build} (round {rep + 1}/{args.reps})", flush=True)
                cmd = [sys.executable, os.path.join(HERE, "bench.py"), *bench_args, "--json", path]
                subprocess.run(cmd, check=True, cwd=ROOT, env=envs[build][1])
                with open(path) as f:
                    runs[build].append(json.load(f))
    finally:
        if os.path.exists(backup):
            shutil.copy2(backup, INSTALLED)

    # rows[(label, dtype, causal, mode)][build] = [(tflops, ratio), ...]
    rows: dict[tuple, dict[str, list[tuple]]] = {}
    for build, docs in runs.items():
        for doc in docs:
            for rec in doc["results"]:
                s = rec["shape"]
                for m in rec["modes"]:
                    ref = reference(m, args.ref)
                    fc, other = metric(m, "flashcore", args.graph), metric(m, ref, args.graph)
                    key = (rec["label"], s["dtype"], "causal" if s["causal"] else "full", m["mode"], ref)
                    ratio = (other / fc if args.graph else fc / other) if fc and other else None
                    rows.setdefault(key, {}).setdefault(build, []).append((fc, ratio))

    def med(vals):
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    what = ("per-call time in a CUDA graph (us) and speed ratio (reference time / flashcore time)" if args.graph
            else "TFLOP/s (backward-only for fwdbwd when fwd ran too, else fwd+bwd) and ratio to the reference")
    print(f"\nflashcore {what}, median over rounds")
    timed = [b for b in args.builds if b not in failed]
    names = [os.path.basename(b) for b in timed]
    width = max(24, max(len(n) for n in names) + 2)
    print(f"{'shape':<34} {'mode':<7} " + " ".join(f"{n:>{width}}" for n in names))
    for key, per in rows.items():
        label, dtype, causal, mode, ref = key
        cells = []
        for b in timed:
            vals = per.get(b, [])
            t, r = med([v[0] for v in vals]), med([v[1] for v in vals])
            cells.append(f"{t:8.2f} ({r:.3f} {ref[-5:]})" if t and r else f"{t:8.2f}" if t else f"{'-':>24}")
        print(f"{label + ' ' + dtype + ' ' + causal:<34} {mode:<7} " + " ".join(f"{c:>{width}}" for c in cells))
    print(f"\nraw JSON in {out_dir}")
    if failed:
        print("tests failed with: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
