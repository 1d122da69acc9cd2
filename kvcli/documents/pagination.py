"""A document's passages: what a ranking by the question reads (BM25's, the ``pages`` method's).

A PDF's passages are its pages. A document without pages (text, Markdown, HTML, stdin) is cut into
passages of about a page: at most :data:`PASSAGE_CHARS` characters, cut at paragraph ends (blank
lines) where it can be, else at line ends, else at sentence ends, else between words — whatever its
blank lines, so a text without any is not one passage whose first tokens are all that is read.

The size: the median page of the six Debian manuals of docs/bench/cite is 560 tokens of the embedded
model's tokenizer and 1,952 characters (405 pages, 3.3 characters a token); a passage holds at most
2,000 characters (~600 tokens). Characters, not tokens, so the passages are the document's whatever
the model (the cited sources and the prompt cut it the same way).

Packing: the pieces (paragraphs that fit whole, else their lines, else the lines' sentences, else
runs of words) are taken in order while the passage stays within the size; where the next piece
does not fit, the passage ends at the strongest boundary (paragraph, then line, then sentence) that
leaves it at least half the size, else just before that piece. Each passage is a (start, end)
character span of the text, whitespace trimmed, so sources and ``inspect`` still point at lines.
"""

from __future__ import annotations

import re

PASSAGE_CHARS = 2000  # ~600 tokens: a manual's median page (module docstring)

PARAGRAPH, LINE, SENTENCE, WORDS = 0, 1, 2, 3  # the boundary before a piece, strongest first
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_SENTENCE_END = re.compile(r"(?<=[\w)\]\"'’”])[.!?][\"')\]’”]*(?=\s)")


def passages(text: str, page_starts: tuple[int, ...] = (0,), size: int | None = None) -> list[tuple[int, int]]:
    """The passages of ``text``: its pages where it has more than one (``page_starts`` as
    :class:`~kvcli.documents.Document`'s), else page-sized runs of it (module docstring; ``size``
    characters at most, default :data:`PASSAGE_CHARS`); (start, end) of each, whitespace trimmed,
    empty ones left out."""
    if len(page_starts) > 1:
        bounds = [*page_starts, len(text)]
        return [span for span in (_trim(text, lo, hi) for lo, hi in zip(bounds, bounds[1:])) if span]
    return pack(pieces(text, size or PASSAGE_CHARS), size or PASSAGE_CHARS)


def pieces(text: str, size: int) -> list[tuple[int, int, int]]:
    """``(start, end, boundary)`` of each piece of at most ``size`` characters, in order: a
    paragraph that fits, else its lines, else a line's sentences, else runs of its words;
    ``boundary``: what ends before it (:data:`PARAGRAPH` ... :data:`WORDS`)."""
    out: list[tuple[int, int, int]] = []
    lo = 0
    for m in [*_BLANK_LINE.finditer(text), None]:
        hi = len(text) if m is None else m.start()
        span = _trim(text, lo, hi)
        if span:
            _split(text, *span, PARAGRAPH, size, out)
        if m is not None:
            lo = m.end()
    return out


def _split(text: str, lo: int, hi: int, level: int, size: int, out: list) -> None:
    """Append the pieces of ``text[lo:hi]`` (trimmed), the first after a ``level`` boundary."""
    if hi - lo <= size:
        out.append((lo, hi, level))
        return
    if level < LINE and "\n" in text[lo:hi]:
        parts, finer = _cuts(text, lo, hi, [(m.start(), m.end()) for m in re.finditer("\n", text[lo:hi])]), LINE
    elif level < SENTENCE and (ends := [(m.end(), m.end()) for m in _SENTENCE_END.finditer(text[lo:hi])]):
        parts, finer = _cuts(text, lo, hi, ends), SENTENCE
    else:
        for i, (a, b) in enumerate(_words(text, lo, hi, size)):
            out.append((a, b, level if i == 0 else WORDS))
        return
    for i, (a, b) in enumerate(parts):
        _split(text, a, b, level if i == 0 else finer, size, out)


def _cuts(text: str, lo: int, hi: int, gaps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``text[lo:hi]`` cut at each gap ``(start, end)`` (offsets from ``lo``: what lies between two
    parts), the parts trimmed, empty ones left out."""
    spans, a = [], lo
    for start, end in gaps:
        spans.append((a, lo + start))
        a = lo + end
    spans.append((a, hi))
    return [s for s in (_trim(text, a, b) for a, b in spans) if s]


def _words(text: str, lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """``text[lo:hi]`` in runs of at most ``size`` characters cut between words (a word longer
    than ``size`` is cut inside)."""
    out = []
    while lo < hi:
        end = min(hi, lo + size)
        if end < hi:
            space = text.rfind(" ", lo + 1, end + 1)
            if space > lo:
                end = space
        span = _trim(text, lo, end)
        if span:
            out.append(span)
        lo = end
        while lo < hi and text[lo].isspace():
            lo += 1
    return out


def pack(items: list[tuple[int, int, int]], size: int) -> list[tuple[int, int]]:
    """Consecutive pieces joined into passages of at most ``size`` characters (a piece is never
    over it), each ended at the strongest boundary that leaves it at least half the size."""
    out, i = [], 0
    while i < len(items):
        j = i + 1
        while j < len(items) and items[j][1] - items[i][0] <= size:
            j += 1
        cut = j
        if j < len(items):  # the next piece does not fit: end at the strongest boundary past half
            fits = [k for k in range(i + 1, j + 1) if items[k - 1][1] - items[i][0] >= size / 2]
            if fits:
                cut = min(fits, key=lambda k: (items[k][2], -k))
        out.append((items[i][0], items[cut - 1][1]))
        i = cut
    return out


def _trim(text: str, lo: int, hi: int) -> tuple[int, int] | None:
    while lo < hi and text[lo].isspace():
        lo += 1
    while hi > lo and text[hi - 1].isspace():
        hi -= 1
    return (lo, hi) if hi > lo else None
