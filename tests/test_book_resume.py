"""A book read that stops keeps what it read: Ctrl-C, an error or a kill (SIGKILL, at any point:
in a chunk, in the middle of keeping a resume point, a write torn half-way) leaves a partial entry,
never served as a whole one, and the next read resumes it without reading its finished blocks
again; the book and the answer are those of a read that never stopped, bit for bit. A torn or
foreign partial entry is read again from the start, with one line. ``cache ls`` shows a partial
entry and how far it got; prune and the cap remove it, except while its read runs."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcli import notices
from kvcli.caches.book import BookCache
from kvcli.caches.bookfile import FileStorage, tensor_specs
from kvcli.resume_points import read_progress
from kvcli.store import KVStore, book, take_lock
from kvcli.store.keys import lock_path
from tests.helpers.books import CHUNK, answer, entry_tensors
from tests.helpers.cli_runner import heavy_imports, run_cli
from tests.helpers.stores import silent_notices  # noqa: F401  (autouse: the store's warnings silenced, forgotten after each test)
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one intra-op thread in this module)

REPO = Path(__file__).resolve().parent.parent
PWRITE = os.pwrite


class Killed(BaseException):
    """Stands for SIGKILL in this process: nothing after it runs (no resume point is kept)."""


@pytest.fixture
def lm(tiny_lm):
    return tiny_lm("llama")


def _files(cache: Path) -> tuple[list[Path], list[Path]]:
    """(whole entries, partial entries) under ``cache``."""
    files = sorted((cache / "kv").glob("*.safetensors"))
    return [p for p in files if ".partial" not in p.name], [p for p in files if ".partial" in p.name]


def _same_as(reference, result, cache: Path) -> None:
    """``result`` answered as the reference did, and the entry under ``cache`` holds its bytes."""
    want, tensors = reference
    entries, partials = _files(cache)
    assert partials == [] and len(entries) == 1
    got = entry_tensors(entries[0])
    assert set(got) == set(tensors) and all(torch.equal(got[n], tensors[n]) for n in tensors)
    assert result.answer_ids == want.answer_ids


def _chunks(monkeypatch) -> list[int]:
    """The chunks read from now on: the tokens read at the end of each."""
    seen = []
    original = BookCache.end_chunk

    def counted(self):
        seen.append(self.n_tokens)
        return original(self)

    monkeypatch.setattr(BookCache, "end_chunk", counted)
    return seen


def test_ctrl_c_keeps_the_finished_chunks_and_the_next_read_resumes_there(lm, reference, tmp_path, monkeypatch):
    n_chunks = -(-reference[0].prompt.prefix_len // CHUNK)
    stop_at = n_chunks // 2
    original = BookCache.end_chunk
    calls = []

    def interrupted(self):
        calls.append(1)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(BookCache, "end_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        answer(lm, KVStore.open(tmp_path / "c"))
    entries, [partial] = _files(tmp_path / "c")
    assert entries == [] and read_progress(partial)["tokens"] == (stop_at - 1) * CHUNK
    store = KVStore.open(tmp_path / "c")  # opening (reclaim) keeps it: it is no leftover
    [listed] = store.entries()
    assert listed.partial and listed.read_tokens == (stop_at - 1) * CHUNK and not listed.reading
    assert store.load(_key(lm)) is None  # never served as a whole entry
    monkeypatch.setattr(BookCache, "end_chunk", original)
    read = _chunks(monkeypatch)
    said = []
    notices.set_sink(said.append)
    result = answer(lm, store)
    assert read[0] == stop_at * CHUNK and len(read) == n_chunks - (stop_at - 1)  # only the rest is read
    assert result.extra["cache"]["status"] == "miss"
    assert any("resuming the read" in m and f"{(stop_at - 1) * CHUNK:,}/" in m for m in said), said
    _same_as(reference, result, tmp_path / "c")
    assert answer(lm, KVStore.open(tmp_path / "c")).extra["cache"]["status"] == "hit"


def _key(lm):
    from kvcli.answer.prefix import chunked_state
    from kvcli.answer.prompt import build_prompt
    from kvcli.compressors import parse_one
    from kvcli.runtime.engine import Engine
    from kvcli.store import make_key
    from tests.helpers.books import DOC, QUESTION, SPEC

    prompt = build_prompt(lm.tokenizer, DOC, QUESTION)
    ids = prompt.ids[: prompt.prefix_len]
    stage = parse_one(SPEC)
    return make_key(lm, ids, chunked_state(Engine(lm), ids, stage.prefix_state(lm)))


def _writes(monkeypatch, kill_at: int | None) -> list[int]:
    """Counts os.pwrite calls; at number ``kill_at`` writes half its bytes and is killed."""
    calls = []

    def pwrite(fd, data, offset):
        calls.append(1)
        if len(calls) == kill_at:
            data = bytes(data)
            PWRITE(fd, data[: len(data) // 2], offset)
            raise Killed
        return PWRITE(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return calls


def test_a_kill_at_any_write_resumes_to_the_same_book(lm, reference, tmp_path, monkeypatch):
    """A resume point after every chunk; killed at randomly drawn writes (a block's rows, Local's
    rows or a slot of a resume point, the final header), the write torn half-way: the next read
    resumes (or, killed before any point was kept, starts over) and gives the same book."""
    monkeypatch.setattr(book, "CHECKPOINT_EVERY_S", 0.0)
    monkeypatch.setattr(book.PartialRead, "interrupted", lambda self: None)  # a kill keeps nothing more
    writes = _writes(monkeypatch, None)
    answer(lm, KVStore.open(tmp_path / "count"))
    total = len(writes)
    draws = sorted(random.Random(41).sample(range(1, total + 1), 6)) + [total]  # the last: the final header
    for kill_at in draws:
        cache = tmp_path / f"k{kill_at}"
        _writes(monkeypatch, kill_at)
        with pytest.raises(Killed):
            answer(lm, KVStore.open(cache))
        monkeypatch.setattr(os, "pwrite", PWRITE)
        result = answer(lm, KVStore.open(cache))
        _same_as(reference, result, cache)


@pytest.mark.parametrize("kill_at", [4, 9])
def test_a_real_sigkill_mid_chunk_resumes_to_the_same_book(lm, reference, tiny_dir, tmp_path, kill_at):
    folder = tiny_dir("llama", num_hidden_layers=4)
    cache = tmp_path / "c"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.books", str(folder), str(cache), str(kill_at)],
        env=env,
        cwd=REPO,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    entries, [partial] = _files(cache)
    assert entries == [] and read_progress(partial)["tokens"] == (kill_at - 1) * CHUNK  # the chunks it finished
    monkeypatch = pytest.MonkeyPatch()
    try:
        read = _chunks(monkeypatch)
        result = answer(lm, KVStore.open(cache))
    finally:
        monkeypatch.undo()
    assert read[0] == kill_at * CHUNK  # from the end of the last chunk finished
    _same_as(reference, result, cache)


@pytest.mark.parametrize("damage", ["slots", "truncated", "another key"])
def test_a_damaged_partial_entry_is_read_again_from_the_start(lm, reference, tmp_path, monkeypatch, damage):
    original = BookCache.end_chunk
    calls = []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(BookCache, "end_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        answer(lm, KVStore.open(tmp_path / "c"))
    monkeypatch.setattr(BookCache, "end_chunk", original)
    _, [partial] = _files(tmp_path / "c")
    data = bytearray(partial.read_bytes())
    if damage == "slots":  # both resume points torn: nothing to resume (said by nothing: none was kept)
        for at in range(_resume_at(partial), len(data), 97):
            data[at] ^= 0xFF
        partial.write_bytes(bytes(data))
    elif damage == "truncated":
        partial.write_bytes(bytes(data[: len(data) // 2]))
    else:  # its header names another key (the same length: the layout stays)
        digest = _key(lm).digest
        before = f'\\"key\\": \\"{digest}'.encode()
        assert before in data
        partial.write_bytes(bytes(data).replace(before, before[: -len(digest)] + digest[::-1].encode(), 1))
    said = []
    notices.set_sink(said.append)
    read = _chunks(monkeypatch)
    result = answer(lm, KVStore.open(tmp_path / "c"))
    assert read[0] == CHUNK  # from the start
    if damage != "slots":
        assert any("partial read" in m and "damaged" in m for m in said), said
    _same_as(reference, result, tmp_path / "c")


def _resume_at(path: Path) -> int:
    from kvcli.caches.bookfile import FileStorage

    storage, _ = FileStorage.open(path)
    try:
        return storage.resume_at
    finally:
        storage.close()


def test_cache_commands_show_and_remove_a_partial_entry_but_not_while_it_is_read(lm, tmp_path, capsys, monkeypatch):
    original = BookCache.end_chunk
    calls = []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(BookCache, "end_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        answer(lm, KVStore.open(tmp_path))
    monkeypatch.setattr(BookCache, "end_chunk", original)
    code, out, _ = run_cli(["cache", "ls", "--cache-dir", tmp_path, "--json"], capsys, monkeypatch)
    [row] = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and row["partial"] and row["read_tokens"] == 3 * CHUNK and not row["reading"]
    assert row["key"] == _key(lm).digest and row["document"] == "doc.txt"
    # the same row from a new process that imports no PyTorch (its header and resume point read as bytes)
    done, heavy = heavy_imports(["cache", "ls", "--cache-dir", tmp_path, "--json"])
    assert done.returncode == 0 and heavy == [] and [json.loads(line) for line in done.stdout.splitlines()] == [row]
    code, out, _ = run_cli(["cache", "ls", "--cache-dir", tmp_path], capsys, monkeypatch)  # piped: TSV
    header, first = (line.split("\t") for line in out.splitlines()[:2])
    assert dict(zip(header, first))["read_tokens"] == str(3 * CHUNK)
    code, out, _ = run_cli(["cache", "info", "--cache-dir", tmp_path], capsys, monkeypatch)
    assert json.loads(out)["evicts_next"]["key"] == row["key"]
    _, [partial] = _files(tmp_path)
    with take_lock(lock_path(tmp_path / "kv", row["key"])):  # its read runs (another process)
        store = KVStore.open(tmp_path)
        [listed] = store.entries()
        assert listed.reading and store.next_evicted([listed]) is None
        assert store.prune(0)[0] == [] and partial.exists()
        assert store.remove([listed]) == 0 and partial.exists()
    code, out, err = run_cli(["cache", "prune", "--cache-max", "0", "--cache-dir", tmp_path], capsys, monkeypatch)
    assert code == 0 and "removed 1 entry" in out and not partial.exists(), err


def test_a_resume_point_of_the_largest_size_fits_either_slot(tmp_path):
    """The embedded model's geometry (30 layers, 3 KV heads, a 4,096-token window): Local's scores,
    not the facts, make a point's bytes; each of the two slots holds the largest one."""
    largest = BookCache.point_bytes(100_000, 30, 3, initial=4, local=4096, block_size=128)
    storage = FileStorage.create(tmp_path / "book", tensor_specs(1, 1, 8, 4, 1, torch.float16), largest)
    try:
        first, second = bytes([1]) * largest, bytes([2]) * largest
        storage.write_slot(7, first)
        storage.write_slot(8, second)
        assert storage.latest_slot() == (8, second)
        storage.write_slot(9, first[:100])
        assert storage.latest_slot() == (9, first[:100])
    finally:
        storage.close()
