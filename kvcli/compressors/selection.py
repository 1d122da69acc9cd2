"""Kept token positions -> character spans -> pages: the one thing ``--show-selected`` renders.

A method that keeps a single set of prompt tokens (GemFilter) reports it as a :class:`Selection`;
runs of consecutive kept document tokens become :class:`Span` objects over ``Document.text``.
A method that retrieves instead of compressing (``pages``: :attr:`Compressor.retrieves
<kvcli.compressors.base.Compressor.retrieves>`) also says what it read, passage by passage
(:class:`Read`, ``Selection.read``): what the stats line, ``--json``'s ``read`` and ``inspect`` show.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class Span:
    start: int  # character offsets in Document.text, [start, end)
    end: int
    page: int  # page of the first character (1-based)
    last_page: int  # page of the last character
    n_tokens: int
    score: float | None  # best filter score among the span's tokens, if the method scores
    text: str

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Read:
    """A passage a retrieving method read: ``how`` "whole", "beginning" (its first tokens: the best
    passage alone over the method's budget) or "skimmed" (its best sentences)."""

    how: str
    start: int  # prompt tokens [start, end)
    end: int
    char_start: int  # its text in Document.text, [char_start, char_end), whitespace trimmed
    char_end: int

    @property
    def n_tokens(self) -> int:
        return self.end - self.start

    def place(self, document) -> tuple[str, int, int]:
        """("pages", first, last) in a paged document, else ("lines", first, last); 1-based."""
        if document.n_pages > 1:
            return ("pages", *document.page_range(self.char_start, self.char_end))
        text = document.text
        first = text.count("\n", 0, self.char_start) + 1
        return "lines", first, first + text.count("\n", self.char_start, max(self.char_start, self.char_end - 1))

    def where(self, document) -> str:
        """``p. 42``, ``pp. 41-42``, ``line 7``, ``lines 7-9``."""
        unit, first, last = self.place(document)
        short = "p." if unit == "pages" else "line"
        if first == last:
            return f"{short} {first}"
        return f"{'pp.' if unit == 'pages' else 'lines'} {first}-{last}"

    def to_json(self, document) -> dict:
        unit, first, last = self.place(document)
        return {
            "how": self.how,
            unit: [first, last],
            "start": self.char_start,
            "end": self.char_end,
            "n_tokens": self.n_tokens,
        }


def read_record(
    read: tuple[Read, ...] | None, prompt, document, ranked_by: str | None = None, expansion: str | None = None
) -> dict | None:
    """``--json``'s ``read``: the passages read (whole first, then skimmed, in the method's order),
    the tokens read of them and of the document, what ranked them (:attr:`Selection.ranked_by`) and,
    where the question was expanded, the passage the model wrote for it (:attr:`Selection.expansion`);
    None for a method that does not retrieve."""
    if read is None:
        return None
    out = {
        "passages": [r.to_json(document) for r in read],
        "n_tokens": sum(r.n_tokens for r in read),
        "n_document_tokens": prompt.n_document_tokens,
        "ranked_by": ranked_by,
    }
    if expansion is not None:
        out["expansion"] = expansion
    return out


def read_line(read: tuple[Read, ...], prompt, document) -> str:
    """What was read, in a few words: "read p. 12 whole, p. 3 and p. 40 skimmed: 760 of 74,000
    document tokens"."""
    parts = []
    for how in ("whole", "beginning", "skimmed"):
        places = [r.where(document) for r in read if r.how == how]
        if places:
            listed = places[0] if len(places) == 1 else ", ".join(places[:-1]) + " and " + places[-1]
            parts.append(f"the beginning of {listed}" if how == "beginning" else f"{listed} {how}")
    n = sum(r.n_tokens for r in read)
    return f"read {', '.join(parts) or 'nothing'}: {n:,} of {prompt.n_document_tokens:,} document tokens"


@dataclass
class Selection:
    kept: torch.Tensor  # (k,) sorted indices into Prompt.ids
    scores: torch.Tensor | None = None  # (n,) per prompt token, when the method scores tokens
    # what the user is told about the choice (one line), e.g. that no passage matched the question
    note: str | None = None
    # what a method that retrieves read, passage by passage (Read); None: it compresses or keeps all
    read: tuple[Read, ...] | None = None
    # what ranked the passages a method that retrieves read (kvcli.retrieval.Ranking.signal:
    # "bm25+embeddinggemma-300m", "bm25" without an embedding model); None: it ranks no passages
    ranked_by: str | None = None
    # the passage the model wrote to rank the passages with (kvcli.retrieval.expansion); None: none
    expansion: str | None = None

    @property
    def n_kept(self) -> int:
        return self.kept.numel()

    @property
    def retrieved(self) -> bool:
        """Whether a method that retrieves chose this (``pages``): what it read, not a compression."""
        return self.read is not None

    def spans(self, prompt, document) -> list[Span]:
        """Runs of consecutive kept *document* tokens, in document order."""
        doc = [i for i in self.kept.tolist() if prompt.doc_start <= i < prompt.doc_end]
        runs: list[list[int]] = []
        for i in doc:
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        spans = []
        for run in runs:
            start = prompt.char_span(run[0])[0]
            end = prompt.char_span(run[-1])[1]
            score = float(self.scores[run].max()) if self.scores is not None else None
            spans.append(
                Span(
                    start=start,
                    end=end,
                    page=document.page_of(start),
                    last_page=document.page_of(max(start, end - 1)),
                    n_tokens=len(run),
                    score=score,
                    text=document.text[start:end],
                )
            )
        return spans
