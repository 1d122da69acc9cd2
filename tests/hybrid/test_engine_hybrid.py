"""Hybrid sliding-window families (Gemma 2 / 3) in the layer-by-layer engine: transformers' own
logits with strong soft-capping, and decoding that keeps only each sliding layer's window."""

from __future__ import annotations

import pytest
import torch

from kvcli.caches import KVCache
from kvcli.runtime import windows as windows_mod
from kvcli.runtime.engine import Engine
from kvcli.runtime.kernels import softcapped
from tests.helpers.reference import hf_logits
from tests.helpers.runs import random_ids
from tests.helpers.tiny_models import HYBRID_FAMILIES, HYBRID_WINDOW

TOL = 1e-4


def test_strong_softcapping_matches_transformers(tiny_lm):
    """Caps low enough to bend every score and logit (the defaults 50 / 30 barely touch a tiny
    random model's): transformers' eager Gemma 2 and kvcli agree."""
    lm = tiny_lm("gemma2", attn_logit_softcapping=0.05, final_logit_softcapping=0.02)
    ids = random_ids(40, seed=3)
    ref = hf_logits(lm, ids)
    engine = Engine(lm)
    got = engine.logits(engine.forward(ids, torch.arange(40), KVCache()))
    assert torch.allclose(got, ref, atol=TOL)
    assert ref.abs().max() <= 0.02 + 1e-6  # the final cap did apply
    uncapped = Engine(lm)
    uncapped.final_softcap = None
    assert not torch.allclose(uncapped.logits(uncapped.forward(ids, torch.arange(40), KVCache())), ref, atol=TOL)


def test_softcapped_kernel_against_a_dense_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 8, generator=g) * 3 for h, n in ((4, 5), (2, 9), (2, 9)))
    mask = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)
    out = softcapped(q, k, v, mask, 0.5, 2.0)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = torch.tanh(q @ kk.transpose(-1, -2) * 0.5 / 2.0) * 2.0
    ref = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ vv
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_decoding_keeps_only_the_window_and_matches_transformers(tiny_lm, family, monkeypatch):
    monkeypatch.setattr(windows_mod, "WINDOW_SLACK", 3)
    lm = tiny_lm(family)
    ids = random_ids(70, seed=4)
    ref = hf_logits(lm, ids)
    engine = Engine(lm)
    assert list(engine.windows.layers) == [HYBRID_WINDOW, None, HYBRID_WINDOW, None]
    cache, logits = engine.prefill(ids[:30])
    cache.trim_windows(engine.windows)  # what the pipeline does before decoding
    assert [cache.seq_len(i) for i in range(4)] == [HYBRID_WINDOW - 1, 30, HYBRID_WINDOW - 1, 30]
    assert torch.allclose(logits, ref[29], atol=TOL)
    for i in range(30, 70):
        logits = engine.step(int(ids[i]), i, cache)
        assert torch.allclose(logits, ref[i], atol=TOL), i
        for layer in (0, 2):
            assert HYBRID_WINDOW - 1 <= cache.seq_len(layer) <= HYBRID_WINDOW - 1 + 3
        assert cache.seq_len(1) == i + 1
    mask = cache.kept_mask(70)  # what the sliding layers hold: their last entries
    held = mask[0, 0].nonzero().view(-1).tolist()
    assert held == list(range(70 - cache.seq_len(0), 70)) and mask[1, 0].all()


def test_rope_differs_between_layer_types(tiny_lm):
    """Gemma 3's local and global layers get the (cos, sin) of their own base."""
    engine = Engine(tiny_lm("gemma3"))
    x = torch.zeros(1, 1, 1)
    cos0, _ = engine.rotary(0)(x, torch.arange(1, 50).view(1, -1))
    cos1, _ = engine.rotary(1)(x, torch.arange(1, 50).view(1, -1))
    assert not torch.allclose(cos0, cos1)
    assert engine.windows.full_layers == [1, 3] and engine.rope_groups() == {0: [0, 2], 1: [1, 3]}
