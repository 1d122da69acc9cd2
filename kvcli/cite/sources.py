"""Where an answer comes from: the document cut into units, token scores -> unit scores -> sources.

A **unit** is a whole sentence or a whole line of ``Document.text`` (:mod:`kvcli.documents.units`
cuts them); every document token falls in exactly one.

* A **source** is a run of adjacent units: the units are taken best first; a unit next to a
  source joins it when it scores at least ``JOIN_SHARE`` of the source's best unit (up to
  ``MAX_SOURCE_UNITS``), another opens a new source while fewer than ``top`` are open.
  Its score is the sum of its units'; sources are returned best first. A paged document cites
  pages (``{"pages": [first, last], ...}``, 1-based), a document without pages (text, stdin) its
  line numbers (``{"lines": [first, last], ...}``).
* **No clear source**: when the best unit's score is less than ``clear_ratio`` times the mean
  score of the units that were read (``Sources.peak``), nothing stands out: the sources are still
  returned, marked ``clear=False`` with a reason, and a terminal says "no clear source".

What scores the tokens is the caller's (the answer's attention, BM25 in :mod:`kvcli.retrieval.bm25`); this
module only maps them, so it is tested without a model.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ..documents import Document
from ..documents.units import Unit, owner_starts, split_units
from ..retrieval.bm25 import bm25_scores
from . import evidence

MAX_SOURCE_UNITS = 4  # adjacent units merged into one source at most
JOIN_SHARE = 0.5  # a unit joins the source next to it when it scores at least this share of the source's best
DEFAULT_TOP = 3
DEFAULT_CLEAR_RATIO = 4.0  # the best unit's score over the mean of the units read (measured: docs/bench/cite)
QUOTE_CHARS = 80
# what ranks an answer's sources (kvcli.answer.citing.cite): the attention's unit scores (shares of the best)
# plus this weight of the question's BM25 over the units read (:func:`fused`); 0: the attention
# alone. 2: chosen on RULER qa_2 instances 100-115 (docs/bench/cite), where the embedded model's
# attention alone cited the gold paragraph first for 19% and fused 88%
LEXICAL_WEIGHT = 2.0


@dataclass(frozen=True)
class Source:
    start: int
    end: int
    first: int  # page (paged documents) or line (unpaged), 1-based
    last: int
    paged: bool
    text: str
    score: float
    units: tuple[int, ...]  # indices into the document's units

    def to_json(self) -> dict:
        return {
            "pages" if self.paged else "lines": [self.first, self.last],
            "start": self.start,
            "end": self.end,
            "text": self.text,
            "score": round(self.score, 4),
        }

    def where(self) -> str:
        """``p. 42``, ``pp. 41-42``, ``line 7``, ``lines 7-9``."""
        if self.paged:
            return f"p. {self.first}" if self.first == self.last else f"pp. {self.first}-{self.last}"
        return f"line {self.first}" if self.first == self.last else f"lines {self.first}-{self.last}"

    def quote(self, limit: int = QUOTE_CHARS) -> str:
        """The source's text on one line, at most ``limit`` characters, cut ends marked ``...``."""
        text = " ".join(self.text.split())
        return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


@dataclass(frozen=True)
class Sources:
    items: tuple[Source, ...]
    clear: bool  # False: nothing stands out ("no clear source"), or nothing could be cited
    reason: str | None = None  # why there is no clear source / no source
    peak: float | None = None  # the best unit's score over the mean of the units read
    signal: str = ""  # what ranked them ("attention", "bm25", ...)
    extra: dict = field(default_factory=dict)

    def to_json(self) -> list[dict]:
        return [s.to_json() for s in self.items]

    def lines(self, numbered: bool = False) -> list[str]:
        """What a terminal shows after the answer: ``p. 42: "...the default is 4095..."``, one
        source a line, best first; "no clear source" (then the best guesses) or why there is none.
        ``numbered``: each source's line starts ``[n]``, as ``inspect`` marks it in the document."""
        out = [f'{f"[{i}] " if numbered else ""}{s.where()}: "{s.quote()}"' for i, s in enumerate(self.items, 1)]
        if not self.items:
            return [self.reason or "no sources"]
        return out if self.clear else ["no clear source; the answer read most:", *(f"  {line}" for line in out)]


# --------------------------------------------------------------------------- units


@dataclass
class DocumentUnits:
    """A document's units with the arrays that map characters to them."""

    document: Document
    units: list[Unit]

    def __post_init__(self) -> None:
        self._owner_starts = owner_starts(self.units)
        self._newlines: list[int] | None = None

    @classmethod
    def of(cls, document: Document) -> DocumentUnits:
        return cls(document, split_units(document.text, document.page_starts))

    def __len__(self) -> int:
        return len(self.units)

    def unit_of(self, chars: np.ndarray) -> np.ndarray:
        """The unit owning each character index."""
        return np.searchsorted(self._owner_starts, np.asarray(chars, dtype=np.int64), side="right") - 1

    def scores(self, offsets: list[tuple[int, int]], token_scores) -> tuple[np.ndarray, np.ndarray]:
        """(unit scores, units read): a unit's score is the sum of the scores of the tokens whose
        last character it owns; it was read when one of them was. ``offsets``: each document
        token's (start, end) in the text (``Prompt.doc_offsets``); ``token_scores``: one score per
        document token (a tensor or an array; NaN: the method did not keep or retrieve it)."""
        ends = np.fromiter((max(s, e - 1) for s, e in offsets), dtype=np.int64, count=len(offsets))
        values = np.asarray(token_scores, dtype=np.float64).reshape(-1)
        if values.shape[0] != ends.shape[0]:
            raise ValueError(f"{values.shape[0]} token scores for {ends.shape[0]} document tokens")
        read = ~np.isnan(values)
        owners = self.unit_of(ends[read])
        out = np.zeros(len(self.units), dtype=np.float64)
        np.add.at(out, owners, values[read])
        was_read = np.zeros(len(self.units), dtype=bool)
        was_read[owners] = True
        return out, was_read

    def line_of(self, char: int) -> int:
        if self._newlines is None:
            self._newlines = [i for i, c in enumerate(self.document.text) if c == "\n"]
        return bisect.bisect_left(self._newlines, char) + 1

    def place(self, start: int, end: int) -> tuple[int, int, bool]:
        """(first, last, paged): the pages of ``[start, end)``, or its lines in an unpaged document."""
        if self.document.n_pages > 1:
            return (*self.document.page_range(start, end), True)
        return self.line_of(start), self.line_of(max(start, end - 1)), False


# --------------------------------------------------------------------------- ranking


def rank(
    doc_units: DocumentUnits,
    unit_scores: np.ndarray,
    *,
    read: np.ndarray | None = None,
    top: int = DEFAULT_TOP,
    clear_ratio: float = DEFAULT_CLEAR_RATIO,
    signal: str = "",
    groups: np.ndarray | None = None,
    group_order: np.ndarray | None = None,
) -> Sources:
    """Ranked sources from unit scores (module docstring). ``read``: the units the method read
    (default: those with a non-zero score); none read: no source, and the reason. Units are taken
    best first: one next to a source joins it when it scores at least ``JOIN_SHARE`` of the
    source's best unit, another opens a new source while fewer than ``top`` are open. With
    ``groups`` (a group id per unit: the passage it is in) a group opens one source at most, and
    the sources come best ``group_order`` (a score per unit, the same within a group) first, their
    own scores second."""
    scores = np.asarray(unit_scores, dtype=np.float64)
    read = scores != 0 if read is None else np.asarray(read, dtype=bool)
    if not read.any():
        return Sources((), clear=False, reason="the method kept nothing of the document", signal=signal)
    order = [int(i) for i in np.argsort(-scores, kind="stable") if read[i] and scores[i] > 0]
    if not order:
        return Sources((), clear=False, reason="the answer read nothing of the document", signal=signal)
    runs: list[list[int]] = []
    opened: set[int] = set()
    for i in order:  # best first
        run = next(
            (
                r
                for r in runs
                if len(r) < MAX_SOURCE_UNITS
                and i in (r[0] - 1, r[-1] + 1)
                and scores[i] >= JOIN_SHARE * scores[r].max()
                and (groups is None or groups[i] == groups[r[0]])
            ),
            None,
        )
        if run is not None:
            run.insert(0, i) if i < run[0] else run.append(i)
        elif groups is not None:
            if len(runs) < top and int(groups[i]) not in opened:
                runs.append([i])
                opened.add(int(groups[i]))
        elif len(runs) < top:
            runs.append([i])
        elif scores[i] < JOIN_SHARE * min(scores[r].max() for r in runs):
            break  # it can join no source, nor can any unit after it
    items = [_source(doc_units, run, scores) for run in runs]
    if group_order is None:
        items.sort(key=lambda s: -s.score)
    else:
        items.sort(key=lambda s: (-group_order[s.units[0]], -s.score))
    peak = float(scores[order[0]] / scores[read].mean()) if scores[read].mean() > 0 else None
    clear = peak is not None and peak >= clear_ratio
    reason = None if clear else "no clear source: the answer's attention is spread over what it read"
    return Sources(tuple(items), clear=clear, reason=reason, peak=peak, signal=signal)


def _source(doc_units: DocumentUnits, run: list[int], scores: np.ndarray) -> Source:
    units = doc_units.units
    start, end = units[run[0]].start, units[run[-1]].end
    first, last, paged = doc_units.place(start, end)
    return Source(
        start, end, first, last, paged, doc_units.document.text[start:end], float(scores[run].sum()), tuple(run)
    )


def sources_from_tokens(
    document: Document,
    prompt,
    token_scores,
    *,
    question: str = "",
    lexical: float = 0.0,
    passage_scores=None,
    answer: str = "",
    **kwargs,
) -> Sources:
    """Sources from one score per *prompt* token (NaN where the token was not read): the document
    tokens' scores mapped to units, then :func:`rank`. ``lexical`` > 0 adds that weight of the
    units' BM25 score for ``question`` (:func:`fused`) to the attention's, over the units read.

    ``passage_scores``: one score per prompt token, the score of the passage (page or paragraph)
    it is in, for a method that read whole passages chosen by it (``pages``): then each passage
    read gives at most one source (its best run of units), and the sources come in the passages'
    retrieval order (the score that chose them; the answer's words and attention did not order them
    better: :mod:`kvcli.cite.evidence`), the units' own scores breaking ties and choosing within a
    passage; "no clear source" when the ``answer``'s evidence (its own words, its attention) points
    to no passage read (:func:`kvcli.cite.evidence.points_nowhere`), each passage's evidence in
    ``extra``."""
    doc_units = DocumentUnits.of(document)
    values = np.asarray(token_scores, dtype=np.float64).reshape(-1)[prompt.doc_start : prompt.doc_end]
    scores, read = doc_units.scores(prompt.doc_offsets, values)
    attention = scores
    if lexical > 0:
        scores = fused(doc_units, scores, read, question, lexical)
    if passage_scores is None:
        return rank(doc_units, scores, read=read, **kwargs)
    # a unit's group: the prompt's passage it is in (units never cross one); its order: the passages'
    # retrieval score; the answer's evidence over them (kvcli.cite.evidence) decides "no clear source"
    starts = [p.char_start for p in prompt.passages]
    groups = np.array([bisect.bisect_right(starts, u.start) - 1 for u in doc_units.units], dtype=np.int64)
    per_passage = np.asarray(passage_scores, dtype=np.float64).reshape(-1)[[p.start for p in prompt.passages]]
    was_read = sorted({int(g) for g in groups[read]})
    passages = [prompt.passages[g] for g in was_read]
    terms = evidence.answer_terms(answer, question)
    found = evidence.weigh(
        [p.text for p in passages],
        [doc_units.place(p.char_start, p.char_start + len(p.text))[:2] for p in passages],
        per_passage[was_read],
        [attention[(groups == g) & read].sum() for g in was_read],
        terms,
    )
    order = np.zeros(len(prompt.passages))
    order[was_read] = [e.retrieval for e in found]
    out = rank(doc_units, scores, read=read, groups=groups, group_order=order[groups], **kwargs)
    nowhere = evidence.points_nowhere(found, terms)
    reason = "no clear source: the answer's words and attention point to no passage it read" if nowhere else None
    return dataclasses.replace(
        out,
        clear=bool(out.items) and not nowhere,
        reason=reason if out.items else out.reason,
        extra={**out.extra, "evidence": [e.to_json() for e in found]},
    )


def fused(
    doc_units: DocumentUnits, attention: np.ndarray, read: np.ndarray, question: str, weight: float
) -> np.ndarray:
    """Each read unit's share of the best attention plus ``weight`` times its share of the best
    BM25 score (the question over the read units); units not read score 0."""
    text = doc_units.document.text
    idx = np.flatnonzero(read)
    lexical = np.zeros(len(doc_units))
    lexical[idx] = bm25_scores([text[doc_units.units[i].start : doc_units.units[i].end] for i in idx], question)
    out = attention / max(attention[read].max(initial=0.0), 1e-12) + weight * lexical / max(lexical.max(), 1e-12)
    return np.where(read, out, 0.0)


# --------------------------------------------------------------------------- lexical


def bm25_sources(document: Document, question: str, top: int = DEFAULT_TOP) -> Sources:
    """The ``top`` passages (:meth:`Document.passages`) by BM25 with the question as the query, best first;
    a passage no word of the question is in is never cited."""
    cuts = document.passages()
    scores = bm25_scores([document.text[lo:hi] for lo, hi in cuts], question)
    doc_units = DocumentUnits(document, [])
    items = []
    for i in sorted(range(len(cuts)), key=lambda i: -scores[i])[:top]:
        if scores[i] <= 0:
            break
        lo, hi = cuts[i]
        first, last, paged = doc_units.place(lo, hi)
        items.append(Source(lo, hi, first, last, paged, document.text[lo:hi], float(scores[i]), ()))
    reason = None if items else "no word of the question is in the document"
    return Sources(tuple(items), clear=bool(items), reason=reason, signal="bm25")
