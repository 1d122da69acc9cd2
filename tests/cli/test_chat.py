"""``kvcli chat``: over a pipe (one question per line, one answer or JSON object each), and its
interactive loop in-process (Ctrl-C cancels an answer, not the chat; Ctrl-D leaves). The real
terminal (readline, keys, the streamed answer) is tests/cli/test_chat_terminal.py."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

import kvcli.cli.chat
from kvcli import api
from tests.helpers.cli_runner import assert_user_error, run_cli

QUESTIONS = ["How many ships were logged?", "Which entry mentions storms first?"]


@pytest.fixture
def cli(capsys, monkeypatch):
    def run(*args, stdin: str = ""):
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))  # not a terminal
        return run_cli(args, capsys, monkeypatch)

    return run


@pytest.fixture(scope="module")
def model(tiny_dir) -> str:
    # a 256-token window: a long question is refused while the others are answered
    return str(tiny_dir("llama", num_hidden_layers=4, max_position_embeddings=256))


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "log.txt"
    path.write_text(" ".join(f"Entry {i}: {i * 7 % 13} ships, {i % 5} storms." for i in range(12)))
    return path


def test_json_lines_over_a_pipe_answer_from_the_stored_prefix(cli, doc, model, tmp_path):
    cache = tmp_path / "cache"
    common = ("-m", model, "--max-new-tokens", "6", "--cache-dir", cache)
    stdin = f"{QUESTIONS[0]}\n\n   \n{QUESTIONS[1]}\n"  # blank lines are no questions
    code, out, err = cli("chat", doc, *common, "--json", stdin=stdin)
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["question"] for r in records] == QUESTIONS
    assert [r["cache"] for r in records] == ["miss", "hit"]  # the document read once
    assert all(r["document"] == str(doc) for r in records)
    assert len(err.splitlines()) == 2  # one line of figures per answer
    for question, record in zip(QUESTIONS, records):  # the same answers as kvcli ask
        code, out, _ = run_cli(("ask", doc, question, *common, "--json", "-q"), *_capsys_monkeypatch(cli))
        assert json.loads(out)["answer"] == record["answer"]


def _capsys_monkeypatch(cli):
    closure = {c.cell_contents.__class__.__name__: c.cell_contents for c in cli.__closure__}
    return closure["CaptureFixture"], closure["MonkeyPatch"]


def test_text_over_a_pipe_and_a_failing_question(cli, doc, model):
    long_question = "Which entry " + "really " * 300 + "mentions storms?"
    stdin = f"{QUESTIONS[0]}\n{long_question}\n{QUESTIONS[1]}\n"
    code, out, err = cli(
        "chat", doc, "-m", model, "--max-new-tokens", "6", "-c", "full", "--no-cache", "--json", "-q", stdin=stdin
    )
    assert code == 1
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["question"] for r in records] == [QUESTIONS[0], long_question, QUESTIONS[1]]
    assert "answer" in records[0] and "answer" in records[2]
    assert records[1]["error_type"] == "DocumentError" and "window" in records[1]["error"]
    assert err.splitlines() == [f"kvcli: error: {records[1]['error']}"]
    code, out, err = cli(
        "chat", doc, "-m", model, "--max-new-tokens", "6", "-c", "full", "--no-cache", "-q", stdin=f"{QUESTIONS[0]}\n"
    )
    assert code == 0 and out.endswith("\n") and out.count("\n") >= 1 and err == ""


def test_usage_errors(cli, doc, model, tmp_path):
    assert_user_error(cli("chat", "-", "-m", model), 2, "questions from stdin")
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text("Some text about ships.")
    assert_user_error(cli("chat", folder, "-m", model), 2, "one document", "holds 2")
    assert_user_error(cli("chat", tmp_path / "missing.txt", "-m", model), 1, "missing.txt")
    assert_user_error(cli("chat", doc, "-m", model, "-c", "nosuch"), 2, "nosuch")


def _next_line(typed):
    """The next line typed at the prompt: a string, or Ctrl-C / Ctrl-D (an exception raised)."""
    item = next(typed)
    if isinstance(item, type) and issubclass(item, BaseException):
        raise item
    return item


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _chat_at_a_terminal(doc, model, tmp_path, capsys, monkeypatch):
    """``kvcli chat doc`` with stdin a terminal (what is typed: input(), scripted by the test)."""
    monkeypatch.setattr("sys.stdin", _Terminal())
    return run_cli(
        ("chat", doc, "-m", model, "--max-new-tokens", "6", "--no-answer-guard", "--cache-dir", tmp_path / "c"),
        capsys,
        monkeypatch,
    )


def test_at_the_prompt_ctrl_c_cancels_the_answer_not_the_chat(cli, doc, model, monkeypatch, tmp_path, capsys):
    """Questions typed at the prompt (input() scripted); one answer interrupted as it is written."""
    typed = iter(["", QUESTIONS[0], KeyboardInterrupt, "cancel me", QUESTIONS[1], EOFError])

    def fake_input(prompt):
        assert prompt == "> "
        return _next_line(typed)

    real_ask = api.Session.ask

    def ask(self, document, question, pipeline, options):
        if question == "cancel me":  # Ctrl-C while the answer is being written
            write = options.on_text

            def interrupt(piece):
                write(piece)
                raise KeyboardInterrupt

            options = dataclasses.replace(options, on_text=interrupt)
        return real_ask(self, document, question, pipeline, options)

    monkeypatch.setattr(api.Session, "ask", ask)
    monkeypatch.setattr("builtins.input", fake_input)
    monkeypatch.setattr(
        kvcli.cli.chat,
        "stdout",
        __import__("rich.console").console.Console(force_terminal=True, highlight=False, soft_wrap=True),
    )
    code, out, err = _chat_at_a_terminal(doc, model, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert err.count("(answer cancelled)") == 1
    assert err.count(" · cache ") == 2  # two answers' figures: the cancelled one has none
    assert next(typed, None) is None  # every line was read: the chat went on after the Ctrl-C
    assert (tmp_path / "c" / "chat_history").is_file()


def test_at_the_prompt_with_stdout_in_a_pipe_stdout_holds_only_the_answers(doc, model, monkeypatch, tmp_path, capsys):
    """``kvcli chat doc | tee log``: stdin a terminal, stdout not. The prompt and the lines ending
    Ctrl-C and Ctrl-D go to stderr; stdout is the answers, one after another, nothing else."""
    typed = iter([QUESTIONS[0], KeyboardInterrupt, "", QUESTIONS[1], EOFError])

    def fake_input(prompt=""):  # as input() does where stdout is not a terminal: the prompt on stdout
        import sys

        sys.stdout.write(prompt)
        return _next_line(typed)

    answers = []
    real_ask = api.Session.ask

    def ask(self, document, question, pipeline, options):
        result = real_ask(self, document, question, pipeline, options)
        answers.append(result.answer)
        return result

    monkeypatch.setattr(api.Session, "ask", ask)
    monkeypatch.setattr("builtins.input", fake_input)
    code, out, err = _chat_at_a_terminal(doc, model, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert len(answers) == 2 and next(typed, None) is None
    assert out == "".join(a + "\n" for a in answers)  # no prompt, no blank line
    assert err.count("> ") == 5  # a prompt for each line read, the Ctrl-D one too


def test_at_the_prompt_the_idle_embedding_runs_between_questions_never_beside_one(
    doc, model, monkeypatch, tmp_path, capsys
):
    """After each answer the chat starts its idle work (Session.embed_rest, here one that runs
    until it is told to stop) and stops it when a question is entered (Ctrl-C at the prompt and an
    empty line leave it running) or the chat ends (Ctrl-D): no question is answered while it runs,
    and none is left running when the chat ends."""
    import threading

    typed = iter([QUESTIONS[0], KeyboardInterrupt, "", QUESTIONS[1], EOFError])
    events = []

    def idle_work(self, result, stop):
        events.append("idle")
        stop.wait(30)  # works until the chat stops it
        events.append("stopped" if stop.is_set() else "timed out")

    real_ask = api.Session.ask

    def ask(self, document, question, pipeline, options):
        assert not [t for t in threading.enumerate() if t.name == "kvcli-idle-embedding"]
        events.append("ask")
        return real_ask(self, document, question, pipeline, options)

    monkeypatch.setattr(api.Session, "embed_rest", idle_work)
    monkeypatch.setattr(api.Session, "ask", ask)

    def typing(prompt=""):
        line = _next_line(typed)
        if line == QUESTIONS[1]:  # after Ctrl-C and an empty line at the prompt: still at work
            assert [t for t in threading.enumerate() if t.name == "kvcli-idle-embedding"]
        return line

    monkeypatch.setattr("builtins.input", typing)
    code, out, err = _chat_at_a_terminal(doc, model, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert events == ["ask", "idle", "stopped", "ask", "idle", "stopped"]
    assert not [t for t in threading.enumerate() if t.name == "kvcli-idle-embedding"]
