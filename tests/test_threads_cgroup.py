"""--threads auto in containers (kvcli.runtime.threads): this process's own cgroup found from
/proc/self/cgroup in fake cgroup trees (v1, v2, a nested slice, a container that sees its cgroup as
the root), its quota (the smallest up the tree) and its cpu.stat (the group's other processes'
usage, its throttled periods) as the busy signal; and each policy (one per Session) keeps its own
count: two policies in one process never leave it lowered."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcli.runtime import threads
from kvcli.runtime.threads import Cgroup, ThreadPolicy, find_cgroup, group_free
from tests.test_threads import Machine


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def v2_stat(usage_s: float, periods: int = 0, throttled: int = 0) -> str:
    return f"usage_usec {int(usage_s * 1e6)}\nuser_usec 0\nsystem_usec 0\nnr_periods {periods}\nnr_throttled {throttled}\nthrottled_usec 0\n"


def test_v2_nested_slice_the_parents_quota_binds(tmp_path):
    root = tmp_path / "sys"
    proc = write(tmp_path / "proc", "0::/user.slice/user-1000.slice/app.scope\n")
    write(root / "cgroup.controllers", "cpu memory\n")
    write(root / "user.slice" / "cpu.max", "max 100000\n")
    write(root / "user.slice" / "user-1000.slice" / "cpu.max", "150000 100000\n")  # 1.5 CPUs: 2 threads at most
    write(root / "user.slice" / "user-1000.slice" / "app.scope" / "cpu.max", "max 100000\n")
    write(root / "user.slice" / "user-1000.slice" / "app.scope" / "cpu.stat", v2_stat(12.5, 40, 3))
    group = find_cgroup(proc, root)
    assert group == Cgroup(2, root / "user.slice" / "user-1000.slice" / "app.scope", root)
    assert group.cores() == 2
    reading = group.read(clock=lambda: 7.0, own=lambda: 1.0)
    assert (reading.usage, reading.periods, reading.throttled, reading.wall, reading.own) == (12.5, 40, 3, 7.0, 1.0)
    write(root / "user.slice" / "user-1000.slice" / "app.scope" / "cpu.max", "50000 100000\n")
    assert group.cores() == 1  # the smallest quota on the way up


def test_v2_a_container_sees_its_cgroup_as_the_root(tmp_path):
    root = tmp_path / "sys"
    write(root / "cpu.max", "200000 100000\n")
    for line in ("0::/\n", "0::/kubepods/burstable/pod1/ctr\n"):  # namespaced, or a path the mount does not show
        group = find_cgroup(write(tmp_path / "proc", line), root)
        assert group.version == 2 and group.folder == root and group.cores() == 2
    assert find_cgroup(tmp_path / "missing", root) is None


def test_v1_cpu_and_cpuacct_together_and_apart(tmp_path):
    root = tmp_path / "sys"
    proc = write(tmp_path / "proc", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    folder = root / "cpu,cpuacct" / "docker" / "abc"
    write(folder / "cpu.cfs_quota_us", "150000\n")
    write(folder / "cpu.cfs_period_us", "100000\n")
    write(folder / "cpu.stat", "nr_periods 10\nnr_throttled 4\nthrottled_time 900000\n")
    write(folder / "cpuacct.usage", "3000000000\n")
    group = find_cgroup(proc, root)
    assert (group.version, group.folder, group.cores()) == (1, folder, 2)
    r = group.read(clock=lambda: 1.0, own=lambda: 0.0)
    assert (r.usage, r.periods, r.throttled) == (3.0, 10, 4)
    write(folder / "cpu.cfs_quota_us", "-1\n")
    assert group.cores() is None  # -1: no quota

    # the cpu and cpuacct controllers mounted apart, as on many v1 hosts
    root2 = tmp_path / "sys2"
    proc2 = write(tmp_path / "proc2", "3:cpuacct:/slurm/job1\n2:cpu:/slurm/job1\n")
    write(root2 / "cpu" / "slurm" / "cpu.cfs_quota_us", "200000\n")  # the job's parent holds the quota
    write(root2 / "cpu" / "slurm" / "cpu.cfs_period_us", "100000\n")
    write(root2 / "cpu" / "slurm" / "job1" / "cpu.stat", "nr_periods 0\nnr_throttled 0\n")
    write(root2 / "cpuacct" / "slurm" / "job1" / "cpuacct.usage", "5000000000\n")
    group = find_cgroup(proc2, root2)
    assert group.folder == root2 / "cpu" / "slurm" / "job1" and group.cores() == 2
    assert group.read(clock=lambda: 1.0, own=lambda: 0.0).usage == 5.0


def test_group_free_counts_the_neighbours_and_the_throttling():
    g = threads.GroupTimes
    assert group_free(g(0.0, 0.0, 0, 0, 0.0), g(10.0, 10.0, 100, 0, 0.0), 2) == pytest.approx(
        1.0
    )  # a neighbour: 1 core
    assert group_free(g(0.0, 0.0, 0, 0, 0.0), g(10.0, 10.0, 100, 0, 10.0), 2) == pytest.approx(2.0)  # that was us
    assert group_free(g(0.0, 0.0, 0, 0, 0.0), g(10.0, 0.0, 100, 50, 0.0), 2) == pytest.approx(
        1.0
    )  # throttled half the time
    assert group_free(g(0.0, None, 0, 0, 0.0), g(10.0, None, 0, 0, 0.0), 2) == pytest.approx(2.0)


def test_a_busy_neighbour_inside_a_2_cpu_container_on_an_idle_host(tmp_path):
    """The host's /proc/stat: 64 idle cores. The container's cgroup (v2, quota 2): a neighbour uses
    one core of it -> one thread; gone -> two; throttled most of the time -> one."""
    root = tmp_path / "sys"
    folder = root / "app.scope"
    write(root / "cpu.max", "max 100000\n")
    write(folder / "cpu.max", "200000 100000\n")
    stat = write(folder / "cpu.stat", v2_stat(0.0))
    group = find_cgroup(write(tmp_path / "proc", "0::/app.scope\n"), root)
    m = Machine(cpus=64, threads_now=8)
    p = ThreadPolicy(
        read=m.read, clock=lambda: m.wall, set_threads=m.set, get_threads=lambda: m.threads, cpus=64, cgroup=group
    )
    assert p.quota == 2
    m.run(2.0, others=1.0)  # the host sees a busy core of 64: nothing
    stat.write_text(v2_stat(2.0))  # ... the container: its neighbour used a core of its 2
    with p.phase("decode"):
        assert m.threads == 1
    m.run(2.0)
    stat.write_text(v2_stat(2.0, 20, 0))  # the neighbour is gone
    with p.phase("decode"):
        assert m.threads == 2
    m.run(2.0)
    stat.write_text(v2_stat(2.0, 40, 16))  # throttled in 16 of 20 periods: the quota is spent
    with p.phase("prefill"):
        assert m.threads == 1
    assert m.threads == 8 and p.used == {"decode": [1, 2], "prefill": [1]}


def test_two_policies_in_one_process_never_leave_the_count_lowered():
    """Two Sessions' policies, one process-wide count: A lowers it for its phase, B's phase starts
    inside it and ends after it. Before, B restored A's lowered count for good; now each policy
    restores the count it found, and B's ceiling is the caller's count, not A's choice."""
    m = Machine(cpus=4, threads_now=4)
    a = m.policy()
    m.run(2.0, others=3.0)  # three cores busy: A's phase runs on one
    with a.phase("decode"):
        assert m.threads == 1
        b = m.policy()  # a second Session: nothing measured yet, its ceiling is the caller's 4, not A's 1
        with b.phase("prefill"):
            assert m.threads == 4
    assert m.threads == 4
    with b.phase("decode"):  # and again, sequentially
        assert m.threads == 4
    assert m.threads == 4

    # interleaved: B's phase ends after A's
    m.run(2.0, others=3.0)
    phase_a, phase_b = a.phase("decode"), b.phase("decode")
    phase_a.__enter__()
    assert m.threads == 1
    phase_b.__enter__()  # finds A's count, 1: not the caller's
    phase_a.__exit__(None, None, None)
    phase_b.__exit__(None, None, None)
    assert m.threads == 4  # before: 1, for good
