"""The answer's check (kvcli.answer.grounding): its tokens' log-probabilities with the document, as
decoding chose them, and without it, each against transformers' own forward; the score, the note,
and that checking never changes an answer."""

from __future__ import annotations

import copy
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


def test_the_follow_up_turn_is_the_chat_templates_next_user_turn(tiny_lm):
    tokenizer = tiny_lm("qwen2").tokenizer
    turn = tokenizer.decode(g.follow_up_ids(tokenizer, "Is it so?"))
    assert turn == "<|im_end|>\n<|im_start|>user\nIs it so?<|im_end|>\n<|im_start|>assistant\n"


def answered(lm, n_answer: int = 5):
    """(engine, prompt ids, answer ids, cache): a prompt read and an answer decoded greedily on its
    KV, as a question leaves them (the last answer token not fed)."""
    engine, prompt = Engine(lm), random_ids(24, seed=6).tolist()
    cache = KVCache()
    hidden = engine.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache)
    answer = engine.decode(engine.logits(hidden)[-1], cache, len(prompt), n_answer, set())
    return engine, prompt, answer, cache


def test_the_asked_log_odds_are_transformers_next_token_odds_and_the_cache_comes_back(tiny_lm):
    lm = tiny_lm("qwen2")
    tok = lm.tokenizer
    engine, prompt, answer, cache = answered(lm)
    fed = cache.n_tokens - len(prompt)
    assert 0 < fed < len(answer) + 1
    keys = [layer.clone() for layer in cache.keys]
    got = g.asked_log_odds(engine, tok, cache, answer, len(prompt), "Is it so?")
    turn = g.follow_up_ids(tok, "Is it so?")
    lp = torch.log_softmax(hf_logits(lm, torch.tensor(prompt + answer + turn))[-1].float(), -1).cpu()
    yes = [tok("Yes", add_special_tokens=False)["input_ids"][0], tok("yes", add_special_tokens=False)["input_ids"][0]]
    no = [tok("No", add_special_tokens=False)["input_ids"][0], tok("no", add_special_tokens=False)["input_ids"][0]]
    ref = float(torch.logsumexp(lp[yes], 0) - torch.logsumexp(lp[no], 0))
    assert got == pytest.approx(ref, abs=1e-3)
    assert cache.n_tokens == len(prompt) + fed and all(torch.equal(a, b) for a, b in zip(cache.keys, keys))


def test_the_asked_question_notes_an_answer_the_gain_passes(tiny_lm):
    lm = tiny_lm("qwen2")
    engine, prompt, answer, cache = answered(lm)
    with_doc = [w + 1.0 for w in g.closed_book_logprobs(engine, lm.tokenizer, "Q?", answer)]  # a gain of 1 nat
    odds = g.asked_log_odds(engine, lm.tokenizer, cache, answer, len(prompt), "Is it so?")
    for under, grounded in ((odds - 1, True), (odds + 1, False)):
        found = g.grounding(engine, lm.tokenizer, "Q?", answer, with_doc, 0.1, ("Is it so?", under), cache, len(prompt))
        assert found.score == pytest.approx(1.0, abs=1e-3) and found.asked == pytest.approx(odds, abs=1e-4)
        assert found.grounded is grounded and (found.note() is None) is grounded
    assert "unsure" in found.note() and f"{odds:.2f}" in found.note()
    plain = g.grounding(engine, lm.tokenizer, "Q?", answer, with_doc, 0.1)  # no question: not asked
    assert plain.asked is None and plain.grounded
    gained = g.grounding(engine, lm.tokenizer, "Q?", answer, with_doc, 2.0, ("Is it so?", odds - 1), cache, len(prompt))
    assert gained.asked is None and not gained.grounded and "readily without it" in gained.note()  # noted: not asked


def test_nothing_is_asked_of_a_model_without_a_chat_template_or_a_cache_that_cannot_be_cut_back(tiny_lm):
    qwen = tiny_lm("qwen2")
    engine, prompt, answer, cache = answered(qwen)
    completion = copy.copy(qwen.tokenizer)
    completion.chat_template = None  # a model without a chat template: kvcli's completion prompt
    assert g.follow_up_ids(completion, "Is it so?") is None
    assert g.asked_log_odds(engine, completion, cache, answer, len(prompt), "Is it so?") is None
    assert g.asked_log_odds(engine, qwen.tokenizer, cache, answer, len(prompt), "Is it so?") is not None
    cache.__class__ = type("Fixed", (KVCache,), {"truncatable": False})  # the same KV, a layout that cannot cut
    assert g.asked_log_odds(engine, qwen.tokenizer, cache, answer, len(prompt), "Is it so?") is None
    assert g.asked_log_odds(engine, qwen.tokenizer, None, answer, len(prompt), "Is it so?") is None
