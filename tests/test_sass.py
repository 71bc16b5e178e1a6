"""Instruction-order checks on the built Hopper forward kernels (SASS, from `cuobjdump -sass` of the extension).

ptxas schedules `wgmma.wait_group` (SASS `WARPGROUP.DEPBAR.LE gsb0, N`) freely within a basic block. Written after
the softmax, the wait for the previous tile's P V was hoisted above it in every sm90 forward kernel, so the softmax
waited for the GEMM it is meant to overlap (3-7 % on the long forwards; docs/PERFORMANCE.md, ablation table).
The consumer now stores the row sums (fed by every exp2) to a scratch slot just before that wait, and ptxas keeps
the wait behind the store (ptx::store_before_wait). These tests keep it that way: every wait that retires a P V
group must come after exp2s issued since the S it overlaps retired.

Needs no GPU: `cuobjdump` (the CUDA toolkit's, or the `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels that
the test extra installs) and an extension built with sm_90a code. Without the tool or without CUDA kernels the
tests skip with that reason (CI allows neither); a build whose SASS yields no sm90 forward kernel fails.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

import pytest

import flashcore


def _cuobjdump() -> str | None:
    """cuobjdump from PATH, the CUDA toolkit, or the nvidia-cuda-cuobjdump wheel (nvidia/cu13/bin)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    try:
        import nvidia  # the namespace package of NVIDIA's PyPI wheels

        roots += [os.path.join(p, sub) for p in nvidia.__path__ for sub in ("cu13", "cuda_cuobjdump")]
    except ImportError:
        pass
    for root in roots:
        if root and os.path.isfile(os.path.join(root, "bin", "cuobjdump")):
            return os.path.join(root, "bin", "cuobjdump")
    return None


def _extension_path() -> str | None:
    """The extension flashcore loaded (not whichever `_C*.so` a directory listing finds first)."""
    ext = getattr(flashcore, "_C", None)
    return getattr(ext, "__file__", None)


@functools.lru_cache(maxsize=1)
def _sm90_forward_sass() -> dict[str, list[str]]:
    """Instruction mnemonics (with operands) of every sm90 forward kernel in the extension, by mangled name."""
    tool, ext = _cuobjdump(), _extension_path()
    if tool is None:
        pytest.skip("cuobjdump not found: install the test extra (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")
    if not flashcore._has_cuda_kernels():
        pytest.skip("flashcore was built without CUDA kernels")
    # cuobjdump disassembles through nvdisasm, found on PATH: the one beside it first (the wheels install both).
    env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
    res = subprocess.run([tool, "-sass", "-arch", "sm_90a", ext], capture_output=True, text=True, env=env)
    assert res.returncode == 0, f"cuobjdump failed on {os.path.basename(ext)}: {res.stderr.strip()[:300]}"
    kernels: dict[str, list[str]] = {}
    current = None
    for line in res.stdout.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = m.group(1) if "fwd_sm90_kernel" in m.group(1) else None
            if current:
                kernels[current] = []
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m and current:
            kernels[current].append(m.group(1).strip())
    assert kernels, "no sm90 forward kernel in the extension's sm_90a SASS (built without the 90a target?)"
    assert all(len(ins) > 100 for ins in kernels.values()), "a kernel's SASS did not parse"
    return kernels


def _pv_waits_without_softmax(instructions: list[str]) -> int:
    """Walks the kernel's SASS in order, keeping the queue of committed wgmma groups (a group ends with the
    HGMMA that sets gsb0): S groups read both operands from shared memory, P V groups take A from registers. Counts
    the waits that retire a P V group with no exp2 issued since the last wait that retired an S group, i.e. where
    the softmax of that S waits for the P V instead of running under it."""
    queue: list[str] = []
    group_kind = None
    exp_since_s = True
    bad = 0
    for ins in instructions:
        if "HGMMA" in ins:
            operands = ins.split(None, 1)[1].split(",")
            group_kind = "pv" if re.match(r"\s*R\d+", operands[1]) else "s"
            if "gsb0" in ins:
                queue.append(group_kind)
        elif "WARPGROUP.DEPBAR.LE gsb0" in ins:
            keep = int(ins.rsplit(",", 1)[-1].strip(), 16)
            while len(queue) > keep:
                kind = queue.pop(0)
                if kind == "s":
                    exp_since_s = False
                elif not exp_since_s:
                    bad += 1
        elif "MUFU.EX2" in ins:
            exp_since_s = True
    return bad


def test_sm90_forward_softmax_not_behind_pv_wait():
    kernels = _sm90_forward_sass()
    bad = {name[:100]: n for name, ins in kernels.items() if (n := _pv_waits_without_softmax(ins))}
    assert not bad, f"{len(bad)} of {len(kernels)} sm90 forward kernels wait for P V before their softmax: {bad}"


def test_sm90_forward_kernels_overlap_wgmma():
    """No kernel has every wgmma followed by a full wait (ptxas's serialization when it cannot track the
    pipeline, C7514/C7515): the key loop keeps at least one group in flight across the softmax."""
    kernels = _sm90_forward_sass()
    serialized = [n for n, ins in kernels.items() if not any("DEPBAR.LE gsb0, 0x1" in i for i in ins)]
    assert not serialized, f"serialized wgmma in {serialized[:3]}"
