"""Which document goes to which worker, and what becomes of a document whose worker fails: the
decisions of a batch on several workers, as a plain object that neither waits nor calls anyone.

    plan = Scheduler(jobs, workers=["w1", "w2"])
    actions = plan.start()                 # [Dispatch(job, "w1"), Dispatch(job, "w2")]
    actions = plan.finished("w1")          # its document's records are out: "w1" takes the next
    actions = plan.failed("w2", "worker killed", lost=True)   # retried on "w1" when it is free
    ...
    until plan.done

Each event (a worker joined or could not load, a document finished or failed) returns what to do
now, in order: :class:`Dispatch` a document to a worker, or :class:`Fail` it (its questions become
error records with that message). A worker is anything hashable that the caller knows it by
(:class:`~kvcli.executors.RayExecutor` passes its actors' records, the tests strings).

The rules:

* Documents go out longest first within windows of the input order (:func:`dispatch_order`), one
  whole document per worker, to the worker that has been free longest.
* A document whose worker died or failed is retried once (:data:`MAX_ATTEMPTS` in all), first in
  line, on a worker it has not failed on; a worker that died takes nothing more, one that failed
  takes other documents.
* A document is failed when it has failed :data:`MAX_ATTEMPTS` times, or when no worker can take it
  any more (every live worker failed it, or none is alive) and none is still loading.

How many workers a cluster gets is :func:`worker_count`'s choice.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from .batch import Job
from .errors import KvcliError

MAX_ATTEMPTS = 2  # a document runs on at most this many workers: once, and once again elsewhere


@dataclass(frozen=True)
class Dispatch:
    """Send ``job`` to ``worker`` (which was free)."""

    job: Job
    worker: Hashable


@dataclass(frozen=True)
class Fail:
    """``job`` will not be answered: give its questions as error records saying ``message``."""

    job: Job
    message: str


def default_window(n_workers: int) -> int:
    """How many documents of the input order are balanced together (:func:`dispatch_order`)."""
    return max(32, 8 * n_workers)


def dispatch_order(jobs: list[Job], window: int) -> list[Job]:
    """The order documents are handed to workers: longest first within consecutive windows of
    ``window`` documents of the input order. Longest first keeps every worker busy to the end
    (a long document started last would leave the others idle); windows keep the output
    streaming, since a record is written only when every document before it is done, and keep
    that wait to about one window. Windows are counted from the end, so the last one is whole
    (where balancing matters) and the first one short (the first records come sooner)."""
    n = len(jobs)
    return sorted(jobs, key=lambda j: (-((n - 1 - j.index) // window), -_size(j), j.index))


def _size(job: Job) -> int:
    """How long a document is, to hand out the longest first: its bytes on disk (or stdin's)."""
    if job.text is not None:
        return len(job.text)
    try:
        return os.stat(job.item.source).st_size
    except OSError:
        return 0


def worker_count(
    device: str, gpus: int, cpus: int, requested: int | None, n_documents: int | None, threads: int = 1
) -> tuple[bool, int]:
    """Whether each worker takes a GPU, and how many workers to start on a cluster with these
    ``gpus`` and ``cpus``: ``requested``, else one per GPU when the model may run on CUDA and
    the cluster has GPUs, else one per ``threads`` CPUs (the threads each CPU worker runs on);
    never more than the documents, at least one."""
    if device == "cuda" and gpus == 0:
        raise KvcliError("--device cuda: the Ray cluster has no GPUs")
    use_gpu = device != "cpu" and gpus > 0
    n = requested or (gpus if use_gpu else cpus // max(1, threads)) or 1
    if n_documents is not None:
        n = max(1, min(n, n_documents))
    return use_gpu, n


class Scheduler:
    """One batch's scheduling state (see the module docstring). ``workers``: those ready now, in
    the order they take documents; ``loading``: how many more may join (:meth:`joined` or
    :meth:`not_joined` each); ``window``: :func:`dispatch_order`'s (default: :func:`default_window`
    of every worker, ready or loading)."""

    def __init__(self, jobs: list[Job], workers: Iterable[Hashable], *, loading: int = 0, window: int | None = None):
        workers = list(workers)
        self.queue = deque(dispatch_order(jobs, window or default_window(len(workers) + loading)))
        self.idle = deque(workers)  # free workers, the one free longest first
        self.alive = set(workers)
        self.loading = loading
        self.running: dict[Hashable, Job] = {}  # busy worker -> its document
        self.failures: dict[int, list[tuple[Hashable, str]]] = {}  # job index -> (worker, why), try after try
        self.retried = 0  # documents queued again after a failure (for a second worker)

    @property
    def done(self) -> bool:
        """Every document dispatched and answered, or failed."""
        return not self.queue and not self.running

    # --- events: each returns the actions to take now, in order -------------------------------
    def start(self) -> list[Dispatch | Fail]:
        return self._assign([])

    def joined(self, worker: Hashable) -> list[Dispatch | Fail]:
        """A loading worker is ready."""
        self.loading -= 1
        self.alive.add(worker)
        self.idle.append(worker)
        return self._assign([])

    def not_joined(self) -> list[Dispatch | Fail]:
        """A loading worker will not come (its model did not load, it died)."""
        self.loading -= 1
        return self._assign([])

    def finished(self, worker: Hashable) -> list[Dispatch | Fail]:
        """``worker`` answered its document (its records are out)."""
        del self.running[worker]
        self.idle.append(worker)
        return self._assign([])

    def failed(self, worker: Hashable, reason: str, *, lost: bool) -> list[Dispatch | Fail]:
        """``worker``'s document failed outside the per-question handling, for ``reason`` (a few
        words); ``lost``: the worker died with it (it takes nothing more)."""
        job = self.running.pop(worker)
        if lost:
            self.alive.discard(worker)
        else:
            self.idle.append(worker)
        failures = self.failures.setdefault(job.index, [])
        failures.append((worker, reason))
        if len(failures) < MAX_ATTEMPTS:
            self.retried += 1
            self.queue.appendleft(job)  # next, on another worker: it holds the output back
            return self._assign([])
        return self._assign([self._fail(job)])

    # --- the rules ---------------------------------------------------------------------------
    def _assign(self, actions: list[Dispatch | Fail]) -> list[Dispatch | Fail]:
        """Free workers take the first document they have not failed on; then the documents no
        worker can take any more are failed."""
        parked = []
        while self.idle and self.queue:
            worker = self.idle.popleft()
            job = next((j for j in self.queue if not self._failed_on(j, worker)), None)
            if job is None:  # it failed every queued document already
                parked.append(worker)
                continue
            self.queue.remove(job)
            self.running[worker] = job
            actions.append(Dispatch(job, worker))
        self.idle.extend(parked)
        if not self.loading:
            for job in [j for j in self.queue if all(self._failed_on(j, w) for w in self.alive)]:
                self.queue.remove(job)
                actions.append(self._fail(job))
        return actions

    def _failed_on(self, job: Job, worker: Hashable) -> bool:
        return any(w == worker for w, _ in self.failures.get(job.index, ()))

    def _fail(self, job: Job) -> Fail:
        reasons = [reason for _, reason in self.failures.get(job.index, ())]
        n = len(reasons)
        if n == 0:
            return Fail(job, "no Ray worker left to answer it")
        alone = "; no other worker left to retry it" if n < MAX_ATTEMPTS else ""
        return Fail(job, f"failed on {n} Ray worker{'s' if n != 1 else ''} ({'; '.join(reasons)}){alone}")
