"""Decoding keeps to the device: no host -> device copy and no synchronisation inside a step
(full attention and the eviction methods' plain cache); the decoding loop reads the token once a
step. Counted with a TorchDispatchMode over an engine whose model lives on ``meta`` (any device
but the CPU: a host tensor mixed in shows as a cross-device op)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcli.caches import KVCache
from kvcli.runtime.decode import DecodeStep
from kvcli.runtime.engine import Engine
from tests.helpers.runs import random_ids

# a host read of a tensor: ``aten.item`` shows itself under inference mode, its body otherwise
SCALAR = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


class Traffic(TorchDispatchMode):
    """Counts ``.item()``-style reads (``aten.item`` / ``aten._local_scalar_dense``) and ops whose tensors sit on
    more than one device (host <-> device copies)."""

    def __init__(self):
        super().__init__()
        self.syncs, self.crossings = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SCALAR:
            self.syncs += 1
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        tensors += [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        if len({t.device.type for t in tensors}) > 1:
            self.crossings.append(str(func))
        return out


def evicted(cache: KVCache, keep: int) -> KVCache:
    """What an eviction method leaves: per layer the same number of entries per KV head, their
    original positions in ``kept`` (the decode path of SnapKV, H2O, PyramidKV, StreamingLLM, ...)."""
    n_kv, n = cache.keys[0].shape[1], cache.seq_len()
    idx = torch.arange(n - keep, n, device=cache.keys[0].device)
    cache.keys = [k.index_select(2, idx) for k in cache.keys]
    cache.values = [v.index_select(2, idx) for v in cache.values]
    cache.kept = [torch.arange(n - keep, n).expand(n_kv, keep) for _ in cache.keys]
    return cache


@pytest.mark.parametrize("evict", [False, True])
def test_a_decoding_step_makes_no_copy_and_no_sync(meta_engine, evict):
    engine = meta_engine
    cache, _ = engine.prefill(random_ids(30, seed=7))
    if evict:
        cache = evicted(cache, 12)
    token = torch.zeros(1, dtype=torch.long, device="meta")  # the last step's argmax, on the device
    traffic = Traffic()
    with traffic:
        for i in range(3):
            logits = engine.step(token, 30 + i, cache)
            token = torch.argmax(logits).view(1)
    assert traffic.syncs == 0 and traffic.crossings == []
    assert cache.positions.tolist() == list(range(33)) and cache.seq_len() == (15 if evict else 33)


def test_decode_reads_the_token_once_a_step(tiny_lm):
    """The decoding loop (CPU): one ``.item()`` a step, the token; the same tokens as stepping by hand."""
    engine = Engine(tiny_lm("llama"))
    ids = random_ids(20, seed=8)
    cache, logits = engine.prefill(ids)
    ref_cache, ref = engine.prefill(ids)
    traffic = Traffic()
    with traffic:
        out = engine.decode(logits, cache, 20, 6, set())
    assert traffic.syncs == 6
    by_hand = []
    for i in range(6):
        by_hand.append(int(torch.argmax(ref)))
        ref = engine.step(by_hand[-1], 20 + i, ref_cache)
    assert out == by_hand


def _razor(cache):
    from kvcli.caches.razor import RazorCache

    return RazorCache.compress(cache, torch.tensor([[True, False], [False, True]]), 4, sinks=4, window=8, consume=True)


def _ragged(cache):
    from kvcli.caches import RaggedCache

    g = torch.Generator().manual_seed(0)
    return RaggedCache.from_selection(cache, [torch.rand(2, 30, generator=g) < 0.5 for _ in range(2)], consume=True)


def _blocks(cache):
    from kvcli.caches.blocks import BlockCache

    return BlockCache.from_kv(cache, local=8, initial=4, block_size=4, representative="max", topk=2, consume=True)


@pytest.mark.parametrize("layout", [_razor, _ragged, _blocks], ids=["razor", "ragged", "blocks"])
def test_grouped_ragged_and_block_caches_decode_without_copies(meta_engine, layout):
    """RazorAttention's head groups, padded ragged heads (AdaKV, KVzip, ExpectedAttention) and
    block retrieval held on the device: after a first step (per-layer index tables go to the
    device once; RazorAttention's already when its cache is built), a step makes no copy and no
    synchronisation either."""
    engine = meta_engine
    cache, _ = engine.prefill(random_ids(30, seed=9))
    cache = layout(cache)
    token = torch.zeros(1, dtype=torch.long, device="meta")
    first = Traffic()
    with first:
        engine.step(token, 30, cache)
    traffic = Traffic()
    with traffic:
        for i in range(3):
            engine.step(token, 31 + i, cache)
    assert traffic.syncs == 0 and traffic.crossings == []
    if layout is _razor:  # its head tables went to the device when the cache was built
        assert first.syncs == 0 and first.crossings == []


@pytest.mark.parametrize(
    "spec, layout",
    [("blocksparse", _blocks), ("decoding:interval=100,budget=40", None)],
    ids=["blocksparse", "decoding"],
)
def test_methods_that_own_decoding_take_the_token_where_it_is(meta_engine, spec, layout):
    """Block-sparse retrieval and DecodingPress run their own decoding step on the token the last
    argmax left on the device (``device_token``): no upload of the id, no synchronisation."""
    from kvcli.answer.pipeline import Pipeline

    engine = meta_engine
    method = Pipeline.parse(spec).stages[0]
    method.configure(engine.lm)
    assert method.device_token
    cache, _ = engine.prefill(random_ids(30, seed=9))
    if layout is not None:
        cache = layout(cache)
    token = torch.zeros(1, dtype=torch.long, device="meta")
    traffic = Traffic()
    with traffic:
        for i in range(3):
            method.decode_step(engine, token, 30 + i, cache)
    assert traffic.syncs == 0 and traffic.crossings == []


def test_decode_hands_a_methods_step_the_token_as_it_asks(tiny_lm):
    """A method's own step gets the id, or with ``device_token`` the (1,) tensor the argmax left
    on the model's device; the tokens are the same either way."""
    engine = Engine(tiny_lm("llama"))
    ids = random_ids(20, seed=8)
    runs = {}
    for device_token in (False, True):
        seen = []

        def step(token, position, cache):
            seen.append(token)
            return engine.step(token, position, cache)

        cache, logits = engine.prefill(ids)
        runs[device_token] = (engine.decode(logits, cache, 20, 4, set(), step=DecodeStep(step, device_token)), seen)
    assert all(isinstance(t, int) for t in runs[False][1])
    assert all(isinstance(t, torch.Tensor) and t.shape == (1,) for t in runs[True][1])
    assert runs[True][0] == runs[False][0] and [int(t) for t in runs[True][1]] == runs[False][1]
