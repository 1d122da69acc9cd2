"""A batch says each document's error once on stderr, however many questions it fails; the JSON
keeps one error record per (document, question) (issue 27, item 6)."""

from __future__ import annotations

import json

from kvcli.batch import ErrorLines
from tests.helpers.cli_runner import run_cli


def test_a_broken_document_asked_two_questions_is_said_once(tmp_path, model, capsys, monkeypatch):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("The keeper was Ada Brook; 3 ships arrived.")
    (folder / "broken.pdf").write_bytes(b"%PDF-1.4 this is not really a pdf")
    questions = tmp_path / "q.txt"
    questions.write_text("Who was the keeper?\nHow many ships?\n")
    args = ["ask", folder, "--questions", questions, "-m", model, "-c", "full", "--max-new-tokens", "2", "--no-cache"]
    code, out, err = run_cli(args, capsys, monkeypatch)
    records = [json.loads(line) for line in out.splitlines()]
    errors = [r for r in records if "error" in r]
    assert code == 1 and len(records) == 4 and len(errors) == 2  # one record per pair
    assert {r["question"] for r in errors} == {"Who was the keeper?", "How many ships?"}
    said = [line for line in err.splitlines() if line.startswith("kvcli: error:")]
    assert len(said) == 1 and "broken.pdf" in said[0] and "not a valid PDF" in said[0], err
    assert err.splitlines()[-1] == "2 answered, 2 failed · full"
    code, out2, err = run_cli([*args, "-q"], capsys, monkeypatch)  # --quiet: nothing on stderr but the errors
    again = [(r["document"], r.get("answer"), r.get("error")) for r in map(json.loads, out2.splitlines())]
    assert code == 1 and again == [(r["document"], r.get("answer"), r.get("error")) for r in records]
    assert err.splitlines() == said


def test_error_lines_are_per_document_and_message():
    lines = ErrorLines()
    a1 = {"document": "a.pdf", "question": "q1", "error": "'a.pdf' is not a valid PDF"}
    assert lines.line(a1) == "'a.pdf' is not a valid PDF"
    assert lines.line({**a1, "question": "q2"}) is None
    # another document, or another error of the same document (a question that failed), is said
    assert (
        lines.line({**a1, "document": "b.pdf", "error": "'b.pdf' is not a valid PDF"}) == "'b.pdf' is not a valid PDF"
    )
    assert (
        lines.line({**a1, "question": "q3", "error": "the question is too long"}) == "a.pdf: the question is too long"
    )
