"""``kvcli cache add``: every passage of a document embedded ahead of its questions
(kvcli.api.keep_document), so that a question about it, in any process, embeds only itself; the
file written step by step; one bad document never stops the others."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from kvcli import api
from kvcli.answer.pipeline import Pipeline
from kvcli.documents import Document, document_from_text, load_document
from kvcli.retrieval import embed, vectors
from tests.helpers.cli_runner import run_cli
from tests.helpers.embedders import Counting, paged_document
from tests.helpers.stores import session_for

DATA = Path(__file__).parents[1] / "data"
PAGES = [
    f"Page {i}: the keeper logs the {word} lamp and the {word} flag."
    for i, word in enumerate(["red", "green", "blue", "amber", "white", "grey", "black"])
]


def paged() -> Document:
    return paged_document(PAGES)


def unpaged() -> Document:
    """A text without pages: page-sized runs of paragraphs are its passages."""
    return document_from_text("\n\n".join(" ".join([page] * 40) for page in PAGES), source="notes.txt")


@pytest.fixture
def model(monkeypatch) -> Counting:
    counting = Counting()
    monkeypatch.setattr(embed, "embedder", lambda name: counting)
    monkeypatch.delenv(embed.ENV, raising=False)
    return counting


@pytest.mark.parametrize("make", [paged, unpaged], ids=["pages", "no-pages"])
def test_a_question_after_it_embeds_only_itself(tiny_lm, tmp_path, model, make):
    doc = make()
    kept = api.keep_document(doc, tmp_path)
    assert len(doc.passages()) > 2 and kept.passages == kept.embedded == kept.added == len(doc.passages())
    assert kept.model is not None and kept.vectors is not None and kept.vectors.is_file()
    session = session_for(tiny_lm("llama"), tmp_path)
    calls = model.calls
    result = session.ask(doc, "Which lamp is amber?", Pipeline.parse("pages:candidates=3"))
    assert result.selection.ranked_by.startswith("bm25+")
    assert model.calls == calls + 1 and model.texts == ["Which lamp is amber?"]  # the question's own vector
    # the file is the one the pages method reads: the prompt's passages are the document's
    texts = [p.text for p in result.prompt.passages]
    assert kept.vectors == vectors.path_for(tmp_path, vectors.key(model.id, texts))


def test_its_vectors_are_those_one_call_over_every_passage_gives(tmp_path, model, monkeypatch):
    monkeypatch.setattr(api, "KEEP_STEP", 2)
    doc = paged()
    steps: list[tuple[int, int]] = []
    kept = api.keep_document(doc, tmp_path, on_step=lambda done, total: steps.append((done, total)))
    assert steps == [(0, 7), (2, 7), (4, 7), (6, 7), (7, 7)] and model.calls == 4  # written after each step
    texts = [doc.text[lo:hi] for lo, hi in doc.passages()]
    digest = vectors.key(model.id, texts)
    vecs, owner, done = vectors.load(kept.vectors, digest)
    ref, ref_owner, _ = vectors.passage_vectors(Counting(), texts, None)  # all at once, not kept
    assert done.all() and np.array_equal(owner, ref_owner) and np.allclose(vecs, ref)
    again = api.keep_document(doc, tmp_path)
    assert (again.embedded, again.added) == (7, 0) and model.calls == 4  # nothing left to embed


def test_stopped_it_keeps_what_it_embedded_and_goes_on_from_there(tmp_path, model, monkeypatch):
    monkeypatch.setattr(api, "KEEP_STEP", 3)
    stop = threading.Event()
    first = api.keep_document(paged(), tmp_path, on_step=lambda done, total: stop.set() if done else None, stop=stop)
    assert (first.embedded, first.added) == (3, 3)
    rest = api.keep_document(paged(), tmp_path)
    assert (rest.embedded, rest.added) == (7, 4) and model.calls == 3  # pages 0-2, then 3-5 and 6
    assert [t.split()[1] for t in model.texts] == ["6:"]


def test_without_an_embedding_model_nothing_is_embedded(tmp_path, monkeypatch):
    monkeypatch.setenv(embed.ENV, "none")
    kept = api.keep_document(paged(), tmp_path)
    assert (kept.model, kept.vectors, kept.embedded) == (None, None, 0) and not (tmp_path / vectors.FOLDER).exists()


def test_the_command_keeps_each_document_and_one_bad_file_stops_none(tmp_path, model, capsys, monkeypatch):
    pdf = tmp_path / "refcard.pdf"
    shutil.copyfile(DATA / "refcard-en-a4.pdf", pdf)
    bad = tmp_path / "bad.pdf"
    bad.write_bytes(b"not a pdf")
    cache = tmp_path / "cache"
    code, out, err = run_cli(["cache", "add", bad, pdf, "--cache-dir", cache, "--json"], capsys, monkeypatch)
    assert code == 1 and "Traceback" not in err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["document"] for r in records] == [str(bad), str(pdf)] and "error" in records[0]
    doc = load_document(pdf)
    kept = records[1]
    assert kept["unit"] == "pages" and kept["passages"] == kept["embedded"] == len(doc.passages())
    assert Path(kept["vectors"]).is_file() and kept["embedding_model"]
    lines = err.splitlines()
    assert lines[0].startswith("kvcli: error: ") and str(bad) in lines[0]
    n = len(doc.passages())
    assert lines[1].startswith(f"kvcli: refcard.pdf: {n} of {n} pages embedded ({n} now, ")
    assert lines[1].endswith(f" s) by {embed.setting()}") and len(lines) == 2
    code, out, _ = run_cli(["cache", "ls", "--cache-dir", cache, "--json"], capsys, monkeypatch)
    kinds = sorted(json.loads(line)["kind"] for line in out.splitlines())
    assert kinds == ["text", "vectors"]  # the PDF's extracted text is kept too
    code, out, err = run_cli(["cache", "add", pdf, "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and out == "" and "all there already" in err  # stdout holds only what --json asks for
    code, out, err = run_cli(["cache", "add", bad, pdf, "--cache-dir", cache, "-q"], capsys, monkeypatch)
    assert (code, out, err.splitlines()) == (1, "", lines[:1])  # --quiet: the error alone


def test_with_kv_a_first_question_starts_from_the_kept_kv(tiny_dir, tmp_path, model, capsys, monkeypatch):
    """``--kv``: the document's prefix KV read with the model and stored, so that the first
    question's prompt is a cache hit (and answers as a cold run does); a second run finds it there;
    a method that reads what the question points to keeps none."""
    doc = tmp_path / "notes.txt"
    doc.write_text(" ".join(PAGES), encoding="utf-8")
    cache, tiny = tmp_path / "cache", tiny_dir("llama")
    add = ["cache", "add", doc, "--kv", "-m", tiny, "--cache-dir", cache, "--json"]
    code, out, err = run_cli(add, capsys, monkeypatch)
    assert code == 0, err
    kv = json.loads(out)["kv"]
    assert kv["method"] == "full" and kv["status"] == "miss" and kv["tokens"] > len(PAGES)
    assert err.strip().endswith(f"; its KV kept (full, {kv['tokens']:,} tokens, {kv['seconds']:,.0f} s)")
    code, out, err = run_cli(add, capsys, monkeypatch)
    assert json.loads(out)["kv"]["status"] == "hit" and err.strip().endswith("tokens, there already)")
    ask = ["ask", doc, "Which lamp is amber?", "-m", tiny, "--cache-dir", cache, "--json", "--max-new-tokens", "4"]
    code, out, err = run_cli(ask, capsys, monkeypatch)
    warm = json.loads(out)
    assert code == 0 and warm["cache"] == "hit" and warm["cache_saved_s"] > 0
    code, out, err = run_cli([*ask, "--no-cache"], capsys, monkeypatch)
    assert json.loads(out)["answer"] == warm["answer"]
    code, out, err = run_cli([*add, "-c", "pages"], capsys, monkeypatch)
    kv = json.loads(out)["kv"]
    assert kv["tokens"] == 0 and kv["status"] is None
    assert err.strip().endswith("; no KV to keep: pages reads what each question points to")
    code, out, err = run_cli([*add, "-c", "finch"], capsys, monkeypatch)  # compresses with the question
    assert json.loads(out)["kv"]["tokens"] == 0 and err.strip().endswith(
        "; no KV to keep: finch reads the document with each question"
    )
    # a document past the window: -c auto reads pages, so nothing is kept, and no warning about a
    # question's reading is said where there is no question
    long = tmp_path / "long.txt"
    long.write_text(" ".join(PAGES * 12), encoding="utf-8")
    small = tiny_dir("llama", max_position_embeddings=512)
    code, out, err = run_cli(["cache", "add", long, "--kv", "-m", small, "--cache-dir", cache, "--json"], capsys, monkeypatch)  # fmt: skip
    kv = json.loads(out)["kv"]
    assert code == 0 and kv["tokens"] == 0 and kv["method"].startswith("pages") and "window" not in err
