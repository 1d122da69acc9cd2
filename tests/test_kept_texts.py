"""A PDF's (or an HTML page's) extracted text kept in the cache folder (kvcli.documents.kept): the
same Document back without extracting again, a miss for anything else, and an entry of the disk
store like the page vectors (listed, counted, removed by document)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvcli import documents
from kvcli.batch import expand_inputs, read_input
from kvcli.documents import kept, load_document
from kvcli.store import KVStore
from tests.helpers.cli_runner import run_cli

DATA = Path(__file__).parent / "data"


@pytest.fixture
def pdf(tmp_path) -> Path:
    path = tmp_path / "refcard.pdf"
    shutil.copyfile(DATA / "refcard-en-a4.pdf", path)
    return path


def counted_extractions(monkeypatch, kind: str) -> list[str]:
    """The extractor of ``kind`` wrapped to note each call: what a hit must not make."""
    calls: list[str] = []
    extract = documents._LOADERS[kind]

    def noted(data, source):
        calls.append(source)
        return extract(data, source)

    monkeypatch.setitem(documents._LOADERS, kind, noted)
    return calls


def kept_files(cache: Path) -> list[Path]:
    return sorted((cache / "texts").glob("*.safetensors"))


def test_a_kept_pdf_text_is_the_extracted_document_without_extracting_it_again(pdf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    plain = load_document(pdf)  # nothing kept without a cache folder
    assert not (cache / "texts").exists()
    calls = counted_extractions(monkeypatch, "pdf")
    first = load_document(pdf, cache)
    assert calls == [str(pdf)] and len(kept_files(cache)) == 1
    second = load_document(pdf, cache)
    assert calls == [str(pdf)]  # read back, not extracted
    assert first == second == plain and second.n_pages == plain.n_pages > 1
    # the CLI's reading of an input goes through the same cache
    again = read_input(expand_inputs([str(pdf)])[0], lambda: "", cache)
    assert again == plain and calls == [str(pdf)]


def test_another_file_or_format_or_extractor_is_another_key(pdf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    text = load_document(pdf).text
    calls = counted_extractions(monkeypatch, "pdf")
    load_document(pdf, cache)
    data = pdf.read_bytes()
    other = tmp_path / "other.pdf"
    other.write_bytes(data + b"\n%% one more line\n")  # the same text, other bytes: extracted again
    assert load_document(other, cache).text == text
    assert len(calls) == 2 and len(kept_files(cache)) == 2
    assert kept.key(data, "pdf") != kept.key(data, "html")
    monkeypatch.setattr(kept, "FORMAT", kept.FORMAT + 1)
    load_document(pdf, cache)  # another layout: a miss
    assert len(calls) == 3 and len(kept_files(cache)) == 3
    kept.extractor.cache_clear()
    monkeypatch.setattr(kept, "extractor", lambda kind: "another extraction")
    load_document(pdf, cache)
    assert len(calls) == 4


def test_a_damaged_or_foreign_file_is_a_miss_and_replaced(pdf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    good = load_document(pdf, cache)
    (path,) = kept_files(cache)
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 0x01  # a bit of the text flipped: its sha256 no longer holds
    path.write_bytes(bytes(raw))
    calls = counted_extractions(monkeypatch, "pdf")
    assert load_document(pdf, cache) == good and len(calls) == 1
    assert kept.load(path, path.stem) is not None  # written again, whole
    path.write_bytes(b"not a safetensors file")
    assert load_document(pdf, cache) == good and len(calls) == 2
    assert kept.load(path, "another key") is None


def test_a_cache_that_cannot_be_written_only_costs_the_extraction(pdf, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "texts").write_text("a file where the folder would be")
    assert load_document(pdf, cache) == load_document(pdf)


def test_html_is_kept_and_plain_text_is_not(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    page, notes = tmp_path / "page.html", tmp_path / "notes.txt"
    page.write_text("<html><head><title>t</title></head><body><p>The lamp is <b>red</b>.</p></body></html>")
    notes.write_text("The lamp is red.\n")
    calls = counted_extractions(monkeypatch, "html")
    assert load_document(page, cache).text == load_document(page, cache).text == "The lamp is red."
    assert len(calls) == 1 and len(kept_files(cache)) == 1
    load_document(notes, cache)
    assert len(kept_files(cache)) == 1


def test_an_unusable_document_keeps_nothing(tmp_path):
    cache = tmp_path / "cache"
    junk = tmp_path / "junk.pdf"
    junk.write_bytes(b"%PDF-1.4 nothing more")
    with pytest.raises(documents.DocumentError):
        load_document(junk, cache)
    blank = tmp_path / "blank.html"
    blank.write_text("<html><body>   </body></html>")
    with pytest.raises(documents.DocumentError, match="is empty"):
        load_document(blank, cache)
    assert kept_files(cache) == []


def test_the_store_lists_counts_and_removes_a_kept_text(pdf, tmp_path, capsys, monkeypatch):
    """An entry of kind "text" for ``kvcli cache``: listed with its document, counted by ``info``
    (and under the cap), removed by ``rm DOCUMENT`` and by ``prune``."""
    cache = tmp_path / "cache"
    document = load_document(pdf, cache)
    (path,) = kept_files(cache)
    code, out, _ = run_cli(["cache", "ls", "--cache-dir", cache, "--json"], capsys, monkeypatch)
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and row["kind"] == "text" and row["key"] == path.stem and row["error"] is None
    assert row["document"] == str(pdf.resolve()) and row["document_sha256"] == document.sha256
    assert row["state"] == {"kind": "text", "pages": document.n_pages, "chars": len(document.text)}
    assert row["size_bytes"] == path.stat().st_size
    code, out, _ = run_cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
    info = json.loads(out)
    assert (
        info["entries"] == 1 and info["texts"] == 1 and info["texts_bytes"] == info["size_bytes"] == row["size_bytes"]
    )
    store = KVStore.open(cache)
    assert [f[0] for f in store._files()] == [path]  # the cap counts it
    code, out, _ = run_cli(["cache", "rm", pdf, "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and out.startswith("removed 1 entry, ") and kept_files(cache) == []
    load_document(pdf, cache)
    code, out, _ = run_cli(["cache", "prune", "--cache-max", "1", "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and kept_files(cache) == []
