"""The passages ranked for a question: BM25 on word stems fused with a sentence embedding.

* lexical: BM25 over the passages with Snowball stems (:func:`kvcli.retrieval.bm25.bm25_scores`,
  ``stem=True``);
* semantic: the cosine between the question's vector and each window of a passage, the passage's
  best window (:mod:`.vectors`, :mod:`.embed`), for BM25's best :data:`CANDIDATES` passages only
  (:func:`candidates_of`): the embedding re-ranks them, the other passages follow in BM25's order;
* fused as a weighted sum, ``WEIGHT · BM25 / the best passage's BM25 + (1 - WEIGHT) · cosine``
  (:func:`weighted`; reciprocal rank fusion, Cormack, Clarke & Büttcher 2009, :func:`reciprocal_rank`,
  ranked below it). The window, the fusion and its weight were chosen on the tuning questions only
  (benchmarks/retrieval.py; docs/bench/retrieval); the weight is each embedding model's own
  (kvcli/retrieval/embedders.json: 0.3 for all-MiniLM-L6-v2, less for a model that ranks better alone).

Only the candidates are embedded, so a book's first question embeds a few pages, not the book
(the 236-page R-exts.pdf: 1,304 windows, ~75 s on two cores). :data:`CANDIDATES` was chosen on the
tuning questions: the smallest count whose best three passages (what ``pages`` reads) are those of
the ranking over every passage for each of them (docs/bench/retrieval, "Candidates").

No real signal (:attr:`Ranking.matched` False): no window of the candidates is within the
model's no-match cosine (:data:`NO_MATCH_COSINE` for the default) of the question (BM25 alone: no word of the question is in it). Measured
on the tuning questions against the same questions asked of the other manuals (docs/bench/retrieval).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import embed, embedders, vectors
from .bm25 import bm25_scores
from .expansion import queries

RRF_K = 60  # reciprocal rank fusion's constant (the paper's), when fused by ("rrf", k)
# the default model's tuned values (kvcli/retrieval/embedders.json); another model's are its own
_DEFAULT = embedders.tuned(embedders.default_name())
WEIGHT = _DEFAULT.weight  # BM25's weight in the weighted sum
FUSION = ("mix", WEIGHT)  # how the two are fused: chosen on the tuning questions (docs/bench/retrieval)
CANDIDATES = 30  # BM25's best passages the embedding re-ranks (0: every passage); module doc
NO_MATCH_COSINE = _DEFAULT.no_match_cosine  # a best window's cosine under this: no page matched the question


@dataclass
class Ranking:
    """One score per passage (higher first) and what made it."""

    scores: np.ndarray  # the fused score (BM25 alone without an embedding model)
    bm25: np.ndarray  # BM25 on stems
    semantic: np.ndarray | None  # the best window's cosine; None: no embedding model (``none``)
    signal: str  # "bm25+" the embedding model's name ("bm25+embeddinggemma-300m"), or "bm25"
    no_match: float = NO_MATCH_COSINE  # the embedding model's no-match cosine (:mod:`.embedders`)
    # what :attr:`matched` reads: the question's own cosines (BM25 without an embedding model), which
    # differ from ``semantic`` (``bm25``) when the question was expanded (:mod:`.expansion`); None: those
    verdict: np.ndarray | None = None

    @property
    def order(self) -> list[int]:
        """The passages best first (ties: document order)."""
        return sorted(range(len(self.scores)), key=lambda i: (-self.scores[i], i))

    @property
    def matched(self) -> bool:
        """Whether the best passage has a real signal: with an embedding, a window whose cosine
        with the question is at least :attr:`no_match` (the model's; the default's :data:`NO_MATCH_COSINE`) (a word of the question alone is not:
        questions asked of another manual share some with most pages); BM25 alone, a word of it."""
        if self.semantic is not None:
            own = self.semantic if self.verdict is None else self.verdict
            return len(own) > 0 and float(own.max()) >= self.no_match
        own = self.bm25 if self.verdict is None else self.verdict
        return len(own) > 0 and float(own.max()) > 0


def reciprocal_rank(
    *signals: np.ndarray, k: float = RRF_K, present: list[np.ndarray | None] | None = None
) -> np.ndarray:
    """``Σ_s 1 / (k + rank_s(i))`` over the signals, rank 1 the highest score (ties: document order);
    ``present[s]``: which passages signal ``s`` ranks at all (the others get nothing from it)."""
    out = np.zeros(len(signals[0]) if signals else 0)
    for s, values in enumerate(signals):
        values = np.asarray(values, dtype=np.float64)
        order = sorted(range(len(values)), key=lambda i: (-values[i], i))
        ranks = np.empty(len(values))
        ranks[order] = np.arange(1, len(values) + 1)
        gain = 1.0 / (k + ranks)
        mask = None if present is None else present[s]
        out += gain if mask is None else np.where(mask, gain, 0.0)
    return out


def weighted(lexical: np.ndarray, semantic: np.ndarray, weight: float = WEIGHT) -> np.ndarray:
    """``weight · BM25 / its best + (1 - weight) · cosine``: BM25 put on the cosine's scale (its best
    passage 1, a passage without a word of the question 0)."""
    lexical = np.asarray(lexical, dtype=np.float64)
    return weight * lexical / max(float(lexical.max(initial=0.0)), 1e-12) + (1 - weight) * np.asarray(semantic)


def fuse(lexical: np.ndarray, semantic: np.ndarray, how: tuple[str, float] | None = None) -> np.ndarray:
    """The two signals as one score a passage, by :data:`FUSION` (or ``how``): ``("rrf", k)``,
    :func:`reciprocal_rank`; ``("mix", w)``, :func:`weighted`."""
    name, value = how or FUSION
    if name == "rrf":
        return reciprocal_rank(lexical, semantic, k=value, present=[np.asarray(lexical) > 0, None])
    return weighted(lexical, semantic, value)


def semantic_scores(vecs: np.ndarray, owner: np.ndarray, query: np.ndarray, n: int) -> np.ndarray:
    """Each passage's best window cosine (vectors are unit rows); -1 for a passage without windows."""
    cos = vecs @ query
    best = np.full(n, -1.0)
    np.maximum.at(best, owner, cos)
    return best


def candidates_of(lexical: np.ndarray, candidates: int) -> list[int]:
    """The passages the embedding re-ranks, in passage order: BM25's best ``candidates`` (ties,
    passages without a word of the question among them: document order, so a document of at most
    that many passages is embedded whole); 0: every passage."""
    if not candidates:
        return list(range(len(lexical)))
    return sorted(sorted(range(len(lexical)), key=lambda i: (-lexical[i], i))[:candidates])


def reranked(
    lexical: np.ndarray, semantic: np.ndarray, wanted: list[int], how: tuple[str, float] | None = None
) -> np.ndarray:
    """One score a passage: the ``wanted`` passages fused (:func:`fuse` by ``how``, in [-1, 1]), then
    the others in BM25's order (below -2)."""
    scores = np.asarray(lexical, dtype=np.float64) / max(float(np.max(lexical, initial=0.0)), 1e-12) - 3.0
    scores[wanted] = fuse(np.asarray(lexical)[wanted], np.asarray(semantic)[wanted], how)
    return scores


def rank_passages(
    passages: list[str],
    question: str,
    cache_dir: Path | None = None,
    *,
    candidates: int = CANDIDATES,
    document: dict | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    on_stored: Callable[[Path], None] | None = None,
    expansion: str = "",
) -> Ranking:
    """The passages' ranking for ``question`` (module doc). ``cache_dir``: where the passage
    vectors are kept (``<cache_dir>/vectors``; None: computed, not kept). The embedding model is
    ``$KVCLI_EMBED_MODEL`` (:func:`kvcli.retrieval.embed.setting`; ``none``: BM25 alone) and
    re-ranks BM25's best ``candidates`` passages (:func:`candidates_of`; 0: every passage).
    ``document``, ``on_progress``, ``on_stored``: :func:`kvcli.retrieval.vectors.passage_vectors`'s.
    ``expansion``: a passage the model wrote for the question (:mod:`.expansion`, Query2doc): both
    queries are the question expanded by it (:func:`kvcli.retrieval.expansion.queries`), while
    whether a passage matched is still the question's own cosine's verdict (its threshold was
    tuned on questions alone); its signal then ends ``+query2doc``."""
    lexical_query, dense_query = queries(question, expansion)
    lexical = np.asarray(bm25_scores(passages, lexical_query, stem=True), dtype=np.float64)
    expanded = "+query2doc" if lexical_query != question else ""
    name = embed.setting()
    if name is None or not passages:
        plain = np.asarray(bm25_scores(passages, question, stem=True), dtype=np.float64) if expanded else None
        return Ranking(lexical, lexical, None, f"bm25{expanded}", verdict=plain)
    model = embed.embedder(name)  # loaded (or said missing) whatever the question matches
    wanted = candidates_of(lexical, candidates)  # never empty: the document has passages
    vecs, owner, _ = vectors.passage_vectors(
        model, passages, cache_dir, wanted=wanted, document=document, on_progress=on_progress, on_stored=on_stored
    )
    # a passage not embedded has no window: -1, as no window matched
    semantic = semantic_scores(vecs, owner, model.encode_query(dense_query), len(passages))
    own = semantic_scores(vecs, owner, model.encode_query(question), len(passages)) if expanded else None
    tuned = embedders.tuned(name)
    scores = reranked(lexical, semantic, wanted, ("mix", tuned.weight))
    signal = f"bm25+{embedders.short(name)}{expanded}"
    return Ranking(scores, lexical, semantic, signal, tuned.no_match_cosine, verdict=own)
