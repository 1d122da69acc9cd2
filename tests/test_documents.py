"""Tests for kvcli.documents: loaders, the page map, and one-line user errors."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from kvcli.documents import (
    SUPPORTED_SUFFIXES,
    Document,
    document_from_text,
    load_document,
)
from kvcli.errors import DocumentError

SENTENCES = [
    "The harbour on page one is painted blue.",
    "The passkey on page two is 71432.",
    "The final answer on page three is forty-two.",
]


# --- fixture builders ----------------------------------------------------------------


def make_pdf(path: Path, pages: list[str | None]) -> Path:
    """A PDF with one page per entry: text, or None for a page holding only a small image."""
    from fpdf import FPDF
    from PIL import Image

    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    for text in pages:
        pdf.add_page()
        if text is None:
            pdf.image(Image.new("RGB", (8, 8), (200, 30, 30)), x=20, y=20, w=40)
            pdf.rect(20, 80, 60, 30)
        elif text:
            pdf.multi_cell(0, 8, text)
    pdf.output(str(path))
    return path


def encrypt_pdf(src: Path, dst: Path, user_password: str, owner_password: str, algorithm: str = "RC4-128") -> Path:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(src))
    writer.encrypt(user_password=user_password, owner_password=owner_password, algorithm=algorithm)
    with open(dst, "wb") as fh:
        writer.write(fh)
    return dst


@pytest.fixture(scope="module")
def pdf_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pdfs")
    make_pdf(d / "three.pdf", SENTENCES)
    return d


def error_of(path, capfd=None) -> str:
    with pytest.raises(DocumentError) as info:
        load_document(path)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert os.path.basename(os.fspath(path)) in msg, msg
    if capfd is not None:
        out, err = capfd.readouterr()
        assert err == "" and out == "", (out, err)
    return msg


# --- PDFs ----------------------------------------------------------------------------


def test_pdf_pages_map_back(pdf_dir, capfd):
    doc = load_document(pdf_dir / "three.pdf")
    assert capfd.readouterr().err == ""
    assert doc.kind == "pdf" and doc.n_pages == 3
    assert doc.source == str(pdf_dir / "three.pdf")
    assert doc.page_starts[0] == 0
    assert list(doc.page_starts) == sorted(set(doc.page_starts))
    assert doc.sha256 == hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
    spans = []
    for page, sentence in enumerate(SENTENCES, start=1):
        i = doc.text.index(sentence)
        assert doc.page_of(i) == page
        assert doc.page_of(i + len(sentence) - 1) == page
        assert doc.page_range(i, i + len(sentence)) == (page, page)
        spans.append((i, i + len(sentence)))
    assert doc.page_range(spans[0][0], spans[2][1]) == (1, 3)
    assert doc.page_range(spans[1][0], spans[2][0] + 1) == (2, 3)
    # each page's slice of the text is exactly that page's (stripped) text plus the separator
    assert doc.text[doc.page_starts[1] : doc.page_starts[2]] == SENTENCES[1] + "\n\n"
    assert doc.text.endswith(SENTENCES[2])


def test_pdf_accepts_pathlike_and_uppercase_suffix(pdf_dir):
    upper = pdf_dir / "UPPER.PDF"
    upper.write_bytes((pdf_dir / "three.pdf").read_bytes())
    assert load_document(upper).n_pages == 3
    assert load_document(str(upper)).source == str(upper)


def test_pdf_empty_pages_keep_offsets_increasing(tmp_path):
    doc = load_document(make_pdf(tmp_path / "gaps.pdf", [SENTENCES[0], "", None, SENTENCES[2], ""]))
    assert doc.n_pages == 5
    starts = doc.page_starts
    assert all(b > a for a, b in zip(starts, starts[1:]))
    # empty middle pages own exactly their separator; the empty last page starts at len(text)
    assert starts[2] - starts[1] == 2 and starts[3] - starts[2] == 2
    assert starts[4] == len(doc.text)
    assert doc.text[starts[1] : starts[3]] == "\n\n\n\n"
    # the separator after a page belongs to that page
    end1 = doc.text.index(SENTENCES[0]) + len(SENTENCES[0])
    assert doc.page_of(end1) == 1 and doc.page_of(end1 + 1) == 1 and doc.page_of(end1 + 2) == 2
    assert doc.page_of(doc.text.index(SENTENCES[2])) == 4
    assert doc.page_of(len(doc.text) - 1) == 4
    assert doc.page_of(len(doc.text)) == 5


ALGORITHMS = ["RC4-128", "AES-128", "AES-256"]  # AES-256: qpdf's default


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_password_protected_pdf_is_refused_in_one_line(pdf_dir, tmp_path, capfd, algorithm):
    path = encrypt_pdf(pdf_dir / "three.pdf", tmp_path / "locked.pdf", "secret", "owner", algorithm)
    msg = error_of(path, capfd)
    assert "is protected by a password" in msg and "qpdf --password=PASSWORD --decrypt" in msg
    assert "cryptography" not in msg  # installing a package would not help


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pdf_with_empty_user_password_is_read(pdf_dir, tmp_path, algorithm):
    # PDFium decrypts RC4 and AES itself: these open with no extra package
    path = encrypt_pdf(pdf_dir / "three.pdf", tmp_path / "owner-only.pdf", "", "owner", algorithm)
    doc = load_document(path)
    assert doc.n_pages == 3
    assert doc.page_of(doc.text.index(SENTENCES[1])) == 2


DATA = Path(__file__).resolve().parent / "data"


def pdf_words(text: str) -> list[str]:
    import re
    import unicodedata

    return re.findall(r"\w+", unicodedata.normalize("NFKC", text))


# (file, words pdftotext finds, words run together by an extraction that misses word gaps, a phrase
# on a later page): debian-refcard places each word on its own (pypdf read 597 of its 940 words,
# "aptupdate"); Ghostscript's kerned text defeats PDFium's own spacing ("anyother", "viewspecification")
REAL_PDFS = [
    ("refcard-en-a4.pdf", 940, ["aptupdate", "Updatepackageslistings"], ("apt update", 2)),
    ("groff-pdfmark.pdf", 10547, ["anyother", "viewspecification", "aDocument"], ("any other", 4)),
]


@pytest.mark.parametrize("name, reference_words, run_together, phrase", REAL_PDFS)
def test_real_pdfs_keep_the_spaces_between_words(name, reference_words, run_together, phrase):
    """Real PDFs (tests/data/README.md): as many words as pdftotext finds, none run together, and
    the page map still right (docs/bench/pdf-extraction: the comparison on 16 PDFs)."""
    doc = load_document(DATA / name)
    words = pdf_words(doc.text)
    assert abs(len(words) - reference_words) <= 0.01 * reference_words, len(words)
    assert not set(run_together) & set(words)
    text, page = phrase
    assert doc.page_of(doc.text.index(text)) == page
    # every page's slice is that page's own text: the same page extracted alone
    for i in range(doc.n_pages):
        end = doc.page_starts[i + 1] if i + 1 < doc.n_pages else len(doc.text)
        assert doc.page_of(doc.page_starts[i]) == i + 1 and doc.page_of(end - 1) == i + 1


def test_pdf_hyphen_marks():
    from kvcli.documents import _join_hyphenated

    assert _join_hyphenated("co\ufffe\r\nordinates and hot\ufffespot") == "coordinates and hot-spot"


def test_image_only_pdf(tmp_path, capfd):
    msg = error_of(make_pdf(tmp_path / "scan.pdf", [None, None]), capfd)
    assert "image-only" in msg and "scanned" in msg and "OCR" in msg and "ocrmypdf" in msg


def test_corrupt_pdf(tmp_path, capfd):
    path = tmp_path / "junk.pdf"
    path.write_bytes(os.urandom(2048))
    msg = error_of(path, capfd)
    assert "is not a valid PDF" in msg


def test_recoverable_pdf_is_read_silently(pdf_dir, tmp_path, capfd, caplog):
    # a wrong startxref offset: pypdf recovers but logs "incorrect startxref pointer"
    data = (pdf_dir / "three.pdf").read_bytes()
    at = data.rindex(b"startxref") + len(b"startxref")
    offset = data[at:].split()[0]
    path = tmp_path / "shifted.pdf"
    path.write_bytes(data[:at] + data[at:].replace(offset, str(int(offset) + 3).encode(), 1))
    caplog.set_level(logging.DEBUG)  # records any warning that gets past pypdf's logger level
    assert load_document(path).n_pages == 3
    assert [r.getMessage() for r in caplog.records if r.name.startswith("pypdf")] == []
    out, err = capfd.readouterr()
    assert err == "" and out == ""


def test_truncated_pdf_is_silent(pdf_dir, tmp_path, capfd):
    data = (pdf_dir / "three.pdf").read_bytes()
    path = tmp_path / "cut.pdf"
    path.write_bytes(data[: len(data) // 2])
    try:  # pypdf may recover some pages or give up; either way nothing goes to stderr
        load_document(path)
    except DocumentError as e:
        assert "\n" not in str(e) and "cut.pdf" in str(e)
    out, err = capfd.readouterr()
    assert err == "" and out == ""


# --- text, Markdown, HTML ------------------------------------------------------------


def test_text_normalisation(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"\n\n  indented line   \r\nnext\t\r\n\r\n\r\n\r\n\r\n\r\nafter gap  \n\n")
    doc = load_document(path)
    assert doc.kind == "text" and doc.page_starts == (0,) and doc.n_pages == 1
    assert doc.text == "  indented line\nnext\n\n\nafter gap"
    assert doc.page_of(0) == 1 and doc.page_of(10**6) == 1 and doc.page_range(0, 5) == (1, 1)


def test_markdown_kept_as_is(tmp_path):
    path = tmp_path / "readme.markdown"
    path.write_text("# Title\n\n- item *one*\n- `code`\n", encoding="utf-8")
    doc = load_document(path)
    assert doc.kind == "markdown"
    assert doc.text == "# Title\n\n- item *one*\n- `code`"


def test_utf8_bom_and_latin1(tmp_path):
    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffcafé ünïcode".encode("utf-8"))
    assert load_document(bom).text == "café ünïcode"
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Crème brûlée à la café, naïve".encode("latin-1"))
    assert load_document(latin).text == "Crème brûlée à la café, naïve"


def test_html_visible_text(tmp_path):
    path = tmp_path / "page.htm"
    path.write_text(
        "<!DOCTYPE html><html><head><title>Hidden title</title>"
        "<style>p { color: red; }</style><script>var hidden = 1;</script></head>\n"
        "<body><h1>Main   heading</h1>\n<p>Fish &amp; chips &lt;3 caf&eacute; &#8212; <b>bold</b>"
        " <i>text</i></p><script>alert('no')</script>"
        "<ul><li>one</li><li>two</li></ul><div>line<br>break</div>"
        "<pre>  keep\n    spacing</pre></body></html>",
        encoding="utf-8",
    )
    doc = load_document(path)
    assert doc.kind == "html"
    assert doc.text == (
        "Main heading\n\nFish & chips <3 café \u2014 bold text\n\none\ntwo\n\nline\nbreak\n\n  keep\n    spacing"
    )
    for hidden in ("Hidden title", "color", "hidden", "alert"):
        assert hidden not in doc.text


def test_html_without_closing_head(tmp_path):
    path = tmp_path / "sloppy.html"
    path.write_text("<html><head><title>T</title><meta charset=utf-8><p>Body text<p>More", encoding="utf-8")
    assert load_document(path).text == "Body text\n\nMore"


def test_document_from_text():
    doc = document_from_text("hello  \nworld\n")
    assert doc.source == "-" and doc.kind == "text" and doc.text == "hello\nworld"
    assert doc.page_starts == (0,)
    assert doc.sha256 == hashlib.sha256(b"hello\nworld").hexdigest()
    html = document_from_text("<p>a &amp; b</p><script>x</script>", source="x.html", kind="html")
    assert html.text == "a & b" and html.kind == "html"
    with pytest.raises(DocumentError, match="stdin is empty"):
        document_from_text(" \n\t ")
    with pytest.raises(ValueError):
        document_from_text("x", kind="pdf")


def test_document_validates_page_starts():
    with pytest.raises(ValueError):
        Document("-", "abc", (1,), "text", "0")
    with pytest.raises(ValueError):
        Document("-", "abcdef", (0, 3, 3), "pdf", "0")
    doc = Document("-", "abcdef", (0, 2, 4), "pdf", "0")
    assert [doc.page_of(i) for i in range(-2, 9)] == [1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3]
    assert doc.page_range(1, 5) == (1, 3)
    assert doc.page_range(2, 4) == (2, 2)
    assert doc.page_range(3, 3) == (2, 2)  # empty span: its start page


# --- errors --------------------------------------------------------------------------


def test_empty_documents(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.md").write_text("  \n\t\n   \n", encoding="utf-8")
    (tmp_path / "nothing.html").write_text("<html><head><title>t</title></head><body> </body></html>")
    for name in ("empty.txt", "blank.md", "nothing.html"):
        assert "is empty" in error_of(tmp_path / name)


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "report.docx"
    path.write_bytes(b"PK\x03\x04")
    msg = error_of(path)
    assert "unsupported" in msg and "'.docx'" in msg
    assert all(suffix in msg for suffix in SUPPORTED_SUFFIXES)
    noext = tmp_path / "README"
    noext.write_text("hi")
    assert "no file extension" in error_of(noext)


def test_missing_path(tmp_path):
    assert "does not exist" in error_of(tmp_path / "nope.pdf")


def test_directory(tmp_path):
    d = tmp_path / "folder.pdf"
    d.mkdir()
    assert "is a directory" in error_of(d)


def test_unreadable_file(tmp_path, monkeypatch):
    path = tmp_path / "secret.txt"
    path.write_text("top secret")

    def deny(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", deny)  # works even when the tests run as root
    msg = error_of(path)
    assert "cannot be read" in msg and "permission denied" in msg


# --- not text: binary data under a text name (issue 27, item 3) ------------------------------


@pytest.mark.parametrize("suffix", [".txt", ".md", ".html"])
def test_random_bytes_named_as_text_are_refused_in_one_line(tmp_path, capfd, suffix):
    path = tmp_path / f"binary{suffix}"
    path.write_bytes(os.urandom(20000))
    msg = error_of(path, capfd)
    assert "is not text" in msg and "binary" in msg


def test_control_characters_without_nul_are_refused_but_text_with_a_few_is_read(tmp_path):
    import random

    rng = random.Random(0)
    noise = bytes(rng.choice([*range(1, 9), *range(14, 32), *range(0x80, 0xA0)]) for _ in range(3000))
    (tmp_path / "noise.txt").write_bytes(noise + b" some words" * 10)
    assert "control characters" in error_of(tmp_path / "noise.txt")
    # a text with form feeds, an escape sequence and a stray control character is text
    (tmp_path / "old.txt").write_bytes(
        b"Chapter 1\x0c\nThe keeper \x1b[1mwrote\x1b[0m.\x07\n" + b"More lines of text.\n" * 20
    )
    assert "The keeper" in load_document(tmp_path / "old.txt").text
    # UTF-16 holds NUL bytes but is text: with a BOM, or without (every other byte NUL)
    (tmp_path / "utf16.txt").write_bytes("Der Leuchtturm steht.".encode("utf-16"))
    assert load_document(tmp_path / "utf16.txt").text == "Der Leuchtturm steht."
    for codec in ("utf-16-le", "utf-16-be"):
        (tmp_path / "utf16-no-bom.txt").write_bytes("Der Leuchtturm steht am Kap.".encode(codec))
        assert load_document(tmp_path / "utf16-no-bom.txt").text == "Der Leuchtturm steht am Kap."


def test_binary_text_on_stdin_is_refused():
    with pytest.raises(DocumentError, match="stdin is not text"):
        document_from_text("PK\x03\x04\x00\x00" + "x" * 100)


def test_stdin_bytes_that_were_not_utf8_are_decoded_as_a_file_would_be():
    # Python's stdin keeps undecodable bytes as lone surrogates (surrogateescape)
    cafe = "Le café du phare.".encode("cp1252").decode("utf-8", "surrogateescape")
    assert document_from_text(cafe).text == "Le café du phare."
    high = bytes(range(0x80, 0x100)) * 20  # no NUL, all high bytes: Latin-1's C1 controls
    with pytest.raises(DocumentError, match="stdin is not text"):
        document_from_text(high.decode("utf-8", "surrogateescape"))
    with pytest.raises(DocumentError, match="stdin is not text"):
        document_from_text("\ud800" * 100 + "a few words")
