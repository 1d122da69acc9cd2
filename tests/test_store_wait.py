"""What a run says while the store answers for it: waiting for another kvcli process computing the
same document's KV (which document, how far it is) instead of silence; nothing of a read when the
document's KV came from the store (a hit); a resumed book read counts from where it resumed."""

from __future__ import annotations

import threading
import time
from io import StringIO

from rich.console import Console

from kvcli.answer.pipeline import Pipeline
from kvcli.answer.question import QuestionOptions
from kvcli.cli import live
from kvcli.documents import document_from_text
from kvcli.store import Holder, take_lock
from kvcli.store.keys import lock_path
from kvcli.store.locks import write_holder
from tests.helpers.books import DOC as BOOK
from tests.helpers.books import SPEC as BOOK_SPEC
from tests.helpers.stores import (
    DOC,
    Q1,
    Q2,
    session_for,
    silent_notices,  # noqa: F401  (autouse: the store\'s warnings silenced, forgotten after each test)
)
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one intra-op thread in this module)


def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_run_waiting_for_another_process_says_which_document_and_how_far(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    first = session_for(lm, tmp_path).ask(document_from_text(DOC), Q1, Pipeline.parse("full"))
    digest = first.extra["cache"]["key"]
    session = session_for(lm, tmp_path)
    session.store.remove(session.store.entries())  # computed again: under the lock another process holds
    holder = Holder(4242, "elsewhere", "/home/u/manual.pdf", 36245, 9061, time.time() - 5)
    said, results = [], []
    with take_lock(lock_path(tmp_path / "kv", digest)) as handle:  # another process computes it
        write_holder(handle, holder)
        asking = threading.Thread(
            target=lambda: results.append(
                session.ask(document_from_text(DOC), Q2, Pipeline.parse("full"), QuestionOptions(on_wait=said.append))
            )
        )
        asking.start()
        _until(lambda: said)
        holder.done = 18122
        write_holder(handle, holder)
        _until(lambda: any("18,122" in (s or "") for s in said))
    asking.join(timeout=60)
    assert said[0] == (
        "waiting for another kvcli process (pid 4242 on elsewhere) reading manual.pdf: 9,061/36,245 tokens (25%)"
    )
    assert said[-1] is None  # the wait is over
    assert results and results[0].extra["cache"]["status"] == "miss"


def test_a_hit_says_nothing_of_a_read(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    for spec, doc in (("full", DOC), (BOOK_SPEC, BOOK)):
        session = session_for(lm, tmp_path / spec.split(":")[0])
        cold, warm = [], []
        session.ask(document_from_text(doc), Q1, Pipeline.parse(spec), QuestionOptions(on_progress=cold.append))
        result = session_for(lm, tmp_path / spec.split(":")[0]).ask(
            document_from_text(doc), Q2, Pipeline.parse(spec), QuestionOptions(on_progress=warm.append)
        )
        assert result.extra["cache"]["status"] == "hit" and cold and cold[-1] > 0.9
        assert warm == [], (spec, warm)  # before: "3/36,245 tokens (0%)" on a stored book


def test_the_live_display_shows_the_wait_and_a_resumed_read():
    err = Console(file=StringIO(), width=200)  # piped
    with live.Reading(err) as reading:
        reading.on_prompt("infllm", 20000)
        reading.on_wait("waiting for another kvcli process (pid 7) reading a.pdf: 2,000/20,000 tokens (10%)")
        # within 30 s: not said
        reading.on_wait("waiting for another kvcli process (pid 7) reading a.pdf: 2,500/20,000 tokens (12%)")
        reading.waited -= live.LINE_EVERY_S
        reading.on_wait("waiting for another kvcli process (pid 7) reading a.pdf: 9,000/20,000 tokens (45%)")
        reading.on_wait(None)
        reading.on_resume(0.6)  # the other process was killed: this one resumes its read
        reading.t0 -= 10
        reading.on_progress(0.75)
    lines = err.file.getvalue().splitlines()
    assert lines[:2] == [
        "kvcli: waiting for another kvcli process (pid 7) reading a.pdf: 2,000/20,000 tokens (10%)",
        "kvcli: waiting for another kvcli process (pid 7) reading a.pdf: 9,000/20,000 tokens (45%)",
    ]
    # 3,000 tokens in 10 s since it resumed at 12,000: 300 tok/s, 5,000 left
    assert lines[2] == "kvcli: infllm · 20,000 tokens: 15,000/20,000 tokens (75%) · 300 tok/s · 0m 16s left"
    terminal = Console(file=StringIO(), force_terminal=True, width=200)
    with live.Reading(terminal) as reading:
        reading.on_prompt("full attention", 100)
        reading.on_wait("waiting for another kvcli process (pid 7) reading a.pdf")
        assert reading.status is not None and reading.label == "full attention · 100 tokens"
        reading.on_wait(None)


def test_a_book_read_says_how_far_it_is_in_its_lock_file(tiny_lm, tmp_path, monkeypatch):
    """What a waiting process reads: the document and the tokens read, after every chunk."""
    from kvcli.caches.book import BookCache
    from kvcli.store import KVStore, kvstore
    from kvcli.store.locks import read_holder
    from tests.helpers.books import CHUNK, answer

    monkeypatch.setattr(kvstore, "PROGRESS_EVERY_S", 0.0)
    seen = []
    original = BookCache.end_chunk

    def watched(self):
        original(self)
        [lock] = (tmp_path / "kv" / "locks").glob("*.lock")
        seen.append(read_holder(lock))

    monkeypatch.setattr(BookCache, "end_chunk", watched)
    result = answer(tiny_lm("llama"), KVStore.open(tmp_path))
    assert seen[0].document == "doc.txt" and seen[0].n_tokens == result.prompt.prefix_len and seen[0].done is None
    assert [h.done for h in seen[1:6]] == [CHUNK * i for i in range(1, 6)]
    assert "doc.txt: 60/" in seen[5].describe()
