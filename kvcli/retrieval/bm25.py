"""BM25 (Lucene's variant, as ``bm25s`` computes it): passages ranked by a query's words.

The lexical baseline of the citations (docs/bench/cite) and half of the pages' ranking
(:mod:`kvcli.retrieval`): BM25 over pages (or paragraphs) with the question as the query. Written
out (a few lines) and tested against ``bm25s``'s numbers: words are ``bm25s.tokenize``'s (lower
case, ``\\b\\w\\w+\\b``, its English stop words removed), ``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``,
a word's term ``idf · tf / (tf + k1 · (1 - b + b · len / avg_len))``, summed over the query's words
(a word the query repeats counts each time; one no passage holds, not at all).

``stem=True`` reduces each word to its English Snowball stem first (the ``snowballstemmer``
package, which runs PyStemmer's C Snowball where that is installed, a dependency: the same stems,
faster; the stemmer ``bm25s`` takes: "failing", "fails" and "failed" are all "fail"), so a
question in other word forms than the page's still meets it; the citations keep the plain words
(their numbers in docs/bench/cite were measured so).
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter

from ..errors import ModelError

K1, B = 1.5, 0.75
_WORD = re.compile(r"(?u)\b\w\w+\b")
# bm25s's STOPWORDS_EN (bm25s.stopwords), which ``stopwords="en"`` removes
STOPWORDS = frozenset(
    (
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "but",
        "by",
        "for",
        "if",
        "in",
        "into",
        "is",
        "it",
        "no",
        "not",
        "of",
        "on",
        "or",
        "such",
        "that",
        "the",
        "their",
        "then",
        "there",
        "these",
        "they",
        "this",
        "to",
        "was",
        "will",
        "with",
    )
)


def words(text: str, stem: bool = False) -> list[str]:
    """The text's words as BM25 counts them: lower case, stop words out, each stemmed with ``stem``."""
    out = [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]
    return [_stem(w) for w in out] if stem else out


@functools.lru_cache(maxsize=1)
def _stemmer():
    try:
        import snowballstemmer
    except ImportError as e:  # a dependency (pyproject): only a broken install lacks it
        raise ModelError("the snowballstemmer package is missing: pip install snowballstemmer") from e
    return snowballstemmer.stemmer("english")


@functools.lru_cache(maxsize=1 << 16)
def _stem(word: str) -> str:
    return _stemmer().stemWord(word)


def bm25_scores(passages: list[str], query: str, k1: float = K1, b: float = B, stem: bool = False) -> list[float]:
    """One score per passage, in the passages' order; ``stem``: words by their Snowball stems."""
    bags = [Counter(words(p, stem)) for p in passages]
    lengths = [sum(bag.values()) for bag in bags]
    n, avg = len(bags), (sum(lengths) / len(bags) if bags else 0.0) or 1.0
    df = Counter(w for bag in bags for w in bag)
    idf = {w: math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5)) for w in df}
    asked = [w for w in words(query, stem) if w in df]
    return [
        sum(idf[w] * bag[w] / (bag[w] + k1 * (1 - b + b * length / avg)) for w in asked if w in bag)
        for bag, length in zip(bags, lengths)
    ]
