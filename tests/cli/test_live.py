"""``kvcli ask`` on a terminal: the answer streamed to stdout as it is decoded, the spinner naming
the method and the prompt's length, a bar for a long prompt; --json and pipes unchanged."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from rich.console import Console

import kvcli.cli.ask
from kvcli.cli import live


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "log.txt"
    path.write_text(" ".join(f"Entry {i}: the keeper logged {i * 7 % 13} ships and {i % 5} storms." for i in range(40)))
    return path


def test_ask_on_a_terminal_streams_the_answer_piece_by_piece(cli, doc, model, monkeypatch):
    args = ("ask", doc, "How many ships?", "-m", model, "--max-new-tokens", "16", "--no-answer-guard", "--no-cache",
            "--no-sources")
    code, out, err = cli(*args, "--json")
    answer = json.loads(out)["answer"]
    assert code == 0 and answer

    pieces: list[str] = []
    real_write = live.Reading.write
    monkeypatch.setattr(live.Reading, "write", lambda self, piece: (pieces.append(piece), real_write(self, piece)))
    code, out, err = cli(*args)  # a pipe: one write of the whole answer, as before
    assert (code, out, pieces) == (0, answer + "\n", [])

    monkeypatch.setattr(kvcli.cli.ask, "stdout", Console(force_terminal=True, highlight=False, soft_wrap=True))
    code, out, err = cli(*args)
    assert code == 0, err
    assert out == answer + "\n" and "".join(pieces) == answer
    assert len(pieces) >= 3, pieces  # token by token (no guard: every settled token at once)
    code, out, err = cli(*args, "--json")  # --json on a terminal: still one object
    assert json.loads(out)["answer"] == answer and "".join(pieces) == answer


def test_spinner_names_the_method_and_tokens_then_a_bar_for_a_long_prompt(monkeypatch):
    err = Console(file=StringIO(), force_terminal=True, width=100)
    with live.Reading(err) as reading:
        reading.on_prompt("full attention", 6529)
        assert reading.label == "full attention · 6,529 tokens"
        reading.on_progress(0.1)
        assert reading.progress is None  # not long yet: the spinner
        reading.t0 -= live.BAR_AFTER_S
        reading.on_progress(0.2)
        assert reading.progress is not None and reading.status is None
        assert reading.progress.tasks[0].description == "full attention · 6,529 tokens"
        assert reading.progress.tasks[0].completed == 0.2
        reading.write("The")  # the first answer text: nothing left on stderr
        assert reading.progress is None and reading.status is None


def test_a_pipe_gets_a_line_every_tenth_or_30_s_and_no_bar(monkeypatch):
    err = Console(file=StringIO(), width=100)  # not a terminal
    with live.Reading(err) as reading:
        reading.on_prompt("infllm", 20000)
        reading.on_progress(0.15)
        assert err.file.getvalue() == ""  # short so far: nothing
        reading.t0 -= 10
        reading.on_progress(0.16)
        reading.on_progress(0.18)  # the same tenth, within 30 s: no second line
        reading.last_line -= live.LINE_EVERY_S
        reading.on_progress(0.19)  # 30 s later: a line
        reading.on_progress(0.31)  # the next tenth: a line
        assert reading.progress is None
    lines = err.file.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("kvcli: infllm · 20,000 tokens: 3,200/20,000 tokens (16%) · ")
    assert "tok/s" in lines[0] and "left" in lines[0]
    assert "6,200/20,000 tokens (31%)" in lines[2]


def test_the_bar_shows_tokens_rate_and_time_left():
    err = Console(file=StringIO(), force_terminal=True, width=160)
    with live.Reading(err) as reading:
        reading.on_prompt("infllm", 72580)
        reading.t0 -= 100
        reading.on_progress(0.25)
        figures = reading.progress.tasks[0].fields["figures"]
    assert figures.startswith("18,145/72,580 tokens (25%) · 181 tok/s · 5m 0") and figures.endswith("s left")


def test_quiet_prints_no_progress():
    err = Console(file=StringIO(), width=100, quiet=True)
    with live.Reading(err) as reading:
        reading.on_prompt("finch", 20000)
        reading.t0 -= 100
        reading.on_progress(0.5)
    assert err.file.getvalue() == ""
