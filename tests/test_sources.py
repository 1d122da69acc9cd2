"""kvcli.cite.sources (units, token -> unit scores, ranked sources) and kvcli.cite.bm25, each against an
independent computation: brute force over characters, hand-computed numbers, bm25s (a test extra)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvcli.cite.sources import (
    MAX_SOURCE_UNITS,
    DocumentUnits,
    fused,
    rank,
    sources_from_tokens,
)
from kvcli.documents import Document, document_from_text
from kvcli.documents.units import split_units
from kvcli.retrieval.bm25 import bm25_scores, words


@pytest.fixture(scope="module")
def tokenizer(tiny_lm):
    return tiny_lm("llama").tokenizer  # SmolLM2's tokenizer and chat template


def paged(pages: list[str]) -> Document:
    text, starts = "", []
    for p in pages:
        starts.append(len(text))
        text += p + "\n\n"
    return Document(source="t.pdf", text=text, page_starts=tuple(starts), kind="pdf", sha256="0")


def texts(text: str, units) -> list[str]:
    return [text[u.start : u.end] for u in units]


def test_units_are_sentences_and_lines_never_across_a_page():
    doc = paged(
        [
            (
                "Title of the book\nThe default is 4095. It can be changed at any time with the\n"
                "option -n, which is long enough to wrap around the line.\nx = 1\n\nLast words here"
            ),
            "Second page starts mid-sentence and ends. Done!",
        ]
    )
    got = texts(doc.text, split_units(doc.text, doc.page_starts))
    assert got == [
        "Title of the book",
        "The default is 4095.",
        "It can be changed at any time with the\noption -n, which is long enough to wrap around the line.",
        "x = 1",
        "Last words here",
        "Second page starts mid-sentence and ends.",
        "Done!",
    ]


def test_dot_leaders_and_decimals_do_not_end_sentences():
    text = "1.2 Model objects . . . . . . . 6\nThe value 3.14159 is pi e.g. here."
    got = texts(text, split_units(text))
    assert got == ["1.2 Model objects . . . . . . . 6", "The value 3.14159 is pi e.g.", "here."]


def test_a_long_wrapped_sentence_is_cut_at_a_line_end():
    line = "word " * 15  # 75 characters, no sentence end: wrapped prose
    text = "\n".join([line.strip()] * 12)
    units = split_units(text)
    assert len(units) > 1
    assert all(text[u.end - 1] != "\n" and (u.end == len(text) or text[u.end] == "\n") for u in units)


def test_every_character_has_one_owner_and_it_is_the_unit_around_it():
    rng = random.Random(0)
    pieces = ["Alpha beta.", "gamma", "\n", "\n\n", " ", "Delta? ", "x" * 60, "end.\n", "3.5 items"]
    doc = paged(["".join(rng.choice(pieces) for _ in range(40)) for _ in range(3)])
    du = DocumentUnits.of(doc)
    owner = du.unit_of(np.arange(len(doc.text)))
    assert (np.diff(owner) >= 0).all() and owner[0] == 0 and owner[-1] == len(du) - 1
    for i, u in enumerate(du.units):  # a unit's own characters are its, and it stays on one page
        assert (owner[u.start : u.end] == i).all()
        assert doc.page_of(u.start) == doc.page_of(u.end - 1)
        assert doc.text[u.start : u.end].strip() == doc.text[u.start : u.end]


def test_unit_scores_sum_the_tokens_by_their_last_character():
    doc = document_from_text("One two. Three four five.\nSix\n")
    du = DocumentUnits.of(doc)
    assert texts(doc.text, du.units) == ["One two.", "Three four five.", "Six"]
    # tokens as a tokenizer gives them: a leading space belongs to the token
    words_at = [
        (m, m + len(w))
        for m, w in (
            (0, "One"),
            (3, " two"),
            (7, "."),
            (8, " Three"),
            (14, " four"),
            (19, " five"),
            (24, "."),
            (25, "\n"),
            (26, "Six"),
            (29, "\n"),
        )
    ]
    scores = np.arange(1.0, 11.0)
    scores[4] = np.nan  # " four" not read
    got, read = du.scores(words_at, scores)
    assert got.tolist() == [1 + 2 + 3, 4 + 6 + 7 + 8, 9 + 10]  # "\n" after "five." is its unit's
    assert read.tolist() == [True, True, True]
    _, read = du.scores(words_at, np.where(np.arange(10) < 3, 1.0, np.nan))
    assert read.tolist() == [True, False, False]


def test_rank_merges_adjacent_units_and_orders_by_score():
    doc = paged(["A one. B two. C three.", "D four. E five.", "F six."])
    du = DocumentUnits.of(doc)
    assert texts(doc.text, du.units) == ["A one.", "B two.", "C three.", "D four.", "E five.", "F six."]
    s = rank(du, np.array([0.1, 5.0, 4.0, 0.2, 3.0, 0.05]), top=2, clear_ratio=1.0)
    assert [(x.text, x.first, x.last, x.units) for x in s.items] == [
        ("B two. C three.", 1, 1, (1, 2)),
        ("E five.", 2, 2, (4,)),
    ]
    assert s.items[0].score == pytest.approx(9.0)
    assert s.items[0].to_json() == {"pages": [1, 1], "start": 7, "end": 22, "text": "B two. C three.", "score": 9.0}
    # across a page boundary the merged source spans both pages
    s = rank(du, np.array([0, 0, 3.0, 2.0, 0, 0]), top=1)
    assert (s.items[0].first, s.items[0].last, s.items[0].where()) == (1, 2, "pp. 1-2")


def test_rank_by_passage_opens_one_source_a_passage_in_the_passages_order():
    """groups: the best units of page 1 would make all three sources; one a page instead, and
    the pages in group_order's order (page 3 before page 1) whatever their units score."""
    doc = paged(["A one. B two. C three.", "D four. E five.", "F six."])
    du = DocumentUnits.of(doc)
    scores = np.array([5.0, 0.1, 4.0, 0.2, 0.3, 1.0])
    plain = rank(du, scores, top=3, clear_ratio=1.0)
    assert [x.first for x in plain.items] == [1, 1, 3]  # "A one." and "C three." (not adjacent) both open one
    groups = np.array([0, 0, 0, 1, 1, 2])
    order = np.array([2.0, 2.0, 2.0, 1.0, 1.0, 3.0])  # page 3 first, then 1, then 2
    s = rank(du, scores, top=3, clear_ratio=1.0, groups=groups, group_order=order)
    assert [(x.text, x.first) for x in s.items] == [("F six.", 3), ("A one.", 1), ("D four. E five.", 2)]


def test_rank_caps_a_source_and_says_when_nothing_stands_out():
    doc = document_from_text(" ".join(f"S{i} x." for i in range(12)))
    du = DocumentUnits.of(doc)
    flat = rank(du, np.ones(len(du)), top=3, clear_ratio=4.0)
    assert not flat.clear and flat.reason.startswith("no clear source") and flat.peak == pytest.approx(1.0)
    assert max(len(x.units) for x in flat.items) <= MAX_SOURCE_UNITS
    peaked = rank(du, np.where(np.arange(len(du)) == 5, 100.0, 1.0), top=3, clear_ratio=4.0)
    assert peaked.clear and peaked.items[0].units[0] <= 5 <= peaked.items[0].units[-1]
    none = rank(du, np.zeros(len(du)), read=np.zeros(len(du), dtype=bool))
    assert none.items == () and not none.clear and "kept nothing" in none.reason


def test_an_unpaged_document_cites_lines():
    doc = document_from_text("first line\nsecond line\nthe answer is 42.\nlast line")
    du = DocumentUnits.of(doc)
    s = rank(du, np.array([0.0, 0.0, 9.0, 0.0]), read=np.ones(4, dtype=bool), top=1)
    assert s.items[0].to_json()["lines"] == [3, 3] and "pages" not in s.items[0].to_json()
    assert s.items[0].where() == "line 3"


def test_sources_from_prompt_token_scores(tokenizer):
    from kvcli.answer.prompt import build_prompt

    doc = paged(["The cat sat on the mat.", "The default limit is 4095 bytes.", "Nothing else."])
    prompt = build_prompt(tokenizer, doc.text, "What is the default limit?")
    scores = np.zeros(prompt.n_tokens)
    for i in range(prompt.doc_start, prompt.doc_end):
        s, e = prompt.char_span(i)
        if "4095" in doc.text[max(0, s - 3) : e + 3]:  # the digits, one token each
            scores[i] = 1.0
    scores[: prompt.doc_start] = 50.0  # outside the document: never cited
    s = sources_from_tokens(doc, prompt, scores, top=3)
    assert s.items[0].text == "The default limit is 4095 bytes." and (s.items[0].first, s.items[0].last) == (2, 2)


def test_bm25_by_hand():
    passages = ["apple banana apple", "banana cherry", "cherry cherry cherry date"]
    # idf = ln(1 + (N - df + .5) / (df + .5)), N = 3; lengths 3, 2, 4 (avg 3)
    idf = {w: math.log(1 + (3 - df + 0.5) / (df + 0.5)) for w, df in {"apple": 1, "banana": 2, "cherry": 2}.items()}

    def term(w, tf, length):
        return idf[w] * tf / (tf + 1.5 * (1 - 0.75 + 0.75 * length / 3))

    want = [
        term("apple", 2, 3) + term("banana", 1, 3),
        term("banana", 1, 2) + term("cherry", 1, 2),
        term("cherry", 3, 4),
    ]
    got = bm25_scores(passages, "Apple and banana with the cherry?")  # "and", "with", "the": stop words
    assert got == pytest.approx(want)
    assert words("The X-ray of a cat") == ["ray", "cat"]


def test_bm25_matches_bm25s():
    """Lucene's BM25 as bm25s computes it (k1 1.5, b 0.75, its English stopwords), an independent
    implementation: a test extra (pyproject.toml), so this runs wherever the tests do."""
    import bm25s

    rng = random.Random(1)
    vocab = ["alpha", "beta", "gamma", "delta", "the", "of", "epsilon", "zeta", "eta", "theta"]
    corpus = [" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 30))) for _ in range(20)]
    query = "alpha theta of the zeta alpha unknownword"
    index = bm25s.BM25()
    index.index(bm25s.tokenize(corpus, stopwords="en", show_progress=False), show_progress=False)
    want = index.get_scores(bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0][:-1])
    assert bm25_scores(corpus, query) == pytest.approx(want.tolist(), rel=1e-5)


def test_fused_adds_the_questions_bm25_over_the_units_read():
    doc = document_from_text("Cats purr. The default limit is 4095 bytes. Dogs bark. Limit words here.")
    du = DocumentUnits.of(doc)
    attention = np.array([4.0, 1.0, 2.0, 0.0])
    read = np.array([True, True, True, False])  # the last unit was not read: never scored
    got = fused(du, attention, read, "What is the default limit?", 2.0)
    texts_read = [doc.text[u.start : u.end] for u, r in zip(du.units, read) if r]
    lexical = bm25_scores(texts_read, "What is the default limit?")
    want = [a / 4.0 + 2.0 * b / max(lexical) for a, b in zip(attention[:3], lexical)] + [0.0]
    assert got == pytest.approx(want) and int(np.argmax(got)) == 1
