"""``kvcli ask`` on a terminal: the answer streamed to stdout as it is decoded, the spinner naming
the method and the prompt's length, a bar for a long prompt; --json and pipes unchanged; in a pipe,
lines while the prompt is read and the answer written; a time left from the read's recent speed."""

from __future__ import annotations

import json
import re
from io import StringIO

import pytest
from rich.console import Console

import kvcli.cli.ask
from kvcli.cli import live
from tests.helpers.embedders import Counting


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "log.txt"
    path.write_text(" ".join(f"Entry {i}: the keeper logged {i * 7 % 13} ships and {i % 5} storms." for i in range(40)))
    return path


def test_ask_on_a_terminal_streams_the_answer_piece_by_piece(cli, doc, model, monkeypatch):
    args = (
        "ask",
        doc,
        "How many ships?",
        "-m",
        model,
        "--max-new-tokens",
        "16",
        "--no-answer-guard",
        "--no-cache",
        "--no-sources",
    )
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


# --- issue 41, item 7: no silent stretch in a pipe, an honest time left -----------------------------


class Clock:
    """time.perf_counter for live.py, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(live.time, "perf_counter", c)
    return c


def test_the_time_left_waits_for_a_tenth_of_the_read_then_follows_its_recent_speed(clock):
    """A 405 s read whose first 6% took 5 s (issue 41: "1m 20s left" at 6%): no time left before
    a tenth, then one from the speed of the last 30 s, within 10% of the truth."""
    n, first, rest = 88_244, 0.06, 400.0
    err = Console(file=StringIO(), width=200)  # a pipe: lines
    with live.Reading(err) as reading:
        reading.on_prompt("infllm", n)
        start = clock.now

        def at(t: float) -> float:  # the share read t seconds in
            return first * t / 5 if t <= 5 else first + (1 - first) * (t - 5) / rest

        lefts = {}
        for t in range(0, 406):
            clock.now = start + t
            reading.last_line = -1e9  # a line every call
            reading.on_progress(at(t))
            line = err.file.getvalue().splitlines()[-1] if err.file.getvalue() else ""
            lefts[t] = line
    early = [lefts[t] for t in range(6, 40) if at(t) < live.ETA_AFTER]
    assert early and not any("left" in line for line in early)
    for t in (60, 150, 300):
        m = re.search(r"(\d+)m (\d+)s left", lefts[t])
        said, true = int(m[1]) * 60 + int(m[2]), 405 - t
        assert abs(said - true) <= 0.1 * true + 1, (t, lefts[t])
    # what the overall rate said at 60 s: far too little
    assert "tok/s" in live.reading_figures(at(60), n, 60) and abs((1 - at(60)) * n / (at(60) * n / 60) - 345) > 30


def test_a_pipe_is_told_the_answer_is_being_written(clock):
    err = Console(file=StringIO(), width=100)  # not a terminal
    with live.Reading(err) as reading:
        reading.on_prompt("full attention", 900)
        reading.on_progress(1.0)
        start = clock.now
        for t in (0, 2, 4):
            clock.now = start + t
            reading.on_token(7)
        assert err.file.getvalue() == ""  # a short answer: nothing said
        for t in range(6, 70, 2):
            clock.now = start + t
            reading.on_token(7)
    lines = err.file.getvalue().splitlines()
    assert lines == [f"kvcli: writing the answer: {n} tokens · 0.5 tok/s" for n in (4, 19, 34)], lines


def test_a_terminal_spinner_counts_the_answer_and_quiet_says_nothing(clock):
    err = Console(file=StringIO(), force_terminal=True, width=100)
    with live.Reading(err) as reading:
        reading.on_prompt("full attention", 9000)
        clock.now += 2
        reading.on_progress(0.3)
        assert reading.progress is not None  # the bar while the prompt is read
        reading.on_token(7)
        clock.now += 2
        reading.on_token(7)
        assert reading.progress is None and reading.status is not None
        assert reading.status.status == "writing the answer · 2 tokens · 0.5 tok/s"
    quiet = Console(file=StringIO(), width=100, quiet=True)
    with live.Reading(quiet) as reading:
        for _ in range(3):
            clock.now += 30
            reading.on_token(7)
    assert quiet.file.getvalue() == ""


def test_ask_and_inspect_in_a_pipe_print_progress(cli, doc, model, monkeypatch):
    monkeypatch.setattr(live, "LINE_AFTER_S", 0.0)
    monkeypatch.setattr(live, "LINE_EVERY_S", 0.0)
    code, out, err = cli("inspect", doc, "How many ships?", "-m", model, "--no-cache", "-c", "snapkv:budget=48")
    assert code == 0, err
    assert re.search(r"^kvcli: snapkv · [\d,]+ tokens: [\d,]+/[\d,]+ tokens \(\d+%\)", err, re.M), err
    ask = ("ask", doc, "How many ships?", "-m", model, "--no-cache", "--max-new-tokens", "6")
    code, out, err = cli(*ask, "--no-answer-guard")
    assert code == 0, err
    assert re.search(r"^kvcli: writing the answer: \d+ tokens", err, re.M), err
    code, out, err = cli(*ask, "-q")
    assert code == 0 and err == "", err


# --- issue 49: the page vectors' embedding shows its progress on stderr ----------------------------------


def test_embedding_the_pages_updates_the_spinner_then_gives_it_back(clock):
    err = Console(file=StringIO(), force_terminal=True, width=160)
    with live.Reading(err) as reading:
        labels = []
        real_update = reading.status.update
        reading.status.update = lambda text: (labels.append(text), real_update(text))
        reading.on_embed(0, 1204)
        clock.now += 8
        reading.on_embed(320, 1204)
        reading.on_embed(1204, 1204)
    assert labels[0] == "embedding the pages · 0/1,204 windows (0%)"
    assert labels[1] == "embedding the pages · 320/1,204 windows (27%) · 40 windows/s · 0m 22s left"
    assert labels[-1] == "reading the prompt…"  # done: the spinner's own label again


def test_embedding_the_pages_in_a_pipe_says_a_line_every_tenth_once_it_takes_long(clock):
    err = Console(file=StringIO(), width=200)  # not a terminal
    with live.Reading(err) as reading:
        reading.on_embed(0, 1000)
        clock.now += 1
        reading.on_embed(300, 1000)
        assert err.file.getvalue() == ""  # short so far: nothing
        clock.now += live.LINE_AFTER_S
        reading.on_embed(400, 1000)
        reading.on_embed(450, 1000)  # the same tenth: no second line
        reading.on_embed(500, 1000)
        reading.on_embed(1000, 1000)  # done: no line
    lines = err.file.getvalue().splitlines()
    assert lines == [
        "kvcli: embedding the pages: 400/1,000 windows (40%) · 67 windows/s · 0m 09s left",
        "kvcli: embedding the pages: 500/1,000 windows (50%) · 83 windows/s · 0m 06s left",
    ]
    quiet = Console(file=StringIO(), width=200, quiet=True)
    with live.Reading(quiet) as reading:
        reading.on_embed(0, 1000)
        clock.now += 100
        reading.on_embed(500, 1000)
    assert quiet.file.getvalue() == ""


def test_ask_says_how_far_the_embedding_is_on_stderr_and_nothing_of_it_on_stdout(
    cli, doc, model, tmp_path, monkeypatch
):
    """``kvcli ask -c pages`` on a document's first question: its windows' embedding in lines on
    stderr (a pipe), stdout the answer alone; a second question reads the vectors kept: no line."""

    from kvcli.retrieval import embed

    monkeypatch.setattr(embed, "embedder", lambda name: Counting(progress_step=2))
    monkeypatch.delenv(embed.ENV, raising=False)
    monkeypatch.setattr(live, "LINE_AFTER_S", 0.0)
    pages = tmp_path / "pages.txt"
    pages.write_text("\n\n".join(f"Page {i}. " + " ".join(f"word{i}x{j}" for j in range(150)) for i in range(6)))
    args = ("ask", pages, "Which page has word3x7?", "-m", model, "-c", "pages", "--max-new-tokens", "4")
    args += ("--cache-dir", tmp_path / "cache", "--no-sources")
    code, out, err = cli(*args)
    assert code == 0, err
    assert "kvcli: embedding the pages: " in err and "windows" in err
    assert "embedding" not in out and "windows" not in out and out.count("\n") == 1  # the answer alone
    code, out2, err = cli(*args)
    assert code == 0 and out2 == out and "embedding the pages" not in err


def test_a_question_that_embedded_pages_long_is_told_of_cache_add_on_a_terminal_only(
    cli, model, tmp_path, monkeypatch, clock
):
    """The seconds a question embedded pages add up (Reading.embedding_s); over TIP_EMBED_S, a
    terminal's stderr is told after the answer that `kvcli cache add` embeds every page ahead; a
    question that embedded nothing, a pipe, stdin: nothing said."""
    from kvcli.retrieval import embed

    err = Console(file=StringIO(), force_terminal=True, width=160)
    with live.Reading(err) as reading:
        reading.on_embed(0, 100)
        clock.now += 3
        reading.on_embed(100, 100)
        reading.on_embed(0, 10)
        clock.now += 4
        reading.on_embed(10, 10)
    assert reading.embedding_s == 7
    assert live.embedding_tip(7, "my book.pdf") == (
        "kvcli: 7 s of this question went to embedding pages it points to; "
        "`kvcli cache add 'my book.pdf'` embeds every page once, ahead of later questions"
    )
    assert live.embedding_tip(live.TIP_EMBED_S - 0.1, "book.pdf") is None and live.embedding_tip(60, "-") is None

    monkeypatch.undo()  # the real clock from here: an ask end to end
    monkeypatch.setattr(embed, "embedder", lambda name: Counting())
    monkeypatch.delenv(embed.ENV, raising=False)
    monkeypatch.setattr(live, "TIP_EMBED_S", 1e-9)  # any embedding at all
    pages = tmp_path / "pages.txt"
    pages.write_text("\n\n".join(f"Page {i}. " + " ".join(f"word{i}x{j}" for j in range(150)) for i in range(6)))
    args = ("ask", pages, "Which page has word3x7?", "-m", model, "-c", "pages", "--max-new-tokens", "4")
    args += ("--cache-dir", tmp_path / "cache", "--no-sources")
    code, out, err = cli(*args)  # a pipe: no tip
    assert code == 0 and "cache add" not in err + out
    (tmp_path / "cache" / "vectors").rename(tmp_path / "vectors-kept")  # embed again, on a terminal
    terminal = {"stderr": True, "force_terminal": True, "soft_wrap": True, "highlight": False}  # as console.stderr's
    monkeypatch.setattr(kvcli.cli.ask, "stderr", lambda quiet: Console(quiet=quiet, **terminal))
    code, out, err = cli(*args)
    assert code == 0 and f"`kvcli cache add {pages}` embeds every page once" in err and "cache add" not in out
    code, out, err = cli(*args)  # the vectors kept: nothing embedded, nothing said
    assert code == 0 and "cache add" not in err
