"""An answer's sources: :func:`cite` ranks what its decoding steps read of the document
(:mod:`kvcli.cite.sources`). :meth:`kvcli.api.Session.ask` calls it once the answer is decoded."""

from __future__ import annotations

import time

from ..cite.sources import LEXICAL_WEIGHT, Sources, sources_from_tokens
from ..documents import Document
from .pipeline import Result


def cite(document: Document, result: Result, question: str = "", by_passage: bool = False) -> Sources:
    """The answer's sources from what its decoding steps read (``result.extra["citing"]``, taken
    out), ranked with the question's BM25 by :data:`kvcli.cite.sources.LEXICAL_WEIGHT`; the time they
    added (reading and ranking) in ``result.extra["sources_s"]``. ``by_passage``: the method read
    whole passages chosen by their retrieval score (``pages``: ``result.selection.scores``, BM25 fused
    with a sentence embedding): one source per passage, ordered by the answer's evidence over them
    (:func:`kvcli.cite.sources.sources_from_tokens`). The sources' ``signal`` says what ranked them:
    "attention+bm25" (or "attention"), after "passages by bm25+<the embedding model>, " (or "passages by bm25, "
    without an embedding model) for such a method."""
    t0 = time.perf_counter()
    citing = result.extra.pop("citing")
    if citing["unsupported"]:
        found = Sources((), clear=False, reason=f"no sources: {citing['unsupported']}", signal="attention")
    else:
        found = sources_from_tokens(
            document,
            result.prompt,
            citing["scores"].numpy(),
            question=question,
            lexical=LEXICAL_WEIGHT,
            passage_scores=result.selection.scores.numpy() if by_passage else None,
            answer=result.answer,
            signal=(f"passages by {result.selection.ranked_by or 'retrieval'}, " if by_passage else "")
            + ("attention+bm25" if LEXICAL_WEIGHT else "attention"),
        )
    result.extra["sources_s"] = citing["seconds"] + time.perf_counter() - t0
    return found
