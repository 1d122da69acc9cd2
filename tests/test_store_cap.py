"""The store's cap: a new entry is kept only when it fits, the least recently used others go to make
room for it (and say so), an entry that does not fit removes nothing; the cap's default and
``--cache-max``."""

from __future__ import annotations

import json
import time

import pytest

from kvcli import notices
from tests.helpers.cli_runner import run_cli
from tests.helpers.embedders import Counting
from tests.helpers.stores import (
    DOC,
    Q1,
    Q2,
    ask,
    entry_files,
    session_for,
    silent_notices,  # noqa: F401  (autouse: the store\'s warnings silenced, forgotten after each test)
)


def _docs(n: int) -> list[str]:
    return [DOC.replace("ships", word) for word in ("ships", "boats", "rafts", "barges", "canoes")[:n]]


def test_the_cap_removes_the_least_recently_used_entries_after_each_write(tiny_lm, tmp_path):
    import time

    from kvcli.store.capacity import least_recently_used

    lm = tiny_lm("llama")
    session = session_for(lm, tmp_path)
    docs = [DOC.replace("ships", word) for word in ("ships", "boats", "rafts")]
    ask(session, "full", doc=docs[0])
    size = entry_files(tmp_path)[0].stat().st_size
    session.store.max_bytes = 2 * size + size // 2  # room for two entries
    ask(session, "full", doc=docs[1])
    first, second = sorted(entry_files(tmp_path), key=lambda p: p.stat().st_mtime)
    time.sleep(0.02)
    session.store.forget()
    assert (
        ask(session, "full", doc=docs[0]).extra["cache"]["status"] == "hit"
    )  # doc 0 used again: now doc 1 is the oldest
    time.sleep(0.02)
    ask(session, "full", doc=docs[2])
    left = entry_files(tmp_path)
    assert len(left) == 2 and second not in left and first in left
    assert sum(p.stat().st_size for p in left) <= session.store.max_bytes
    # the evicted document is computed again (and stored, evicting the next oldest)
    assert ask(session, "full", doc=docs[1]).extra["cache"]["status"] == "miss"
    assert first not in entry_files(tmp_path) and len(entry_files(tmp_path)) == 2
    # the selection itself, against a hand count
    items = [("a", 5, 1.0), ("b", 5, 3.0), ("c", 5, 2.0)]
    assert least_recently_used(items, 10, size=lambda i: i[1], last_use=lambda i: i[2]) == [items[0]]
    assert least_recently_used(items, 4, size=lambda i: i[1], last_use=lambda i: i[2]) == [items[0], items[2], items[1]]
    assert least_recently_used(items, 15, size=lambda i: i[1], last_use=lambda i: i[2]) == []


def test_an_entry_over_the_cap_is_not_kept_and_said_once(tiny_lm, tmp_path):
    warnings = []
    notices.set_sink(warnings.append)
    lm = tiny_lm("llama")
    session = session_for(lm, tmp_path)
    session.store.max_bytes = 1000
    cold = ask(session, "full")
    assert (
        entry_files(tmp_path) == []
        and len(warnings) == 1
        and "over the cache cap" in warnings[0]
        and "--cache-max" in warnings[0]
    )
    again = ask(session, "full", Q2)
    assert again.extra["cache"]["status"] == "miss" and len(warnings) == 1
    assert cold.answer_ids == ask(session_for(lm, None, use_cache=False), "full").answer_ids


def test_resolve_cap(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from kvcli.errors import UsageError
    from kvcli.store.capacity import DEFAULT_CAP_BYTES, resolve_cap

    monkeypatch.delenv("KVCLI_CACHE_MAX", raising=False)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 100 << 30))
    assert resolve_cap(None, tmp_path) == DEFAULT_CAP_BYTES  # a big disk: 10 GiB
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 8 << 30))
    assert resolve_cap(None, tmp_path) == 2 << 30  # a quarter of 8 GiB free
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / f"{'a' * 64}.safetensors").write_bytes(b"x" * (4 << 20))
    assert resolve_cap(None, tmp_path) == (2 << 30) + (1 << 20)  # what the store holds counts as its room
    assert resolve_cap(None, tmp_path / "not" / "yet") == 2 << 30  # the disk of the nearest existing folder
    assert resolve_cap("500M", tmp_path) == 500 << 20
    assert resolve_cap("None", tmp_path) is None
    monkeypatch.setenv("KVCLI_CACHE_MAX", "3G")
    assert resolve_cap(None, tmp_path) == 3 << 30
    assert resolve_cap("1G", tmp_path) == 1 << 30  # the option before the variable
    with pytest.raises(UsageError):
        resolve_cap("lots", tmp_path)


def test_cache_max_on_the_command_line(tiny_dir, tmp_path, capsys, monkeypatch):
    model = str(tiny_dir("llama", num_hidden_layers=4))
    doc, cache = tmp_path / "doc.txt", tmp_path / "cache"
    doc.write_text(DOC)
    args = ["ask", doc, Q1, "-m", model, "-c", "full", "--cache-dir", cache, "--json", "-q", "--max-new-tokens", "2"]
    code, out, err = run_cli([*args, "--cache-max", "lots"], capsys, monkeypatch)
    assert (
        code == 2
        and out == ""
        and err.startswith("kvcli: error: --cache-max must look like 500M, 2G or 1048576, not 'lots'")
        and len(err.splitlines()) == 1
    )
    monkeypatch.setenv("KVCLI_CACHE_MAX", "-2G")  # the error names where the value came from
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert (code, out, err) == (2, "", "kvcli: error: KVCLI_CACHE_MAX must not be negative, got '-2G'\n")
    monkeypatch.delenv("KVCLI_CACHE_MAX")
    code, out, err = run_cli([*args, "--cache-max", "1K"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["cache"] == "miss" and entry_files(cache) == []
    monkeypatch.setenv("KVCLI_CACHE_MAX", "1K")
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0 and entry_files(cache) == []
    monkeypatch.setenv("KVCLI_CACHE_MAX", "none")
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0 and len(entry_files(cache)) == 1
    code, out, _ = run_cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
    assert json.loads(out)["max_bytes"] is None
    monkeypatch.setenv("KVCLI_CACHE_MAX", "2G")
    code, out, _ = run_cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
    assert json.loads(out)["max_bytes"] == 2 << 30


def test_an_entry_over_the_cap_removes_no_other_entry(tiny_lm, tmp_path):
    """The issue's case: a populated cache, one ask with a cap below its new entry: the entry is not
    kept, and every entry already there stays (the cap does not destroy what it then refuses)."""
    lm = tiny_lm("llama")
    session = session_for(lm, tmp_path)
    for doc in _docs(3):
        ask(session, "full", doc=doc)
    before = {p: p.read_bytes() for p in entry_files(tmp_path)}
    size = min(p.stat().st_size for p in before)
    said = []
    notices.set_sink(said.append)
    session.store.max_bytes = size - 1  # below the new entry (and far below the three held)
    result = ask(session, "full", doc=DOC.replace("ships", "dinghies"))
    assert result.extra["cache"]["status"] == "miss" and result.extra["cache"]["entry_bytes"] is None
    assert {p: p.read_bytes() for p in entry_files(tmp_path)} == before  # all three, untouched
    assert (
        len(said) == 1
        and "over the cache cap" in said[0]
        and "not kept" in said[0]
        and "no other entry was removed" in said[0]
    )
    # a stored book over the cap: the same
    session.store.max_bytes = 10_000
    ask(session, "infllm:block_size=8,initial=4,local_window=16,topk=3,chunk=12")
    assert {p: p.read_bytes() for p in entry_files(tmp_path)} == before


def test_the_cap_makes_room_only_for_an_entry_it_keeps_and_says_what_went(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    session = session_for(lm, tmp_path)
    docs = _docs(4)
    for doc in docs[:3]:
        ask(session, "full", doc=doc)
        time.sleep(0.02)
    oldest = sorted(entry_files(tmp_path), key=lambda p: p.stat().st_mtime)
    size = oldest[0].stat().st_size
    said = []
    notices.set_sink(said.append)
    session.store.max_bytes = 2 * size + size // 2  # room for two: the new one and the most recent
    ask(session, "full", doc=docs[3])
    left = entry_files(tmp_path)
    assert oldest[0] not in left and oldest[1] not in left and oldest[2] in left and len(left) == 2
    assert len(said) == 1, said
    line = said[0]
    assert "made room" in line and "removed 2 least recently used entries" in line
    assert "(the largest: stdin, " in line and "KiB" in line  # the documents were given as text (stdin)


def test_cache_info_shows_the_room_left_and_what_goes_next(tiny_lm, tiny_dir, tmp_path, capsys, monkeypatch):
    model = str(tiny_dir("llama", num_hidden_layers=4))
    cache = tmp_path / "cache"
    for _i, word in enumerate(("ships", "boats")):
        doc = tmp_path / f"{word}.txt"
        doc.write_text(DOC.replace("ships", word))
        code, _, _ = run_cli(
            ["ask", doc, Q1, "-m", model, "-c", "full", "--cache-dir", cache, "-q", "--max-new-tokens", "1"],
            capsys,
            monkeypatch,
        )
        assert code == 0
        time.sleep(0.02)
    monkeypatch.setenv("KVCLI_CACHE_MAX", "10M")
    code, out, _ = run_cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
    info = json.loads(out)
    assert code == 0 and info["max_bytes"] == 10 << 20 and info["room_bytes"] == (10 << 20) - info["size_bytes"]
    assert info["evicts_next"]["document"].endswith("ships.txt") and info["evicts_next"]["size_bytes"] > 0
    monkeypatch.setenv("KVCLI_CACHE_MAX", "none")
    code, out, _ = run_cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
    assert json.loads(out)["room_bytes"] is None


def test_the_cap_counts_the_page_vectors_and_removes_them_least_recently_used_first(tiny_lm, tmp_path, monkeypatch):
    """The page vectors (``<cache_dir>/vectors``) are under the cap (issue 49): a KV entry written
    over it removes vectors used less recently than the other entries, vectors the pages method
    writes make room under it as an entry does, and a hit on vectors marks them used."""
    import os

    from kvcli.retrieval import embed, vectors

    warnings = []
    notices.set_sink(warnings.append)
    lm = tiny_lm("llama")
    session = session_for(lm, tmp_path)
    docs = _docs(3)
    ask(session, "full", doc=docs[0])
    (e0,) = entry_files(tmp_path)
    kv_size = e0.stat().st_size
    vectors.passage_vectors(Counting(), ["an old page"], tmp_path)
    (old,) = (tmp_path / "vectors").glob("*.safetensors")
    v_size = old.stat().st_size
    past = time.time() - 100
    os.utime(old, (past, past))  # used before the KV entry
    session.store.max_bytes = 2 * kv_size + v_size - 1  # two KV entries and the vectors do not fit
    assert json.loads(json.dumps(session.store.total_bytes())) == kv_size + v_size
    ask(session, "full", doc=docs[1])
    assert not old.exists() and len(entry_files(tmp_path)) == 2  # the vectors were the oldest
    assert any("least recently used" in w for w in warnings)

    # the pages method's vectors go through the cap as its entries do
    monkeypatch.setattr(embed, "embedder", lambda name: Counting())
    monkeypatch.delenv(embed.ENV, raising=False)
    made, make_room = [], session.store.make_room
    monkeypatch.setattr(session.store, "make_room", lambda path: (made.append(path), make_room(path)))
    ask(session, "pages", doc=docs[2])
    (written,) = (tmp_path / "vectors").glob("*.safetensors")
    assert written in made and session.store.total_bytes() <= session.store.max_bytes
    # a later question on the same document reads the file and marks it used
    os.utime(written, (past, past))
    ask(session, "pages", Q2, doc=docs[2])
    assert written.stat().st_mtime > past + 50
