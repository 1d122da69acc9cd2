"""kvcli ask over folders, several documents and --questions: JSON Lines, error records, exit codes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcli import model as models  # Session.open loads through kvcli.model.load_model
from kvcli.batch import expand_inputs, read_questions
from kvcli.errors import UsageError
from tests.helpers.cli_runner import run_cli

REPO = Path(__file__).resolve().parents[2]
TEXT = "The harbour log for {name}: {n} ships arrived, the keeper was Ada Brook, the light is red."


@pytest.fixture
def folder(tmp_path):
    """3 documents (one in a sub-folder) and a corrupt PDF."""
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text(TEXT.format(name="a", n=3))
    (d / "b.md").write_text("# Log\n\n" + TEXT.format(name="b", n=5))
    (d / "sub" / "c.html").write_text(f"<html><body><p>{TEXT.format(name='c', n=7)}</p></body></html>")
    (d / "broken.pdf").write_bytes(b"%PDF-1.4 this is not really a pdf")
    (d / "notes.bin").write_bytes(b"\x00\x01")  # unsupported extension: not picked up from a folder
    (d / ".hidden.txt").write_text("hidden files are skipped")
    return d


@pytest.fixture
def cli(capsys, monkeypatch, model, tmp_path):
    """``cli(*args)`` -> (code, records, stderr), with the tiny model and a short answer."""

    def run(*args, stdin: str | None = None):
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        code, out, err = run_cli(
            ["ask", *args, "-m", model, "-c", "full", "--max-new-tokens", "3", "--cache-dir", tmp_path / "cache"],
            capsys,
            monkeypatch,
        )
        return code, [json.loads(line) for line in out.splitlines()], err

    return run


def test_folder_with_a_corrupt_file_gives_records_for_all_and_exit_1(cli, folder):
    code, records, err = cli(folder, "Who was the keeper?")
    assert code == 1
    assert [Path(r["document"]).name for r in records] == ["a.txt", "b.md", "broken.pdf", "c.html"]  # sorted paths
    errors = [r for r in records if "error" in r]
    assert len(records) == 4 and len(errors) == 1
    assert errors[0]["document"].endswith("broken.pdf") and errors[0]["error_type"] == "DocumentError"
    assert "broken.pdf" in errors[0]["error"] and errors[0]["question"] == "Who was the keeper?"
    for r in records:
        if "error" not in r:
            assert r["question"] == "Who was the keeper?" and isinstance(r["answer"], str) and r["n_context_tokens"] > 0
            assert list(r)[:2] == ["document", "question"]
    # the failure is also said on stderr, naming the file once; then the summary
    [line] = [line for line in err.splitlines() if "broken.pdf" in line]
    assert line.startswith("kvcli: error: ") and line.count("broken.pdf") == 1, line
    assert err.splitlines()[-1] == "3 answered, 1 failed · full"


def test_questions_file_asks_every_question_of_every_document_loading_the_model_once(
    cli, folder, tmp_path, monkeypatch
):
    loads = []
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    questions = tmp_path / "q.txt"
    questions.write_text("Who was the keeper?\n\n# a comment\nHow many ships arrived?\nWhat colour is the light?\n")
    code, records, _ = cli(folder / "a.txt", folder / "b.md", "--questions", questions)
    assert code == 0 and len(loads) == 1
    assert [(Path(r["document"]).name, r["question"]) for r in records] == [
        (doc, q)
        for doc in ("a.txt", "b.md")
        for q in ("Who was the keeper?", "How many ships arrived?", "What colour is the light?")
    ]
    # the questions about one document share its prefix state: computed once, then hits
    assert [r["cache"] for r in records] == ["miss", "hit", "hit", "miss", "hit", "hit"]


def test_stdin_document(cli):
    code, records, _ = cli("-", "Who was the keeper?", "--json", stdin=TEXT.format(name="x", n=1))
    assert code == 0 and len(records) == 1 and records[0]["document"] == "-"
    # stdin among other documents: a batch
    code, out, _ = run_stdin_batch(cli)
    assert code == 0 and [r["document"] for r in out] == ["-", "-"]


def run_stdin_batch(cli):
    return cli("-", "--questions", _write_questions(), stdin=TEXT.format(name="y", n=2))


def _write_questions() -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write('{"question": "Who was the keeper?"}\n"How many ships?"\n')
    return f.name


def test_quiet_leaves_stderr_the_errors_alone(cli, folder):
    """--quiet: "nothing on stderr but errors": no progress, no summary, each failure's one line."""
    code, records, err = cli(folder, "Who was the keeper?", "--quiet")
    failed = [r for r in records if "error" in r]
    assert code == 1 and len(records) == 4 and len(failed) == 1
    assert err.splitlines() == [f"kvcli: error: {failed[0]['error']}"]
    code, records, err = cli(folder / "a.txt", "Who was the keeper?", "--quiet", "--json")
    assert code == 0 and err == ""


def test_fail_fast_stops_at_the_first_failure(cli, folder):
    code, records, err = cli(folder / "missing.txt", folder / "a.txt", "Who?", "--fail-fast")
    assert code == 1 and len(records) == 1 and "does not exist" in records[0]["error"]
    assert err.splitlines()[-1] == "0 answered, 1 failed, 1 not asked (--fail-fast) · full"
    code, records, _ = cli(folder / "missing.txt", folder / "a.txt", "Who?")
    assert code == 1 and len(records) == 2 and "error" not in records[1]


def test_batch_summary_counts_what_ran_and_shows_the_resolved_spec(folder, model, tmp_path, capsys, monkeypatch):
    def run(*args):
        return run_cli(
            ["ask", *args, "-m", model, "--max-new-tokens", "2", "--no-cache", "-c", "gemfilter:layer=2"],
            capsys,
            monkeypatch,
        )

    code, out, err = run(folder / "missing.txt", folder / "a.txt", folder / "b.md", "Who?", "--fail-fast")
    assert code == 1 and len(out.splitlines()) == 1
    assert err.splitlines() == [
        f"kvcli: error: '{folder / 'missing.txt'}' does not exist",
        "0 answered, 1 failed, 2 not asked (--fail-fast) · gemfilter:layer=2",  # nothing ran: the spec as given
    ]
    code, out, err = run(folder / "a.txt", folder / "missing.txt", "Who?")
    summary = err.splitlines()[-1]
    resolved = json.loads(out.splitlines()[0])["compressor"]  # the JSON: every knob resolved
    assert resolved.startswith("gemfilter:layer=2,k=") and "auto" not in resolved, resolved
    assert code == 1 and summary == "1 answered, 1 failed · gemfilter:layer=2", summary  # the knob the user set


def test_an_error_that_does_not_name_the_document_gets_its_name_once():
    from kvcli.batch import error_line

    assert (
        error_line({"document": "/x/a.pdf", "error": "'/x/a.pdf' is not a valid PDF"})
        == "'/x/a.pdf' is not a valid PDF"
    )
    assert (
        error_line({"document": "/x/a.txt", "error": "the prompt is longer than the window"})
        == "/x/a.txt: the prompt is longer than the window"
    )
    assert error_line({"document": "-", "error": "stdin is empty"}) == "stdin is empty"


def test_glob_pattern_and_usage_errors(cli, folder, capsys):
    code, records, _ = cli(str(folder / "*.txt"), "Who?")
    assert code == 0 and [Path(r["document"]).name for r in records] == ["a.txt"]
    code, records, err = cli(str(folder / "*.nothing"), "Who?")  # one input that names no document
    assert code == 1 and records == [] and err.startswith("kvcli: error:") and "no files match" in err
    code, records, _ = cli(str(folder / "*.nothing"), folder / "a.txt", "Who?")  # in a batch: a record
    assert code == 1 and "no files match" in records[0]["error"] and "answer" in records[1]
    # usage errors: exit 2, one line, before any model work
    for args in (
        [folder, "--questions", folder / "nope.txt"],
        [folder, "Who?", "--template", "nosuch-template"],
        ["-", "-", "Who?"],
    ):
        code, records, err = cli(*args)
        assert code == 2 and records == [] and err.startswith("kvcli: error:") and len(err.splitlines()) == 1


def test_records_stream_in_input_order_as_soon_as_every_earlier_document_is_done():
    """Executors report documents in any order; a record goes out once the documents before it are
    done (not at the end), so what was printed stays printed if the run dies."""
    from kvcli.executors import in_input_order

    consumed = []

    def events():  # job 2 finishes first, then job 0 record by record, then job 1
        for event in [
            (2, {"r": "2a"}),
            (2, None),
            (0, {"r": "0a"}),
            (0, {"r": "0b"}),
            (0, None),
            (1, {"r": "1a"}),
            (1, None),
        ]:
            consumed.append(event)
            yield event

    out = []
    for record in in_input_order(events(), 3):
        out.append((record["r"], len(consumed)))
    # 0a as soon as it came (job 0 is the head), 2a right after job 1 was done
    assert out == [("0a", 3), ("0b", 4), ("1a", 6), ("2a", 7)]
    with pytest.raises(RuntimeError, match="1 documents unfinished"):
        list(in_input_order(iter([(0, None), (1, {"r": "x"})]), 2))


def test_expand_inputs_and_read_questions(folder, tmp_path):
    items = expand_inputs([str(folder), "-", str(folder / "a.txt")])
    assert [Path(i.source).name for i in items] == ["a.txt", "b.md", "broken.pdf", "c.html", "-", "a.txt"]
    q = tmp_path / "q.jsonl"
    q.write_text('{"question": "One?"}\n"Two?"\nThree?\n')
    assert read_questions(str(q)) == ["One?", "Two?", "Three?"]
    q.write_text('{"q": 1}\n')
    with pytest.raises(UsageError):
        read_questions(str(q))
    q.write_text("\n# only a comment\n")
    with pytest.raises(UsageError):
        read_questions(str(q))


# --- the shell scripts in examples/ run as documented ----------------------------------------


def _script_env(model: str, tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    launcher = bin_dir / "kvcli"
    launcher.write_text(f'#!/bin/sh\nexec {sys.executable} -m kvcli "$@"\n')
    launcher.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "KVCLI_MODEL": model,
        "KVCLI_CACHE_DIR": str(tmp_path / "cache"),
        "KVCLI_MAX_NEW_TOKENS": "3",
    }


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "examples").glob("*.sh")))
def test_example_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(REPO / "examples" / script)], check=True)


def run_example(script: str, model: str, tmp_path: Path, *args) -> str:
    """Run examples/<script> with kvcli on PATH (tiny model, private cache); its stdout."""
    out = subprocess.run(
        ["bash", str(REPO / "examples" / script), *map(str, args)],
        capture_output=True,
        text=True,
        env=_script_env(model, tmp_path),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.e2e
def test_example_folder_script_runs(model, folder, tmp_path):
    (folder / "broken.pdf").unlink()
    lines = run_example("ask_folder.sh", model, tmp_path, folder, "Who was the keeper?").strip().splitlines()
    assert len(lines) == 3 and all("\t" in line for line in lines)


@pytest.mark.e2e
def test_example_questions_script_runs(model, folder, tmp_path):
    questions = tmp_path / "q.txt"
    questions.write_text("# two questions\nWho was the keeper?\nHow many ships?\n")
    rows = [
        line.split("\t")
        for line in run_example("ask_questions.sh", model, tmp_path, folder / "a.txt", questions).splitlines()
    ]
    assert [(r[0], r[2]) for r in rows] == [("Who was the keeper?", "miss"), ("How many ships?", "hit")]


@pytest.mark.e2e
def test_example_parallel_script_shares_one_cache(model, folder, tmp_path):
    (folder / "broken.pdf").unlink()
    out = run_example("ask_parallel.sh", model, tmp_path, folder, "Who was the keeper?")
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 3 and all("answer" in r for r in records)
    assert len(list((tmp_path / "cache" / "kv").glob("*.safetensors"))) == 3
