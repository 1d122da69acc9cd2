"""A prefix state's sliding layers keep only their window and ``PREFIX_WINDOW_ROOM`` entries more
(``Engine.prefix_kv(window_room=...)``, cut as each layer has run): on the tiny hybrids (Gemma 2 /
3: sliding, full, sliding, full; window 16) every method answers with the logits of the same run
whose prefix holds every entry — computed, loaded back from the disk store, and with a query window
that goes back further than the room (then the whole prompt runs again: ``Windows.can_resume``)."""

from __future__ import annotations

import json

import pytest
import torch

from kvcli.answer.pipeline import run
from kvcli.caches.base import SPARE_SLOTS
from kvcli.compressors.base import REGISTRY
from kvcli.runtime import windows
from kvcli.runtime.engine import Engine
from kvcli.store import KVStore
from tests.helpers.runs import configured, prompt_for
from tests.helpers.specs import COMPRESSING, NOT_ON_HYBRIDS
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one intra-op thread in this module)
from tests.helpers.tiny_models import HYBRID_FAMILIES, HYBRID_WINDOW

W = HYBRID_WINDOW
SLIDING = (0, 2)
STEPS = 6


def _run(lm, spec, profiles, store, room, monkeypatch):
    """The run's logits (prompt and every step) and the sliding layers' lengths in each prefix
    state built (None: the prefix kept every entry)."""
    with monkeypatch.context() as m:
        m.setattr(windows, "PREFIX_WINDOW_ROOM", room)
        logits, prefixes = [], []
        original_logits, original_prefix = Engine.logits, Engine.prefix_kv
        m.setattr(Engine, "logits", lambda self, hidden: logits.append(original_logits(self, hidden)) or logits[-1])

        def prefix_kv(self, ids, n_layers=None, observers=None, window_room=None, cache=None):
            cache = original_prefix(self, ids, n_layers, observers, window_room, cache)
            prefixes.append((ids.numel(), [cache.get_seq_length(i) for i in SLIDING if i < cache.n_layers]))
            return cache

        m.setattr(Engine, "prefix_kv", prefix_kv)
        result = run(
            Engine(lm),
            prompt_for(lm),
            configured(spec, lm, profiles),
            max_new_tokens=STEPS,
            stop_ids=set(),
            store=store,
        )
    return result, logits, prefixes


def _same(a, b):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert torch.allclose(x, y, atol=1e-5), step


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("name", sorted(set(REGISTRY) - set(NOT_ON_HYBRIDS)))
def test_every_method_answers_alike_on_a_cut_prefix(tiny_lm, isolated_cache_dir, tmp_path, monkeypatch, family, name):
    lm = tiny_lm(family)
    spec = COMPRESSING[name]
    whole, ref, _ = _run(lm, spec, isolated_cache_dir, None, None, monkeypatch)
    # rooms of 40 and 4: the query windows here (TOVA 1, SnapKV 8, blocksparse 32) go on from the
    # cut prefix with the first; with the second all but TOVA's run the whole prompt again
    for attempt, (room, store) in enumerate(
        [(40, None), (4, None), (40, KVStore.open(tmp_path / "s")), (40, KVStore.open(tmp_path / "s"))]
    ):
        cut, logits, _ = _run(lm, spec, isolated_cache_dir, store, room, monkeypatch)
        assert cut.answer_ids == whole.answer_ids, attempt
        _same(logits, ref)
    if name == "full":  # its prefix state is the plain KV: cut (then loaded back from the store)
        store = KVStore.open(tmp_path / "full")
        _, _, prefixes = _run(lm, spec, isolated_cache_dir, store, 4, monkeypatch)
        n_prefix, held = prefixes[0]
        assert n_prefix > W - 1 + 4 and held == [W - 1 + 4] * len(SLIDING)
        again, logits, prefixes = _run(lm, spec, isolated_cache_dir, store, 4, monkeypatch)
        assert prefixes == [] and again.extra["cache"]["status"] == "hit"  # loaded, not computed
        _same(logits, ref)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_query_window_past_the_room_runs_the_whole_prompt(tiny_lm, isolated_cache_dir, tmp_path, monkeypatch, family):
    """SnapKV's 16 last prompt tokens vote, 5 more than the question's 11: with a room of 8 the
    question's pass goes on from the cut prefix (its last 5 tokens run again); with 4 the prefix
    lacks keys their windows reach, so the whole prompt runs — both answer as the uncut run."""
    lm = tiny_lm(family)
    spec = "snapkv:budget=0.25,window=16"
    whole, ref, _ = _run(lm, spec, isolated_cache_dir, None, None, monkeypatch)
    n_prefix = prompt_for(lm).prefix_len
    ran = {}
    for room in (8, 4):
        with monkeypatch.context() as m:
            seen = []
            original = Engine.prefill
            m.setattr(
                Engine, "prefill", lambda self, ids, *a, **k: seen.append(ids.numel()) or original(self, ids, *a, **k)
            )
            cut, logits, _ = _run(lm, spec, isolated_cache_dir, KVStore.open(tmp_path / str(room)), room, monkeypatch)
        assert cut.answer_ids == whole.answer_ids
        _same(logits, ref)
        ran[room] = seen[0]
    n = prompt_for(lm).n_tokens
    assert n_prefix > W - 1 + 8 and n - n_prefix == 11
    assert ran == {8: 16, 4: n}


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_cut_prefix_frees_its_buffers_goes_through_the_store_and_cuts_back_by_position(tiny_lm, family):
    engine = Engine(tiny_lm(family))
    ids = prompt_for(engine.lm).ids[:200]
    cut = engine.prefix_kv(ids, window_room=4)
    whole = engine.prefix_kv(ids)
    for layer in range(4):
        k = cut.keys[layer]
        if layer in SLIDING:  # its last w - 1 + 4 entries, in a buffer of its own (the prompt's one freed)
            assert k.shape[2] == W - 1 + 4 and cut.dropped[layer] == 200 - (W - 1 + 4)
            row = k[:, :, :1].numel() * k.element_size()
            assert k.untyped_storage().nbytes() <= (W - 1 + 4 + SPARE_SLOTS) * row
            assert torch.equal(k, whole.keys[layer][:, :, -(W - 1 + 4) :])
        else:
            assert torch.equal(k, whole.keys[layer]) and layer not in cut.dropped
    tensors, facts = cut.to_tensors()
    back = type(cut).from_tensors(tensors, json.loads(json.dumps(facts)), device=cut.keys[0].device)
    assert back.dropped == cut.dropped and all(torch.equal(a, b) for a, b in zip(back.keys, cut.keys))
    with pytest.raises(ValueError):  # a layer that does not hold what its dropped count leaves
        type(cut).from_tensors(tensors, {**facts, "dropped": {"0": 3}})
    with pytest.raises(ValueError):
        type(cut).from_tensors(tensors, {**facts, "dropped": {**facts["dropped"], "7": 1}})
    # cut back by position: 196 tokens leave the sliding layers 196 - dropped entries (the last
    # w - 1): enough to go on; 195 leave too few, and can_resume says so; 0 needs nothing
    for n, ok in ((200, True), (196, True), (195, False), (100, False), (0, True)):
        c = cut.copy()
        assert engine.windows.can_resume(c, n) is ok
        c.truncate(n)
        assert c.n_tokens == n
        for layer in range(4):
            assert c.keys[layer].shape[2] == (max(0, n - cut.dropped[layer]) if layer in SLIDING else n)
