"""The KV is never held twice: KVzip's reconstruction passes free each layer's copy once the layer
has run; the block layout and Razor's groups are built while consuming their source."""

from __future__ import annotations

import torch

from kvcli.caches import KVCache
from kvcli.compressors import kvzip as kvzip_mod
from kvcli.compressors import parse_one
from kvcli.runtime.engine import Engine
from tests.helpers.runs import prompt_for


def test_kvzip_reconstruction_holds_one_layer_copy_at_a_time(tiny_lm, monkeypatch):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prefix = prompt_for(lm).ids[: prompt_for(lm).prefix_len]
    n = prefix.numel()
    copies, widest = [], []
    real_copy, real_scores = KVCache.copy, kvzip_mod.chunk_scores

    def copy(self):
        out = real_copy(self)
        copies.append(out)
        return out

    def scores(query, key, *args, **kwargs):
        # while a layer is scored: how many layers of the reconstruction's copy hold more than the prefix
        widest.append(sum(k.shape[2] > n for k in copies[-1].keys))
        return real_scores(query, key, *args, **kwargs)

    monkeypatch.setattr(KVCache, "copy", copy)
    monkeypatch.setattr(kvzip_mod, "chunk_scores", scores)
    method = parse_one("kvzip:budget=40,sinks=5,chunk=64,overlap=3")
    method.configure(lm)
    method.prefix_scores(engine, prefix)
    assert len(widest) == lm.n_layers * len(copies) and len(copies) > 1
    assert max(widest) == 1  # only the layer being run


def _full_kv(layers=3, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = KVCache()
    for layer in range(layers):
        kv.update(torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g), layer)
    kv.record_positions(torch.arange(n))
    return kv


def test_block_layout_is_built_while_consuming_its_source(monkeypatch):
    from kvcli.caches import blocks

    config = dict(local=8, initial=4, block_size=4, representative="max", topk=2)
    ref = blocks.BlockCache.from_kv(_full_kv(), **config)
    kv = _full_kv()
    held, real = [], blocks.block_representatives

    def reps(*args, **kwargs):  # called once per layer, after the layer's parts are laid out
        held.append(sum(k is not None for k in kv.keys))
        return real(*args, **kwargs)

    monkeypatch.setattr(blocks, "block_representatives", reps)
    got = blocks.BlockCache.from_kv(kv, consume=True, **config)
    assert held == [3, 2, 1]  # layer l's source is released before layer l + 1 is laid out
    assert all(k is None for k in kv.keys) and all(v is None for v in kv.values)
    for name in ("keys", "values", "fkeys", "fvalues", "reps"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(got, name), getattr(ref, name)))


def test_razor_groups_are_built_while_consuming_their_source(monkeypatch):
    from kvcli.caches.razor import RazorCache

    protected = torch.tensor([[True, False], [False, False], [False, True]])
    ref = RazorCache.compress(_full_kv(), protected, 4, sinks=2, window=6)
    kv = _full_kv()
    held, real = [], RazorCache.kv_heads

    def kv_heads(self, layer, device):  # called once per layer while splitting it
        held.append(sum(k is not None for k in kv.keys))
        return real(self, layer, device)

    monkeypatch.setattr(RazorCache, "kv_heads", kv_heads)
    got = RazorCache.compress(kv, protected, 4, sinks=2, window=6, consume=True)
    assert held == [3, 2, 1] and all(k is None for k in kv.keys)
    for name in ("pk", "pv", "ck", "cv"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(got, name), getattr(ref, name)))


def test_a_value_that_is_a_view_of_a_fused_projection_is_stored_on_its_own():
    """Phi-3's fused qkv_proj hands the cache its values as a slice of the whole q|k|v output: the
    cache keeps a copy of the slice, not the projection (else every layer's projection stays alive)."""
    qkv = torch.randn(1, 10, 3 * 2 * 8)  # (batch, tokens, q|k|v of 2 heads x 8)
    value = qkv[..., 2 * 16 :].view(1, 10, 2, 8).transpose(1, 2)
    key = torch.randn(1, 2, 10, 8)
    kv = KVCache()
    kv.update(key, value, 0)
    assert kv.values[0].untyped_storage().nbytes() == value.numel() * value.element_size()
    assert torch.equal(kv.values[0], value)
    assert kv.keys[0] is key  # a tensor of its own is kept as it is (no copy)


def test_phi3_prefill_holds_no_projection(tiny_lm):
    lm = tiny_lm("phi3")
    engine = Engine(lm)
    ids = prompt_for(lm).ids
    cache, _ = engine.prefill(ids)
    assert len(cache.values) == lm.n_layers
    for _k, v in zip(cache.keys, cache.values):
        assert (
            v.untyped_storage().nbytes() <= 2 * v.numel() * v.element_size()
        )  # its own buffer (room to spare at most)
