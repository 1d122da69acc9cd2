"""The store under stalls and crashes, with real signals in child processes (as
tests/test_book_resume.py does): a lock holder that is stopped (SIGSTOP) stops beating and its
waiter gives up after the stated time, with one line, and reads the document itself (a book into
memory: the stopped holder may still write its partial entry); a holder that runs is waited for; a
partial book counts against the cap at the bytes it holds, not its sparse full size; a read killed
at any point of its final write (after the final header, after the cut, before the rename) is kept
without reading the book again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvcli import notices
from kvcli.caches import KVCache
from kvcli.store import KVStore, locks
from kvcli.store.keys import StoreKey, lock_path
from tests.helpers.books import answer, entry_tensors
from tests.helpers.stores import silent_notices  # noqa: F401  (autouse: the store's warnings silenced, forgotten after each test)
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one intra-op thread in this module)
from tests.test_book_resume import _chunks  # the chunks a read goes through, counted (one helper for both)

REPO = Path(__file__).resolve().parent.parent
BEAT_S = 0.25  # the heartbeat here (5 s in kvcli): the floor of the stall time is 4 of them, 1 s
STALE_S = 1.5
KEY = StoreKey("ab" * 32, {"n_tokens": 7})


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), locks.STALE_ENV: str(STALE_S), **extra}


def _python(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        env=_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


HOLD = """
import sys, time
from kvcli.store import KVStore, locks
locks.HEARTBEAT_S = @BEAT@
from kvcli.store.keys import StoreKey
store = KVStore.open(sys.argv[1])
key = StoreKey(sys.argv[2], {"n_tokens": 7})
with store.lock(key, {"document": "held.txt"}):
    print("locked", flush=True)
    time.sleep(600)
""".replace("@BEAT@", str(BEAT_S))


@pytest.fixture(autouse=True)
def fast_beats(monkeypatch):
    """Heartbeats every BEAT_S in this process too (the floor of stale_after() follows them)."""
    monkeypatch.setattr(locks, "HEARTBEAT_S", BEAT_S)


@pytest.fixture
def holder(tmp_path):
    """A child process holding KEY's lock in the store under tmp_path (and beating)."""
    proc = _python(HOLD, tmp_path, KEY.digest)
    try:
        assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _waiting(store: KVStore, out: list) -> threading.Thread:
    def take() -> None:
        with store.lock(KEY) as owned:
            out.append((owned, time.monotonic()))

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


def test_the_stall_time_is_stated_and_overridable(monkeypatch):
    monkeypatch.delenv(locks.STALE_ENV, raising=False)
    assert locks.stale_after() == locks.STALE_AFTER_S == 120.0
    monkeypatch.setenv(locks.STALE_ENV, "2.5")
    assert locks.stale_after() == 2.5
    monkeypatch.setenv(locks.STALE_ENV, "soon")
    assert locks.stale_after() == locks.STALE_AFTER_S


def test_the_stall_time_has_a_floor_of_several_heartbeats(monkeypatch):
    """A short setting cannot give up on a holder between two of its beats."""
    monkeypatch.setattr(locks, "HEARTBEAT_S", 5.0)  # kvcli's own
    assert locks.stale_floor() == 20.0 >= 3 * locks.HEARTBEAT_S
    for short in ("0.5", "5", "19.9"):
        monkeypatch.setenv(locks.STALE_ENV, short)
        assert locks.stale_after() == 20.0
    monkeypatch.setenv(locks.STALE_ENV, "300")
    assert locks.stale_after() == 300.0


def test_staleness_is_seen_by_the_waiter_not_read_from_the_files_clock(tmp_path, monkeypatch):
    """A holder on a host whose clock is far behind (its lock file's mtime hours old however often
    it beats) is waited for while it beats; once it stops, the waiter gives up only after seeing
    the file unchanged for the whole period on its own clock, not at its first look."""
    monkeypatch.setenv(locks.STALE_ENV, str(STALE_S))
    store = KVStore.open(tmp_path)
    path = lock_path(store.root, KEY.digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    held = locks.take_lock(path)  # another open file: flock keeps it from the waiter, as another process
    skew = time.time() - 6 * 3600  # the holder's clock: six hours behind
    os.utime(path, (skew, skew))
    beating = threading.Event()
    beating.set()

    last_beat: list[float] = []  # when (on this clock) the file last changed

    def beat() -> None:  # the skewed holder's heartbeat: every BEAT_S, its own (old) time
        n = 0
        while beating.is_set():
            n += 1
            os.utime(path, (skew + n * BEAT_S, skew + n * BEAT_S))
            last_beat[:] = [time.monotonic()]
            time.sleep(BEAT_S)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        got: list = []
        thread = _waiting(store, got)
        time.sleep(3 * STALE_S)  # beating, however old its mtime: waited for
        assert got == [] and thread.is_alive()
        beating.clear()
        beater.join(timeout=5)
        thread.join(timeout=30)
        [(owned, when)] = got
        # from the file's last change (not from the join, which waits out the beater's sleep: under
        # load that made the measured wait look up to a beat short)
        assert owned is False and STALE_S * 0.9 <= when - last_beat[0] <= STALE_S + 5
    finally:
        held.close()

    # a waiter arriving at a lock file that has not changed for hours waits the period too
    held = locks.take_lock(path)
    try:
        os.utime(path, (skew, skew))
        got = []
        start = time.monotonic()
        _waiting(store, got).join(timeout=30)
        [(owned, when)] = got
        assert owned is False and when - start >= STALE_S
    finally:
        held.close()


def test_a_running_holder_is_waited_for_and_a_stopped_one_given_up_on(holder, tmp_path, monkeypatch):
    monkeypatch.setenv(locks.STALE_ENV, str(STALE_S))
    store = KVStore.open(tmp_path)
    got: list = []
    thread = _waiting(store, got)
    time.sleep(3 * STALE_S)  # the holder runs and beats: waited for, however long
    assert got == [] and thread.is_alive()

    os.kill(holder.pid, signal.SIGSTOP)  # stopped: its heartbeat stops with it
    stopped = time.monotonic()
    thread.join(timeout=30)
    [(owned, when)] = got
    assert owned is False and STALE_S * 0.5 <= when - stopped <= STALE_S + 5
    [line] = notices.collected()
    assert "held.txt" in line and "no sign of life" in line and locks.STALE_ENV in line


def test_a_holder_that_dies_lets_the_waiter_take_the_lock(holder, tmp_path, monkeypatch):
    monkeypatch.setenv(locks.STALE_ENV, "60")
    store = KVStore.open(tmp_path)
    got: list = []
    thread = _waiting(store, got)
    time.sleep(0.5)
    holder.kill()  # the kernel releases its flock
    thread.join(timeout=30)
    assert [owned for owned, _ in got] == [True] and notices.collected() == []


def test_a_fetch_behind_a_stopped_holder_computes_and_keeps_its_entry(holder, tmp_path, monkeypatch):
    monkeypatch.setenv(locks.STALE_ENV, str(STALE_S))
    os.kill(holder.pid, signal.SIGSTOP)
    store = KVStore.open(tmp_path)
    cache = KVCache()
    cache.keys, cache.values = [torch.zeros(1, 1, 7, 4)], [torch.ones(1, 1, 7, 4)]
    cache.positions = torch.arange(7)
    state, fetched = store.fetch(KEY, lambda: cache, {"document": "mine.txt"})
    assert fetched.status == "miss" and state is cache
    assert KVStore.open(tmp_path).load(KEY) is not None  # written atomically, readable
    assert len(notices.collected()) == 1


# --- books ---------------------------------------------------------------------------------------


@pytest.fixture
def lm(tiny_lm):
    return tiny_lm("llama")


def _book_key(lm):
    from kvcli.answer.prefix import chunked_state
    from kvcli.answer.prompt import build_prompt
    from kvcli.compressors import parse_one
    from kvcli.runtime.engine import Engine
    from kvcli.store import make_key
    from tests.helpers.books import DOC, QUESTION, SPEC

    prompt = build_prompt(lm.tokenizer, DOC, QUESTION)
    ids = prompt.ids[: prompt.prefix_len]
    return make_key(lm, ids, chunked_state(Engine(lm), ids, parse_one(SPEC).prefix_state(lm)))


def test_a_book_behind_a_stopped_holder_is_read_into_memory(lm, reference, tmp_path, monkeypatch):
    monkeypatch.setenv(locks.STALE_ENV, str(STALE_S))
    key = _book_key(lm)
    proc = _python(HOLD, tmp_path, key.digest)
    try:
        assert proc.stdout.readline().strip() == "locked"
        os.kill(proc.pid, signal.SIGSTOP)
        result = answer(lm, KVStore.open(tmp_path))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert result.extra["cache"]["status"] == "off"  # read, not stored: the holder's partial entry is its own
    assert list((tmp_path / "kv").glob("*.safetensors")) == []
    assert result.answer_ids == reference[0].answer_ids


def _killed_read(tiny_dir, flag: str, program: str, cache, arg: str) -> None:
    """Run ``python flag program <tiny model> cache arg`` (a read that kills itself) to its SIGKILL."""
    model = str(tiny_dir("llama", num_hidden_layers=4))
    proc = subprocess.run(
        [sys.executable, flag, program, model, str(cache), arg],
        env=_env(),
        cwd=REPO,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr


KILL_IN_FINISH = """
import os, signal, sys
import torch
from kvcli.caches import bookfile
from kvcli.model import load_model
from kvcli.store import KVStore, book
from tests.helpers.books import answer

folder, cache, point = sys.argv[1:]
torch.set_num_threads(1)
book.CHECKPOINT_EVERY_S = 0.0
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
final = [False]
write_header = bookfile.FileStorage._write_header
def header(self, metadata, specs):
    write_header(self, metadata, specs)
    final[0] = any('"crc32"' in v for v in metadata.values())
    if final[0] and point == "header":
        die()
bookfile.FileStorage._write_header = header
ftruncate = os.ftruncate
def cut(fd, n):
    ftruncate(fd, n)
    if final[0] and point == "cut":
        die()
os.ftruncate = cut
replace = os.replace
def rename(a, b):
    if final[0] and point == "rename":
        die()
    return replace(a, b)
os.replace = rename
answer(load_model(folder, device="cpu", dtype="float32"), KVStore.open(cache))
"""


@pytest.mark.parametrize("point", ["header", "cut", "rename"])
def test_a_kill_in_the_final_write_is_kept_without_reading_the_book_again(
    lm, reference, tiny_dir, tmp_path, monkeypatch, point
):
    """SIGKILL after the final header is written (the resume region still there), after the region
    is cut off, and just before the rename: the next ask opens the book as stored, reads no chunk."""
    cache = tmp_path / "c"
    _killed_read(tiny_dir, "-c", KILL_IN_FINISH, cache, point)
    [partial] = (cache / "kv").glob("*.partial.safetensors")
    assert list((cache / "kv").glob("*.safetensors")) == [partial]
    read = _chunks(monkeypatch)
    result = answer(lm, KVStore.open(cache))
    assert read == [] and result.extra["cache"]["status"] == "hit"  # not read again
    assert result.answer_ids == reference[0].answer_ids
    [entry] = (cache / "kv").glob("*.safetensors")
    got, want = entry_tensors(entry), reference[1]
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert any("not read again" in line for line in notices.collected())


def test_a_partial_book_counts_at_the_bytes_it_holds(lm, tiny_dir, tmp_path, monkeypatch):
    """A read killed early leaves a partial entry of its full size, sparse: the cap and cache ls
    count the blocks it holds, so it pushes out no entry the bytes it does not hold would."""
    cache = tmp_path / "c"
    _killed_read(tiny_dir, "-m", "tests.helpers.books", cache, "2")
    [partial] = (cache / "kv").glob("*.partial.safetensors")
    st = partial.stat()
    held = st.st_blocks * 512
    if held >= st.st_size:
        pytest.skip("this filesystem has no sparse files")
    store = KVStore.open(cache)
    [entry] = store.entries()
    assert entry.partial and entry.size == held < st.st_size

    # an older entry and a new one: under a cap that fits them with the partial's held bytes, not
    # with its full size, nothing goes (counted at its full size, the older entry was pushed out)
    def kv(n: int) -> KVCache:
        c = KVCache()
        c.keys, c.values = [torch.zeros(1, 1, n, 64)], [torch.zeros(1, 1, n, 64)]
        c.positions = torch.arange(n)
        return c

    old_key, new_key = StoreKey("01" * 32, {"n_tokens": 64}), StoreKey("02" * 32, {"n_tokens": 64})
    store.fetch(old_key, lambda: kv(64), {"document": "old.txt"})
    old_path = store.path_of(old_key.digest)
    os.utime(old_path, (time.time() - 3600, time.time() - 3600))  # the least recently used
    size = old_path.stat().st_size
    store.max_bytes = 2 * size + held + (st.st_size - held) // 2
    assert 2 * size + st.st_size > store.max_bytes
    store.fetch(new_key, lambda: kv(64), {"document": "new.txt"})
    assert old_path.exists() and store.path_of(new_key.digest).exists() and partial.exists()
    assert not any("made room" in line for line in notices.collected())
