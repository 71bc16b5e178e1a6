"""PEP 517 build backend of flashcore: setuptools', building against the torch of the environment being installed
into.

flashcore's extension must be compiled against the torch that will load it (its C++ ABI). pip builds in an
isolated environment by default, which has no torch, and listing torch as a build requirement would download a
second, possibly different torch into it. pip runs the backend with the target environment's own interpreter, so
its site-packages (where torch is installed) are known: they are appended to sys.path when torch is not already
importable. `pip install -e .`, `pip install .` and `pip wheel .` then work as typed, and
`--no-build-isolation` keeps working (torch is importable already).
"""

import sys
import sysconfig


def _find_target_torch():
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths()[key]
        if path not in sys.path:
            sys.path.append(path)
    try:
        import torch  # noqa: F401,F811
    except ImportError as e:
        raise RuntimeError(
            "flashcore builds against the installed torch: install torch (pip install torch==2.11.0) into this "
            f"environment first ({sys.executable})"
        ) from e


_find_target_torch()

from setuptools.build_meta import *  # noqa: E402,F401,F403
