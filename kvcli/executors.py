"""Where a batch's documents are answered: here, or on the actors of a Ray cluster.

    from kvcli.executors import LocalExecutor, RayExecutor
    with RayExecutor(AskOptions(), address="auto", workers=4) as executor:
        for record in run_batch(executor, inputs, questions, pipeline):
            print(record)

The records always come from :meth:`kvcli.batch.Work.records`, one document at a time with all
of its questions, in order; an executor only decides *where* a document runs. Its ``run(jobs,
work)`` yields ``(job index, record)`` as records are made and ``(job index, None)`` when a
document is done, in any order across documents; :func:`run_batch` puts them back in
input order.

* :class:`LocalExecutor`: this process, the caller's :class:`~kvcli.api.Session`, documents in
  input order.
* :class:`RayExecutor`: N Ray actors, each holding one loaded model (one GPU each when the model is
  on CUDA). A whole document goes to one actor, so its questions 2..n hit that actor's memo and
  the shared disk store. Which document goes to which actor, longest first, and what becomes of
  one whose actor dies or fails (retried once elsewhere, then error records, ``error_type``
  ``WorkerError``) is decided by :class:`kvcli.scheduler.Scheduler`; the executor turns its
  actions into Ray calls and Ray's results into its events. Closing the run early
  (``--fail-fast``, Ctrl-C) kills the actors still working and reclaims the temporary files they
  were writing; entries are written atomically, so none is ever half there.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from .batch import STDIN, Input, Job, Work
from .documents import read_stdin
from .errors import KvcliError, UsageError
from .runtime.threads import local_count
from .scheduler import Fail, Scheduler, worker_count

RAY_MISSING = "--ray needs Ray, an optional extra: pip install 'kvcli[ray]'"


class WorkerError(KvcliError):
    """A document whose Ray workers died (or failed) while answering it, on every try."""


class Executor:
    """Decides where each document's questions run (see the module docstring)."""

    def run(
        self,
        jobs: list[Job],
        work: Work,
        *,
        on_start: Callable[[str, str], None] | None = None,
        stdin_text: Callable[[], str] = read_stdin,
    ) -> Iterator[tuple[int, dict | None]]:
        raise NotImplementedError

    def describe(self) -> str:
        """A few words for the batch summary ('' for nothing worth saying)."""
        return ""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalExecutor(Executor):
    """Every document in this process, one after the other, with the caller's session."""

    def __init__(self, session) -> None:
        self.session = session

    def run(self, jobs, work, *, on_start=None, stdin_text=read_stdin):
        for job in jobs:
            yield from document_events(job.index, work.records(self.session, job, on_start, stdin_text))


# --------------------------------------------------------------------------- Ray


def import_ray():
    """The ``ray`` module, or a usage error naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise UsageError(RAY_MISSING) from None
    return ray


def _no_stdin() -> str:  # a worker never reads stdin: the driver sends its text with the job
    raise RuntimeError("stdin is read where the batch starts")


class BatchWorker:
    """The body of one Ray actor: a loaded model answering whole documents.

    A model that cannot load does not kill the actor: :meth:`ready` reports the error (one line)
    so the driver can say it as kvcli says it locally."""

    def __init__(self, options, cwd: str | None) -> None:
        import ray

        from . import notices

        notices.set_sink(None)  # warnings travel in the records' "warnings"; the driver says them
        self.id = ray.get_runtime_context().get_actor_id()
        self.session = None
        self.error: tuple[str, int] | None = None
        try:
            if cwd and os.path.isdir(cwd):  # relative paths mean what they mean to the driver
                os.chdir(cwd)
            from .api import Session

            self.session = Session.open(options)
        except KvcliError as e:
            self.error = (str(e), e.exit_code)
        except Exception as e:  # noqa: BLE001 - said by the driver, like a local internal error
            self.error = (f"internal error: {type(e).__name__}: {e}", 3)

    def ready(self) -> dict:
        device = None if self.session is None else str(self.session.engine.device)
        return {"id": self.id, "host": socket.gethostname(), "pid": os.getpid(), "device": device, "error": self.error}

    def run(self, job: Job, work: Work) -> list[dict]:
        records = []
        for record in work.records(self.session, job, None, _no_stdin):
            record["worker"] = self.id  # which actor answered (``ray list actors`` shows the same id)
            records.append(record)
        return records


@dataclass(eq=False)
class WorkerInfo:
    """A Ray actor that loaded its model, as the driver knows it (and the scheduler by identity)."""

    id: str
    host: str
    pid: int
    device: str
    handle: object = field(repr=False)


def _reason(exc: BaseException) -> str:
    """A Ray error in a few words (its message runs over many lines)."""
    import ray

    if isinstance(exc, ray.exceptions.RayActorError):
        text = str(exc)
        if "ray.kill" in text:
            return "worker killed"
        if "memory" in text.lower():
            return "worker died: out of memory"
        return "worker died"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return f"worker error: {type(cause).__name__}: {cause}"[:300]
    return f"worker error: {lines[-1] if lines else type(exc).__name__}"[:300]


class RayExecutor(Executor):
    """Documents on ``workers`` Ray actors, each holding one loaded model.

    ``address``: what ``ray.init`` takes (``auto``: the running cluster, ``ray://host:port``), or
    ``local`` to start a Ray instance for this run; a process already connected to Ray uses that
    connection. ``workers``: default one per GPU of the cluster when the model runs on CUDA,
    else one per N CPUs, never more than the documents; on the CPU each worker runs on N threads,
    the count a local run would start on (``options.threads``, else PyTorch's count here:
    :func:`~kvcli.runtime.threads.local_count`), so that its answers are the local run's. The cache folder is
    resolved here, so workers on other hosts need it (and the documents) at the same paths: a
    shared filesystem. ``on_warning``: gets each warning the workers report, once.
    ``on_dispatch(job index, worker id)``: called as a document is sent to a worker.
    """

    def __init__(
        self,
        options,
        address: str = "auto",
        workers: int | None = None,
        *,
        on_warning: Callable[[str], None] | None = None,
        on_dispatch: Callable[[int, str], None] | None = None,
    ) -> None:
        from .files import cache_folder

        if workers is not None and workers < 1:
            raise UsageError(f"--workers must be at least 1, not {workers}")
        cache_dir = cache_folder(options.cache_dir)
        self.options = replace(options, cache_dir=Path(cache_dir).expanduser().absolute())
        self.address = address
        self.requested = workers
        self.on_warning = on_warning
        self.on_dispatch = on_dispatch
        self.workers: list[WorkerInfo] = []  # loaded and alive
        self.dead: list[str] = []  # ids of workers that died
        self.load_errors: list[str] = []
        self.retried = 0  # documents sent to a second worker
        self.n_started = 0  # workers that loaded the model
        self.use_gpu = False
        self._pending: dict = {}  # ready() ref -> actor handle still loading its model
        self._own_ray = False
        self._started = False
        self._warned: set[str] = set()
        self._ray = None
        self.window: int | None = None  # documents ordered longest first within (None: scheduler.default_window)

    # --- the cluster ---------------------------------------------------------------------------
    def start(self, n_documents: int | None = None) -> None:
        """Connect, start the actors and wait until they have loaded the model (the first, and
        the others for a while longer); a model that loads on no worker is the error kvcli gives
        locally (one line)."""
        if self._started:
            return
        ray = self._ray = import_ray()
        if not ray.is_initialized():
            kwargs = {"logging_level": logging.ERROR, "log_to_driver": False, "include_dashboard": False}
            if self.address == "local":
                kwargs["num_cpus"] = max(os.cpu_count() or 1, self.requested or 0)
            else:
                kwargs["address"] = self.address
            try:
                ray.init(**kwargs)
            except Exception as e:  # ConnectionError, ValueError (bad address), RuntimeError
                first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
                raise KvcliError(f"--ray {self.address}: cannot start or reach a Ray cluster: {first}") from None
            self._own_ray = True
        self._started = True
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        threads = local_count(self.options.threads)  # the count a local run would start on
        self.use_gpu, n = worker_count(self.options.device, gpus, cpus, self.requested, n_documents, threads)
        # on the CPU each worker runs on that count (Ray would give it one thread): the same answers
        options = self.options if self.use_gpu else replace(self.options, device="cpu", threads=str(threads))
        actor = ray.remote(num_cpus=1, num_gpus=1 if self.use_gpu else 0, max_restarts=0, max_task_retries=0)(
            BatchWorker
        )
        cwd = os.getcwd()
        handles = [actor.remote(options, cwd) for _ in range(n)]
        self._pending = {h.ready.remote(): h for h in handles}
        t0 = time.monotonic()
        while not self.workers and self._pending:
            [ref], _ = ray.wait(list(self._pending), num_returns=1)
            self._collect_ready(ref)
        # the others load at the same pace: wait for them a while, so the first does not take every
        # document; one that waits for resources (a GPU not there yet) joins when it is ready
        deadline = time.monotonic() + max(30.0, 2 * (time.monotonic() - t0))
        while self.workers and self._pending and time.monotonic() < deadline:
            done, _ = ray.wait(list(self._pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in done:
                self._collect_ready(ref)
        if not self.workers:
            message, code = self.load_errors[0] if self.load_errors else ("no Ray worker started", 1)
            error = KvcliError(message)
            error.exit_code = code
            raise error

    def _collect_ready(self, ref) -> WorkerInfo | None:
        """The worker whose ready() call ``ref`` is, if it loaded its model (else its error is noted)."""
        ray = self._ray
        handle = self._pending.pop(ref)
        try:
            info = ray.get(ref)
        except ray.exceptions.RayError as e:
            self.load_errors.append((f"a Ray worker died loading the model ({_reason(e)})", 1))
            return None
        if info["error"] is not None:
            self.load_errors.append(tuple(info["error"]))
            ray.kill(handle, no_restart=True)
            return None
        worker = WorkerInfo(info["id"], info["host"], info["pid"], info["device"], handle)
        self.workers.append(worker)
        self.n_started += 1
        return worker

    def describe(self) -> str:
        died = f", {len(self.dead)} died" if self.dead else ""
        retried = f", {self.retried} document{'s' if self.retried != 1 else ''} retried" if self.retried else ""
        kind = "GPU" if self.use_gpu else "CPU"
        n = self.n_started
        return f"{n} Ray {kind} worker{'s' if n != 1 else ''}{died}{retried}"

    def close(self) -> None:
        """Stop every worker (and the Ray instance this executor started)."""
        if self._ray is None:
            return
        for worker in self.workers:
            self._ray.kill(worker.handle, no_restart=True)
        for handle in self._pending.values():
            self._ray.kill(handle, no_restart=True)
        self.workers, self._pending = [], {}
        if self._own_ray:
            self._ray.shutdown()
            self._own_ray = False
        self._started = False

    # --- the batch -----------------------------------------------------------------------------
    def run(self, jobs, work, *, on_start=None, stdin_text=read_stdin):
        """The scheduler's actions as Ray calls, and Ray's results as its events."""
        self.start(len(jobs))
        ray = self._ray
        jobs = [_with_stdin(job, stdin_text) for job in jobs]
        plan = Scheduler(jobs, self.workers, loading=len(self._pending), window=self.window)
        running: dict = {}  # run() ref -> (the document, the worker answering it)
        actions = plan.start()
        try:
            while True:
                for action in actions:
                    if isinstance(action, Fail):
                        yield from self._failed(action.job, work, action.message)
                        continue
                    running[action.worker.handle.run.remote(action.job, work)] = (action.job, action.worker)
                    if on_start is not None:
                        on_start(action.job.item.source, work.questions[0])
                    if self.on_dispatch is not None:
                        self.on_dispatch(action.job.index, action.worker.id)
                if plan.done:
                    return
                [ref], _ = ray.wait(list(running) + list(self._pending), num_returns=1)
                if ref in self._pending:
                    worker = self._collect_ready(ref)
                    actions = plan.not_joined() if worker is None else plan.joined(worker)
                    continue
                job, worker = running.pop(ref)
                try:
                    records = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # killed, out of memory, node lost
                    self._lost(worker)
                    actions = plan.failed(worker, _reason(e), lost=True)
                except ray.exceptions.RayError as e:  # failed outside the per-question handling
                    actions = plan.failed(worker, _reason(e), lost=False)
                else:
                    yield from document_events(job.index, (self._relay_warnings(r) for r in records))
                    actions = plan.finished(worker)
        finally:
            self.retried += plan.retried
            if running:  # closed early (--fail-fast, Ctrl-C, an error): stop what still runs
                self._abort([worker for _, worker in running.values()])

    def _failed(self, job: Job, work: Work, message: str) -> Iterator[tuple[int, dict | None]]:
        records = work.error_records(job.item.source, WorkerError(message))
        return document_events(job.index, ({**record, "worker": None} for record in records))

    def _lost(self, worker: WorkerInfo) -> None:
        if worker in self.workers:
            self.workers.remove(worker)
            self.dead.append(worker.id)
            self._ray.kill(worker.handle, no_restart=True)  # unreachable may mean not quite dead

    def _relay_warnings(self, record: dict) -> dict:
        """The record, once its new warnings are said."""
        for message in record.get("warnings") or []:
            if message not in self._warned:
                self._warned.add(message)
                if self.on_warning is not None:
                    self.on_warning(message)
        return record

    def _abort(self, busy: list[WorkerInfo]) -> None:
        """Kill the workers still answering, wait (briefly) until they are gone, and reclaim the
        temporary files of the cache entries they were writing (their locks died with them)."""
        ray = self._ray
        for worker in busy:
            self._ray.kill(worker.handle, no_restart=True)
            if worker in self.workers:
                self.workers.remove(worker)
        if busy:
            ray.wait([w.handle.ready.remote() for w in busy], num_returns=len(busy), timeout=10)
        if self.options.use_cache:
            from .store import KVStore

            KVStore.open(self.options.cache_dir)  # opening reclaims what dead writers left


def _with_stdin(job: Job, stdin_text: Callable[[], str]) -> Job:
    """The job with stdin's text (read here: a worker has no stdin)."""
    if job.item.source != STDIN or job.item.problem is not None:
        return job
    try:
        return replace(job, text=stdin_text())
    except (OSError, UnicodeDecodeError) as e:
        return replace(job, item=Input(STDIN, f"stdin cannot be read: {getattr(e, 'strerror', None) or e}"))


# --------------------------------------------------------------------------- the batch


def run_batch(
    executor,
    inputs: list[Input],
    questions: list[str],
    pipeline,
    *,
    include_spans: bool = False,
    fail_fast: bool = False,
    on_start: Callable[[str, str], None] | None = None,
    stdin_text: Callable[[], str] = read_stdin,
) -> Iterator[dict]:
    """Yield one record per (document, question): the result fields of ``ask --json`` with the
    document and the question first, or an error record. Documents in input order, questions in
    file order. With ``fail_fast`` the first error record is the last record.

    ``executor`` decides where each document's questions run (:mod:`kvcli.executors`): a
    :class:`~kvcli.api.Session` (or ``LocalExecutor(session)``) answers here, one document after
    the other; a ``RayExecutor`` on Ray actors, several documents at once. Either way a record is
    yielded as soon as every record before it is (a document finished early waits for the ones
    before it), so what was yielded stays valid if the batch dies later."""
    if not isinstance(executor, Executor):
        executor = LocalExecutor(executor)
    work = Work(tuple(questions), pipeline, include_spans=include_spans, fail_fast=fail_fast)
    jobs = [Job(i, item) for i, item in enumerate(inputs)]
    events = executor.run(jobs, work, on_start=on_start, stdin_text=stdin_text)
    try:
        for record in in_input_order(events, len(jobs)):
            yield record
            if fail_fast and "error" in record:
                return
    finally:
        events.close()  # stops what still runs (a Ray executor kills its busy workers)


def document_events(index: int, records: Iterable[dict]) -> Iterator[tuple[int, dict | None]]:
    """One document's events, as executors report them: ``(index, record)`` for each of its
    records, then ``(index, None)``: it is done."""
    for record in records:
        yield index, record
    yield index, None


def in_input_order(events: Iterator[tuple[int, dict | None]], n_jobs: int) -> Iterator[dict]:
    """Records in job order from an executor's events, ``(job index, record)`` as records are made
    and ``(job index, None)`` when a job is done, in any order across jobs (in order within one):
    each record as soon as the jobs before its own are done."""
    waiting: dict[int, list[dict]] = {}
    done: set[int] = set()
    head = 0  # the first job not yet done: its records go out as they come
    for index, record in events:
        if record is None:
            done.add(index)
        else:
            waiting.setdefault(index, []).append(record)
        while head < n_jobs:
            yield from waiting.pop(head, [])
            if head not in done:
                break
            head += 1
    if head < n_jobs:
        raise RuntimeError(f"the executor stopped with {n_jobs - head} documents unfinished")
