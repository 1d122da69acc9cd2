"""The disk store's memo (the last entry, kept for the next question) lives on the host: on an
accelerator each fetch gets its own upload, so the prefix KV is never held twice there."""

from __future__ import annotations

import torch

from kvcli.caches import KVCache
from kvcli.store import KVStore, make_key


def _kv(device="cpu"):
    cache = KVCache()
    for layer in range(2):
        cache.update(torch.randn(1, 2, 5, 4).to(device), torch.randn(1, 2, 5, 4).to(device), layer)
    cache.record_positions(torch.arange(5))
    return cache


def _memo_device(store):
    return store.memo.cache.keys[0].device.type


def test_memo_stays_on_the_host_for_an_accelerator(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    key = make_key(lm, torch.arange(5), {"kind": "kv", "layers": 2})
    computed = _kv()  # stands for a cache computed on the accelerator ("meta": any device but the CPU)
    store = KVStore(tmp_path / "kv")
    got, fetched = store.fetch(key, lambda: computed, {}, device="meta")
    assert fetched.status == "miss" and got is computed
    assert _memo_device(store) == "cpu" and store.memo.cache is not computed
    again, fetched = store.fetch(key, lambda: None, {}, device="meta")  # the memo: an upload of its own
    assert fetched.status == "hit" and again.keys[0].device.type == "meta" and _memo_device(store) == "cpu"
    fresh = KVStore(tmp_path / "kv")  # read from disk
    loaded, fetched = fresh.fetch(key, lambda: None, {}, device="meta")
    assert fetched.status == "hit" and loaded.keys[0].device.type == "meta" and _memo_device(fresh) == "cpu"
    # on the CPU the memo itself, as before
    cpu, _ = fresh.fetch(key, lambda: None, {}, device="cpu")
    assert cpu is fresh.memo.cache and torch.equal(cpu.keys[1], computed.keys[1])


def test_an_upload_leaves_room_for_what_follows_the_prefix(tiny_lm, tmp_path):
    """A plain KV uploaded from the memo to an accelerator sits in buffers with ``room`` more
    entries: the question and the answer append in place (no layer moved to a larger buffer)."""
    lm = tiny_lm("llama")
    key = make_key(lm, torch.arange(5), {"kind": "kv", "layers": 2})
    computed = _kv()
    store = KVStore(tmp_path / "kv")
    store.fetch(key, lambda: computed, {}, device="meta", room=7)
    got, fetched = store.fetch(key, lambda: None, {}, device="meta", room=7)
    assert fetched.status == "hit" and got.positions.tolist() == list(range(5))
    row_bytes = 2 * 4 * 4  # heads x head_dim x float32
    assert [k.untyped_storage().nbytes() for k in got.keys + got.values] == [12 * row_bytes] * 4
    for _step in range(7):
        for layer in range(2):
            got.update(torch.zeros(1, 2, 1, 4, device="meta"), torch.zeros(1, 2, 1, 4, device="meta"), layer)
    assert [k.shape[-2] for k in got.keys] == [12, 12]
    assert [k.untyped_storage().nbytes() for k in got.keys + got.values] == [12 * row_bytes] * 4  # in place
    cpu, _ = store.fetch(key, lambda: None, {}, device="cpu", room=7)  # on the CPU: the memo itself, as before
    assert cpu is store.memo.cache
