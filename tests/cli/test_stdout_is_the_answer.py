"""stdout is the answer: ``kvcli ask``, ``kvcli chat`` over a pipe and a batch over a folder, run as a
script runs them (a real process, stdout a pipe), write the answer (or JSON) and nothing else on
stdout, the very string the ``--json`` record's ``answer`` holds; the sources follow the answer only
with ``--sources`` (on a terminal by default), and are always in ``--json``. One real process for
each output a script captures (the answer, JSON, JSON Lines); the variants of a command's options
(``--sources``, ``--no-sources``) run in-process, their stdout a pipe too, on the same single thread.
Every answer compared is non-empty: an empty one would pass against almost any stdout."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = ["Who keeps the light?", "How many ships came?"]


@pytest.fixture(scope="module")
def model(tiny_dir) -> str:
    return str(tiny_dir("llama", num_hidden_layers=4))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("docs")
    (d / "a.txt").write_text("The harbour log: 3 ships arrived.\nThe keeper was Ada Brook.\nThe light is red.\n")
    (d / "b.md").write_text("# Log\n\nThe keeper was Tom Reed.\n\nNine ships came in the storm.\n")
    return d


def kvcli(*args, stdin: str = "") -> tuple[str, str]:
    """``kvcli *args`` in a process of its own, stdout and stderr pipes: (stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for name in ("KVCLI_DEBUG", "KVCLI_COMPRESSOR", "KVCLI_KV_BITS"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "kvcli", *map(str, args)],
        cwd=REPO,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout, proc.stderr


def common(model) -> tuple:
    # one thread in every run: in-process and real processes compute the same bits
    return ("-m", model, "-c", "full", "--max-new-tokens", "6", "--no-cache", "--threads", "1")


@pytest.fixture(scope="module")
def asked(folder, model) -> tuple[str, dict]:
    """``kvcli ask a.txt QUESTIONS[0] --json``'s stdout and its record (one process, shared by the
    ask and the batch test)."""
    out, _ = kvcli("ask", folder / "a.txt", QUESTIONS[0], *common(model), "--json")
    record = json.loads(out)
    assert record["answer"].strip()  # an empty answer would make "stdout is the answer" hold of any stdout
    return out, record


def test_ask_piped_stdout_is_the_json_answer(folder, model, asked, cli):
    doc = folder / "a.txt"
    out, record = asked
    assert out.count("\n") == 1 and record["sources"] is not None  # --json: sources always

    out, err = kvcli("ask", doc, QUESTIONS[0], *common(model))
    assert out == record["answer"] + "\n"  # not a byte more: $(kvcli ask ...) is the answer
    assert err  # the figures went to stderr

    code, out, _ = cli("ask", doc, QUESTIONS[0], *common(model), "--sources")
    assert code == 0 and out.startswith(record["answer"] + "\n")
    shown = out[len(record["answer"]) + 1 :].splitlines()
    assert shown and all(any(s["text"][:20] in line for line in shown) for s in record["sources"]), out

    code, out, _ = cli("ask", doc, QUESTIONS[0], *common(model), "--json", "--no-sources")
    assert code == 0 and json.loads(out)["sources"] is None and json.loads(out)["answer"] == record["answer"]


def test_chat_piped_stdout_is_the_json_answers(folder, model, cli, monkeypatch):
    doc = folder / "a.txt"
    stdin = "".join(q + "\n" for q in QUESTIONS)
    out, _ = kvcli("chat", doc, *common(model), "--json", stdin=stdin)
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["question"] for r in records] == QUESTIONS and all(r["sources"] is not None for r in records)
    assert all(r["answer"].strip() for r in records)  # answers to find on stdout, not empty strings

    out, _ = kvcli("chat", doc, *common(model), stdin=stdin)
    assert out == "".join(r["answer"] + "\n" for r in records)

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))  # a pipe: not a terminal
    code, out, _ = cli("chat", doc, *common(model), "--sources")
    assert (
        code == 0
        and out.startswith(records[0]["answer"] + "\n")
        and len(out) > len("".join(r["answer"] + "\n" for r in records))
    )


def test_batch_over_a_folder_stdout_is_json_lines_of_the_answers(folder, model, asked, cli):
    out, err = kvcli("ask", folder, QUESTIONS[0], *common(model))
    records = [json.loads(line) for line in out.splitlines()]  # every line a JSON object, nothing else
    assert [Path(r["document"]).name for r in records] == ["a.txt", "b.md"]
    assert all(r["answer"].strip() for r in records)
    assert all(r["sources"] is not None for r in records)  # JSON: sources always
    # each answer the one kvcli ask gives for that document alone: a.txt's is the --json run's
    # (whose answer the ask test finds on stdout without --json), b.md's a run of its own
    assert records[0]["answer"] == asked[1]["answer"]
    code, alone, _ = cli("ask", records[1]["document"], QUESTIONS[0], *common(model))
    assert code == 0 and alone == records[1]["answer"] + "\n"
