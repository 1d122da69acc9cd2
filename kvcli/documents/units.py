"""A document cut into units: whole sentences or whole lines of ``Document.text``.

A **unit** is a whole sentence or a whole line (never a token: a tokenizer splits numbers into
digits, and a quote must be readable). Units partition the text: every character up to the next
unit's start belongs to a unit, so every document token falls in exactly one; the unit's
``start``/``end`` are its text without the surrounding whitespace. Units never cross a page.

A sentence ends at ``.``, ``!`` or ``?`` (a closing quote or bracket may follow) before whitespace;
a line ends its unit where it does not read as wrapped prose: a blank line, a short line (a
heading, a table cell, a line of code), a line ending in ``.:;!?``, or a unit already over
``MAX_UNIT_CHARS``. A long line whose sentence goes on continues the unit on the next line.

What reads them: the answer's sources (:mod:`kvcli.cite.sources`), the sentences ``pages``
skims (:mod:`kvcli.compressors.pages`) and the passages of a document without pages
(:mod:`kvcli.documents.pagination`).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np

MAX_UNIT_CHARS = 400  # a wrapped sentence longer than this is cut at a line end
SHORT_LINE = 50  # a line shorter than this ends its unit (not wrapped prose)

_SENTENCE_END = re.compile(r"(?<=[\w)\]\"'’”])[.!?][\"')\]’”]*(?=\s)")
_LINE_ENDS_UNIT = re.compile(r"[.:;!?][\"')\]’”]*$")


@dataclass(frozen=True)
class Unit:
    start: int  # [start, end): the unit's text in Document.text, whitespace trimmed
    end: int
    owns: int  # the first character of the next unit's share: the unit owns [its share's start, owns)


def split_units(text: str, page_starts: tuple[int, ...] = (0,)) -> list[Unit]:
    """The units of ``text`` (module docstring), in order; ``page_starts`` as ``Document``'s."""
    units: list[Unit] = []
    bounds = list(page_starts) + [len(text)]
    for lo, hi in itertools.pairwise(bounds):
        _split_page(text, lo, hi, units)
    if units:  # the last unit owns the rest of the text; the first, what comes before it
        units[-1] = Unit(units[-1].start, units[-1].end, len(text))
    return units


def _split_page(text: str, lo: int, hi: int, units: list[Unit]) -> None:
    start = None  # the open unit's first character

    def close(end: int) -> None:
        nonlocal start
        if start is not None:
            e = end
            while e > start and text[e - 1].isspace():
                e -= 1
            if e > start:
                if units:
                    prev = units[-1]
                    units[-1] = Unit(prev.start, prev.end, start)
                units.append(Unit(start, e, end))
            start = None

    pos = lo
    while pos < hi:
        nl = text.find("\n", pos, hi)
        line_end = hi if nl < 0 else nl
        line = text[pos:line_end]
        stripped = line.strip()
        if not stripped:
            close(pos)
        else:
            offset = pos + len(line) - len(line.lstrip())
            if start is None:
                start = offset
            for m in _SENTENCE_END.finditer(text, offset, line_end):
                close(m.end())
                nxt = m.end()
                while nxt < line_end and text[nxt].isspace():
                    nxt += 1
                start = nxt if nxt < line_end else None
            if start is not None and (
                len(stripped) < SHORT_LINE or _LINE_ENDS_UNIT.search(stripped) or line_end - start > MAX_UNIT_CHARS
            ):
                close(line_end)
        pos = line_end + 1
    close(hi)


def owner_starts(units: list[Unit]) -> np.ndarray:
    """The first character of each unit's share (``searchsorted(..., side="right") - 1`` of a
    character is the unit owning it): the first unit owns everything before it too."""
    return np.array([0] + [u.owns for u in units[:-1]], dtype=np.int64)
