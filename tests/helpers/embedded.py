"""The embedded models in tests: loaded when their packages are installed, else the test skips
(CI installs none of the chunk packages), and their logits through kvcli's engine beside
transformers' own on random token ids."""

from __future__ import annotations

import pytest
import torch

from kvcli.caches import KVCache
from kvcli.errors import ModelError
from kvcli.model import catalog, load_model
from kvcli.runtime.engine import Engine
from tests.helpers.reference import hf_logits


def embedded_or_skip(name: str, dtype: str = "float32"):
    """The embedded model ``name`` loaded (converted on first use), or the test skipped with the
    one-line install hint."""
    try:
        catalog.chunks(catalog.CATALOG[name])
    except ModelError as e:
        pytest.skip(str(e))
    return load_model(name, dtype=dtype)


def logits_both_ways(lm, n: int, vocab: int, seed: int = 0):
    """(ids, kvcli's engine, its logits, transformers' logits) for ``n`` random ids below ``vocab``."""
    ids = torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    ref = hf_logits(lm, ids)
    engine = Engine(lm)
    return ids, engine, engine.logits(engine.forward(ids, torch.arange(n), KVCache())), ref
