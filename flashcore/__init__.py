"""flashcore: fused, exact FlashAttention kernels for PyTorch.

    import flashcore
    out = flashcore.attention(q, k, v, is_causal=True)   # same semantics as F.scaled_dot_product_attention

The ops are also reachable as torch.ops.flashcore.fwd / torch.ops.flashcore.bwd.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

try:
    from . import _C  # noqa: F401  (registers the TORCH_LIBRARY ops and their CPU/CUDA kernels)
except ImportError as e:  # pragma: no cover - only when the extension was not built
    raise ImportError(
        "flashcore's compiled extension (flashcore._C) could not be loaded; build it with "
        "`pip install -e . --no-build-isolation`. Original error: " + str(e)
    ) from e

from .ops import attention, bwd_kernel_name, fwd_kernel_name, last_kernel, varlen_attention  # noqa: E402
from .flash_attn_interface import (  # noqa: E402  (flash-attn's package exports these seven at its top level)
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

from .flash_attn_alias import install_flash_attn_alias  # noqa: E402

__version__ = "0.1.0"


def cuda_available() -> bool:
    """True when this build of flashcore has CUDA kernels and a CUDA device is present."""
    return torch.cuda.is_available() and _has_cuda_kernels()


def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("flashcore::fwd", "CUDA")


__all__ = [
    "attention", "varlen_attention", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache", "fwd_kernel_name", "bwd_kernel_name", "last_kernel", "cuda_available",
    "install_flash_attn_alias",
]
