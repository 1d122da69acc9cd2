"""kvcli ask --ray: the same batch on Ray actors (a local Ray instance on 2 CPUs, a tiny model).

The records equal the local batch's, each document runs on one actor, a killed actor's document is
retried elsewhere (records exactly once), a document that kills every worker is error records, an
interrupted run stops its workers and leaves the cache clean, and without Ray installed --ray is
one line. Also: the disk store without flock (a shared filesystem without locks)."""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcli import notices
from kvcli.api import AskOptions, Session, parse_pipeline
from kvcli.batch import expand_inputs
from kvcli.executors import LocalExecutor, RayExecutor, run_batch
from tests.helpers.cli_runner import run_cli

try:
    import ray  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'kvcli[ray]')")
QUESTIONS = ["Who was the keeper?", "How many ships arrived?", "What colour is the light?"]
# what differs from run to run (timings, memory) or names the worker
VOLATILE = {
    "ttft_s",
    "total_s",
    "decode_tokens_per_s",
    "peak_mem_mb",
    "cache_saved_s",
    "cache_entry_bytes",
    "worker",
    "sources_s",
    "threads",
}  # entry bytes: the header holds compute_s; threads: compared where the count is set (test_ray_workers_answer_on_the_local_run_s_thread_count)


def _text(i: int, repeat: int) -> str:
    line = f"The harbour log of port {i}: {3 + i} ships arrived, the keeper was Ada Brook, the light is red. "
    return line * repeat


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance on 2 CPUs for this module, shut down after it."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def folder(tmp_path):
    """6 documents of different lengths (longest not first) and a corrupt PDF."""
    d = tmp_path / "docs"
    d.mkdir()
    for i, repeat in enumerate([2, 9, 1, 5, 3, 7]):
        (d / f"doc{i}.txt").write_text(_text(i, repeat))
    (d / "broken.pdf").write_bytes(b"%PDF-1.4 this is not really a pdf")
    return d


def _options(model: str, cache: Path) -> AskOptions:
    return AskOptions(model=model, max_new_tokens=3, cache_dir=cache)


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in records]


def _local_records(model: str, inputs: list[str], cache: Path) -> list[dict]:
    executor = LocalExecutor(Session.open(_options(model, cache)))
    return list(run_batch(executor, expand_inputs(inputs), QUESTIONS, parse_pipeline("full")))


# --- the CLI: --ray local gives the local batch's records ------------------------------------


@pytest.mark.ray
@needs_ray
def test_ray_batch_records_equal_the_local_batch_and_each_document_stays_on_one_actor(
    ray_cluster, model, folder, tmp_path, capsys, monkeypatch
):
    questions = tmp_path / "q.txt"
    questions.write_text("\n".join(QUESTIONS) + "\n")

    def ask(*extra, cache):
        code, out, err = run_cli(
            [
                "ask",
                folder,
                "--questions",
                questions,
                "-m",
                model,
                "-c",
                "full",
                "--max-new-tokens",
                "3",
                "--cache-dir",
                tmp_path / cache,
                *extra,
            ],
            capsys,
            monkeypatch,
        )
        return code, [json.loads(line) for line in out.splitlines()], err

    code, local, local_err = ask(cache="local")
    code_ray, remote, ray_err = ask("--ray", "local", "--workers", "2", cache="ray")
    assert code == code_ray == 1  # the corrupt PDF
    assert len(remote) == 7 * 3
    assert _stable(remote) == _stable(local)  # answers, order, cache statuses, error records
    assert [r["document"] for r in remote if "error" in r] == [str(folder / "broken.pdf")] * 3
    # each document's questions ran on one actor, in order (miss, then the actor's memo/store),
    # and the documents were spread over both actors
    by_doc: dict[str, list[dict]] = {}
    for r in remote:
        by_doc.setdefault(r["document"], []).append(r)
    for doc, records in by_doc.items():
        assert len({r["worker"] for r in records}) == 1, doc
        if "error" not in records[0]:
            assert [r["cache"] for r in records] == ["miss", "hit", "hit"]
    assert len({r["worker"] for r in remote}) == 2
    # stderr: the same error lines, the summary names the workers
    assert [l for l in ray_err.splitlines() if l.startswith("kvcli: error:")] == [
        l for l in local_err.splitlines() if l.startswith("kvcli: error:")
    ]
    assert ray_err.splitlines()[-1] == local_err.splitlines()[-1] + " · 2 Ray CPU workers"
    # nothing else on stderr: Ray's own logging stays in its log files
    assert all(l.startswith("kvcli: error:") for l in ray_err.splitlines()[:-1]), ray_err


@pytest.mark.ray
@needs_ray
def test_ray_workers_answer_on_the_local_run_s_thread_count(ray_cluster, model, tmp_path):
    """An answer may change with the thread count on a near tie: a Ray worker (one CPU, one thread
    to Ray) runs on the count the local run starts on, so every field but the timings is equal,
    ``threads`` included."""
    import torch

    docs = tmp_path / "two"
    docs.mkdir()
    for i in range(2):
        (docs / f"doc{i}.txt").write_text(_text(i, 2))
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the local run's count, whatever the test runner gave this process
    try:
        local = _local_records(model, [str(docs)], tmp_path / "local")
        with RayExecutor(_options(model, tmp_path / "ray"), "local", 2) as executor:
            remote = list(run_batch(executor, expand_inputs([str(docs)]), QUESTIONS, parse_pipeline("full")))
    finally:
        torch.set_num_threads(before)
    timings = VOLATILE - {"threads"}
    assert len({r["worker"] for r in remote}) == 2
    assert [r["threads"] for r in local] == [{"prefill": [2], "decode": [2]}] * 2 * len(QUESTIONS)
    assert [{k: v for k, v in r.items() if k not in timings} for r in remote] == [
        {k: v for k, v in r.items() if k not in timings} for r in local
    ]


# --- faults ------------------------------------------------------------------------------------


def _fifo_document(folder: Path, text: str) -> tuple[Path, Callable]:
    """A document whose reader blocks until ``feed()`` writes its text: a worker answering it is
    certainly mid-document until then."""
    path = folder / "slow.txt"
    os.mkfifo(path)
    feeders: list[threading.Thread] = []

    def feed() -> None:
        def write():
            with open(path, "w") as f:  # blocks until a reader opens the other end
                f.write(text)

        feeders.append(threading.Thread(target=write, daemon=True))
        feeders[-1].start()

    feed.threads = feeders
    return path, feed


def _release(path: Path, feed) -> None:
    """Unblock a feeder still waiting for a reader (a failed test)."""
    for thread in feed.threads:
        if thread.is_alive():
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            thread.join(5)
            os.close(fd)


def _by_pair(records: list[dict]) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for r in records:
        counts[(r["document"], r["question"])] = counts.get((r["document"], r["question"]), 0) + 1
    return counts


@pytest.mark.ray
@needs_ray
def test_a_killed_actor_s_document_is_retried_on_another_and_every_record_comes_once(
    ray_cluster, model, folder, tmp_path
):
    slow_text = _text(9, 4)
    slow, feed = _fifo_document(tmp_path, slow_text)
    inputs = [str(folder), str(slow)]  # the FIFO outside the folder (a folder lists files only)
    items = expand_inputs(inputs)
    slow_index = [i.source for i in items].index(str(slow))
    killed: list[str] = []
    executor = RayExecutor(_options(model, tmp_path / "cache"), "local", 2)

    def on_dispatch(index: int, worker_id: str) -> None:
        if index != slow_index:
            return
        if not killed:  # first try: kill its worker while it waits for the document
            killed.append(worker_id)
            handle = next(w.handle for w in executor.workers if w.id == worker_id)
            ray_cluster.kill(handle, no_restart=True)
        else:  # the retry, on the other worker: now the document can be read
            feed()

    dispatched: list[int] = []
    executor.on_dispatch = lambda index, worker_id: dispatched.append(index) or on_dispatch(index, worker_id)
    try:
        with executor:
            records = list(run_batch(executor, items, QUESTIONS, parse_pipeline("full")))
            assert executor.dead == killed and executor.retried == 1
    finally:
        _release(slow, feed)
    slow.unlink()
    slow.write_text(slow_text)  # the same document as a plain file, for the local reference
    local = _local_records(model, inputs, tmp_path / "local-cache")
    assert all(n == 1 for n in _by_pair(records).values()) and len(records) == 8 * 3 == len(local)
    assert _stable(records) == _stable(local)
    slow_records = [r for r in records if r["document"] == str(slow)]
    assert [r["cache"] for r in slow_records] == ["miss", "hit", "hit"]
    assert {r["worker"] for r in slow_records} != set(killed)  # answered by the other actor
    # longest first: doc1 (9 lines), doc5 (7), doc3 (5), ...; the FIFO (0 bytes) last, then its retry
    names = [Path(items[i].source).name for i in dispatched]
    assert names == [
        "doc1.txt",
        "doc5.txt",
        "doc3.txt",
        "doc4.txt",
        "doc0.txt",
        "doc2.txt",
        "broken.pdf",
        "slow.txt",
        "slow.txt",
    ]


@pytest.mark.ray
@needs_ray
def test_a_document_that_kills_every_worker_is_one_error_record_per_question(ray_cluster, model, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(_text(1, 3))
    poison, feed = _fifo_document(folder, "never read")
    killed: list[str] = []
    executor = RayExecutor(_options(model, tmp_path / "cache"), "local", 2)

    def on_dispatch(index: int, worker_id: str) -> None:
        if index == 1:  # the poison document: its worker dies, on every try
            killed.append(worker_id)
            ray_cluster.kill(next(w.handle for w in executor.workers if w.id == worker_id), no_restart=True)

    executor.on_dispatch = on_dispatch
    try:
        with executor:
            records = list(
                run_batch(
                    executor, expand_inputs([str(folder / "a.txt"), str(poison)]), QUESTIONS, parse_pipeline("full")
                )
            )
    finally:
        _release(poison, feed)
    assert len(killed) == 2 and len(set(killed)) == 2  # tried once, then once on the other worker
    assert [("error" in r, r["question"]) for r in records] == [(False, q) for q in QUESTIONS] + [
        (True, q) for q in QUESTIONS
    ]
    errors = records[3:]
    assert {r["error_type"] for r in errors} == {"WorkerError"}
    assert errors[0]["error"] == "failed on 2 Ray workers (worker killed; worker killed)"


@pytest.mark.ray
@needs_ray
def test_an_interrupted_ray_batch_kills_its_busy_workers_and_leaves_no_partial_cache_files(
    ray_cluster, model, folder, tmp_path
):
    from kvcli.store import KVStore

    cache = tmp_path / "cache"
    executor = RayExecutor(_options(model, cache), "local", 2)
    handles: list = []

    def on_dispatch(index: int, worker_id: str) -> None:
        handles.append(next(w.handle for w in executor.workers if w.id == worker_id))
        if len(handles) == 3:  # a document just sent to a worker: Ctrl-C
            raise KeyboardInterrupt

    executor.on_dispatch = on_dispatch
    with executor:
        with pytest.raises(KeyboardInterrupt):
            list(run_batch(executor, expand_inputs([str(folder)]), QUESTIONS, parse_pipeline("full")))
        # the worker with a document in flight was stopped
        with pytest.raises(ray_cluster.exceptions.RayActorError):
            ray_cluster.get(handles[2].ready.remote(), timeout=30)
    # and nothing is left half-written: no temporary files, every entry whole
    kv = cache / "kv"
    assert not list(kv.glob(".*.tmp"))
    assert all(e.error is None for e in KVStore(kv).entries())


def _slow_entry_writes():
    """Ray worker setup hook (one test's instance only): an entry's bytes go to its temporary file,
    then the writer says so in the marker file and waits before the rename — a write in flight."""
    import os
    import time as _time

    from kvcli import files

    real = files.write_safetensors

    def slow(filename, *args, **kwargs):
        real(filename, *args, **kwargs)
        with open(os.environ["KVCLI_TEST_WRITE_MARKER"], "a", encoding="utf-8") as f:
            f.write(f"{filename}\n")
        _time.sleep(120)

    files.write_safetensors = slow


@pytest.mark.ray
@needs_ray
def test_ctrl_c_while_a_worker_writes_an_entry_leaves_no_torn_entry(ray_cluster, model, folder, tmp_path):
    """The Ctrl-C above comes at a dispatch, with no write proven in flight. Here a worker has
    written an entry's bytes to its temporary file and not yet renamed it when Ctrl-C comes: the
    worker is killed mid-write, the temporary file is all it leaves (no entry, torn or whole), and
    the next run's store reclaims it."""
    from kvcli.store import KVStore

    marker = tmp_path / "writing"
    ray_cluster.shutdown()  # this test's workers write slowly: an instance of its own
    ray_cluster.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
                     runtime_env={"env_vars": {"KVCLI_TEST_WRITE_MARKER": str(marker), "PYTHONPATH": str(Path(__file__).resolve().parents[2])},  # the hook's module
                                  "worker_process_setup_hook": _slow_entry_writes})  # fmt: skip
    try:
        cache = tmp_path / "cache"
        executor = RayExecutor(_options(model, cache), "local", 2)
        dispatched: list[str] = []

        def on_dispatch(index: int, worker_id: str) -> None:
            dispatched.append(worker_id)
            if len(dispatched) == 2:  # both workers busy: Ctrl-C once one of them is writing its entry
                deadline = time.monotonic() + 100
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise KeyboardInterrupt

        executor.on_dispatch = on_dispatch
        with executor, pytest.raises(KeyboardInterrupt):
            list(run_batch(executor, expand_inputs([str(folder)]), QUESTIONS, parse_pipeline("full")))
        in_flight = [Path(line) for line in marker.read_text(encoding="utf-8").split()]
        assert in_flight and all(p.exists() for p in in_flight)  # killed between the bytes and the rename
        kv = cache / "kv"
        assert not list(kv.glob("*.safetensors"))  # no entry was completed, so none can be torn
        # the next run: once a killed writer's process is gone (Ray stops it asynchronously) its
        # lock is free and its temporary file goes; a live writer's file is never touched. The
        # temporary files are counted as found: the other worker may be killed after its bytes and
        # before its marker line, leaving a file the marker does not list
        left, reclaimed, deadline = set(in_flight), 0, time.monotonic() + 60
        while True:
            left |= set(kv.glob(".*.tmp"))
            if not any(p.exists() for p in left) or time.monotonic() > deadline:
                break
            store = KVStore.open(cache)
            reclaimed += store.reclaimed.temp_files
            time.sleep(0.5)
        assert reclaimed == len(left) and not list(kv.glob(".*.tmp"))
        assert store.entries() == []
    finally:
        ray_cluster.shutdown()
        ray_cluster.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)


# --- without Ray ------------------------------------------------------------------------------


def test_ray_without_ray_installed_is_one_line_and_exit_2(folder, model, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code, out, err = run_cli(["ask", folder, "Who?", "-m", model, "--ray", "local"], capsys, monkeypatch)
    assert (code, out) == (2, "")
    assert err == "kvcli: error: --ray needs Ray, an optional extra: pip install 'kvcli[ray]'\n"
    code, out, err = run_cli(["ask", folder, "Who?", "-m", model, "--workers", "2"], capsys, monkeypatch)
    assert (
        code == 2 and out == "" and err.startswith("kvcli: error: --workers needs --ray") and len(err.splitlines()) == 1
    )


# --- the store on a filesystem without flock --------------------------------------------------


def test_store_without_flock_computes_without_the_lock_and_reclaims_by_age(tiny_lm, tmp_path, monkeypatch):
    from kvcli import store as store_module
    from kvcli.answer.prompt import load_template
    from kvcli.documents import document_from_text
    from kvcli.runtime.engine import Engine
    from kvcli.store import locks as store_locks

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(store_locks.fcntl, "flock", no_locks)
    notices.reset()
    said: list[str] = []
    notices.set_sink(said.append)
    try:
        lm = tiny_lm("llama")
        store = store_module.KVStore.open(tmp_path)
        session = Session(
            lm=lm,
            engine=Engine(lm),
            options=AskOptions(max_new_tokens=3, cache_dir=tmp_path),
            template=load_template(),
            store=store,
        )
        doc = document_from_text(_text(0, 3))
        first = session.ask(doc, QUESTIONS[0], parse_pipeline("full"))
        second = session.ask(doc, QUESTIONS[1], parse_pipeline("full"))
    finally:
        notices.set_sink(None)
        notices.reset()
    assert store.enabled and first.extra["cache"]["status"] == "miss" and second.extra["cache"]["status"] == "hit"
    assert len(list((tmp_path / "kv").glob("*.safetensors"))) == 1
    assert len(said) == 1 and "has no file locks" in said[0]
    # without locks a temporary file's writer cannot be told alive: a fresh one stays, an old one goes
    kv = tmp_path / "kv"
    fresh, old = kv / f".{'a' * 64}.safetensors.x1.tmp", kv / f".{'b' * 64}.safetensors.x2.tmp"
    fresh.write_bytes(b"x")
    old.write_bytes(b"y")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    left = store.reclaim()
    assert fresh.exists() and not old.exists() and left.temp_files == 1
