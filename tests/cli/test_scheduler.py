"""The Ray executor's scheduling decisions, without Ray (kvcli.scheduler): which document goes to
which worker and in what order, retries on another worker, documents no worker can take, workers
joining late or never, and a batch cut short by --fail-fast; then a random walk over the events
checking what must always hold. tests/cli/test_ray.py runs the same rules on a real Ray instance."""

from __future__ import annotations

import random

import pytest

from kvcli.batch import Input, Job, Work
from kvcli.errors import KvcliError
from kvcli.executors import Executor, WorkerError, document_events, run_batch
from kvcli.scheduler import MAX_ATTEMPTS, Dispatch, Fail, Scheduler, default_window, dispatch_order, worker_count


def _jobs(*sizes: int) -> list[Job]:
    """Documents of these lengths (their text is known, as stdin's is: no file to read)."""
    return [Job(i, Input(f"d{i}.txt"), text="x" * size) for i, size in enumerate(sizes)]


def _sent(actions) -> list[tuple[int, str]]:
    assert all(isinstance(a, (Dispatch, Fail)) for a in actions)
    return [(a.job.index, a.worker) for a in actions if isinstance(a, Dispatch)]


def _failed(actions) -> list[tuple[int, str]]:
    return [(a.job.index, a.message) for a in actions if isinstance(a, Fail)]


# --- the order documents go out in --------------------------------------------------------------


def test_dispatch_order_is_longest_first_within_windows_counted_from_the_end(tmp_path):
    sizes = [5, 1, 9, 3, 7, 2, 8, 6, 4, 10]
    jobs = []
    for i, size in enumerate(sizes):
        (tmp_path / f"d{i}.txt").write_text("x" * size)
        jobs.append(Job(i, Input(str(tmp_path / f"d{i}.txt"))))
    order = lambda window: [j.index for j in dispatch_order(jobs, window)]
    assert order(100) == sorted(range(10), key=lambda i: -sizes[i])  # one window: longest first
    # windows of 4 from the end: [0, 1] [2, 3, 4, 5] [6, 7, 8, 9], each longest first, in input order
    assert order(4) == [0, 1, 2, 4, 3, 5, 9, 6, 7, 8]
    stdin = Job(10, Input("-"), text="y" * 50)  # stdin's text counts, a missing file is 0
    missing = Job(11, Input(str(tmp_path / "gone.txt")))
    assert [j.index for j in dispatch_order([missing, stdin], 10)] == [10, 11]


def test_each_document_goes_whole_to_the_worker_free_longest_longest_first():
    """test_ray's batch: 6 documents and a corrupt one (0 bytes here), 2 workers."""
    plan = Scheduler(_jobs(2, 9, 1, 5, 3, 7, 0), ["a", "b"])
    assert _sent(plan.start()) == [(1, "a"), (5, "b")]
    assert _sent(plan.finished("b")) == [(3, "b")]
    assert _sent(plan.finished("a")) == [(4, "a")]
    assert _sent(plan.finished("a")) == [(0, "a")]
    assert _sent(plan.finished("b")) == [(2, "b")]
    assert _sent(plan.finished("b")) == [(6, "b")]
    assert not plan.done
    assert plan.finished("a") == [] and plan.finished("b") == [] and plan.done
    assert plan.retried == 0 and plan.failures == {}


def test_the_window_counts_the_workers_still_loading():
    """41 documents, longer and longer: the first window is [0] with 40 (1 worker ready and 4
    loading: 8 x 5), [0..8] with 32 (the 1 ready alone)."""
    assert (default_window(1), default_window(4), default_window(5)) == (32, 32, 40)
    sizes = list(range(1, 42))
    assert _sent(Scheduler(_jobs(*sizes), ["a"], loading=4).start()) == [(0, "a")]
    assert _sent(Scheduler(_jobs(*sizes), ["a"]).start()) == [(8, "a")]
    assert _sent(Scheduler(_jobs(*sizes), ["a"], loading=4, window=10).start()) == [(0, "a")]  # 41 = 1 + 4 x 10


def test_a_worker_that_joins_late_takes_the_next_document():
    plan = Scheduler(_jobs(3, 2, 1), ["a"], loading=2)
    assert _sent(plan.start()) == [(0, "a")]
    assert _sent(plan.joined("b")) == [(1, "b")]
    assert plan.not_joined() == []  # the third never loads: nothing to say while the others work
    assert _sent(plan.finished("b")) == [(2, "b")]
    assert plan.finished("a") == [] and plan.finished("b") == [] and plan.done


def test_the_worker_free_longest_takes_the_next_document():
    plan = Scheduler(_jobs(3, 2, 1), ["a", "b", "c"])
    assert _sent(plan.start()) == [(0, "a"), (1, "b"), (2, "c")]
    assert plan.finished("b") == [] and plan.finished("a") == []  # b free first, then a
    assert _sent(plan.failed("c", "worker killed", lost=True)) == [(2, "b")]
    assert plan.finished("b") == [] and plan.done


def test_worker_count_one_per_gpu_or_cpu_never_more_than_the_documents():
    assert worker_count("auto", 4, 64, None, None) == (True, 4)  # one per GPU
    assert worker_count("auto", 0, 8, None, 100) == (False, 8)  # no GPU: one per CPU
    assert worker_count("cpu", 4, 8, None, None) == (False, 8)  # --device cpu leaves the GPUs alone
    assert worker_count("cuda", 2, 8, 5, 3) == (True, 3)  # --workers 5, but 3 documents
    assert worker_count("cpu", 0, 8, None, None, threads=2) == (False, 4)  # one per 2 CPUs: 2 threads each
    assert worker_count("cpu", 0, 2, None, None, threads=4) == (False, 1)  # at least one
    assert worker_count("auto", 0, 0, None, 0) == (False, 1)  # at least one
    with pytest.raises(KvcliError, match="^--device cuda: the Ray cluster has no GPUs$"):
        worker_count("cuda", 0, 8, 2, 10)


# --- failures -----------------------------------------------------------------------------------


def test_a_killed_worker_s_document_is_retried_first_on_another_worker_and_answered_once():
    """test_ray's killed actor: the document it was answering goes to the other worker before any
    document not yet started, and the dead worker takes nothing more."""
    plan = Scheduler(_jobs(5, 3, 1), ["a", "b"])
    assert _sent(plan.start()) == [(0, "a"), (1, "b")]
    assert plan.failed("a", "worker killed", lost=True) == []  # b is busy: the retry waits for it
    assert plan.retried == 1 and not plan.done
    assert _sent(plan.finished("b")) == [(0, "b")]  # the retry first, then the rest
    assert _sent(plan.finished("b")) == [(2, "b")]
    assert plan.finished("b") == [] and plan.done and plan.alive == {"b"}


def test_a_document_that_kills_every_worker_fails_with_each_reason():
    """test_ray's poison document: it kills its worker, then the other one."""
    plan = Scheduler(_jobs(9, 0), ["a", "b"])
    assert _sent(plan.start()) == [(0, "a"), (1, "b")]
    assert plan.failed("b", "worker killed", lost=True) == []
    assert _sent(plan.finished("a")) == [(1, "a")]
    actions = plan.failed("a", "worker killed", lost=True)
    assert _failed(actions) == [(1, "failed on 2 Ray workers (worker killed; worker killed)")] and plan.done
    assert plan.retried == 1 and plan.alive == set()


def test_a_document_a_live_worker_failed_is_not_given_back_to_it():
    """A worker whose document failed (not died) keeps working on other documents, never on that
    one: it waits for another worker, and fails when the only other worker dies."""
    plan = Scheduler(_jobs(9, 5, 1), ["a", "b"])
    assert _sent(plan.start()) == [(0, "a"), (1, "b")]
    assert _sent(plan.failed("a", "worker error: MemoryError: x", lost=False)) == [(2, "a")]  # not 0, queued first
    assert plan.finished("a") == []  # a is free and 0 waits: b may take it
    actions = plan.failed("b", "worker died", lost=True)  # b dies with document 1: a takes it, 0 has no one left
    assert _sent(actions) == [(1, "a")]
    assert _failed(actions) == [
        (0, "failed on 1 Ray worker (worker error: MemoryError: x); no other worker left to retry it")
    ]
    assert plan.finished("a") == [] and plan.done


def test_a_retry_waits_for_a_worker_still_loading_and_fails_when_it_never_comes():
    plan = Scheduler(_jobs(4, 2), ["a"], loading=1)
    assert _sent(plan.start()) == [(0, "a")]
    assert _sent(plan.failed("a", "worker error: boom", lost=False)) == [(1, "a")]  # 0 waits for the loading one
    assert plan.finished("a") == []
    assert _failed(plan.not_joined()) == [
        (0, "failed on 1 Ray worker (worker error: boom); no other worker left to retry it")
    ]
    assert plan.done
    # the same, when the other worker does come: it takes the retry
    plan = Scheduler(_jobs(4, 2), ["a"], loading=1)
    plan.start()
    plan.failed("a", "worker error: boom", lost=False)
    plan.finished("a")
    assert _sent(plan.joined("b")) == [(0, "b")] and plan.finished("b") == [] and plan.done


def test_when_every_worker_is_dead_the_documents_left_fail():
    plan = Scheduler(_jobs(5, 4, 3, 2), ["a", "b"])
    assert _sent(plan.start()) == [(0, "a"), (1, "b")]
    assert plan.failed("a", "worker died: out of memory", lost=True) == []  # 0 waits for b
    actions = plan.failed("b", "worker killed", lost=True)
    assert _sent(actions) == []
    assert _failed(actions) == [
        (1, "failed on 1 Ray worker (worker killed); no other worker left to retry it"),  # first in line now
        (0, "failed on 1 Ray worker (worker died: out of memory); no other worker left to retry it"),
        (2, "no Ray worker left to answer it"),
        (3, "no Ray worker left to answer it"),
    ]
    assert plan.done


def test_with_no_worker_at_all_every_document_fails_once_none_is_loading():
    plan = Scheduler(_jobs(1, 2), [], loading=1)
    assert plan.start() == [] and not plan.done  # one may still come
    assert _failed(plan.not_joined()) == [
        (1, "no Ray worker left to answer it"),
        (0, "no Ray worker left to answer it"),
    ]
    assert plan.done


# --- fail-fast: the batch stops at the first error in input order ------------------------------


class _Simulated(Executor):
    """A batch on workers driven by the scheduler, without Ray: ``outcome(job index, worker)`` says
    how each try ends (``None``: its records; else why its worker died), and documents finish in
    the order the workers took them. Remembers what was still running when the batch closed it."""

    def __init__(self, workers: list[str], outcome) -> None:
        self.workers, self.outcome = workers, outcome
        self.dispatched: list[tuple[int, str]] = []
        self.stopped: list[str] | None = None

    def run(self, jobs, work, *, on_start=None, stdin_text=None):
        plan = Scheduler(jobs, self.workers)
        running: list[tuple[Job, str]] = []
        actions = plan.start()
        try:
            while True:
                for action in actions:
                    if isinstance(action, Fail):
                        records = work.error_records(action.job.item.source, WorkerError(action.message))
                        yield from document_events(action.job.index, records)
                    else:
                        self.dispatched.append((action.job.index, action.worker))
                        running.append((action.job, action.worker))
                if plan.done:
                    return
                job, worker = running.pop(0)
                death = self.outcome(job.index, worker)
                if death is not None:
                    actions = plan.failed(worker, death, lost=True)
                    continue
                records = [{"document": job.item.source, "question": q, "answer": worker} for q in work.questions]
                yield from document_events(job.index, records)
                actions = plan.finished(worker)
        finally:
            self.stopped = [worker for _, worker in running]


def test_fail_fast_stops_at_the_first_error_in_input_order_and_stops_the_busy_workers():
    """Document 1 kills both workers it goes to (its error records come after documents 2 and 3
    are answered); with --fail-fast the batch ends at its first error record, the records of 2 and 3
    never show, and the worker still answering document 4 is stopped."""
    items = [Input(f"d{i}.txt") for i in range(5)]

    def outcome(index: int, worker: str):
        return "worker killed" if index == 1 else None

    questions = ["Q1?", "Q2?"]
    executor = _Simulated(["a", "b", "c"], outcome)
    records = list(run_batch(executor, items, questions, pipeline=None, fail_fast=True))
    assert [(r["document"], r["question"], "error" in r) for r in records] == [
        ("d0.txt", "Q1?", False),
        ("d0.txt", "Q2?", False),
        ("d1.txt", "Q1?", True),
    ]
    assert records[-1]["error"] == "failed on 2 Ray workers (worker killed; worker killed)"
    assert executor.dispatched == [(0, "a"), (1, "b"), (2, "c"), (3, "a"), (1, "c"), (4, "a")]
    assert executor.stopped == ["a"]  # answering document 4 when the batch stopped
    # without --fail-fast: every record, each once, in input order, the failed document's too
    executor = _Simulated(["a", "b", "c"], outcome)
    records = list(run_batch(executor, items, questions, pipeline=None))
    assert [(r["document"], r["question"]) for r in records] == [(i.source, q) for i in items for q in questions]
    assert [r["document"] for r in records if "error" in r] == ["d1.txt"] * 2 and executor.stopped == []


def test_a_failed_document_gives_one_error_record_per_question_or_one_with_fail_fast():
    questions = ("Q1?", "Q2?", "Q3?")
    records = list(Work(questions, None).error_records("a.txt", RuntimeError("boom")))
    assert [(r["question"], r["error_type"]) for r in records] == [(q, "InternalError") for q in questions]
    assert [
        r["question"] for r in Work(questions, None, fail_fast=True).error_records("a.txt", RuntimeError("boom"))
    ] == ["Q1?"]


# --- a random walk over the events --------------------------------------------------------------


@pytest.mark.parametrize("seed", range(200))
def test_random_events_answer_or_fail_every_document_once_and_never_stall(seed):
    """Random workers joining, never loading, finishing, failing or dying: every document is
    answered or failed exactly once, never tried twice on one worker nor more than MAX_ATTEMPTS
    times, never sent to a busy or dead worker; the run never waits on nothing; a document fails
    before its last try only when no live or loading worker could take it."""
    rng = random.Random(seed)
    jobs = _jobs(*(rng.randrange(0, 50) for _ in range(rng.randrange(0, 12))))
    ready = [f"w{i}" for i in range(rng.randrange(0, 4))]
    loading = [f"late{i}" for i in range(rng.randrange(0, 3))]
    plan = Scheduler(jobs, ready, loading=len(loading), window=rng.choice([None, 1, 3]))
    busy: dict[str, int] = {}
    dead: set[str] = set()
    tries: dict[int, list[str]] = {}
    ended: dict[int, str] = {}
    failed_once: set[int] = set()

    def apply(actions) -> None:
        for action in actions:
            index = action.job.index
            assert index not in ended
            if isinstance(action, Dispatch):
                assert action.worker not in busy and action.worker not in dead
                assert action.worker not in tries.get(index, []) and len(tries.get(index, [])) < MAX_ATTEMPTS
                tries.setdefault(index, []).append(action.worker)
                busy[action.worker] = index
            else:
                ended[index] = "failed"
                n = len(tries.get(index, []))
                assert action.message.startswith("no Ray worker left" if n == 0 else f"failed on {n} Ray worker")
                if n < MAX_ATTEMPTS:  # early: nobody can take it
                    assert plan.loading == 0 and all(w in tries.get(index, []) for w in plan.alive)
        assert plan.done or plan.running or plan.loading  # something will happen, or all is done
        assert plan.running == {w: next(j for j in jobs if j.index == i) for w, i in busy.items()}

    apply(plan.start())
    for _ in range(200):
        if plan.done:
            break
        choices = [("run", w) for w in busy] + [("load", w) for w in loading]
        kind, worker = rng.choice(choices)
        if kind == "load":
            loading.remove(worker)
            apply(plan.joined(worker) if rng.random() < 0.7 else plan.not_joined())
            continue
        index = busy.pop(worker)
        roll = rng.random()
        if roll < 0.6:
            ended[index] = "answered"
            apply(plan.finished(worker))
            continue
        failed_once.add(index)
        if roll < 0.8:
            dead.add(worker)
            apply(plan.failed(worker, "worker killed", lost=True))
        else:
            apply(plan.failed(worker, "worker error: x", lost=False))
    assert plan.done and sorted(ended) == [j.index for j in jobs]
    # retried: the documents queued again after their first failure (sent again or not)
    assert plan.retried == len(failed_once) >= sum(len(t) - 1 for t in tries.values())
