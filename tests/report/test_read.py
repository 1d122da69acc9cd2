"""What a method that retrieves read (issue 49): ``Selection.read`` as pages fills it, the ``read``
record and line built from it (places written out by hand), the progress counting the tokens read,
and ``inspect`` saying the same."""

from __future__ import annotations

import json

import pytest

from kvcli.answer.pipeline import Pipeline
from kvcli.api import AskOptions, QuestionOptions, Session
from kvcli.compressors.selection import Read, read_line, read_record
from kvcli.documents import Document, document_from_text, load_document

PAGES = ["First page.\nNothing here.", "Second page.\nThe passkey is 4172.\nEnd.", "Third page."]


def paged() -> Document:
    text, starts = "", []
    for i, page in enumerate(PAGES):
        starts.append(len(text))
        text += page + ("\n\n" if i < len(PAGES) - 1 else "")
    return Document("book.pdf", text, tuple(starts), "pdf", "0")


class FakePrompt:
    n_document_tokens = 1000


def test_places_records_and_lines_by_hand():
    doc = paged()
    second = doc.text.index("Second")
    whole = Read("whole", 10, 30, second, second + len(PAGES[1]))
    skim = Read("skimmed", 40, 45, 0, len("First page."))
    assert whole.where(doc) == "p. 2" and skim.where(doc) == "p. 1"
    assert read_line((whole, skim), FakePrompt, doc) == "read p. 2 whole, p. 1 skimmed: 25 of 1,000 document tokens"
    record = read_record((whole, skim), FakePrompt, doc, "bm25")
    assert record == {
        "passages": [
            {"how": "whole", "pages": [2, 2], "start": second, "end": second + len(PAGES[1]), "n_tokens": 20},
            {"how": "skimmed", "pages": [1, 1], "start": 0, "end": 11, "n_tokens": 5},
        ],
        "n_tokens": 25,
        "n_document_tokens": 1000,
        "ranked_by": "bm25",
    }
    assert read_record(None, FakePrompt, doc) is None
    # a document without pages: lines, counted from 1
    text = "one\ntwo\nthree\nfour\n\nfive"
    note = document_from_text(text)
    lines = Read("whole", 0, 3, text.index("two"), text.index("four") + 4)
    assert lines.place(note) == ("lines", 2, 4) and lines.where(note) == "lines 2-4"
    assert Read("skimmed", 0, 1, text.index("five"), len(text)).where(note) == "line 6"
    two = Read("whole", 0, 1, 0, 3)
    assert read_line((two, lines, lines), FakePrompt, note).startswith("read line 1, lines 2-4 and lines 2-4 whole")
    cut, skim = Read("beginning", 0, 2, 0, 3), Read("skimmed", 5, 8, text.index("two"), text.index("four") + 4)
    got = read_line((cut, skim), FakePrompt, note)
    assert got == "read the beginning of line 1, lines 2-4 skimmed: 5 of 1,000 document tokens"


@pytest.fixture(scope="module")
def short_window(tiny_dir):
    """A window of 2,048 tokens: pages' budget (1,024) holds a whole page-sized passage (~500 tokens)."""
    return str(tiny_dir("llama", num_hidden_layers=4, max_position_embeddings=2048))


def long_text() -> str:
    rows = [f"Row {i}: the harbour log notes calm water and a light breeze." for i in range(200)]  # ~3,400 tokens
    rows[90] = "Row 90: the padlock combination of the oil store is 4417."
    return "\n".join(rows)


def test_pages_reads_what_it_says_and_the_progress_counts_it(short_window, device):
    session = Session.open(AskOptions(model=short_window, max_new_tokens=2, device=device.type, dtype="float32"))
    doc = document_from_text(long_text())
    prompts, fractions = [], []
    result = session.ask(
        doc,
        "What is the padlock combination?",
        Pipeline.parse("auto"),
        QuestionOptions(
            on_prompt=lambda method, n: prompts.append((method, n)),
            on_progress=fractions.append,
            sources=False,
            use_store=False,
        ),
    )
    read = result.selection.read
    assert read and read[0].how == "whole"
    assert doc.text[read[0].char_start : read[0].char_end].find("Row 90:") >= 0  # the answer's passage, whole
    # what it read: the kept document tokens are exactly the reads' tokens
    kept_doc = [i for i in result.selection.kept.tolist() if result.prompt.doc_start <= i < result.prompt.doc_end]
    assert sorted(kept_doc) == sorted(t for r in read for t in range(r.start, r.end))
    # the progress: announced with the tokens read, not the prompt's, and it reaches them all
    assert prompts == [("pages", result.selection.n_kept)] and result.selection.n_kept < result.prompt.n_tokens
    assert fractions and fractions[-1] == pytest.approx(1.0)


def test_inspect_says_what_was_read(cli, short_window, tmp_path):
    path = tmp_path / "log.txt"
    path.write_text(long_text() + "\n", encoding="utf-8")
    args = ("inspect", path, "What is the padlock combination?", "-m", short_window, "-c", "pages", "--no-cache")
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["compression_ratio"] is None and record["read"]["passages"][0]["how"] == "whole"
    doc = load_document(path)
    first = record["read"]["passages"][0]
    assert "Row 90:" in doc.text[first["start"] : first["end"]]
    code, out, err = cli(*args)
    assert code == 0, err
    assert (
        f"of {record['read']['n_document_tokens']:,} document tokens" in out and "compression" not in out.split("\n")[1]
    )
