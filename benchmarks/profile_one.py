"""One call of one backend on one shape, bracketed by cudaProfilerStart/Stop, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --set full -o fc_bwd \\
        python benchmarks/profile_one.py flashcore --shape 4,16,16,8192,8192,128,fp16,0 --mode fwdbwd
    ncu --clock-control none --profile-from-start off --section SourceCounters --section WarpStateStats -o small \\
        python benchmarks/profile_one.py flashcore --shape 1,8,8,512,512,64,fp16,0 --mode fwd

Backends and shapes are bench.py's (the same inputs, the same calls), so a profile describes what the benchmark
timed. Warm-up calls run first and outside the profiled range: allocator growth, cuDNN's plan building and
flashcore's one-time kernel attribute set-up are not in the report. `--clock-control none` keeps the GPU's own
clocks (the lent machines' method; see docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (bench.py next to this file: shapes, inputs, backends)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("backend", help="flashcore, sdpa, sdpa-flash, sdpa-cudnn, sdpa-efficient or sdpa-math")
    p.add_argument("--shape", type=bench.parse_shape, required=True, help="B,Hq,Hkv,Sq,Sk,D,dtype,causal")
    p.add_argument("--mode", choices=[bench.FWD, bench.FWDBWD], default=bench.FWD)
    p.add_argument("--warmup", type=int, default=3, help="unprofiled calls first (default 3)")
    p.add_argument("--calls", type=int, default=1, help="profiled calls (default 1)")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        p.error("no CUDA device: this script drives a GPU profiler")
    registry = bench.backend_registry("cuda")
    if args.backend not in registry:
        p.error(f"unknown backend {args.backend!r}; one of {', '.join(registry)}")
    backend = registry[args.backend]
    if backend.unavailable:
        p.error(f"{args.backend} cannot run here: {backend.unavailable}")
    if args.mode == bench.FWDBWD and args.shape.fwd_only:
        p.error("this shape is forward-only (one query token)")

    inputs = bench.make_inputs(args.shape, "cuda", requires_grad=args.mode == bench.FWDBWD)
    dout = torch.randn_like(inputs[0]) if args.mode == bench.FWDBWD else None
    step = bench.make_step(backend, args.shape, inputs, args.mode, dout)
    with backend.context():
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for _ in range(args.calls):
            step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    kernel = bench.kernel_name(args.shape, "cuda") if args.backend == "flashcore" else "-"
    print(f"profiled {args.calls} {args.mode} call(s) of {args.backend} on {args.shape.label()} "
          f"{args.shape.dtype} causal={args.shape.causal} (flashcore kernel family: {kernel})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
