"""The layer-by-layer engine reproduces transformers' own forward, for every family and kernel."""

from __future__ import annotations

import os

import pytest
import torch

from kvcli.caches import KVCache
from kvcli.runtime.attention import causal_mask, last_query_scores
from kvcli.runtime.engine import Engine
from tests.helpers.reference import hf_logits
from tests.helpers.runs import random_ids
from tests.helpers.tiny_models import FAMILIES

TOL = 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_full_pass_matches_transformers(tiny_lm, family, attn):
    lm = tiny_lm(family, attn=attn)
    ids = random_ids(48)
    ref = hf_logits(lm, ids)
    engine = Engine(lm)
    hidden = engine.forward(ids, torch.arange(48), KVCache())
    assert torch.allclose(engine.logits(hidden), ref, atol=TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_prefill_and_decode_match_one_pass(tiny_lm, family):
    lm = tiny_lm(family)
    ids = random_ids(40, seed=1)
    ref = hf_logits(lm, ids)
    engine = Engine(lm)
    cache = KVCache()
    engine.forward(ids[:25], torch.arange(25), cache)
    hidden = engine.forward(ids[25:37], torch.arange(25, 37), cache)  # a chunk on top of a cache
    assert torch.allclose(engine.logits(hidden), ref[25:37], atol=TOL)
    for i in range(37, 40):  # single-token decode steps
        hidden = engine.forward(ids[i : i + 1], torch.tensor([i]), cache)
        assert torch.allclose(engine.logits(hidden)[0], ref[i], atol=TOL)
    assert cache.seq_len() == 40 and cache.positions.tolist() == list(range(40))


def test_sliding_window_matches_transformers(tiny_lm):
    lm = tiny_lm("mistral", sliding_window=8)
    ids = random_ids(30, seed=2)
    ref = hf_logits(lm, ids)
    engine = Engine(lm)
    assert torch.allclose(engine.logits(engine.forward(ids, torch.arange(30), KVCache())), ref, atol=TOL)


def test_forward_runs_only_the_layers_asked(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    calls = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i)) for i, layer in enumerate(engine.layers)]
    try:
        cache = KVCache()
        engine.forward(random_ids(10), torch.arange(10), cache, layers=range(2))
    finally:
        for h in hooks:
            h.remove()
    assert calls == [0, 1]
    assert cache.n_layers == 2


def test_causal_mask_offsets_and_window():
    assert causal_mask(1, 10, None, "cpu") is None
    assert causal_mask(5, 5, None, "cpu") is None
    m = causal_mask(2, 5, None, "cpu")
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    w = causal_mask(3, 3, 2, "cpu")
    assert w.tolist() == [[True, False, False], [True, True, False], [False, True, True]]


def test_last_query_scores_handles_gqa_without_expanding():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 4, 8, generator=g)  # 6 query heads
    k = torch.randn(1, 2, 9, 8, generator=g)  # 2 KV heads: groups of 3
    expanded = k.repeat_interleave(3, dim=1)
    ref = torch.einsum("hd,hnd->n", q[0, :, -1], expanded[0])
    assert torch.allclose(last_query_scores(q, k)[0], ref, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_prefix, start", [(30, 22), (30, 30), (30, 0)])
def test_prefill_on_prefix_is_the_two_pass_arithmetic(tiny_lm, family, n_prefix, start):
    """Layer by layer over prefix and rest = prefix_kv, truncate, prefill: the same tensors, bit for bit."""
    lm = tiny_lm(family)
    engine = Engine(lm)
    ids = random_ids(40, seed=2)
    ref = engine.prefix_kv(ids[:n_prefix])
    ref.truncate(start)
    ref, ref_logits = engine.prefill(ids[start:], cache=ref)
    seen = []
    cache, logits = engine.prefill_on_prefix(ids, n_prefix, start, after_layer=seen.append)
    assert seen == list(range(lm.n_layers))
    assert torch.equal(logits, ref_logits)
    assert cache.positions.tolist() == ref.positions.tolist() == list(range(40))
    for l in range(lm.n_layers):
        assert torch.equal(cache.keys[l], ref.keys[l]) and torch.equal(cache.values[l], ref.values[l])


@pytest.mark.parametrize("inference", [True, False])
def test_appends_write_in_place_and_never_over_a_view_handed_out(inference):
    """Decoding appends into a buffer with room (no copy of the layer per step); a copy of the
    cache, a layer cut back or replaced gets its own buffer: what anyone else holds stays intact."""
    with torch.inference_mode(inference):
        _check_in_place_appends()


def _check_in_place_appends():
    def kv(n, fill):
        return torch.full((1, 2, n, 4), float(fill)), torch.full((1, 2, n, 4), -float(fill))

    a = KVCache()
    a.update(*kv(10, 1), 0)
    a.update(*kv(1, 2), 0)  # first append: a buffer with room
    ptr = a.keys[0].data_ptr()
    a.update(*kv(1, 3), 0)
    assert a.keys[0].data_ptr() == ptr and a.keys[0].shape[2] == 12  # written in place
    b = a.copy()
    a.update(*kv(1, 4), 0)
    b.update(*kv(1, 5), 0)  # b writes into a buffer of its own
    assert b.keys[0].data_ptr() != ptr
    assert a.keys[0][0, 0, :, 0].tolist() == [1] * 10 + [2, 3, 4]
    assert b.keys[0][0, 0, :, 0].tolist() == [1] * 10 + [2, 3, 5]
    held = a.keys[0]
    a.truncate(11)
    a.update(*kv(1, 6), 0)  # after a cut, a new buffer: the view held above keeps its entries
    assert held[0, 0, :, 0].tolist() == [1] * 10 + [2, 3, 4]
    assert a.keys[0][0, 0, :, 0].tolist() == [1] * 10 + [2, 6] and a.values[0][0, 1, -1, 0].item() == -6
    a.keys[0], a.values[0] = a.keys[0][:, :, [0, 11]].clone(), a.values[0][:, :, [0, 11]].clone()  # an eviction
    a.update(*kv(1, 7), 0)
    assert a.keys[0][0, 0, :, 0].tolist() == [1, 6, 7]
    for _ in range(200):  # the buffer grows as needed
        a.update(*kv(1, 8), 0)
    assert a.keys[0].shape[2] == 203 and a.keys[0][0, 1, -1, 0].item() == 8


def test_models_are_float32_on_the_test_device(tiny_lm, embedded_session, device):
    """The suite's numbers are float32 numbers: the models load on ``pytest --device`` (cpu unless
    asked), float32, and on the default the GPU is hidden from every test (device auto is CPU)."""
    for lm in (tiny_lm("llama"), embedded_session.lm):
        assert lm.device.type == device.type and lm.model.dtype == torch.float32
    if device.type == "cpu":
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
