"""flash-attn 2's own test suite against flashcore, through install_flash_attn_alias(): the usage patterns of
flash-attn's callers, written by its authors. flash-attn's file is not part of flashcore; copy it next to this one
and run it on a GPU machine (it needs einops: `pip install einops`, or a folder `pylib/` here holding it):

    git show <flash-attention commit>:tests/test_flash_attn.py > scripts/flash_attn_upstream/test_flash_attn.py
    cd scripts/flash_attn_upstream && FA_SAMPLE=90 FA_SEED=7 python -m pytest -q --rootdir . test_flash_attn.py

Its parametrizations run to tens of thousands of cases: FA_SAMPLE of them per test function are kept (seeded by
FA_SEED), and cases with dropout_p > 0 are left out (flashcore has no dropout; they raise NotImplementedError). The
two that expect a synchronizing check of a paged cache's tensor cache_seqlens fail by design (README: KV cache)."""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pylib"))
import flashcore  # noqa: E402

flashcore.install_flash_attn_alias()


def pytest_collection_modifyitems(config, items):
    n = int(os.environ.get("FA_SAMPLE", "40"))
    rng = random.Random(os.environ.get("FA_SEED", "0"))
    groups = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("dropout_p", 0.0) > 0:
            continue
        groups.setdefault(item.originalname, []).append(item)
    keep = []
    for name, group in groups.items():
        keep += group if len(group) <= n else rng.sample(group, n)
    kept = set(map(id, keep))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep
