"""Finding the passages a question points to: BM25 on word stems fused with a small sentence
embedding (:mod:`.ranking`), the document's passage vectors kept on disk (:mod:`.vectors`).

What the ``pages`` method reads first (:mod:`kvcli.compressors.pages`); BM25 (:mod:`.bm25`) is
also the citations' lexical signal (:mod:`kvcli.cite.sources`). Imports only
:mod:`kvcli.documents`, :mod:`kvcli.files` and :mod:`kvcli.errors` of kvcli.
"""

from .bm25 import bm25_scores, words
from .ranking import NO_MATCH_COSINE, Ranking, rank_passages, reciprocal_rank

__all__ = ["NO_MATCH_COSINE", "Ranking", "bm25_scores", "rank_passages", "reciprocal_rank", "words"]
