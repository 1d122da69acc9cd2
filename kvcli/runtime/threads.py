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

* **in a container** the process's own cgroup counts too (:func:`find_cgroup`: ``/proc/self/cgroup``,
  v1 or v2, however deeply nested): its CPU quota (the smallest ``cpu.max`` or
  ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` of it and its parents) caps the count, and over each
  window the group's own ``cpu.stat`` is read: the cores of the quota the group's other processes
  used (its usage less this process's), and the share of periods it was throttled in (each one
  stalls every thread at its barrier) — ``(quota - others) x (1 - throttled share)`` cores are free
  in it, and the count follows the smaller of that and the machine's free cores. A busy neighbour
  inside a 2-CPU container is seen though the host's ``/proc/stat`` shows 64 idle cores.
* **each policy its own**: a :class:`ThreadPolicy` (one per ``Session``) remembers the count it
  found and restores that one after a phase; a count another policy left lowered (two Sessions in
  one process, nested or interleaved) is never taken for the caller's.

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
PROC_CGROUP = Path("/proc/self/cgroup")  # which cgroup this process is in
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the cgroup filesystems are mounted
CGROUP_CPU_MAX = CGROUP_ROOT / "cpu.max"


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


def local_count(value: str | int | None = None) -> int:
    """The threads a run in this process would start on: the count asked for (``value``, else
    ``$KVCLI_THREADS``), else PyTorch's count here (``OMP_NUM_THREADS``, the CPUs this process may
    use; ``auto``'s ceiling on an idle machine). A Ray worker is handed it (kvcli.executors): Ray
    gives an actor one thread per CPU it reserves, and an answer may change with the count."""
    fixed = requested_threads(value)
    if fixed is not None:
        return fixed
    import torch

    return torch.get_num_threads()


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
    """The CPU quota in the v2 ``cpu.max`` file ``path`` (``quota period``), rounded up to whole
    cores; None where there is none (``max``) or no such file."""
    try:
        quota, period = path.read_text().split()[:2]
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def _v1_cores(folder: Path) -> int | None:
    """The quota of a v1 cpu cgroup folder (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; -1: none)."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


@dataclass(frozen=True)
class GroupTimes:
    """One reading of this process's cgroup: CPU seconds its processes used (None: not reported),
    its periods and those it was throttled in, and this process's own CPU seconds."""

    wall: float
    usage: float | None
    periods: int
    throttled: int
    own: float


@dataclass(frozen=True)
class Cgroup:
    """This process's cgroup for the CPU: ``version`` 1 or 2, its ``folder`` and the controller's
    mount root ``top`` (its quota may be set on any folder between them)."""

    version: int
    folder: Path
    top: Path
    acct: Path | None = None  # v1: the cpuacct folder of this cgroup (its cpuacct.usage), where it is apart

    def chain(self) -> list[Path]:
        """Its folder and every parent up to the mount root."""
        out, folder = [self.folder], self.folder
        while folder != self.top and folder.parent != folder and self.top in folder.parents:
            folder = folder.parent
            out.append(folder)
        return out

    def cores(self) -> int | None:
        """The quota that binds: the smallest of its folder's and its parents', whole cores."""
        quotas = [cgroup_cores(f / "cpu.max") if self.version == 2 else _v1_cores(f) for f in self.chain()]
        quotas = [q for q in quotas if q is not None]
        return min(quotas) if quotas else None

    def read(self, clock: Callable[[], float] = time.monotonic, own: Callable[[], float] = time.process_time):
        """A :class:`GroupTimes` of its ``cpu.stat`` (v2: ``usage_usec``; v1: ``cpuacct.usage``
        beside it); None where it cannot be read."""
        try:
            stat = dict(line.split()[:2] for line in (self.folder / "cpu.stat").read_text().splitlines() if " " in line)
            periods, throttled = int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0))
        except (OSError, ValueError):
            return None
        usage = None
        with contextlib.suppress(OSError, ValueError, KeyError):
            if self.version == 2:
                usage = int(stat["usage_usec"]) / 1e6
            else:
                usage = int(((self.acct or self.folder) / "cpuacct.usage").read_text()) / 1e9
        return GroupTimes(clock(), usage, periods, throttled, own())


def find_cgroup(proc: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> Cgroup | None:
    """This process's CPU cgroup from ``proc`` (``/proc/self/cgroup``: ``id:controllers:path``
    lines) under the mounts in ``root``: v2's unified line (``0::/path``), else v1's line naming
    ``cpu`` (its folder ``cpu,cpuacct`` or ``cpu``). A path the mount does not show (a container
    sees its own cgroup as the root) is cut from the front until it does. None: no cgroup."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # v1 first: a hybrid host's CPU controller is on v1 when a line names it
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "cpu" in controllers.split(","):
            top = next(
                (root / n for n in (controllers, "cpu,cpuacct", "cpuacct,cpu", "cpu") if (root / n).is_dir()), None
            )
            if top is not None:
                return Cgroup(1, _deepest(top, path), top, _v1_acct(lines, root))
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "" and root.is_dir():
            return Cgroup(2, _deepest(root, path), root)
    return None


def _v1_acct(lines: list[str], root: Path) -> Path | None:
    """The v1 cpuacct folder of this process's cgroup where it is mounted apart from cpu."""
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "cpuacct" and (root / "cpuacct").is_dir():
            return _deepest(root / "cpuacct", path)
    return None


def _deepest(top: Path, path: str) -> Path:
    """``top``/``path``, or the longest tail of ``path`` that exists under ``top`` (else ``top``)."""
    parts = [p for p in path.strip().split("/") if p]
    for i in range(len(parts) + 1):
        folder = top.joinpath(*parts[i:])
        if folder.is_dir():
            return folder
    return top


def own_cgroup() -> Cgroup | None:
    return find_cgroup()


def group_free(before: GroupTimes, after: GroupTimes, quota: int) -> float | None:
    """Cores of the cgroup's ``quota`` free to this process between two readings: the quota less
    what its other processes used, times the share of periods it was not throttled in; None when
    no time passed."""
    wall = after.wall - before.wall
    if wall <= 0:
        return None
    others = 0.0
    if after.usage is not None and before.usage is not None:
        others = max(0.0, (after.usage - before.usage - (after.own - before.own)) / wall)
    periods = after.periods - before.periods
    throttled = (after.throttled - before.throttled) / periods if periods > 0 else 0.0
    return max(0.0, quota - others) * (1.0 - min(1.0, max(0.0, throttled)))


def threads_for(free: float, ceiling: int, phase: str) -> int:
    """The count for ``phase`` when other processes leave ``free`` cores: one per core with at
    least ``phase``'s :data:`FREE_SHARE` of it free, at least 1, at most ``ceiling``."""
    return max(1, min(ceiling, math.floor(free + 1 - FREE_SHARE[phase])))


# --- the policy ------------------------------------------------------------------------------------
_SET_BY_A_POLICY: int | None = None  # the count a policy's phase set last (None: none set, or restored since)
_CALLERS: int | None = None  # the count the caller had when a policy's phase found none of theirs set


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
    cgroup: Cgroup | None = field(default_factory=own_cgroup)  # this process's (None: none, or not Linux)
    quota: int | None = None  # the cgroup's quota in cores (default: read from ``cgroup``)
    read_group: Callable[[], GroupTimes | None] | None = None  # the cgroup's cpu.stat (default: ``cgroup``'s)
    used: dict = field(default_factory=dict)  # phase -> the counts it ran on, in order (one run's)
    _base: CpuTimes | None = field(default=None, repr=False)
    _free: float | None = field(default=None, repr=False)
    _phase: str | None = field(default=None, repr=False)
    _limit: int = field(default=1, repr=False)  # the current phase's ceiling
    _chosen_at: float = field(default=0.0, repr=False)
    _group_base: GroupTimes | None = field(default=None, repr=False)
    _group_free: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.set_threads is None or self.get_threads is None:
            import torch

            self.set_threads = self.set_threads or torch.set_num_threads
            self.get_threads = self.get_threads or torch.get_num_threads
        if self.cgroup is not None:
            if self.quota is None:
                self.quota = self.cgroup.cores()
            if self.read_group is None:
                self.read_group = lambda: self.cgroup.read(self.clock)
        if self.fixed is None:
            self._base = self.read()  # the first window: from here (the model's loading) to the first question
            self._group_base = self.read_group() if self.read_group is not None else None

    @classmethod
    def from_option(cls, value: str | int | None = None) -> ThreadPolicy:
        """The policy for ``--threads``/``AskOptions.threads`` (None: ``$KVCLI_THREADS``, else auto)."""
        return cls(fixed=requested_threads(value))

    def free_cores(self) -> float | None:
        """The cores other processes left free over the window since the last estimate (it
        starts a new one); the last estimate if that window is shorter than :data:`MIN_WINDOW_S`,
        None before the first one."""
        self._group_window()
        now = self.read()
        if now is None or self._base is None:
            self._base = now
            return self._least(self._free)
        if now.wall - self._base.wall >= MIN_WINDOW_S:
            busy = others_busy(self._base, now, self.cpus)
            if busy is not None:
                self._free = max(0.0, self.cpus - busy)
                self._base = now
        return self._least(self._free)

    def _group_window(self) -> None:
        """The cgroup's free cores over the window since its last reading (see :func:`group_free`)."""
        if self.read_group is None or not self.quota:
            return
        now = self.read_group()
        if now is None or self._group_base is None:
            self._group_base = now
            return
        if now.wall - self._group_base.wall >= MIN_WINDOW_S:
            free = group_free(self._group_base, now, self.quota)
            if free is not None:
                self._group_free, self._group_base = free, now

    def _least(self, free: float | None) -> float | None:
        """The machine's free cores or the cgroup's, whichever is fewer (either may be unknown)."""
        known = [f for f in (free, self._group_free) if f is not None]
        return min(known) if known else None

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
        global _SET_BY_A_POLICY
        counts = self.used.setdefault(phase, [])
        if not counts or counts[-1] != n:
            counts.append(n)
        if self.get_threads() != n:
            self.set_threads(n)
        _SET_BY_A_POLICY = n

    def revise(self, *_args) -> None:
        """Choose the current phase's count again if :data:`REVISE_S` has passed since the last
        choice (a forward pre-hook: its arguments are ignored)."""
        if self._phase is not None and self.fixed is None and self.clock() - self._chosen_at >= REVISE_S:
            self._apply(self._phase)

    @contextlib.contextmanager
    def phase(self, name: str, engine=None):
        """Within the block, run on ``name``'s count, chosen again every :data:`REVISE_S` at the
        start of a pass through ``engine``'s first decoder layer. After it, the caller's count is
        restored: the one before the phase, unless that is a count a policy set (another Session's
        phase, still running): then the caller's count that one found (its ceiling too)."""
        global _SET_BY_A_POLICY, _CALLERS
        now, outer = self.get_threads(), (self._phase, self._limit)
        if now != _SET_BY_A_POLICY or _CALLERS is None:
            _CALLERS = now  # the caller's count (OMP_NUM_THREADS, torch.set_num_threads), not a phase's
        before = _CALLERS
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
            if outer[0] is None:  # leaving this policy's outermost phase: its own count back
                if self.get_threads() != before:
                    self.set_threads(before)
                _SET_BY_A_POLICY = None

    def start_run(self) -> dict:
        """Forget the last run's counts; returns the dict this run's are recorded in."""
        self.used = {}
        return self.used


def in_phase(policy: ThreadPolicy | None, name: str, engine=None):
    """``policy.phase(name, engine)``, or nothing when there is no policy (threads left as they are)."""
    return contextlib.nullcontext() if policy is None else policy.phase(name, engine)
