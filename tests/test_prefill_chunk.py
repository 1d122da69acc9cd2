"""Chunked prefill: a layer's MLP runs ``prefill_chunk`` tokens at a time — full attention's result
within 1e-5 on the CPU (off there by default), activations bounded by the chunk, and eviction scores unchanged."""

from __future__ import annotations

import pytest
import torch

from kvcli import engine as engine_mod
from kvcli.engine import Engine
from kvcli.pipeline import Pipeline, run
from tests.helpers.runs import prompt_for
from tests.helpers.tiny_models import FAMILIES
from tests.test_engine import random_ids


@pytest.fixture
def chunked(tiny_lm):
    """``chunked(family, chunk)`` -> an Engine with that prefill chunk (reset afterwards)."""
    made = []

    def make(family, chunk):
        engine = Engine(tiny_lm(family))
        engine.prefill_chunk = chunk
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.prefill_chunk = None


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_is_the_unchunked_prefill(chunked, family):
    ids = random_ids(45, seed=5)
    ref_cache, ref = chunked(family, None).prefill(ids)
    engine = chunked(family, 8)
    seen = []
    hook = engine.layers[0].mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-2]))
    try:
        cache, logits = engine.prefill(ids)
    finally:
        hook.remove()
    # within 1e-5, not bit for bit: a BLAS matmul's rounding depends on its row count
    assert torch.allclose(logits, ref, atol=1e-5, rtol=0)
    for l in range(engine.n_layers):
        assert torch.allclose(cache.keys[l], ref_cache.keys[l], atol=1e-5, rtol=0)
        assert torch.allclose(cache.values[l], ref_cache.values[l], atol=1e-5, rtol=0)
    # the hook sees the wrapped module's call (45 tokens); inside, the MLP's projections see chunks
    assert seen == [45]


def test_mlp_intermediates_are_bounded_by_the_chunk(chunked):
    engine = chunked("llama", 8)
    rows = []
    proj = engine.layers[1].mlp.gate_proj
    hook = proj.register_forward_hook(lambda m, args, out: rows.append(out.shape[-2]))
    try:
        engine.prefill(random_ids(21, seed=6))
    finally:
        hook.remove()
    assert rows == [8, 8, 5]


@pytest.mark.parametrize("spec", ["snapkv:budget=20,window=4", "h2o:budget=20"])
def test_eviction_keeps_the_same_entries_chunked(chunked, spec):
    """SnapKV's observation window and H2O's column sums still see every query: same kept entries."""
    engine = chunked("llama", None)
    prompt = prompt_for(engine.lm)
    ref = run(engine, prompt, Pipeline.parse(spec), max_new_tokens=4, stop_ids=set())
    engine.prefill_chunk = 16
    got = run(engine, prompt, Pipeline.parse(spec), max_new_tokens=4, stop_ids=set())
    assert got.answer_ids == ref.answer_ids
    assert torch.equal(got.kept_mask(), ref.kept_mask())


def test_default_chunk_is_off_on_the_cpu(monkeypatch):
    monkeypatch.delenv(engine_mod.ENV_PREFILL_CHUNK, raising=False)
    assert engine_mod.default_prefill_chunk(torch.device("cpu")) is None
    assert engine_mod.default_prefill_chunk(torch.device("meta")) == engine_mod.ACCELERATOR_PREFILL_CHUNK
    monkeypatch.setenv(engine_mod.ENV_PREFILL_CHUNK, "512")
    assert engine_mod.default_prefill_chunk(torch.device("cpu")) == 512
    monkeypatch.setenv(engine_mod.ENV_PREFILL_CHUNK, "0")
    assert engine_mod.default_prefill_chunk(torch.device("meta")) is None
