"""Build script for flashcore's C++/CUDA extension (`flashcore._C`).

One extension holds every kernel. It is built with the Python limited API (abi3), so a `_C.abi3.so` built with
Python 3.11 loads on 3.12 with the same torch.

Build knobs (environment variables), so that development builds stay small:
  FLASHCORE_CUDA        "auto" (default: build CUDA kernels when nvcc is found), "1" (require), "0" (CPU only)
  FLASHCORE_CUDA_ARCHS  semicolon list of targets, default "80;90a"; "90a" means
                        -gencode=arch=compute_90a,code=sm_90a (Hopper wgmma/setmaxnreg need the "a" target).
                        sm_86 and sm_89 GPUs run the sm_80 binary (same major version, same source: the tiles
                        fit their 99 KiB); "86" and "89" build their own copies when asked.
  FLASHCORE_HEADDIMS    CUDA head-dim tiles to instantiate, default "32;64;96;128;192;256"
  FLASHCORE_DTYPES      CUDA dtypes to instantiate, default "fp16;bf16"
  FLASHCORE_DEBUG       "1" builds with -O0 -g (host) and -lineinfo (device)
  MAX_JOBS              parallel compile jobs (ninja), read by torch's BuildExtension
"""

import glob
import os
import re

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc", "flashcore")

ALL_ARCHS = ["80", "86", "89", "90a"]
DEFAULT_ARCHS = ["80", "90a"]
ALL_HEADDIMS = ["32", "64", "96", "128", "192", "256"]
ALL_DTYPES = ["fp16", "bf16"]


def _env_list(name, default):
    raw = os.getenv(name, "")
    items = [x.strip() for x in re.split(r"[;, ]+", raw) if x.strip()] if raw else list(default)
    return items


def _want_cuda():
    mode = os.getenv("FLASHCORE_CUDA", "auto").lower()
    have = CUDA_HOME is not None and torch.version.cuda is not None
    if mode in ("0", "false", "no", "off"):
        return False
    if mode in ("1", "true", "yes", "on") and not have:
        raise RuntimeError("FLASHCORE_CUDA=1 but no CUDA toolkit (CUDA_HOME) or no CUDA build of torch was found")
    return have


def _gencode_flags(archs):
    flags = []
    for arch in archs:
        if arch not in ALL_ARCHS:
            raise RuntimeError(f"FLASHCORE_CUDA_ARCHS: unsupported target {arch!r}; choose from {ALL_ARCHS}")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    if "80" in archs:
        # PTX of the portable (mma.sync) kernels, so GPUs newer than the listed targets JIT-compile them at load.
        flags.append("-gencode=arch=compute_80,code=compute_80")
    return flags


def _instantiation_selected(path, archs, headdims, dtypes):
    # File names follow csrc/flashcore/cuda/instantiations/<pass>_<family>_hdim<D>_<dtype>[_mod].cu (see generate.py
    # there). The sm90 (wgmma) family exists only in sm_90a code, so it is built only with that target.
    name = os.path.basename(path)
    if "_sm90_" in name and "90a" not in archs:
        return False
    m = re.search(r"_hdim(\d+)_(fp16|bf16)(_mod)?\.cu$", name)
    return m is None or (m.group(1) in headdims and m.group(2) in dtypes)


def get_extensions():
    debug = os.getenv("FLASHCORE_DEBUG", "0") == "1"
    use_cuda = _want_cuda()

    # py_limited_api=True makes torch define Py_LIMITED_API (the stable ABI), so the .abi3.so loads on 3.11+.
    # -fopenmp: at::parallel_for is header-inline and expands to `#pragma omp parallel` (torch's parallel backend
    # is OpenMP); without the flag the CPU kernels would silently run on one thread. The library resolves to the
    # libgomp.so.1 that torch itself ships and has already loaded.
    cxx_flags = ["-O0" if debug else "-O3", "-std=c++17", "-fopenmp"]
    link_flags = ["-fopenmp"]
    if debug:
        cxx_flags.append("-g")
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))

    if not use_cuda:
        return [
            CppExtension(
                "flashcore._C",
                sources,
                extra_compile_args={"cxx": cxx_flags},
                extra_link_args=link_flags,
                py_limited_api=True,
            )
        ]

    archs = _env_list("FLASHCORE_CUDA_ARCHS", DEFAULT_ARCHS)
    headdims = _env_list("FLASHCORE_HEADDIMS", ALL_HEADDIMS)
    dtypes = _env_list("FLASHCORE_DTYPES", ALL_DTYPES)
    for d in headdims:
        if d not in ALL_HEADDIMS:
            raise RuntimeError(f"FLASHCORE_HEADDIMS: unsupported head-dim tile {d!r}; choose from {ALL_HEADDIMS}")
    for t in dtypes:
        if t not in ALL_DTYPES:
            raise RuntimeError(f"FLASHCORE_DTYPES: unsupported dtype {t!r}; choose from {ALL_DTYPES}")

    cuda_sources = sorted(
        glob.glob(os.path.join(CSRC, "cuda", "*.cpp"))
        + glob.glob(os.path.join(CSRC, "cuda", "*.cu"))
        + glob.glob(os.path.join(CSRC, "cuda", "sm90", "*.cpp"))  # host code of the Hopper family (TMA descriptors)
        + glob.glob(os.path.join(CSRC, "cuda", "decode", "*.cu"))  # the KV-cache kernel (sm_80+)
    )
    cuda_sources += sorted(
        p
        for p in glob.glob(os.path.join(CSRC, "cuda", "instantiations", "*.cu"))
        if _instantiation_selected(p, archs, headdims, dtypes)
    )
    nvcc_flags = [
        "-O3",
        "-std=c++17",
       
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-lineinfo",
        # Resource report per kernel (registers, spills), read by developers and docs/PERFORMANCE.md.
        "-Xptxas=-warn-spills",
    ] + _gencode_flags(archs)
    if os.getenv("FLASHCORE_PTXAS_VERBOSE", "0") == "1":
        nvcc_flags.append("-Xptxas=-v")
    nvcc_threads = os.getenv("NVCC_THREADS", "2")
    nvcc_flags.append(f"--threads={nvcc_threads}")
    cxx_flags.append("-DFLASHCORE_WITH_CUDA")
    nvcc_flags.append("-DFLASHCORE_WITH_CUDA")

    return [
        CUDAExtension(
            "flashcore._C",
            sources + cuda_sources,
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_flags,
            py_limited_api=True,
        )
    ]


setup(
    name="flashcore",
    version="0.1.0",
    packages=find_packages(include=["flashcore", "flashcore.*"]),
    ext_modules=get_extensions(),
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
