"""The answer's check on the command line: a warning on stderr (stdout stays the answer, or the JSON
alone), ``grounding``/``grounded`` in JSON, ``--no-check`` off. A tiny random model has no measured
threshold (it is not checked), so it gets one here that every answer is under."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

import kvcli.model

NOTE = "may not come from the document"


@pytest.fixture
def always_noted(tiny_dir, tmp_path, monkeypatch):
    """(model path, document): a tiny llama whose threshold every answer is under."""
    load = kvcli.model.load_model
    monkeypatch.setattr(
        kvcli.model, "load_model", lambda *a, **k: dataclasses.replace(load(*a, **k), check_threshold=1e9)
    )
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted seven gulls on the north rock. " * 8, encoding="utf-8")
    return str(tiny_dir("llama", num_hidden_layers=4)), str(doc)


def test_a_noted_answer_is_said_on_stderr_and_in_json(cli, always_noted):
    model, doc = always_noted
    code, out, err = cli("ask", doc, "How many gulls?", "-m", model, "--json", "--max-new-tokens", "4")
    assert code == 0 and out.count("\n") == 1
    record = json.loads(out)
    assert record["grounded"] is False and isinstance(record["grounding"], float) and record["check_s"] >= 0
    assert any(NOTE in w for w in record["warnings"]) and NOTE in err


def test_piped_stdout_is_the_answer_alone(cli, always_noted):
    model, doc = always_noted
    code, out, err = cli("ask", doc, "How many gulls?", "-m", model, "--max-new-tokens", "4")
    assert code == 0 and NOTE not in out and f"kvcli: warning: the answer {NOTE}" in err


def test_no_check_checks_nothing(cli, always_noted):
    model, doc = always_noted
    code, out, err = cli("ask", doc, "How many gulls?", "-m", model, "--json", "--max-new-tokens", "4", "--no-check")
    record = json.loads(out)
    assert code == 0 and record["grounding"] is None and record["grounded"] is None and NOTE not in err


@pytest.mark.parametrize("command", ["ask", "chat"])
def test_in_a_pipe_the_answer_is_written_before_its_check(cli, always_noted, monkeypatch, command):
    """The answer is final before the check after it runs (seconds on the Qwen models): a pipe gets
    it then, whole, once, and the check's note follows on stderr."""
    from kvcli import api
    from kvcli.cli import live

    model, doc = always_noted
    events = []
    write, check = live.Reading.write_whole, api.Session._check
    monkeypatch.setattr(live.Reading, "write_whole", lambda self, text: events.append("answer") or write(self, text))
    monkeypatch.setattr(api.Session, "_check", lambda *a: events.append("check") or check(*a))
    if command == "ask":
        code, out, err = cli("ask", doc, "How many gulls?", "-m", model, "--max-new-tokens", "4")
    else:
        monkeypatch.setattr("sys.stdin", io.StringIO("How many gulls?\n"))
        code, out, err = cli("chat", doc, "-m", model, "--max-new-tokens", "4")
    assert code == 0 and events == ["answer", "check"] and out.count("\n") == 1 and NOTE in err


def test_in_a_pipe_beside_a_terminal_the_answer_stays_on_stdout(cli, always_noted, monkeypatch):
    """stdout a pipe, stderr a terminal (``a=$(kvcli ask ...)`` in a shell): the answer written
    while stderr's spinner runs (a live display takes over sys.stdout) still goes to stdout alone."""
    from rich.console import Console

    import kvcli.cli.ask

    model, doc = always_noted
    monkeypatch.setattr(
        kvcli.cli.ask,
        "stderr",
        lambda quiet: Console(stderr=True, force_terminal=True, highlight=False, soft_wrap=True),
    )
    code, out, err = cli("ask", doc, "How many gulls?", "-m", model, "--max-new-tokens", "4")
    answer = json.loads(cli("ask", doc, "How many gulls?", "-m", model, "--max-new-tokens", "4", "--json")[1])["answer"]
    assert code == 0 and out == answer + "\n" and answer not in err
