"""kvcli.retrieval: BM25 on Snowball stems, reciprocal rank fusion and the no-match rule, each
against numbers computed by hand here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcli.retrieval import bm25_scores, reciprocal_rank, words
from kvcli.retrieval.ranking import NO_MATCH_COSINE, Ranking, semantic_scores


def test_stemmed_words():
    assert words("The failing commands failed", stem=True) == ["fail", "command", "fail"]
    assert words("The failing commands failed") == ["failing", "commands", "failed"]


def test_the_stemmer_in_use_stems_as_snowballs_own_python():
    """BM25's stemmer (PyStemmer's C Snowball where it installs, a dependency) gives
    the stems of snowballstemmer's pure-Python English stemmer, words whose stemming has steps."""
    from snowballstemmer.english_stemmer import EnglishStemmer

    from kvcli.retrieval.bm25 import _stemmer

    ours, theirs = _stemmer(), EnglishStemmer()
    for word in ["generously", "registering", "routines", "interrupts", "dependencies", "arguing", "news",
                 "skies", "dying", "proceed", "exceeding", "succeeded", "cañon", "1st", "r_checkuserinterrupt"]:  # fmt: skip
        assert ours.stemWord(word) == theirs.stemWord(word), word


def test_bm25_on_stems_by_hand():
    passages = ["failing commands stop the shell", "a command failed", "cats purr"]
    # stems: [fail, command, stop, shell] (4), [command, fail] (2), [cat, purr] (2); avg 8/3, N = 3
    df = {"fail": 2, "command": 2, "shell": 1}
    idf = {w: math.log(1 + (3 - n + 0.5) / (n + 0.5)) for w, n in df.items()}
    avg = 8 / 3

    def term(w, length):  # every tf here is 1
        return idf[w] * 1 / (1 + 1.5 * (1 - 0.75 + 0.75 * length / avg))

    query = "Which shells fail on commands?"  # "on": a stop word
    want = [term("shell", 4) + term("fail", 4) + term("command", 4), term("fail", 2) + term("command", 2), 0.0]
    assert words(query, stem=True) == ["which", "shell", "fail", "command"]  # "which" is in no passage
    assert bm25_scores(passages, query, stem=True) == pytest.approx(want)
    # without stems only "commands" meets the first passage: the plain ranking misses the second
    plain = bm25_scores(passages, query)
    assert plain[1] == 0.0 and plain[0] > 0


def test_reciprocal_rank_by_hand():
    lexical = np.array([0.0, 2.0, 1.0, 2.0])  # ranks 4, 1, 3, 2 (ties: document order); passage 0 holds no word
    semantic = np.array([0.9, 0.1, 0.5, 0.3])  # ranks 1, 4, 2, 3
    k = 60
    want = [
        1 / (k + 1),  # BM25 gives nothing where no word of the question is
        1 / (k + 1) + 1 / (k + 4),
        1 / (k + 3) + 1 / (k + 2),
        1 / (k + 2) + 1 / (k + 3),
    ]
    got = reciprocal_rank(lexical, semantic, k=k, present=[lexical > 0, None])
    assert got.tolist() == pytest.approx(want)
    r = Ranking(got, lexical, semantic, "bm25+embedding")
    assert r.order == [1, 2, 3, 0]  # 2 and 3 tie: document order


def test_semantic_scores_are_each_passages_best_window():
    vecs = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [-1.0, 0.0]])
    owner = np.array([0, 0, 1, 2])
    got = semantic_scores(vecs, owner, np.array([0.0, 1.0]), 4)
    assert got.tolist() == pytest.approx([0.8, 1.0, 0.0, -1.0])  # passage 3 has no window


def test_no_match_rule():
    # with an embedding, the best window's cosine decides: a shared word alone is no match
    words_only = Ranking(np.ones(2), np.array([0.0, 0.4]), np.array([NO_MATCH_COSINE - 0.01, 0.0]), "")
    assert not words_only.matched
    close = Ranking(np.ones(2), np.zeros(2), np.array([NO_MATCH_COSINE, 0.0]), "")
    assert close.matched
    # BM25 alone: a word of the question somewhere
    assert not Ranking(np.zeros(2), np.zeros(2), None, "bm25").matched
    assert Ranking(np.ones(2), np.array([0.0, 0.1]), None, "bm25").matched


def test_weighted_fusion_by_hand():
    from kvcli.retrieval.ranking import fuse, weighted

    lexical, semantic = np.array([0.0, 4.0, 2.0]), np.array([0.6, 0.2, 0.5])
    want = [0.3 * 0 + 0.7 * 0.6, 0.3 * 1 + 0.7 * 0.2, 0.3 * 0.5 + 0.7 * 0.5]
    assert weighted(lexical, semantic, 0.3).tolist() == pytest.approx(want)
    assert fuse(lexical, semantic, ("mix", 0.3)).tolist() == pytest.approx(want)
    assert weighted(np.zeros(3), semantic, 0.3).tolist() == pytest.approx((0.7 * semantic).tolist())
