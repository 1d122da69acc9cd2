"""Pages: read the pages the question points to, whole, with full attention ("read what you cite").

The book path (InfLLM's stored book) reads 128-token blocks a filter layer retrieves; on real
manuals the embedded model then answers far below what it does when handed the page that holds
the answer (the *oracle* reading), and the blocks often miss that page. A lexical ranking finds the
page more often than the filter layer does (docs/bench/cite: BM25 over the pages puts the answer's
page first for 81% of 63 manual questions, among three for 90%). This method does what a reader of
a manual does: look the question's words up, then read those pages whole.

It is GemFilter's two-pass shape (Shi et al. 2024, arXiv:2409.17422) with passages as the unit
and a lexical score instead of an early layer's attention:

1. the document's passages — its pages, or page-sized runs of a document without pages (about
   600 tokens cut at paragraph, line or sentence ends: :mod:`kvcli.documents.pagination`) — are ranked
   by BM25 on word stems (Robertson & Zaragoza 2009, "The Probabilistic Relevance Framework: BM25
   and Beyond"; Lucene's variant, :mod:`kvcli.retrieval.bm25`) with the question as the query, and
   BM25's best ``candidates`` re-ranked by BM25 fused with a small sentence embedding's cosine
   (:mod:`kvcli.retrieval.ranking`: the question in the user's words, not the page's); with
   ``expand`` the model first writes a short passage that would answer the question, closed-book,
   and both rankings read the question expanded by it (Query2doc, :mod:`kvcli.retrieval.expansion`);
2. the best ``pages`` passages (default 1: measured, below) whose tokens fit in ``budget`` are kept
   whole, in document order, with everything around the document (the template, the question);
   of the next ``skim`` passages (default 2) only the best sentence for the question (BM25 over
   the passage's units, :func:`kvcli.documents.units.split_units`) is kept, widened by whole
   neighbouring units, the next first, while at most ``skim_tokens`` are;
3. the model reads only those tokens with full attention (fresh, contiguous positions, as
   GemFilter's second pass) and answers. The answer's sources (:mod:`kvcli.cite.sources`) can only
   be in what it read: the page read whole first, then the skimmed sentences, in the ranking's
   order (BM25 fused with the embedding, step 1).

No model pass over the document chooses the passages (``expand``'s passage is written from the
question and the document's first words alone), so a document longer than the model's window costs
one short reading, not a read of the whole book; no KV is stored (the choice depends on the question; the
passages' vectors are, :mod:`kvcli.retrieval.vectors`). The
whitespace between two passages belongs to the one before it, so keeping every passage keeps the
whole prompt (the contract with full attention). A passage is never cut, except the best one when
it alone is over the budget (its first ``budget`` tokens).

Measured on 63 questions about six Debian manuals (21k-76k tokens; docs/bench/cite, "Pages"): one
page read answers 18, as many as the oracle reading (the answer's page handed over: 17) and more
than twice the stored book's (8); two pages 9, three 7 — the 135M model loses the answer in more
text. The sources hit the answer's page first for 81% (BM25's own rate), among three for 81% with
one page read and 90% with two or three. One page and two skimmed (the default) answers 17 and
cites the answer's page among three for 90%, as BM25 does. This is why ``-c auto`` reads documents
over the window with ``pages`` (:mod:`kvcli.answer.policy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..documents.units import owner_starts, split_units
from ..errors import UsageError
from ..notices import warn
from ..retrieval import rank_passages
from ..retrieval.bm25 import bm25_scores
from ..retrieval.expansion import head_words, write_passage
from ..retrieval.ranking import CANDIDATES
from ..templates import stop_token_ids
from .base import Compressor, knob
from .selection import Read, Selection

BUDGET = 4096  # the default budget's ceiling (tokens): a few pages, read in seconds on a CPU


@dataclass
class Pages(Compressor):
    """Pages: the question's best pages by BM25 on stems fused with a sentence embedding
    (:mod:`kvcli.retrieval.ranking`), read whole with full attention (two passes, GemFilter's shape
    with pages as the unit; Robertson & Zaragoza 2009)."""

    name: ClassVar[str] = "pages"
    auto_kv_bits: ClassVar[int] = 8  # its layout is quantized: --kv-bits auto holds it in 8 bits (docs/kv-bits.md)
    paper: ClassVar[str] = (
        "Robertson & Zaragoza 2009, The Probabilistic Relevance Framework: BM25 and Beyond; "
        "two passes as GemFilter, arXiv:2409.17422"
    )
    keep_all: ClassVar[str] = "pages={n},budget={n}"  # every passage, and room for all of them
    short_document_spec: ClassVar[str] = "pages:budget=60"  # the tests' documents are one paragraph: its first tokens
    title: ClassVar[str] = "pages"
    acts: ClassVar[str] = (
        "selects the document's passages (a PDF's pages, else page-sized passages of ~600 tokens) by BM25 on stems and "
        "a sentence embedding against the question (the embedding re-ranks BM25's best `candidates`), the best `pages` "
        "that fit in `budget` tokens (auto: half the window, at most 4,096), read whole, and the best sentences "
        "(`skim_tokens`) of the next `skim` (no model pass chooses them: a book costs one short reading); "
        "`expand`: the question first expanded by a passage the model writes closed-book (Query2doc)"
    )
    positions: ClassVar[str] = "fresh 0..k-1"
    disk_cache: ClassVar[str] = "nothing (depends on the question)"
    reads_passages: ClassVar[bool] = True
    retrieves: ClassVar[bool] = True  # it reads a few passages, says which (Selection.read)

    pages: int = knob(
        1,
        "passages read whole: the question's best this many by BM25 fused with the sentence embedding "
        "(a PDF's pages, else page-sized passages); "
        "1 answers best on the manuals measured (docs/bench/cite)",
    )
    skim: int = knob(
        2,
        "passages after the ones read whole, in the same order, of which only the best sentences are "
        "read (skim_tokens each): further sources at little cost; 2 cites the answer's page among "
        "three as often as BM25 does and answers as one page does (docs/bench/cite)",
    )
    skim_tokens: int = knob(
        64, "tokens read of a skimmed passage: its best sentence by BM25, widened by whole neighbours"
    )
    candidates: int = knob(
        CANDIDATES,
        "BM25's best passages the sentence embedding re-ranks; the others "
        "follow in BM25's order, and only these are embedded; 0: every passage is embedded and ranked "
        "(a book's first question then embeds the whole book); chosen on the tuning questions (docs/bench/retrieval)",
    )
    budget: int | None = knob(
        None,
        f"most prompt tokens read before the question (the template's head and the passages); "
        f"auto = half the model's window, at most {BUDGET:,}",
    )
    expand: int = knob(
        0,
        "tokens of a passage the model first writes, closed-book, to answer the question (Query2doc, "
        "arXiv:2303.07678); the passages are then ranked by the question expanded by it (a user's words "
        "meet the manual's); 0: by the question alone",
    )

    def __post_init__(self) -> None:
        if self.pages < 1:
            raise UsageError(f"pages: pages must be at least 1, got {self.pages}")
        if self.skim < 0 or self.skim_tokens < 1:
            raise UsageError(
                f"pages: skim must be at least 0 and skim_tokens at least 1, got {self.skim}, {self.skim_tokens}"
            )
        if self.budget is not None and self.budget < 1:
            raise UsageError(f"pages: budget must be at least 1, got {self.budget}")
        if self.candidates < 0:
            raise UsageError(f"pages: candidates must be at least 0 (0: every passage), got {self.candidates}")
        if self.expand < 0:
            raise UsageError(f"pages: expand must be at least 0 (0: the question alone), got {self.expand}")

    def configure(self, lm) -> None:
        if self.budget is None:
            self.budget = min(BUDGET, (lm.max_context or 2 * BUDGET) // 2)
        if self.expand:  # what writing the expansion needs besides the engine (select_tokens)
            self._writer = (lm.tokenizer, stop_token_ids(lm.tokenizer, lm.model.generation_config))

    def prefix_state(self, lm) -> None:
        """None: what is read depends on the question."""
        return None

    def window_needed(self, lm, n_prompt: int, n_suffix: int, max_new_tokens: int) -> int:
        """The kept tokens before the question (at most ``budget``), the question and the answer."""
        return min(n_prompt - n_suffix, self.budget) + n_suffix + max_new_tokens

    def reading_note(self, lm, n_prompt: int) -> str:
        what = "the page (or passage)" if self.pages == 1 else f"the {self.pages} pages (or passages)"
        skim = f", and the best sentences of the next {self.skim}" if self.skim else ""
        return f"pages reads {what} the question's words point to{skim} (at most {self.budget:,} tokens)"

    def select_tokens(
        self, engine, prompt_ids: torch.Tensor, protected: int = 0, prefix=None, prompt=None
    ) -> Selection:
        """Everything outside the document, and the chosen passages' tokens (module docstring);
        each document token scored by its passage's retrieval score, BM25 fused with the sentence
        embedding (:attr:`kvcli.retrieval.Ranking.scores`; NaN elsewhere)."""
        if prompt is None:
            raise UsageError("pages ranks the document's passages: it must be the first method of a pipeline")
        n = prompt_ids.numel()
        keep = torch.ones(n, dtype=torch.bool)
        keep[prompt.doc_start : prompt.doc_end] = False
        scores = torch.full((n,), float("nan"))
        bounds = passage_tokens(prompt)
        if not bounds:
            return Selection(torch.arange(n))
        texts = [p.text for p in prompt.passages]
        expansion = None
        if self.expand:
            tokenizer, stop = self._writer
            expansion = write_passage(engine, tokenizer, stop, prompt.question, head_words(texts), self.expand).text
        ranking = rank_passages(
            texts,
            prompt.question,
            self.vectors_dir(),
            candidates=self.candidates,
            document={"document": self.runtime.document, "document_sha256": self.runtime.document_sha256},
            on_progress=self.runtime.on_embed,
            on_stored=self.runtime.on_stored,
            expansion=expansion or "",
        )
        fused = ranking.scores  # BM25 on stems fused with a sentence embedding (kvcli.retrieval)
        room = self.budget - prompt.doc_start  # the template's head is read too
        chosen, skimmed, read = [], [], []  # read: (how, passage index, token span), in the order chosen
        for i in sorted(range(len(bounds)), key=lambda i: (-fused[i], i)):
            a, b = bounds[i]
            if len(chosen) == self.pages:
                if len(skimmed) == self.skim or ranking.bm25[i] <= 0:
                    break
                span = best_sentences(prompt, prompt.passages[i], a, b, self.skim_tokens)
                if span is not None and span[1] - span[0] <= room:
                    skimmed.append(span)
                    read.append(("skimmed", i, span))
                    room -= span[1] - span[0]
                continue
            if b - a <= room:
                chosen.append((a, b))
                read.append(("whole", i, (a, b)))
                room -= b - a
            elif not chosen:  # the best passage alone is over the budget: its beginning
                chosen.append((a, a + max(room, 0)))
                read.append(("beginning", i, (a, a + max(room, 0))))
                room = 0
        chosen += skimmed
        for (a, b), score in zip(bounds, fused):
            scores[a:b] = score
        for a, b in chosen:
            keep[a:b] = True
        note = None if ranking.matched else no_match_note(prompt, bounds, chosen, ranking.semantic is not None)
        if note is not None:
            warn(note)
        what = tuple(read_of(prompt, how, prompt.passages[i], *span) for how, i, span in read if span[1] > span[0])
        return Selection(
            torch.nonzero(keep).flatten(), scores, note=note, read=what, ranked_by=ranking.signal, expansion=expansion
        )

    def vectors_dir(self):
        """Where the passages' vectors are kept: the run's cache folder (:mod:`kvcli.retrieval.vectors`)."""
        from ..files import cache_folder

        return cache_folder(self.runtime.cache_dir)  # where the store looks for them (KVStore.open expands it too)


def read_of(prompt, how: str, passage, a: int, b: int) -> Read:
    """The :class:`Read` of prompt tokens ``[a, b)`` of ``passage``: their characters, within the
    passage's text (the whitespace after it, which its tokens cover, left out)."""
    lo = prompt.doc_offsets[a - prompt.doc_start][0]
    hi = prompt.doc_offsets[b - 1 - prompt.doc_start][1]
    start, end = passage.char_start, passage.char_start + len(passage.text)
    return Read(how, a, b, max(lo, start), max(max(lo, start), min(hi, end)))


def no_match_note(prompt, bounds, chosen, semantic: bool) -> str:
    """The line that says no passage matched the question, and what was read instead: the passages
    (pages, or the lines of a document without pages) whose tokens were kept, whole or in part."""
    read = [i for i, (a, b) in enumerate(bounds) if any(lo < b and a < hi for lo, hi in chosen)]
    paged = any(p.page > 1 for p in prompt.passages)
    names = [prompt.passages[i].where(paged) for i in read]
    why = "no part of the document is close to it in meaning" if semantic else "no word of it is in the document"
    return f"no page matched the question ({why}): read {', '.join(names) or 'nothing'} instead"


def best_sentences(prompt, passage, a: int, b: int, tokens: int) -> tuple[int, int] | None:
    """The prompt tokens ``[lo, hi)`` of the passage's best unit (sentence or line,
    :func:`kvcli.documents.units.split_units`) by BM25 for the question, widened by whole neighbouring
    units (the next first) while at most ``tokens`` are read; None when no unit holds a word of it.
    ``[a, b)``: the passage's prompt tokens."""
    units = split_units(passage.text)
    if not units:
        return None
    scores = bm25_scores([passage.text[u.start : u.end] for u in units], prompt.question)
    best = max(range(len(units)), key=lambda i: (scores[i], -i))
    if scores[best] <= 0:
        return None
    # a unit's tokens: those whose last character it owns (as DocumentUnits.scores maps them), in order
    ends = np.array([max(s, e - 1) for s, e in prompt.doc_offsets[a - prompt.doc_start : b - prompt.doc_start]])
    owner = np.searchsorted(owner_starts(units), ends - passage.char_start, side="right") - 1
    each = np.arange(len(units))
    first, after = np.searchsorted(owner, each, side="left"), np.searchsorted(owner, each, side="right")
    lo, hi = int(first[best]), int(after[best])
    if lo == hi:
        return None
    below, above = best - 1, best + 1
    while True:
        if above < len(units) and after[above] - lo <= tokens:
            hi, above = int(after[above]), above + 1
        elif below >= 0 and hi - first[below] <= tokens:
            lo, below = int(first[below]), below - 1
        else:
            break
    return a + lo, a + hi  # the best unit whole, even when it alone is over ``tokens``


def passage_tokens(prompt) -> list[tuple[int, int]]:
    """Each passage's prompt tokens, the whitespace after it (up to the next passage) included and
    the document's first tokens given to the first: together they cover the document exactly."""
    starts = [p.start for p in prompt.passages]
    if not starts:
        return []
    starts[0] = prompt.doc_start
    return list(zip(starts, [*starts[1:], prompt.doc_end]))
