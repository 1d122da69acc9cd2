"""kvcli.cite.evidence: the answer's evidence over the passages a retrieving method read (each
against hand-computed shares), "no clear source" when it points to no passage read, and the sources
in the retrieval's order whatever the answer."""

from __future__ import annotations

import numpy as np
import pytest

from kvcli.answer.prompt import build_prompt
from kvcli.cite import evidence
from kvcli.cite.sources import sources_from_tokens
from tests.test_sources import paged, tokenizer  # noqa: F401  (the tokenizer fixture)

PAGES = [
    "The padlock of the oil store is described here. The padlock is brass and old.",
    "Keepers note the weather twice a day in the log book kept by the door.",
    "The padlock combination is 4-7-1-9 and only the head keeper knows it.",
]
QUESTION = "What is the padlock combination?"


def test_the_answers_own_terms_leave_the_questions_words_out_and_keep_its_numbers():
    stems, numbers = evidence.answer_terms("The combination is 4-7-1-9, said the head keeper.", QUESTION)
    assert "combin" not in stems and "padlock" not in stems  # the question's words retrieved the pages
    assert {"head", "keeper", "said"} <= stems and numbers == {"4-7-1-9"}
    assert evidence.answer_terms("4", QUESTION) == (set(), set())  # one digit: in every page
    assert evidence.words_share((stems, numbers), PAGES[2]) == pytest.approx(3 / 4)  # head, keeper, 4-7-1-9
    assert evidence.words_share((set(), set()), PAGES[2]) == 0.0


def test_weigh_gives_each_passage_its_shares():
    found = evidence.weigh(
        PAGES,
        [(1, 1), (2, 2), (3, 3)],
        np.array([4.0, 1.0, 2.0]),
        np.array([1.0, 1.0, 2.0]),
        evidence.answer_terms("4-7-1-9", QUESTION),
    )
    assert [e.retrieval for e in found] == [1.0, 0.25, 0.5]
    assert [e.attention for e in found] == [0.25, 0.25, 0.5]
    assert [e.words for e in found] == [0.0, 0.0, 1.0]


def test_no_clear_source_when_the_answers_words_and_attention_point_nowhere():
    places = [(1, 1), (2, 2), (3, 3)]

    def nowhere(answer, attention):
        terms = evidence.answer_terms(answer, QUESTION)
        return evidence.points_nowhere(evidence.weigh(PAGES, places, np.ones(3), np.array(attention), terms), terms)

    assert nowhere("9-9-9-9 by the lighthouse mechanic", [1.0, 1.0, 1.0])  # none of its terms read, attention spread
    assert not nowhere("9-9-9-9 by the lighthouse mechanic", [0.1, 0.1, 2.0])  # one page holds most of its attention
    assert not nowhere("4-7-1-9", [1.0, 1.0, 1.0])  # its number is on p. 3
    assert not nowhere("The padlock combination.", [1.0, 1.0, 1.0])  # no term of its own: nothing to miss
    assert evidence.points_nowhere([], evidence.answer_terms("4-7-1-9", QUESTION))


@pytest.mark.parametrize("answer", ["4-7-1-9", "twice a day, in the log book", ""])
def test_a_retrieving_methods_sources_come_in_the_retrievals_order(tokenizer, answer):  # noqa: F811
    """Three pages read, retrieval ranking p. 1, then p. 3, then p. 2: the sources come in that
    order whichever page the answer's words are on (its words and attention did not order them
    better, measured); they only decide "no clear source". One source per page, every page read."""
    document = paged(PAGES)
    prompt = build_prompt(tokenizer, document.text, QUESTION, page_starts=document.page_starts)
    assert len(prompt.passages) == 3
    tokens = np.ones(prompt.n_tokens)  # attention spread evenly
    retrieval = np.zeros(prompt.n_tokens)
    for p, score in zip(prompt.passages, [3.0, 2.0, 2.5]):
        retrieval[p.start : p.end] = score
    found = sources_from_tokens(document, prompt, tokens, question=QUESTION, passage_scores=retrieval, answer=answer)
    assert [s.first for s in found.items] == [1, 3, 2]
    shares = found.extra["evidence"]
    assert [e["pages"] for e in shares] == [[1, 1], [2, 2], [3, 3]]
    assert [e["retrieval"] for e in shares] == pytest.approx([1.0, 2 / 3, 5 / 6], abs=1e-4)

    assert found.clear  # the answer's terms are on a page read, or it has none
    lost = sources_from_tokens(
        document, prompt, tokens, question=QUESTION, passage_scores=retrieval, answer="5-5-5-5, the harbour master"
    )
    assert not lost.clear and lost.reason.startswith("no clear source")
    assert [s.first for s in lost.items] == [1, 3, 2]  # the retrieval's order still
