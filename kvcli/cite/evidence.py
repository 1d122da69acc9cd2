"""The answer's evidence over the passages a retrieving method read (``pages``; issue 49 item 6).

Which passages a method like ``pages`` reads is chosen by the question (retrieval); which of them
the answer came from is the answer's to say. Per passage read, three signals:

* ``retrieval``: the passage's retrieval score, as a share of the best read (what chose it);
* ``attention``: the passage's share of the answer's attention over what was read (the unit
  scores of :mod:`kvcli.cite.sources`, attention only: the question's BM25 left out);
* ``words``: the share of the answer's own terms found in the passage — the answer's words (Snowball
  stems, stop words and the question's own words out: those are what retrieved the passages) and
  its numbers (``4-7-1-9``, ``0.05``, ``8080``: a digit run of at least two characters, matched as
  written).

The passages are cited in the retrieval's order: ordering them by the answer's words or attention
as well did no better, measured (benchmarks/heldout_answers.py --analyse weighs the shares ``--json``
reports as ``sources_evidence``; docs/bench/cite/README.md, "Sources from the answer"): on the tuning
questions (user-check.json, pages, 30 in each wording) the answer's page came first for 25 + 15 of 60
in the retrieval's order, 23 + 17 with half the answer's words, 21 + 17 with all of them, no better
with its attention — a tie; on the held-out questions (heldout-questions.json, 25 answerable in each
wording) 23 + 4 against 19 + 5 with half its words. An answer that is wrong (most of this small
model's) points its words at the wrong page. The shares are measured for that benchmark and for
**no clear source** (:func:`points_nowhere`): the answer has terms of its own and none is in any
passage read, and its attention singles out no passage. Model-free: tested with hand-made scores.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..retrieval.bm25 import words

# an answer's attention singles out a passage when that passage holds at least this share of it
ATTENTION_CLEAR_SHARE = 0.6
_NUMBER = re.compile(r"\d+(?:[-.,:/]\d+)*")


@dataclass(frozen=True)
class Evidence:
    """One passage read: its first and last page (or line), and the three signals' shares."""

    first: int
    last: int
    retrieval: float
    attention: float
    words: float

    def to_json(self) -> dict:
        return {
            "pages": [self.first, self.last],
            "retrieval": round(self.retrieval, 4),
            "attention": round(self.attention, 4),
            "answer_words": round(self.words, 4),
        }


def answer_terms(answer: str, question: str) -> tuple[set[str], set[str]]:
    """(stems, numbers): the answer's own terms — its words' stems less the question's, and its
    numbers of two characters or more."""
    asked = set(words(question, stem=True))
    stems = {w for w in words(answer, stem=True) if w not in asked and not w.isdigit()}
    numbers = {n for n in _NUMBER.findall(answer) if len(n) >= 2 and n not in question}
    return stems, numbers


def words_share(terms: tuple[set[str], set[str]], text: str) -> float:
    """The share of the answer's terms found in ``text`` (0 when it has none)."""
    stems, numbers = terms
    total = len(stems) + len(numbers)
    if total == 0:
        return 0.0
    found = len(stems & set(words(text, stem=True))) + sum(n in text for n in numbers)
    return found / total


def weigh(
    texts: list[str],
    places: list[tuple[int, int]],
    retrieval: np.ndarray,
    attention: np.ndarray,
    terms: tuple[set[str], set[str]],
) -> list[Evidence]:
    """One :class:`Evidence` per passage read: ``texts`` and ``places`` (first, last page or line)
    of each; ``retrieval`` its retrieval score; ``attention`` the answer's attention in it (sums);
    ``terms`` the answer's own (:func:`answer_terms`)."""
    retrieval = np.asarray(retrieval, dtype=np.float64)
    attention = np.clip(np.asarray(attention, dtype=np.float64), 0.0, None)
    best = retrieval.max(initial=0.0)
    mass = attention.sum()
    return [
        Evidence(
            first,
            last,
            float(r / best) if best > 0 else 0.0,
            float(a / mass) if mass > 0 else 0.0,
            words_share(terms, text),
        )
        for text, (first, last), r, a in zip(texts, places, retrieval, attention)
    ]


def points_nowhere(evidence: list[Evidence], terms: tuple[set[str], set[str]]) -> bool:
    """Whether the answer's evidence points to no passage read: it has terms of its own (``terms``,
    :func:`answer_terms`) and none is in a passage read, and no passage holds
    :data:`ATTENTION_CLEAR_SHARE` of its attention."""
    stems, numbers = terms
    if not evidence:
        return True
    words_nowhere = bool(stems or numbers) and max(e.words for e in evidence) == 0
    attention_spread = max(e.attention for e in evidence) < ATTENTION_CLEAR_SHARE
    return words_nowhere and attention_spread
