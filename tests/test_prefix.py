"""The prefix API (kvcli.answer.prefix): where the state comes from and under which key (the store's, as
entries always had it), who holds it once taken, and the rest of the prompt extended on top of it —
each checked against an independent computation (the engine's own passes, the key made by hand)."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer.prefix import Prefix, report
from kvcli.compressors import REGISTRY, parse_one
from kvcli.compressors.base import Compressor, Runtime
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from kvcli.store import KVStore, make_key
from tests.helpers.runs import prompt_for

TOL = 1e-4  # one pass against two (prefix, then the rest): within rounding


def _full(tiny_lm, family="llama"):
    lm = tiny_lm(family)
    engine = Engine(lm)
    return lm, engine, prompt_for(lm), parse_one("full")


def _same_kv(a, b) -> None:
    assert a.n_layers == b.n_layers and torch.equal(a.positions, b.positions)
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert torch.equal(x, y)


def test_without_a_store_the_state_is_computed_and_handed_over(tiny_lm):
    lm, engine, prompt, full = _full(tiny_lm)
    prefix = Prefix.of(engine, prompt, full, None, {})
    assert prefix.n_tokens == prompt.prefix_len and torch.equal(prefix.ids, prompt.ids[: prompt.prefix_len])
    assert not prefix.stored and not prefix.shared and prefix.full_kv
    built = []
    real = engine.prefix_kv
    engine.prefix_kv = lambda *a, **k: built.append(real(*a, **k)) or built[-1]
    state = prefix.take()
    assert built == [state]  # the state itself, not a copy: nothing else holds it
    _same_kv(state, real(prompt.ids[: prompt.prefix_len]))
    assert prefix.fetched.status == "off" and report(None, prefix)["status"] == "off"
    again = prefix.take()  # forgotten when handed over: computed again
    assert len(built) == 2 and again is built[1] and again is not state
    assert prefix.copy() is not prefix.copy()  # a copy leaves it here: computed once more, then kept
    assert len(built) == 3


def test_with_a_store_the_state_is_stored_under_the_key_entries_always_had(tiny_lm, tmp_path):
    lm, engine, prompt, full = _full(tiny_lm)
    store = KVStore.open(tmp_path)
    first = Prefix.of(engine, prompt, full, store, {"method": "full"})
    assert first.stored and first.shared  # on the CPU the store's memo keeps it
    taken = first.take()
    assert first.fetched.status == "miss"
    ids = prompt.ids[: prompt.prefix_len]
    key = make_key(lm, ids, {"kind": "kv", "layers": lm.n_layers})  # the key, made without the prefix
    assert [p.name for p in (tmp_path / "kv").glob("*.safetensors")] == [f"{key.digest}.safetensors"]
    assert first.fetched.key == key.digest
    # a copy each time: appending to one never touches what the store holds
    other = first.take()
    assert other is not taken and all(a is b for a, b in zip(other.keys, taken.keys))
    _same_kv(taken, engine.prefix_kv(ids))
    second = Prefix.of(engine, prompt, full, KVStore.open(tmp_path), {})
    _same_kv(second.take(), taken)
    assert second.fetched.status == "hit" and report(first, None, second) == second.fetched.to_json()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("window", [0, 3, 30])
def test_extend_is_one_pass_over_the_whole_prompt(tiny_lm, tmp_path, family, window):
    """The rest of the prompt on the state (cut back first for a query window that reaches into
    the prefix; on a hybrid the state's sliding layers keep their window and some room) gives the
    logits and the KV of one prefill of the whole prompt; the observers see the last
    max(window, question) queries."""
    lm, engine, prompt, full = _full(tiny_lm, family)
    n, n_prefix = prompt.n_tokens, prompt.prefix_len
    ref_cache, ref_logits = engine.prefill(prompt.ids)
    for store in (None, KVStore.open(tmp_path)):
        seen, ran = [], []
        prefix = Prefix.of(engine, prompt, full, store, {})
        observers = {0: [lambda q, k: seen.append(q.shape[2])]}
        cache, logits = prefix.extend(
            prompt.ids, query_window=window, observers=observers, after_layer=lambda c, i: ran.append(i)
        )
        assert torch.allclose(logits, ref_logits, atol=TOL)
        assert seen == [max(window, n - n_prefix)] and ran == list(range(lm.n_layers))
        assert torch.equal(cache.positions, torch.arange(n))
        for layer in range(lm.n_layers):
            k = cache.keys[layer]
            assert torch.allclose(k, ref_cache.keys[layer][:, :, -k.shape[2] :], atol=TOL)
            assert k.shape[2] == n - cache.dropped.get(layer, 0)


def test_extend_computes_full_attentions_kv_with_the_rest_layer_by_layer(tiny_lm):
    """With compressors evicting layer by layer and no store, the prefix is never computed on its
    own: prefix and rest run together (prefill_on_prefix), bit for bit as prefix_kv then prefill."""
    lm, engine, prompt, full = _full(tiny_lm)
    prefix = Prefix.of(engine, prompt, full, None, {})
    calls = []
    real = engine.prefix_kv
    engine.prefix_kv = lambda *a, **k: calls.append("prefix_kv") or real(*a, **k)
    cache, logits = prefix.extend(prompt.ids, query_window=4, after_layer=lambda c, i: None, by_layer=True)
    assert calls == [] and prefix.fetched.status == "off"
    start = prompt.n_tokens - max(4, prompt.n_tokens - prompt.prefix_len)
    ref = real(prompt.ids[: prompt.prefix_len])
    ref.truncate(start)
    ref, ref_logits = engine.prefill(prompt.ids[start:], cache=ref)
    assert torch.equal(logits, ref_logits)
    _same_kv(cache, ref)


def test_a_state_that_cannot_be_cut_back_refuses_a_query_window_into_it(tiny_lm, isolated_cache_dir):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    razor = parse_one("razor:tokens=8,order=prefix")  # its state: the compressed cache
    razor.runtime = Runtime(cache_dir=isolated_cache_dir)
    razor.configure(lm)
    prefix = Prefix.of(engine, prompt, razor, None, {})
    assert not prefix.full_kv
    cache, _ = prefix.extend(prompt.ids, query_window=prompt.n_tokens - prompt.prefix_len)  # the question alone: fine
    assert not cache.truncatable
    with pytest.raises(UsageError, match="cannot be cut back for a 40-token query window"):
        Prefix.of(engine, prompt, razor, None, {}).extend(prompt.ids, query_window=40)


def test_what_methods_declare_of_their_prefix(tiny_lm):
    """Only InfLLM's state is a book written while it is read; a method that says nothing of how
    it reads a long prompt gets the plain note."""
    assert {name for name, cls in REGISTRY.items() if cls.writes_prefix} == {"infllm"}
    assert not Compressor.writes_prefix
    lm = tiny_lm("llama")
    finch, infllm = parse_one("finch"), parse_one("infllm")
    infllm.configure(lm)  # the pipeline configures every stage first
    plain = "finch reads it chunk by chunk, which takes a while (every token runs through the model)"
    assert finch.reading_note(lm, 9000) == plain
    assert "reads it in 512-token chunks into blocks" in infllm.reading_note(lm, 9000)
    assert Prefix.of(Engine(lm), prompt_for(lm), finch, None, {}) is None  # Finch keeps no prefix state
