"""The thread policy (kvcli.runtime.threads): parsing --threads / $KVCLI_THREADS, what ``auto`` picks from
fake /proc/stat readings (never the machine's real load), the phases' counts set and restored, and
the one-line errors of the CLI."""

from __future__ import annotations

import pytest
import torch

from kvcli.errors import UsageError
from kvcli.runtime import threads
from kvcli.runtime.threads import CpuTimes, ThreadPolicy
from tests.helpers.cli_runner import assert_one_line_error

STAT = """cpu  400 0 100 1000 50 0 10 40 0 0
cpu0 100 0 50 500 20 0 5 20 0 0
cpu1 300 0 50 500 30 0 5 20 0 0
intr 1 2 3
ctxt 99
"""


# --- parsing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, expected", [("auto", None), (" AUTO ", None), (None, None), ("1", 1), ("3", 3), (2, 2)]
)
def test_parse_threads(value, expected):
    assert threads.parse_threads(value) == expected


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5", "", "2x"])
def test_parse_threads_refuses(value):
    with pytest.raises(UsageError, match=r"--threads must be auto or a whole number of threads \(1 or more\), not '"):
        threads.parse_threads(value)


def test_env_var_is_read_and_named(monkeypatch):
    monkeypatch.setenv(threads.ENV, "3")
    assert threads.requested_threads() == 3
    assert threads.requested_threads("1") == 1  # the option wins over the variable
    assert threads.requested_threads("auto") is None
    monkeypatch.setenv(threads.ENV, "auto")
    assert threads.requested_threads() is None
    monkeypatch.setenv(threads.ENV, "lots")
    with pytest.raises(UsageError, match="KVCLI_THREADS must be auto or a whole number"):
        threads.requested_threads()
    monkeypatch.setenv(threads.ENV, " ")
    assert threads.requested_threads() is None


# --- readings --------------------------------------------------------------------------------------
def test_read_cpu_times_sums_the_allowed_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    both = threads.read_cpu_times(stat, cpus={0, 1}, clock=lambda: 5.0, own=lambda: 1.5)
    # busy: everything but idle and iowait; steal counts as busy (another guest had the core)
    assert both == CpuTimes(wall=5.0, busy=(100 + 50 + 5 + 20) + (300 + 50 + 5 + 20), total=695 + 905, own=1.5)
    one = threads.read_cpu_times(stat, cpus={1}, clock=lambda: 5.0, own=lambda: 0.0)
    assert (one.busy, one.total) == (375, 905)
    assert threads.read_cpu_times(stat, cpus={7}) is None  # none of this process's CPUs listed
    assert threads.read_cpu_times(tmp_path / "missing") is None  # not Linux


def test_others_busy_takes_this_process_out():
    before = CpuTimes(wall=10.0, busy=0, total=0, own=2.0)
    after = CpuTimes(wall=11.0, busy=150, total=200, own=2.5)  # 2 CPUs 75% busy over 1 s, 0.5 s of it ours
    assert threads.others_busy(before, after, n_cpus=2) == pytest.approx(1.0)
    assert threads.others_busy(before, CpuTimes(11.0, 10, 200, 3.0), n_cpus=2) == 0.0  # never below 0
    assert threads.others_busy(before, CpuTimes(10.0, 0, 0, 2.0), n_cpus=2) is None  # no tick passed


def test_cgroup_quota(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("150000 100000\n")
    assert threads.cgroup_cores(f) == 2
    f.write_text("50000 100000\n")
    assert threads.cgroup_cores(f) == 1
    f.write_text("max 100000\n")
    assert threads.cgroup_cores(f) is None
    assert threads.cgroup_cores(tmp_path / "none") is None


@pytest.mark.parametrize(
    "free, ceiling, phase, expected",
    [
        (2.0, 2, "prefill", 2),
        (1.6, 2, "prefill", 2),
        (1.4, 2, "prefill", 1),
        (1.0, 2, "prefill", 1),
        (0.0, 2, "prefill", 1),
        (8.0, 4, "prefill", 4),
        (3.7, 16, "prefill", 4),
        (2.0, 2, "decode", 2),
        (1.8, 2, "decode", 2),
        (1.6, 2, "decode", 1),
        (1.33, 2, "decode", 1),
        (3.7, 16, "decode", 3),
        (0.2, 2, "decode", 1),
    ],
)
def test_threads_for(free, ceiling, phase, expected):
    assert threads.threads_for(free, ceiling, phase) == expected


# --- the policy with fake readings ----------------------------------------------------------------
class Machine:
    """A fake machine of ``cpus`` CPUs: ``run(seconds, others, own)`` advances its clock with
    ``others`` cores kept busy by other processes and ``own`` by this one; ``read`` gives
    /proc/stat's view; ``threads`` is what the policy set."""

    def __init__(self, cpus: int = 2, threads_now: int = 2) -> None:
        self.cpus, self.wall, self.busy, self.total, self.own = cpus, 100.0, 0, 0, 0.0
        self.threads, self.calls = threads_now, []

    def run(self, seconds: float, others: float = 0.0, own: float = 0.0) -> None:
        self.wall += seconds
        self.total += round(self.cpus * 100 * seconds)
        self.busy += round((others + own) * 100 * seconds)
        self.own += own * seconds

    def read(self):
        return CpuTimes(self.wall, self.busy, self.total, self.own)

    def set(self, n: int) -> None:
        self.calls.append(n)
        self.threads = n

    def policy(self, **kw) -> ThreadPolicy:
        return ThreadPolicy(
            read=self.read,
            clock=lambda: self.wall,
            set_threads=self.set,
            get_threads=lambda: self.threads,
            cpus=self.cpus,
            quota=None,
            cgroup=None,
            **kw,
        )


def test_auto_quiet_machine_keeps_every_core():
    m = Machine()
    p = m.policy()
    m.run(2.0, others=0.1, own=1.0)  # loading the model
    with p.phase("prefill"):
        assert m.threads == 2
        m.run(3.0, others=0.05, own=2.0)
    with p.phase("decode"):
        assert m.threads == 2
    assert p.used == {"prefill": [2], "decode": [2]} and m.threads == 2


def test_auto_one_busy_process_gets_one_thread():
    m = Machine()
    p = m.policy()
    m.run(2.0, others=1.0, own=1.0)
    with p.phase("prefill"):
        assert m.threads == 1
        m.run(3.0, others=1.0, own=1.0)
    with p.phase("decode"):
        assert m.threads == 1
    assert p.used == {"prefill": [1], "decode": [1]}
    assert m.threads == 2 and m.calls == [1, 2, 1, 2]  # each phase restores the count it found


def test_auto_two_threads_against_one_busy_process_still_see_it():
    # with two threads of ours competing, the busy process gets two thirds of a core: still busy
    m = Machine()
    p = m.policy()
    m.run(2.0, others=0.67, own=1.33)
    with p.phase("prefill"):
        assert m.threads == 1


def test_auto_a_partly_busy_core_counts_for_reading_before_decoding():
    m = Machine()
    p = m.policy()
    m.run(1.0, others=0.45)
    assert p.choose("prefill", 2) == 2
    m.run(1.0, others=0.2)
    assert p.choose("decode", 2) == 2
    m.run(1.0, others=0.3)  # 70% of the second core: enough to read the prompt, not to decode
    assert (p.choose("prefill", 2), p.choose("decode", 2)) == (2, 1)
    m.run(1.0, others=0.55)
    assert p.choose("prefill", 2) == 1


def test_auto_short_window_keeps_the_last_estimate():
    m = Machine()
    p = m.policy()
    m.run(1.0, others=1.0)
    assert p.choose("prefill", 2) == 1
    m.run(threads.MIN_WINDOW_S / 2, others=0.0)  # a cache hit: too short to say
    assert p.choose("decode", 2) == 1
    m.run(1.0, others=0.0)  # the window since the last estimate, quiet
    assert p.choose("decode", 2) == 2


def test_auto_without_readings_keeps_pytorchs_count():
    m = Machine(threads_now=2)
    p = ThreadPolicy(
        read=lambda: None,
        clock=lambda: m.wall,
        set_threads=m.set,
        get_threads=lambda: m.threads,
        cpus=2,
        quota=None,
        cgroup=None,
    )
    with p.phase("prefill"):
        assert m.threads == 2
    assert m.calls == []


def test_auto_never_above_the_callers_count_or_the_quota():
    m = Machine(cpus=8, threads_now=3)  # OMP_NUM_THREADS=3, or torch.set_num_threads(3)
    p = m.policy()
    m.run(1.0)
    with p.phase("prefill"):
        assert m.threads == 3
    p.quota = 2
    with p.phase("prefill"):
        assert m.threads == 2
    assert m.threads == 3


def test_fixed_count_ignores_the_load():
    m = Machine()
    p = m.policy(fixed=3)
    m.run(2.0, others=2.0)
    with p.phase("prefill"):
        assert m.threads == 3
    with p.phase("decode"):
        assert m.threads == 3
    assert p.used == {"prefill": [3], "decode": [3]} and m.threads == 2


def test_revised_within_a_phase_at_a_pass_through_the_first_layer():
    m = Machine()
    p = m.policy()
    layer = torch.nn.Linear(2, 2)
    engine = type("E", (), {"layers": [layer]})()
    m.run(1.0, others=0.0)
    with p.phase("prefill", engine):
        assert m.threads == 2
        m.run(threads.REVISE_S / 2, others=1.0, own=1.0)
        layer(torch.ones(2))  # too soon: no new choice
        assert m.threads == 2
        m.run(threads.REVISE_S, others=1.0, own=1.0)
        layer(torch.ones(2))
        assert m.threads == 1
        m.run(threads.REVISE_S, others=0.0, own=1.0)
        layer(torch.ones(2))  # the load is gone
        assert m.threads == 2
    assert p.used == {"prefill": [2, 1, 2]}
    assert not layer._forward_pre_hooks  # removed with the phase


def test_start_run_forgets_the_last_run():
    m = Machine()
    p = m.policy(fixed=1)
    with p.phase("prefill"):
        pass
    used = p.start_run()
    assert used == {} and p.used is used
    with p.phase("decode"):
        pass
    assert used == {"decode": [1]}


def test_unknown_phase():
    with pytest.raises(ValueError, match="unknown phase"):
        Machine().policy().choose("sleep", 2)


# --- through the library and the CLI ----------------------------------------------------------------
def test_session_reports_and_restores_the_threads(tiny_dir):
    from kvcli.api import AskOptions, Session, parse_pipeline
    from kvcli.documents import document_from_text

    before = torch.get_num_threads()
    session = Session.open(AskOptions(model=str(tiny_dir("llama")), threads="1", use_cache=False, max_new_tokens=3))
    result = session.ask(document_from_text("Some text about cats. " * 5), "What?", parse_pipeline("full"))
    assert result.extra["threads"] == {"prefill": [1], "decode": [1]}
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("value", ["0", "abc"])
def test_cli_threads_error_is_one_line(cli, tmp_path, value):
    doc = tmp_path / "d.txt"
    doc.write_text("Hello there.")
    message = f"--threads must be auto or a whole number of threads (1 or more), not '{value}'"
    assert_one_line_error(cli("ask", doc, "What?", "--threads", value), 2, message)
    assert_one_line_error(cli("inspect", doc, "What?", "--threads", value), 2, "--threads must be")


def test_cli_env_threads_error_names_the_variable(cli, tmp_path, monkeypatch):
    doc = tmp_path / "d.txt"
    doc.write_text("Hello there.")
    monkeypatch.setenv(threads.ENV, "0")
    message = "KVCLI_THREADS must be auto or a whole number of threads (1 or more), not '0'"
    assert_one_line_error(cli("ask", doc, "What?"), 2, message)
    monkeypatch.delenv(threads.ENV)
    bench = ("bench", "speed", "--threads", "x", "--lengths", "512", "--out", tmp_path / "bench")
    assert_one_line_error(cli(*bench), 2, "--threads must be")


def test_cli_json_reports_the_threads(cli, tmp_path, tiny_dir):
    model = tiny_dir("llama")
    doc = tmp_path / "d.txt"
    doc.write_text("Cats sleep a lot. " * 10)
    code, out, err = cli(
        "ask", doc, "What?", "-m", model, "--threads", "1", "--json", "--no-cache", "--max-new-tokens", "3"
    )
    assert code == 0, err
    import json

    assert json.loads(out)["threads"] == {"prefill": [1], "decode": [1]}
