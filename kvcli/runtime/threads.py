"""How many intra-op threads kvcli's CPU work runs on, phase by phase.

PyTorch's CPU kernels end each parallel call at an OpenMP barrier: a thread that lost its core to
another process holds all the others there until the scheduler gives it back. A decoding step is
~400 kernel calls, so on a 2-core machine with one other busy process two threads decoded at 0.4
tokens/s where one thread decoded at 6.6. So by default (``auto``) each phase of a
question — reading the prompt (``prefill``), writing the answer (``decode``) — runs on as many
threads as there are cores other processes leave free, measured, never more than PyTorch's count
as the phase starts (``OMP_NUM_THREADS``, the CPUs this process may use, a caller's
``torch.set_num_threads``) or a cgroup's CPU quota:

* **the free cores**: the busy time of this process's CPUs in ``/proc/stat`` less this process's
  own CPU time, over the window since the last choice (the model's loading before the first
  question; the prompt's reading before its answer); a window shorter than :data:`MIN_WINDOW_S`
  keeps the last estimate.
* **re-chosen within a phase** every :data:`REVISE_S` seconds (a book's read takes minutes: a load
  that starts or ends meanwhile is followed), at the start of a forward pass (a hook on the first
  decoder layer), never inside a kernel.
* **per phase**: a core counts when other processes leave it at least :data:`FREE_SHARE` of its
  time — half for the prompt's reading (a few large products: a second thread gains while it gets
  more than half a core), three quarters for decoding (one token is ~400 small calls, each ending
  at a barrier that any preemption of either thread stalls). Measured: docs/cpu.md, "Threads".

``--threads N`` (ask, chat, inspect, bench) or ``$KVCLI_THREADS`` fixes the count for every phase;
``auto`` is the default. Where ``/proc/stat`` cannot be read (not Linux) ``auto`` keeps PyTorch's
count. What each phase ran on is reported (``Result.extra["threads"]``, ``ask --json``'s
``threads``). Between thread counts the answers may differ in the last bits of their logits, as
they did between machines (oneDNN splits its reductions by thread).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError

ENV = "KVCLI_THREADS"
AUTO = "auto"
MIN_WINDOW_S = 0.25  # the shortest window the free cores are measured over (/proc/stat counts 10 ms ticks)
REVISE_S = 1.0  # within a phase, how often the count is chosen again
# a core counts as free in a phase when other processes leave it at least this share of its time
FREE_SHARE = {"prefill": 0.5, "decode": 0.75}
PHASES = tuple(FREE_SHARE)
PROC_STAT = Path("/proc/stat")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def parse_threads(value: str | int | None, source: str = "--threads") -> int | None:
    """``value`` as a thread count: None for ``auto`` (and for None), else a whole number >= 1;
    anything else is a :class:`UsageError` naming ``source`` (the option or the variable it came from)."""
    if value is None:
        return None
    text = str(value).strip()
    if text.lower() == AUTO:
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise UsageError(f"{source} must be auto or a whole number of threads (1 or more), not '{value}'")
    return n


def requested_threads(value: str | int | None = None) -> int | None:
    """The fixed count asked for: ``value`` (the ``--threads`` option, the library's
    ``AskOptions.threads``), else ``$KVCLI_THREADS``; None: ``auto``."""
    if value is not None:
        return parse_threads(value, "--threads")
    env = os.environ.get(ENV, "").strip()
    return parse_threads(env, ENV) if env else None


# --- what the machine's CPUs did -----------------------------------------------------------------
@dataclass(frozen=True)
class CpuTimes:
    """One reading of the CPUs this process may run on."""

    wall: float  # seconds (monotonic)
    busy: int  # ticks those CPUs were busy (steal included: a hypervisor's other guests), summed
    total: int  # ticks in all on those CPUs
    own: float  # this process's CPU seconds, all its threads


def read_cpu_times(
    stat: Path | None = None,
    cpus: set[int] | None = None,
    clock: Callable[[], float] = time.monotonic,
    own: Callable[[], float] = time.process_time,
) -> CpuTimes | None:
    """The ``cpuN`` lines of ``stat`` (default :data:`PROC_STAT`) for ``cpus`` (default: the CPUs
    this process may use), with this process's CPU time; None where ``stat`` cannot be read or
    lists none of them."""
    stat = PROC_STAT if stat is None else stat
    cpus = allowed_cpus() if cpus is None else cpus
    try:
        text = stat.read_text()
    except OSError:
        return None
    busy = total = 0
    seen = False
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal (guest time is counted in user already)
        ticks = [int(x) for x in rest.split()[:8]]
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
        seen = True
    return CpuTimes(clock(), busy, total, own()) if seen else None


def others_busy(before: CpuTimes, after: CpuTimes, n_cpus: int) -> float | None:
    """Cores other processes kept busy between two readings (this process's own time taken out);
    None when no tick passed."""
    ticks, wall = after.total - before.total, after.wall - before.wall
    if ticks <= 0 or wall <= 0:
        return None
    busy = n_cpus * (after.busy - before.busy) / ticks
    return max(0.0, busy - (after.own - before.own) / wall)


def allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def cgroup_cores(path: Path = CGROUP_CPU_MAX) -> int | None:
    """The CPU quota of this process's cgroup (v2 ``cpu.max``: ``quota period``), rounded up to
    whole cores; None where there is none (``max``) or no such file."""
    try:
        quota, period = path.read_text().split()[:2]
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def threads_for(free: float, ceiling: int, phase: str) -> int:
    """The count for ``phase`` when other processes leave ``free`` cores: one per core with at
    least ``phase``'s :data:`FREE_SHARE` of it free, at least 1, at most ``ceiling``."""
    return max(1, min(ceiling, math.floor(free + 1 - FREE_SHARE[phase])))


# --- the policy ------------------------------------------------------------------------------------
@dataclass
class ThreadPolicy:
    """Chooses and sets the intra-op threads of each phase. ``fixed``: one count for every phase
    (``--threads N``); None: ``auto``, from the free cores, never more than ``ceiling`` (default:
    PyTorch's count as the phase starts — ``OMP_NUM_THREADS``, a caller's ``torch.set_num_threads``
    — capped by a cgroup quota). ``read``, ``clock``, ``set_threads``, ``get_threads``: the readings,
    the time and the setting (tests pass fakes)."""

    fixed: int | None = None
    ceiling: int | None = None
    read: Callable[[], CpuTimes | None] = read_cpu_times
    clock: Callable[[], float] = time.monotonic
    set_threads: Callable[[int], None] | None = None
    get_threads: Callable[[], int] | None = None
    cpus: int = field(default_factory=lambda: len(allowed_cpus()))
    quota: int | None = field(default_factory=cgroup_cores)
    used: dict = field(default_factory=dict)  # phase -> the counts it ran on, in order (one run's)
    _base: CpuTimes | None = field(default=None, repr=False)
    _free: float | None = field(default=None, repr=False)
    _phase: str | None = field(default=None, repr=False)
    _limit: int = field(default=1, repr=False)  # the current phase's ceiling
    _chosen_at: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.set_threads is None or self.get_threads is None:
            import torch

            self.set_threads = self.set_threads or torch.set_num_threads
            self.get_threads = self.get_threads or torch.get_num_threads
        if self.fixed is None:
            self._base = self.read()  # the first window: from here (the model's loading) to the first question

    @classmethod
    def from_option(cls, value: str | int | None = None) -> ThreadPolicy:
        """The policy for ``--threads``/``AskOptions.threads`` (None: ``$KVCLI_THREADS``, else auto)."""
        return cls(fixed=requested_threads(value))

    def free_cores(self) -> float | None:
        """The cores other processes left free over the window since the last estimate (it
        starts a new one); the last estimate if that window is shorter than :data:`MIN_WINDOW_S`,
        None before the first one."""
        now = self.read()
        if now is None or self._base is None:
            self._base = now
            return self._free
        if now.wall - self._base.wall >= MIN_WINDOW_S:
            busy = others_busy(self._base, now, self.cpus)
            if busy is not None:
                self._free = max(0.0, self.cpus - busy)
                self._base = now
        return self._free

    def choose(self, phase: str, ceiling: int) -> int:
        """The count ``phase`` runs on now, ``auto`` using at most ``ceiling`` threads."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
        if self.fixed is not None:
            return self.fixed
        free = self.free_cores()
        return ceiling if free is None else threads_for(free, ceiling, phase)

    def _apply(self, phase: str) -> None:
        n = self.choose(phase, self._limit)
        self._chosen_at = self.clock()
        counts = self.used.setdefault(phase, [])
        if not counts or counts[-1] != n:
            counts.append(n)
        if self.get_threads() != n:
            self.set_threads(n)

    def revise(self, *_args) -> None:
        """Choose the current phase's count again if :data:`REVISE_S` has passed since the last
        choice (a forward pre-hook: its arguments are ignored)."""
        if self._phase is not None and self.fixed is None and self.clock() - self._chosen_at >= REVISE_S:
            self._apply(self._phase)

    @contextlib.contextmanager
    def phase(self, name: str, engine=None):
        """Within the block, run on ``name``'s count, chosen again every :data:`REVISE_S` at the
        start of a pass through ``engine``'s first decoder layer; the count before is restored after."""
        before, outer = self.get_threads(), (self._phase, self._limit)
        ceiling = before if self.ceiling is None else self.ceiling
        self._phase, self._limit = name, max(1, min(ceiling, self.quota or ceiling))
        handle = None
        try:
            self._apply(name)
            if engine is not None and self.fixed is None and len(engine.layers):
                handle = engine.layers[0].register_forward_pre_hook(self.revise)
            yield self
        finally:
            if handle is not None:
                handle.remove()
            self._phase, self._limit = outer
            if self.get_threads() != before:
                self.set_threads(before)

    def start_run(self) -> dict:
        """Forget the last run's counts; returns the dict this run's are recorded in."""
        self.used = {}
        return self.used


def in_phase(policy: ThreadPolicy | None, name: str, engine=None):
    """``policy.phase(name, engine)``, or nothing when there is no policy (threads left as they are)."""
    return contextlib.nullcontext() if policy is None else policy.phase(name, engine)
