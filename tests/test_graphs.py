"""A decoding step captured as a CUDA graph (kvcli.runtime.graphs) is the plain step: the same
logits step after step, the same cache after it (entries, positions, room to go on), the same
queries and keys for the observers that listen to every step. On the CPU the fixed computation runs
uncaptured; under ``pytest --device cuda`` it is captured and replayed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcli.caches import KVCache
from kvcli.errors import UsageError
from kvcli.runtime import graphs
from kvcli.runtime.attention import listening
from kvcli.runtime.decode import DecodeStep
from kvcli.runtime.engine import Engine
from tests.helpers.runs import random_ids

N = 40  # prompt tokens
STEPS = 10


def evicted(cache: KVCache) -> KVCache:
    """What PyramidKV leaves: each layer keeps its own number of the last entries (12, 16, ...), their
    positions per head in ``kept``."""
    n_kv = cache.keys[0].shape[1]
    keys, values, kept = [], [], []
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
        keep = 12 + 4 * layer
        idx = torch.arange(N - keep, N, device=k.device)
        keys.append(k.index_select(2, idx))
        values.append(v.index_select(2, idx))
        kept.append(torch.arange(N - keep, N).expand(n_kv, keep))
    cache.keys, cache.values, cache.kept = keys, values, kept
    return cache


def twin_caches(engine, evict: bool):
    ids = random_ids(N, seed=3)
    (cache, logits), (ref, _) = engine.prefill(ids), engine.prefill(ids)
    if evict:
        cache, ref = evicted(cache), evicted(ref)
    return cache, ref, logits


def close(got, want):
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("evict", [False, True], ids=["full", "pyramid"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_fixed_step_is_the_plain_step(tiny_lm, device, family, evict):
    engine = Engine(tiny_lm(family))
    cache, ref, logits = twin_caches(engine, evict)
    held = [k.shape[-2] for k in cache.keys]
    static = graphs.StaticStep(engine, cache, N, STEPS, capture=device.type == "cuda")
    token = torch.argmax(logits).view(1)
    for i in range(STEPS):
        got = static.run(token, N + i, cache)
        want = engine.step(token, N + i, ref)
        close(got, want)
        token = torch.argmax(want).view(1)
    static.finish()
    assert cache.positions.tolist() == ref.positions.tolist() == list(range(N + STEPS))
    assert [k.shape[-2] for k in cache.keys] == [h + STEPS for h in held]
    for layer in range(engine.n_layers):
        close(cache.keys[layer], ref.keys[layer])
        close(cache.values[layer], ref.values[layer])
    # and the cache goes on as a plain one
    close(engine.step(token, N + STEPS, cache), engine.step(token, N + STEPS, ref))
    with pytest.raises(ValueError, match="in order"):
        static.run(token, N + STEPS + 1, cache)


def test_greedy_decoding_and_its_listeners_see_what_the_plain_step_shows(tiny_lm, device):
    """The loop with the fixed step: the plain loop's tokens; an observer listening to layers 1 and
    3 gets the same queries and keys (the answer's citations read them), and the cache counts every
    row once the loop ends, also when it ends early (a stop token)."""
    engine = Engine(tiny_lm("llama"))
    seen = {}
    runs = {}
    for kind in ("plain", "fixed"):
        cache, _, logits = twin_caches(engine, evict=False)
        seen[kind] = []
        record = lambda q, k, kind=kind: seen[kind].append((q.clone(), k.shape, k[..., -1, :].clone()))  # noqa: E731
        with listening({1: [record], 3: [record]}):
            step = None
            if kind == "fixed":
                static = graphs.StaticStep(engine, cache, N, STEPS, capture=device.type == "cuda")
                step = DecodeStep(static.run, device_token=True, finish=static.finish)
            runs[kind] = (engine.decode(logits, cache, N, STEPS + 1, set(), step=step), cache.positions.tolist())
    assert runs["fixed"] == runs["plain"]
    assert len(seen["fixed"]) == len(seen["plain"]) == 2 * STEPS
    for (q, shape, last), (q0, shape0, last0) in zip(seen["fixed"], seen["plain"]):
        assert shape == shape0
        close(q, q0)
        close(last, last0)
    stop = runs["plain"][0][4]  # the fifth token stops the loop: four kept, three steps run
    cache, _, logits = twin_caches(engine, evict=False)
    static = graphs.StaticStep(engine, cache, N, STEPS, capture=device.type == "cuda")
    out = engine.decode(
        logits, cache, N, STEPS + 1, {stop}, step=DecodeStep(static.run, device_token=True, finish=static.finish)
    )
    assert out == runs["plain"][0][:4]
    assert cache.seq_len() == N + 4 and cache.positions.tolist() == list(range(N + 4))


def test_only_a_cuda_step_over_the_plain_layout_of_a_model_without_windows_is_captured(monkeypatch):
    from kvcli.caches.qkv import QuantKVCache

    cuda = SimpleNamespace(device=torch.device("cuda"), windows=SimpleNamespace(hybrid=False))
    assert graphs.unavailable(cuda, KVCache(), 16) is None
    assert "CUDA" in graphs.unavailable(
        SimpleNamespace(device=torch.device("cpu"), windows=cuda.windows), KVCache(), 16
    )
    assert "steps" in graphs.unavailable(cuda, KVCache(), graphs.MIN_STEPS - 1)
    assert "QuantKVCache" in graphs.unavailable(cuda, QuantKVCache.__new__(QuantKVCache), 16)
    hybrid = SimpleNamespace(device=torch.device("cuda"), windows=SimpleNamespace(hybrid=True))
    assert "sliding" in graphs.unavailable(hybrid, KVCache(), 16)
    monkeypatch.setenv(graphs.ENV_CUDA_GRAPHS, "0")
    assert graphs.unavailable(cuda, KVCache(), 16) == f"{graphs.ENV_CUDA_GRAPHS}=0"
    monkeypatch.setenv(graphs.ENV_CUDA_GRAPHS, "no")
    with pytest.raises(UsageError, match="KVCLI_CUDA_GRAPHS must be 1 .* or 0, not 'no'"):
        graphs.unavailable(cuda, KVCache(), 16)


def test_on_a_gpu_greedy_decoding_captures_its_step_and_answers_as_step_by_step(tiny_lm, device, monkeypatch):
    if device.type != "cuda":
        pytest.skip("captures a CUDA graph: pytest --device cuda")
    engine = Engine(tiny_lm("llama"))
    outs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(graphs.ENV_CUDA_GRAPHS, setting)
        cache, _, logits = twin_caches(engine, evict=False)
        outs[setting] = engine.decode(logits, cache, N, 24, set())
        assert cache.seq_len() == N + 23
    assert outs["1"] == outs["0"]
