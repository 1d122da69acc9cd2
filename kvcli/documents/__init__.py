"""Load a document (PDF, plain text, Markdown, HTML) into one string plus a page map.

Every loader returns a :class:`Document`: the whole extracted text as one string, and
``page_starts``, the character offset in that string where each page begins. Unpaged
formats (text, Markdown, HTML) are a single page, ``page_starts == (0,)``.

The page map for PDFs
---------------------
Each page's text is extracted with PDFium (pypdfium2; a space wherever two glyphs of a line
stand apart, see ``WORD_GAP`` and docs/documents.md for why this extraction) and normalised on its
own (line-end spaces stripped, runs of 3+ blank lines collapsed to 2, leading/trailing blank lines dropped),
then the pages are joined with ``PAGE_SEPARATOR`` (``"\\n\\n"``). Offsets are recorded
after normalisation, so they are exact::

    text        = page1 + "\\n\\n" + page2 + "\\n\\n" + page3
    page_starts = (0, len(page1) + 2, len(page1) + 2 + len(page2) + 2)

The separator after a page belongs to that page: a character maps to the last page
whose start is <= its index (``bisect_right``). A page with no text still contributes
its separator, so every page but the last spans at least two characters and
``page_starts`` stays strictly increasing. An empty *last* page starts at
``len(text)``; it owns no characters, which is fine because ``page_of`` clamps.
Consequence: a run of empty pages shows up in ``text`` as a longer run of blank lines
(the one place the blank-line collapsing is not applied).

All errors a user can cause are :class:`~kvcli.errors.DocumentError` with a one-line
message that names the file.
"""

from __future__ import annotations

import bisect
import codecs
import os
import re
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from kvcli.errors import DocumentError

from . import kept
from .pagination import passages

__all__ = [
    "PAGE_SEPARATOR",
    "SUPPORTED_SUFFIXES",
    "Document",
    "document_from_text",
    "load_document",
]

PAGE_SEPARATOR = "\n\n"

SUPPORTED_SUFFIXES: dict[str, str] = {
    ".pdf": "pdf",
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".html": "html",
    ".htm": "html",
}

KINDS = ("pdf", "text", "markdown", "html")


@dataclass(frozen=True)
class Document:
    """A loaded document: its full text and where each page begins in it."""

    source: str  # the path as given by the user, or "-" for stdin
    text: str  # the full extracted text
    page_starts: tuple[int, ...]  # offset in `text` where page i+1 begins; (0,) if unpaged
    kind: str  # "pdf" | "text" | "markdown" | "html"
    sha256: str  # hex sha256 of `text` encoded as UTF-8

    def __post_init__(self) -> None:
        starts = self.page_starts
        if not starts or starts[0] != 0:
            raise ValueError("page_starts must be non-empty and start at 0")
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError("page_starts must be strictly increasing")
        if starts[-1] > len(self.text):
            raise ValueError("page_starts must lie within the text")

    @property
    def n_pages(self) -> int:
        return len(self.page_starts)

    def page_of(self, char_index: int) -> int:
        """The 1-based page holding ``text[char_index]``, clamped to ``1..n_pages``."""
        return max(1, bisect.bisect_right(self.page_starts, char_index))

    def passages(self) -> list[tuple[int, int]]:
        """The passages a ranking by the question reads (BM25's, the ``pages`` method's): its pages,
        else page-sized runs of paragraphs (:func:`kvcli.documents.pagination.passages`)."""
        return passages(self.text, self.page_starts)

    def page_range(self, start: int, end: int) -> tuple[int, int]:
        """First and last page of the character span ``[start, end)`` (an empty span: its start page)."""
        first = self.page_of(start)
        return first, max(first, self.page_of(end - 1))


def read_stdin(lines: bool = False):
    """Stdin's text, read as bytes and decoded as UTF-8 with the bytes that are not kept as lone
    surrogates (:func:`document_from_text` decodes those again), whatever the locale's encoding
    (a strict one would raise on binary input). ``lines=True``: an iterator of its lines, each
    decoded as it arrives (a question per line over a pipe). Without a byte stream (stdin
    replaced by a text stream) the text as that stream gives it."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:
        return iter(sys.stdin) if lines else sys.stdin.read()
    if lines:
        return (line.decode("utf-8", "surrogateescape") for line in buffer)
    return buffer.read().decode("utf-8", "surrogateescape")


def document_from_text(text: str, source: str = "-", kind: str = "text") -> Document:
    """A one-page Document from a string (stdin, tests). ``kind="html"`` extracts the visible text.
    Bytes that were not UTF-8 (which Python's stdin keeps as lone surrogates) are decoded again as a
    file's would be (cp1252, else Latin-1)."""
    if text.lstrip("\ufeff \t\r\n").startswith("%PDF-"):
        raise DocumentError(
            f"{_name(source)} holds a PDF; - takes plain text, Markdown or HTML: give the PDF file's path "
            "instead of - (save it to a file first)"
        )
    if _SURROGATE.search(text):
        try:
            text = _decode(text.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:  # surrogates no decoding made: unreadable characters
            text = _SURROGATE.sub("\ufffd", text)
    if kind == "html":
        text = _html_to_text(text)
    elif kind not in ("text", "markdown"):
        raise ValueError(f"document_from_text: kind must be text, markdown or html, not {kind!r}")
    check_is_text(text, source)
    text = _normalise(text)
    if not text.strip():
        raise DocumentError(f"{_name(source)} is empty")
    return _make(source, text, (0,), kind)


def load_document(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Document:
    """Read the file at ``path``; raise DocumentError (one line, naming the file) if it cannot be used.
    ``cache_dir``: where a PDF's or an HTML page's extracted text is kept for the next process
    (:mod:`.kept`; None: extracted, not kept)."""
    source = os.fspath(path)
    p = Path(source)
    try:
        is_dir = stat.S_ISDIR(p.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        raise DocumentError(f"{_name(source)} does not exist") from None
    except OSError as e:
        raise DocumentError(f"{_name(source)} cannot be read: {e.strerror or e}") from None
    if is_dir:
        raise DocumentError(f"{_name(source)} is a directory, not a document")
    suffix = p.suffix.lower()
    kind = SUPPORTED_SUFFIXES.get(suffix)
    if kind is None:
        found = f"unsupported file type '{suffix}'" if suffix else "no file extension"
        supported = ", ".join(SUPPORTED_SUFFIXES)
        raise DocumentError(f"{_name(source)} has {found}; supported: {supported}")
    try:
        data = p.read_bytes()
    except PermissionError:
        raise DocumentError(f"{_name(source)} cannot be read: permission denied") from None
    except OSError as e:
        raise DocumentError(f"{_name(source)} cannot be read: {e.strerror or e}") from None
    if not data:  # 0 bytes: the same words whatever the file type (PDFium says "Data format error")
        raise DocumentError(f"{_name(source)} is empty")
    if cache_dir is not None and kind in kept.KEPT_KINDS:
        text, page_starts = kept.extracted(Path(cache_dir), data, kind, source, lambda: _LOADERS[kind](data, source))
    else:
        text, page_starts = _LOADERS[kind](data, source)
    if not text.strip():
        raise DocumentError(f"{_name(source)} is empty")
    return _make(source, text, page_starts, kind)


# --- loaders: bytes -> (text, page_starts) -----------------------------------------


def _load_pdf(data: bytes, source: str) -> tuple[str, tuple[int, ...]]:
    import pypdfium2
    import pypdfium2.raw as pdfium_c

    name = _name(source)
    try:
        pdf = pypdfium2.PdfDocument(data)
    except pypdfium2.PdfiumError as e:
        # an owner password only (as qpdf and many tools write them, RC4 or AES) opens; a user
        # password cannot be guessed
        if e.err_code == pdfium_c.FPDF_ERR_PASSWORD:
            raise DocumentError(
                f"{name} is protected by a password; save a copy without it first "
                "(e.g. qpdf --password=PASSWORD --decrypt in.pdf out.pdf)"
            ) from None
        raise DocumentError(f"{name} is not a valid PDF: {_short(e)}") from None
    try:
        pages = []
        for i in range(len(pdf)):
            try:
                page = pdf[i]
                textpage = page.get_textpage()
            except pypdfium2.PdfiumError:
                pages.append("")  # a damaged page: the others are still read
                continue
            pages.append(_page_text(textpage))
    except Exception as e:  # noqa: BLE001 - a malformed file, whatever pdfium makes of it
        raise DocumentError(f"{name} is not a valid PDF: {_short(e)}") from None
    finally:
        pdf.close()

    if not pages:
        raise DocumentError(f"{name} is empty (it has no pages)")
    pages = [_normalise(t) for t in pages]
    if not any(t.strip() for t in pages):
        raise DocumentError(
            f"{name} has no extractable text; it looks scanned/image-only. "
            "Run OCR on it first (e.g. ocrmypdf in.pdf out.pdf)"
        )
    starts, parts, offset = [], [], 0
    for i, t in enumerate(pages):
        starts.append(offset)
        chunk = t if i == len(pages) - 1 else t + PAGE_SEPARATOR
        parts.append(chunk)
        offset += len(chunk)
    return "".join(parts), tuple(starts)


# A gap wider than this share of the font size between two glyphs on one line is a space. PDFium
# inserts spaces where the PDF has none by its own rule, which misses the narrower word gaps of
# kerned text (Ghostscript's "anyother") and of PDFs that place every word on its own
# (debian-refcard's "aptupdate"); poppler's pdftotext uses 0.1 of the font size.
WORD_GAP = 0.15
_HYPHEN_BREAK = "\ufffe"  # PDFium's mark for a hyphen it takes for a soft one


def _page_text(textpage) -> str:
    """A page's text in PDFium's reading order, with a space wherever two glyphs of one line stand
    apart by more than ``WORD_GAP`` of the font size, and hyphenated words joined again."""
    import pypdfium2.raw as pdfium_c

    raw = textpage.raw
    n = pdfium_c.FPDFText_CountChars(raw)
    if n <= 0:
        return ""
    text = textpage.get_text_range(0, n)
    if len(text) != n:  # characters outside the BMP count twice in the range: no spacing pass
        return _join_hyphenated(text)
    out: list[str] = []
    box = pdfium_c.FS_RECTF()
    font_size = pdfium_c.FPDFText_GetFontSize
    prev = None  # (right, bottom, top, index) of the last glyph, None after a space or break
    for i, ch in enumerate(text):
        if ch.isspace() or ch == _HYPHEN_BREAK or pdfium_c.FPDFText_IsGenerated(raw, i) == 1:
            prev = None
            out.append(ch)
            continue
        if not pdfium_c.FPDFText_GetLooseCharBox(raw, i, box):
            prev = None
            out.append(ch)
            continue
        if prev is not None:
            right, bottom, top, j = prev
            gap = box.left - right
            # on the same line, apart: the font sizes are read only then (a word's glyphs touch)
            same_line = min(box.top, top) > max(box.bottom, bottom)
            if gap > 0 and same_line and gap > WORD_GAP * max(font_size(raw, i), font_size(raw, j)):
                out.append(" ")
        prev = (box.right, box.bottom, box.top, i)
        out.append(ch)
    return _join_hyphenated("".join(out))


_HYPHENATED = re.compile(_HYPHEN_BREAK + r"([ \t]*(?:\r\n|\r|\n))?")


def _join_hyphenated(text: str) -> str:
    """PDFium's hyphen mark: a word broken at the end of a line is joined again ("co-|ordinates"
    -> "coordinates", as pdftotext does); inside a line it is the hyphen it shows ("hot-spot")."""
    return _HYPHENATED.sub(lambda m: "" if m.group(1) else "-", text)


def _load_text(data: bytes, source: str) -> tuple[str, tuple[int, ...]]:
    return _normalise(_text_of(data, source)), (0,)


def _load_html(data: bytes, source: str) -> tuple[str, tuple[int, ...]]:
    return _normalise(_html_to_text(_text_of(data, source))), (0,)


# Not text: more than this share of control characters (C0 but tab, line ends, form feed and ESC;
# C1; U+FFFD) in the decoded text. Random bytes decode (as Latin-1) to about 25%; text, even with
# the odd form feed or a mis-saved character, to well under 1%.
MAX_CONTROL_SHARE = 0.05
_CONTROL = re.compile("[\x00-\x08\x0e-\x1a\x1c-\x1f\x7f-\x9f\ufffd]")


def _text_of(data: bytes, source: str) -> str:
    """The decoded text of a file that claims to be text; DocumentError when it is not text."""
    text = _decode(data)
    check_is_text(text, source)
    return text


def check_is_text(text: str, source: str) -> None:
    """DocumentError (one line) for a 'text' that is binary data: a NUL character (never in text;
    UTF-16 with a BOM is decoded before this), or more than ``MAX_CONTROL_SHARE`` control
    characters."""
    name = _name(source)
    if "\x00" in text:
        raise DocumentError(f"{name} is not text: it holds NUL bytes (a binary file?); kvcli reads {_KINDS_READ}")
    sample = text[: 1 << 20]  # the first million characters tell
    n_control = len(_CONTROL.findall(sample))
    if sample and n_control > MAX_CONTROL_SHARE * len(sample):
        raise DocumentError(
            f"{name} is not text: {n_control / len(sample):.0%} of its characters are control characters "
            f"(a binary file?); kvcli reads {_KINDS_READ}"
        )


_KINDS_READ = "PDF, plain text, Markdown and HTML"
_SURROGATE = re.compile("[\ud800-\udfff]")


_LOADERS: dict[str, Callable[[bytes, str], tuple[str, tuple[int, ...]]]] = {
    "pdf": _load_pdf,
    "text": _load_text,
    "markdown": _load_text,  # Markdown is readable as is
    "html": _load_html,
}


# --- helpers -----------------------------------------------------------------------


def _make(source: str, text: str, page_starts: tuple[int, ...], kind: str) -> Document:
    return Document(source=source, text=text, page_starts=page_starts, kind=kind, sha256=kept.text_sha256(text))


def _name(source: str) -> str:
    return "stdin" if source == "-" else f"'{source}'"


def _short(e: Exception, limit: int = 120) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _decode(data: bytes) -> str:
    """UTF-8 (BOM dropped), UTF-16 if it has a BOM or the NUL bytes of one without (every other
    byte of Latin-script text), else cp1252, else latin-1 (never fails)."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError:
            pass
    encodings = ["utf-8-sig", "cp1252"]
    if b"\x00" in data and len(data) % 2 == 0:
        even, odd = data[0::2].count(0), data[1::2].count(0)
        pairs = len(data) // 2
        if odd > pairs // 2 and even * 20 < pairs:
            encodings.insert(0, "utf-16-le")
        elif even > pairs // 2 and odd * 20 < pairs:
            encodings.insert(0, "utf-16-be")
    for encoding in encodings:
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            pass
    return data.decode("latin-1")


_MANY_BLANK_LINES = re.compile(r"\n{4,}")  # 3+ blank lines


def _normalise(text: str) -> str:
    """Unify line ends, strip line-end whitespace, collapse 3+ blank lines to 2, trim blank edges."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _MANY_BLANK_LINES.sub("\n\n\n", text).strip("\n")


# --- HTML --------------------------------------------------------------------------

_SKIP_TAGS = {"script", "style", "head", "title", "template", "noscript"}
_PARAGRAPH_TAGS = {
    "p", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre", "table",
    "ul", "ol", "dl", "hr", "figure",
}  # fmt: skip
_BLOCK_TAGS = {
    "address", "article", "aside", "body", "caption", "dd", "details", "dialog", "div",
    "dt", "fieldset", "figcaption", "footer", "form", "header", "html", "li", "main",
    "nav", "section", "summary", "tbody", "tfoot", "thead", "tr",
}  # fmt: skip
_WHITESPACE = re.compile(r"\s+")


class _TextExtractor(HTMLParser):
    """Visible text of an HTML page: inline whitespace collapsed, blocks on their own lines."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)  # entities decoded in handle_data
        self.parts: list[str] = []
        self.skip: list[str] = []  # open tags whose content is not shown
        self.pre = 0  # depth of <pre>: whitespace kept as is
        self.pending = 0  # newlines to emit before the next text

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if "head" in self.skip and (tag in _BLOCK_TAGS or tag in _PARAGRAPH_TAGS):
            self.skip = [t for t in self.skip if t != "head"]  # </head> may be omitted
        if tag in _SKIP_TAGS:
            self.skip.append(tag)
        elif tag == "br":
            self._break(self.pending + 1)
        elif tag in ("td", "th"):
            self._data(" ")
        self._block(tag, opening=True)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.skip:
            while self.skip.pop() != tag:
                pass
        self._block(tag, opening=False)

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self._data(data)

    def _block(self, tag: str, opening: bool) -> None:
        if tag == "pre":
            self.pre = self.pre + 1 if opening else max(0, self.pre - 1)
        if tag in _PARAGRAPH_TAGS:
            self._break(2)
        elif tag in _BLOCK_TAGS:
            self._break(1)

    def _break(self, n: int) -> None:
        if self.parts and self.parts[-1].endswith(" ") and not self.pre:
            self.parts[-1] = self.parts[-1].rstrip(" ")
        self.pending = max(self.pending, n)

    def _data(self, data: str) -> None:
        if not self.pre:
            data = _WHITESPACE.sub(" ", data)
            if self.pending or not self.parts or self.parts[-1].endswith((" ", "\n")):
                data = data.lstrip(" ")
        if not data:
            return
        if self.pending and self.parts:
            self.parts.append("\n" * self.pending)
        self.pending = 0
        self.parts.append(data)


def _html_to_text(html: str) -> str:
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    return "".join(parser.parts)
