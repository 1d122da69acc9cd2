"""Chunked prefill: a layer's MLP runs ``prefill_chunk`` tokens at a time — full attention's result
within 1e-5 on the CPU (off there by default), activations bounded by the chunk, and eviction scores unchanged."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.runtime import prefill as prefill_mod
from kvcli.runtime.engine import Engine
from tests.helpers.runs import prompt_for, random_ids
from tests.helpers.tiny_models import FAMILIES


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


def test_default_chunk_is_off_on_the_cpu_but_for_hybrids(monkeypatch):
    monkeypatch.delenv(prefill_mod.ENV_PREFILL_CHUNK, raising=False)
    assert prefill_mod.default_prefill_chunk(torch.device("cpu")) is None
    hybrid_cpu = prefill_mod.default_prefill_chunk(torch.device("cpu"), hybrid=True)
    assert hybrid_cpu == prefill_mod.HYBRID_CPU_PREFILL_CHUNK == 2048
    assert prefill_mod.default_prefill_chunk(torch.device("meta")) == prefill_mod.ACCELERATOR_PREFILL_CHUNK
    assert prefill_mod.default_prefill_chunk(torch.device("meta"), hybrid=True) == prefill_mod.ACCELERATOR_PREFILL_CHUNK
    # an embedded model's own measured chunk, on the CPU only, before the hybrids' default
    assert prefill_mod.default_prefill_chunk(torch.device("cpu"), cpu=1024) == 1024
    assert prefill_mod.default_prefill_chunk(torch.device("cpu"), hybrid=True, cpu=1024) == 1024
    assert prefill_mod.default_prefill_chunk(torch.device("meta"), cpu=1024) == prefill_mod.ACCELERATOR_PREFILL_CHUNK
    monkeypatch.setenv(prefill_mod.ENV_PREFILL_CHUNK, "512")
    assert prefill_mod.default_prefill_chunk(torch.device("cpu")) == 512
    assert prefill_mod.default_prefill_chunk(torch.device("cpu"), cpu=1024) == 512  # the setting wins
    monkeypatch.setenv(prefill_mod.ENV_PREFILL_CHUNK, "0")
    assert prefill_mod.default_prefill_chunk(torch.device("meta")) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefix_pass_is_the_chunk_by_chunk_arithmetic(chunked, family):
    """A prefix pass longer than the chunk runs chunk by chunk through every layer (attention too):
    bit for bit the layer-by-layer chunked prefill, within rounding of one pass, and its KV in
    buffers reserved for the prompt plus the room asked for."""
    ids = random_ids(45, seed=7)
    whole = chunked(family, None).prefix_kv(ids)
    engine = chunked(family, 8)
    rows = []
    hook = engine.layers[1].self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: rows.append(
            kwargs["hidden_states"].shape[-2] if "hidden_states" in kwargs else args[0].shape[-2]
        ),
        with_kwargs=True,
    )
    try:
        with engine.reserving(5):
            cache = engine.prefix_kv(ids)
    finally:
        hook.remove()
    assert rows == [8, 8, 8, 8, 8, 5]  # attention sees one chunk of queries at a time
    engine.prefill_chunk = None
    first = engine.prefix_kv(ids[:8])
    ref, _ = engine.prefill_by_layer(ids[8:], torch.arange(8, 45), first, 8)
    assert cache.positions.tolist() == list(range(45))
    # the layer-by-layer pass computes the last layer's attention output too; its KV is the same
    for l in range(engine.n_layers):
        assert torch.equal(cache.keys[l], ref.keys[l]) and torch.equal(cache.values[l], ref.values[l])
        assert torch.allclose(cache.keys[l], whole.keys[l], atol=1e-5, rtol=0)
        assert torch.allclose(cache.values[l], whole.values[l], atol=1e-5, rtol=0)
        assert (
            cache.keys[l].untyped_storage().nbytes()
            == cache.keys[l].element_size() * cache.keys[l][0, :, :1].numel() * 50
        )


def test_question_and_answer_append_in_the_reserved_buffers(chunked):
    """The default path (full attention on a prefix): the question and the answer land in the
    buffers the chunked prefix pass reserved — no layer is copied to a larger buffer."""
    engine = chunked("llama", 16)
    prompt = prompt_for(engine.lm)
    assert prompt.prefix_len > 16
    made = []
    real = engine.prefix_kv

    def spy(ids, n_layers=None, **kwargs):
        cache = real(ids, n_layers, **kwargs)
        made.append([(k.data_ptr(), k.untyped_storage().nbytes()) for k in cache.keys])
        return cache

    engine.prefix_kv = spy
    got = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=5, stop_ids=set())
    engine.prefix_kv = real
    assert len(made) == 1
    assert [(k.data_ptr(), k.untyped_storage().nbytes()) for k in got.cache.keys] == made[0]
    assert got.cache.keys[0].shape[-2] == prompt.n_tokens + 4  # 5 tokens generated, 4 of them fed back
    engine.prefill_chunk = None
    ref = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=5, stop_ids=set())
    assert got.answer_ids == ref.answer_ids


def test_the_store_key_hashes_the_chunk_of_a_chunked_prefix_pass(chunked):
    """Another chunk rounds differently: a prefix read chunk by chunk is stored under a key of its
    own chunk; unchunked (the CPU's default), the key is the one entries always had."""
    from kvcli.answer.prefix import chunked_state

    engine = chunked("llama", None)
    ids, state = random_ids(45, seed=3), {"kind": "kv", "layers": 4}
    assert chunked_state(engine, ids, state) is state
    engine.prefill_chunk = 64  # longer than the prefix: one pass, as unchunked
    assert chunked_state(engine, ids, state) is state
    engine.prefill_chunk = 16
    assert (
        chunked_state(engine, ids, state)
        == {**state, "prefill_chunk": 16}
        != chunked_state(chunked("llama", 8), ids, state)
    )


def test_an_embedded_models_cpu_chunk_reaches_its_engine(tiny_lm, monkeypatch):
    """models.json's ``cpu_prefill_chunk`` (the 0.5B Qwen's) is the engine's chunk on the CPU."""
    import dataclasses

    from kvcli.model import catalog

    monkeypatch.delenv(prefill_mod.ENV_PREFILL_CHUNK, raising=False)
    chunk = catalog.embedded("qwen2.5-coder-0.5b").cpu_prefill_chunk
    assert chunk is not None and catalog.embedded("qwen2.5-coder-1.5b").cpu_prefill_chunk is None
    lm = tiny_lm("qwen2")
    try:
        want = chunk if lm.device.type == "cpu" else prefill_mod.ACCELERATOR_PREFILL_CHUNK
        assert Engine(dataclasses.replace(lm, cpu_prefill_chunk=chunk)).prefill_chunk == want
    finally:
        Engine(lm)  # the chunk is the model's modules': as it was
