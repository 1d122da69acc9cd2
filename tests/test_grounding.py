"""The answer's check (kvcli.answer.grounding): its tokens' log-probabilities with the document, as
decoding chose them, and without it, each against transformers' own forward; the score, the note,
and that checking never changes an answer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcli.answer import grounding as g
from kvcli.api import QuestionOptions, parse_pipeline
from kvcli.caches import KVCache
from kvcli.documents import document_from_text
from kvcli.report.record import result_record
from kvcli.runtime.engine import Engine
from tests.helpers.reference import hf_logits
from tests.helpers.runs import random_ids

TOL = 1e-4


def reference_logprobs(lm, context: list[int], answer: list[int]) -> torch.Tensor:
    """log p(answer[i] | context, answer[:i]) from one transformers pass over context + answer."""
    logits = hf_logits(lm, torch.tensor(context + answer))
    rows = torch.log_softmax(logits[len(context) - 1 : -1].float(), -1)
    return rows[torch.arange(len(answer)), torch.tensor(answer, device=rows.device)].cpu()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_decoding_records_each_chosen_tokens_logprob(tiny_lm, family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    ids = random_ids(30, seed=3)
    cache = KVCache()
    hidden = engine.forward(ids, torch.arange(30), cache)
    recorded: list[torch.Tensor] = []
    out = engine.decode(engine.logits(hidden)[-1], cache, 30, 6, set(), logprobs=recorded)
    assert len(out) == len(recorded) == 6
    ref = reference_logprobs(lm, ids.tolist(), out)
    got = torch.stack(recorded).cpu()
    assert torch.allclose(got, ref, atol=TOL) and bool((got <= 0).all())


def test_closed_book_prompt_holds_the_question_not_the_document(tiny_lm):
    tokenizer = tiny_lm("qwen2").tokenizer
    text = tokenizer.decode(g.closed_book_ids(tokenizer, "  How many gulls?  "))
    assert "Question: How many gulls?" in text and "document" not in text.lower()
    assert text.rstrip().endswith("assistant")  # the generation prompt: the answer comes next


def test_closed_book_logprobs_match_transformers(tiny_lm):
    lm = tiny_lm("qwen2")
    answer = random_ids(5, seed=4).tolist()
    got = g.closed_book_logprobs(Engine(lm), lm.tokenizer, "How many gulls?", answer)
    ref = reference_logprobs(lm, g.closed_book_ids(lm.tokenizer, "How many gulls?"), answer)
    assert torch.allclose(torch.tensor(got), ref, atol=TOL)


def test_score_is_the_mean_gain_and_the_note_follows_the_threshold(tiny_lm):
    lm = tiny_lm("qwen2")
    engine, answer = Engine(lm), random_ids(4, seed=5).tolist()
    without = g.closed_book_logprobs(engine, lm.tokenizer, "Q?", answer)
    with_doc = [w + gain for w, gain in zip(without, (0.0, 0.1, 0.2, 0.5))]
    found = g.grounding(engine, lm.tokenizer, "Q?", answer, with_doc, 0.1)
    assert found.score == pytest.approx(0.2, abs=1e-3) and found.grounded and found.note() is None
    under = g.grounding(engine, lm.tokenizer, "Q?", answer, with_doc, 0.3)
    assert not under.grounded and "may not come from the document" in under.note() and "0.20" in under.note()
    assert g.grounding(engine, lm.tokenizer, "Q?", [], [], 0.1) is None


def test_checking_never_changes_the_answer(embedded_session):
    doc = document_from_text("The new combination for the oil store padlock is 4-7-1-9. The keeper counts gulls.")
    q = "What is the combination for the oil store padlock?"
    unmeasured = embedded_session.ask(doc, q, parse_pipeline("full"), QuestionOptions(check=True))
    assert embedded_session.lm.check_threshold is None and unmeasured.grounding is None  # no threshold: not checked
    # the same model with a threshold, as a Qwen model's in models.json
    embedded_session = dataclasses.replace(
        embedded_session, lm=dataclasses.replace(embedded_session.lm, check_threshold=0.1)
    )
    checked = embedded_session.ask(doc, q, parse_pipeline("full"), QuestionOptions(check=True))
    plain = embedded_session.ask(doc, q, parse_pipeline("full"), QuestionOptions(check=False))
    assert checked.answer_ids == plain.answer_ids == unmeasured.answer_ids and plain.grounding is None
    assert checked.grounding is not None and checked.grounding.grounded  # copied from the document: a gain
    record = result_record(checked, embedded_session, parse_pipeline("full"), doc)
    assert record["grounding"] == checked.grounding.score and record["grounded"] is True
    forced = embedded_session.ask(
        doc, q, parse_pipeline("full"), QuestionOptions(check=True, force_tokens=True, max_new_tokens=4)
    )
    assert forced.grounding is None  # a benchmark's forced length is not an answer to check
