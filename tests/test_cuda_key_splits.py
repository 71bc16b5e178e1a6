"""Key splits of the sm90 forward: a one-warpgroup grid that leaves SMs idle gives each query tile a cluster of
blocks, each over a slice of the key tiles, merged through rank 0's shared memory. FLASHCORE_KEY_SPLITS caps the
blocks a tile (1: no split); every test asserts the split it asked for ran (flashcore.last_kernel)."""

import pytest
import torch
import torch.nn.functional as F

import flashcore
from conftest import capture_graph, check_close, cuda_skip_reason, gpu_families, reference_attention
from test_cuda_forward import check_forward, random_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")]

DEV = "cuda"

# (shape, masks): the launcher splits walks of about 5 key tiles or more, so every case here is split (asserted);
# the few queries of the first two shapes see only the first keys under a top-left causal mask, so they run
# unmasked and bottom-right. The last two give slices that see no key at all: causal query blocks with fewer key
# tiles than blocks in the cluster, and bottom-right rows (Sq > Sk) that see nothing.
SPLIT_CASES = [
    ((1, 2, 1, 70, 1500), ("none", "bottom_right")),
    ((1, 3, 3, 1, 4097), ("none", "bottom_right")),
    ((1, 1, 1, 1400, 1200), ("none", "causal", "bottom_right")),
    ((1, 1, 1, 1280, 1280), ("none", "causal", "bottom_right")),
]
SPLIT_PARAMS = [(shape, mask) for shape, masks in SPLIT_CASES for mask in masks]


@pytest.fixture
def sm90_only(monkeypatch):
    if "sm90" not in gpu_families():
        pytest.skip("sm90 kernels need a compute capability 9.0 GPU")
    monkeypatch.setenv("FLASHCORE_FORCE_KERNEL", "sm90")


def splits_ran() -> int:
    ran = flashcore.last_kernel("fwd")
    assert ran.startswith("sm90"), ran
    return int(ran.split("splits")[1].split()[0]) if "splits" in ran else 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("shape,mask", SPLIT_PARAMS, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else x)
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_forward_key_splits(request, sm90_only, monkeypatch, dtype, head_dim, mask, shape, splits):
    monkeypatch.setenv("FLASHCORE_KEY_SPLITS", str(splits))
    check_forward(*random_qkv(request, shape, head_dim, dtype, "bhsd", "bshd"), mask, "sm90")
    ran = splits_ran()
    assert 2 <= ran <= splits, f"asked for up to {splits} key splits, {flashcore.last_kernel('fwd')} ran"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_key_split_taken_deterministic_and_graph_safe(request, sm90_only, monkeypatch, head_dim):
    """A long key walk over few heads is split by default; the split result is accurate, identical run to run,
    and recomputed on CUDA graph replay."""
    q, k, v = random_qkv(request, (1, 3, 3, 1, 4097), head_dim, torch.bfloat16, "bhsd", "bhsd")
    monkeypatch.setenv("FLASHCORE_KEY_SPLITS", "1")
    unsplit = flashcore.attention(q, k, v)
    assert splits_ran() == 1
    monkeypatch.delenv("FLASHCORE_KEY_SPLITS")
    split = flashcore.attention(q, k, v)
    assert splits_ran() > 1
    assert not torch.equal(split, unsplit)  # summed in another order
    ref, _ = reference_attention(q, k, v)
    check_close("out", split, ref, F.scaled_dot_product_attention(q, k, v))
    for _ in range(3):
        assert torch.equal(split, flashcore.attention(q, k, v))
    graph, out = capture_graph(lambda: flashcore.attention(q, k, v))
    g = torch.Generator(device=DEV).manual_seed(20261123)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=g, device=DEV))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = reference_attention(q, k, v)
    check_close("out", out, ref, F.scaled_dot_product_attention(q, k, v))
