"""Kept token positions -> character spans -> pages: the one thing ``--show-selected`` renders.

A method that keeps a single set of prompt tokens (GemFilter) reports it as a :class:`Selection`;
runs of consecutive kept document tokens become :class:`Span` objects over ``Document.text``.
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


@dataclass
class Selection:
    kept: torch.Tensor  # (k,) sorted indices into Prompt.ids
    scores: torch.Tensor | None = None  # (n,) per prompt token, when the method scores tokens
    # what the user is told about the choice (one line), e.g. that no passage matched the question
    note: str | None = None

    @property
    def n_kept(self) -> int:
        return self.kept.numel()

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
