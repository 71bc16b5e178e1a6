"""Code written for flash-attn 2.x, unchanged: install_flash_attn_alias() makes `import flash_attn` (and its
`flash_attn_interface`, `bert_padding`, `layers.rotary` and `ops.triton.rotary` modules, and its extension
`flash_attn_2_cuda`) resolve to flashcore's implementations of them.

    import flashcore
    flashcore.install_flash_attn_alias()
    from flash_attn import flash_attn_func                     # flashcore.flash_attn_interface.flash_attn_func
    from flash_attn.bert_padding import unpad_input, pad_input
    from flash_attn.layers.rotary import RotaryEmbedding

Opt-in, never on import: a real flash-attn already imported in the process is refused (the two would mix), and
one importable but not yet imported is shadowed for this process only. The alias reports flash-attn's version as
the interface's, with a local label ("2.8.4+flashcore"), so code that gates features on it sees 2.8's: as
`flash_attn.__version__` and as installed-package metadata (`importlib.metadata.version("flash_attn")`, and
`packages_distributions()` mapping `flash_attn` to `flash-attn`), which is what availability checks read. So
transformers' own `attn_implementation="flash_attention_2"` runs on flashcore too when the alias is installed before
transformers first asks (it caches the answer).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import pathlib
import re
import sys
import types

FLASH_ATTN_VERSION = "2.8.4+flashcore"  # the flash-attn release whose interface flashcore follows


def install_flash_attn_alias() -> types.ModuleType:
    """Registers `flash_attn`, `flash_attn.flash_attn_interface`, `flash_attn.bert_padding`, `flash_attn.layers`,
    `flash_attn.layers.rotary` and `flash_attn.ops.triton.rotary` in sys.modules (idempotent) and returns the
    `flash_attn` alias."""
    from . import bert_padding, flash_attn_gpu, flash_attn_interface
    from .layers import rotary

    current = sys.modules.get("flash_attn")
    if current is not None:
        if getattr(current, "__flashcore_alias__", False):
            return current
        raise RuntimeError(
            "install_flash_attn_alias: a flash_attn package is already imported in this process "
            f"({getattr(current, '__file__', current)!r}); flashcore will not replace it")
    package = _package("flash_attn")
    package.__doc__ = "flashcore's implementation of flash-attn 2.x's interface"
    package.__flashcore_alias__ = True
    package.__version__ = FLASH_ATTN_VERSION
    for name in flash_attn_interface.__all__:  # the seven functions flash-attn's package exports at its top level
        setattr(package, name, getattr(flash_attn_interface, name))
    layers = _package("flash_attn.layers")
    layers.rotary = rotary
    # flash_attn.ops.triton.rotary: the rotation kernel itself (apply_rotary), which some models import directly
    ops, triton = _package("flash_attn.ops"), _package("flash_attn.ops.triton")
    triton_rotary = types.ModuleType("flash_attn.ops.triton.rotary", "flashcore.layers.rotary.apply_rotary")
    triton_rotary.__spec__ = importlib.machinery.ModuleSpec(triton_rotary.__name__, None)
    triton_rotary.apply_rotary = rotary.apply_rotary
    ops.triton, triton.rotary = triton, triton_rotary
    package.flash_attn_interface, package.bert_padding, package.layers = flash_attn_interface, bert_padding, layers
    package.ops = ops
    sys.modules.update({
        "flash_attn": package,
        "flash_attn.flash_attn_interface": flash_attn_interface,
        "flash_attn.bert_padding": bert_padding,
        "flash_attn.layers": layers,
        "flash_attn.layers.rotary": rotary,
        "flash_attn.ops": ops,
        "flash_attn.ops.triton": triton,
        "flash_attn.ops.triton.rotary": triton_rotary,
    })
    # flash-attn's extension module, which code imports as `import flash_attn_2_cuda as flash_attn_gpu`; a real one
    # already imported stays
    sys.modules.setdefault("flash_attn_2_cuda", flash_attn_gpu)
    # the metadata first on the path, as the modules shadow an installed flash-attn's
    if not any(isinstance(f, _AliasDistributionFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasDistributionFinder())
    return package


class _AliasDistribution(importlib.metadata.Distribution):
    """flash-attn's installed-package metadata as the alias reports it: name, version, top-level modules."""

    _files = {
        "METADATA": f"Metadata-Version: 2.1\nName: flash-attn\nVersion: {FLASH_ATTN_VERSION}\n"
                    "Summary: flashcore's implementation of flash-attn 2.x's interface (install_flash_attn_alias)\n",
        "top_level.txt": "flash_attn\nflash_attn_2_cuda\n",
    }

    def read_text(self, filename):
        return self._files.get(filename)

    def locate_file(self, path):
        return pathlib.Path(__file__).parent / path


class _AliasDistributionFinder(importlib.abc.MetaPathFinder):
    """Finds no module (sys.modules holds the alias's) but answers importlib.metadata's queries for flash-attn."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if "path" in vars(context):  # a search of given directories: the alias is installed in none
            return
        if context.name is None or re.sub(r"[-_.]+", "-", context.name).lower() == "flash-attn":
            yield _AliasDistribution()


def _package(name: str) -> types.ModuleType:
    """An empty package module whose submodules resolve through sys.modules (an empty __path__), with a spec, so that
    importlib.util.find_spec (availability checks) answers instead of raising."""
    module = types.ModuleType(name)
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    return module
