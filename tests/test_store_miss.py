"""The store on a miss and on a failed write: a miss looks only for the files the key's other
formats would be named (never reads every entry's header), and only a write that fails on the
disk (an OSError: full, read-only, a quota) turns the store off; any other error is a bug, raised."""

from __future__ import annotations

import errno

import pytest
import torch

from kvcli import notices
from kvcli.caches import KVCache, quant
from kvcli.store import KVStore, kvstore
from kvcli.store import entries as entry_files
from kvcli.store.keys import key_of, other_formats
from tests.helpers.stores import silent_notices  # noqa: F401  (autouse: the store's warnings silenced, forgotten after each test)


def _kv(n: int = 7) -> KVCache:
    cache = KVCache()
    cache.keys, cache.values = [torch.zeros(1, 1, n, 4)], [torch.ones(1, 1, n, 4)]
    cache.positions = torch.arange(n)
    return cache


def _fields(tokens: str, state: dict) -> dict:
    return {"format": 1, "model": "m", "device": "cpu", "attn": "sdpa", "tokens": tokens, "n_tokens": 7, "state": state}


NAMED = {"kind": "kv", "layers": 1, **quant.state(16)}  # this kvcli's format


def test_every_codec_in_use_is_among_the_names_looked_for():
    """A codec renamed keeps its old name in CODEC_NAMES: a miss then finds the old entries by name."""
    for bits, codec in quant.CODECS.items():
        assert codec in quant.CODEC_NAMES[bits], bits


def test_a_miss_reads_no_header_but_the_one_of_its_own_state(tmp_path, monkeypatch):
    monkeypatch.setattr(kvstore, "_FORMAT_SAID", False)
    store = KVStore.open(tmp_path)
    for i in range(12):  # other documents' entries
        store.fetch(key_of(_fields(f"doc{i}", NAMED)), _kv, {"document": f"d{i}.txt"})
    # this document's state, written by a kvcli that did not name its KV's format yet
    old = key_of(_fields("mine", {"kind": "kv", "layers": 1}))
    store.fetch(old, _kv, {"document": "mine.txt"})
    key = key_of(_fields("mine", NAMED))
    assert old.digest in other_formats(key) and key.digest not in other_formats(key)
    read = []
    real = entry_files.read_meta
    monkeypatch.setattr(entry_files, "read_meta", lambda path: read.append(path.name) or real(path))
    notices.reset()
    store.miss(key)
    assert read == [f"{old.digest}.safetensors"]  # the old format's file, found by name: no other header read
    [line] = notices.collected()
    assert "another format" in line and "an older kvcli" in line


def test_a_miss_on_a_store_without_its_other_formats_reads_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(kvstore, "_FORMAT_SAID", False)
    store = KVStore.open(tmp_path)
    for i in range(5):
        store.fetch(key_of(_fields(f"doc{i}", NAMED)), _kv, {"document": f"d{i}.txt"})
    read = []
    monkeypatch.setattr(entry_files, "read_meta", lambda path: read.append(path) or (None, None))
    store.miss(key_of(_fields("new", NAMED)))
    assert read == [] and notices.collected() == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT])
def test_a_write_the_disk_refuses_turns_the_store_off(tmp_path, monkeypatch, code):
    def full(path, entry):
        raise OSError(code, "refused")

    monkeypatch.setattr(entry_files, "write_entry", full)
    store = KVStore.open(tmp_path)
    state, fetched = store.fetch(key_of(_fields("a", NAMED)), _kv, {"document": "a.txt"})
    assert fetched.status == "off" and not store.enabled and state.keys[0].shape[2] == 7
    [line] = notices.collected()
    assert line.startswith(f"cannot write to the cache directory {store.root}")


def test_a_bug_while_writing_is_raised_not_taken_for_a_full_disk(tmp_path, monkeypatch):
    def bug(path, entry):
        raise TypeError("unsupported operand type(s) for +: 'NoneType' and 'int'")

    monkeypatch.setattr(entry_files, "write_entry", bug)
    store = KVStore.open(tmp_path)
    with pytest.raises(TypeError, match="unsupported operand"):
        store.fetch(key_of(_fields("a", NAMED)), _kv, {"document": "a.txt"})
    assert store.enabled and not any("cannot write" in line for line in notices.collected())
