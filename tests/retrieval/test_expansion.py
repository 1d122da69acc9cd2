"""Query2doc (kvcli.retrieval.expansion): the passage the model writes is its greedy generation, as
transformers' own forward chooses it; the ranking reads the question expanded by it, while whether a
page matched stays the question's own verdict; ``pages:expand=N`` says what it wrote and what ranked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcli.documents import document_from_text
from kvcli.retrieval import bm25_scores, embed, vectors
from kvcli.retrieval import expansion as x
from kvcli.retrieval.ranking import rank_passages
from kvcli.runtime.engine import Engine
from kvcli.templates import stop_token_ids
from tests.helpers.reference import hf_logits

PASSAGES = [
    "The keeper's log begins with flour, lamp oil and two crates of tinned herring.",
    "The padlock combination of the oil store is 4417; the spare key hangs behind the door.",
    "The gale arrived from the south west and the fog signal stuck on cold mornings.",
]
QUESTION = "What opens the fuel shed's lock?"  # a user's words: not one stem of it is in the passages
WRITTEN = "The padlock combination of the oil store is written in the keeper's log."


def reference_greedy(lm, ids: list[int], tokens: int, stop: set[int]) -> list[int]:
    """Greedy tokens from one transformers pass per step over everything so far (no cache)."""
    out: list[int] = []
    for _ in range(tokens):
        nxt = int(hf_logits(lm, torch.tensor(ids + out))[-1].argmax())
        if nxt in stop:
            break
        out.append(nxt)
    return out


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_written_passage_is_the_models_greedy_generation(tiny_lm, family):
    lm = tiny_lm(family)
    stop = stop_token_ids(lm.tokenizer, lm.model.generation_config)
    head = x.head_words(PASSAGES)
    got = x.write_passage(Engine(lm), lm.tokenizer, stop, QUESTION, head, 6)
    want = reference_greedy(lm, x.prompt_ids(lm.tokenizer, QUESTION, head), 6, stop)
    assert got.n_tokens == len(want) and got.text == lm.tokenizer.decode(want, skip_special_tokens=True).strip()


def test_the_prompt_names_the_manual_by_its_first_words(tiny_lm):
    lm = tiny_lm("qwen2")
    assert x.head_words(["one two", "three four five"], 4) == "one two three four"
    text = lm.tokenizer.decode(x.prompt_ids(lm.tokenizer, QUESTION, "The keeper's log"))
    assert "A manual begins:\nThe keeper's log\n\n" in text and text.index("keeper") < text.index(QUESTION)


def test_the_queries_repeat_the_question_as_the_paper_does():
    lexical, dense = x.queries(QUESTION, WRITTEN)
    assert lexical == " ".join([QUESTION] * 5 + [WRITTEN]) and dense == f"{QUESTION} {WRITTEN}"
    assert x.queries(QUESTION, "  ") == (QUESTION, QUESTION)


def test_bm25_ranks_by_the_expanded_query_and_the_question_says_no_match(monkeypatch):
    monkeypatch.setenv(embed.ENV, "none")
    plain = rank_passages(PASSAGES, QUESTION)
    assert not plain.bm25.any() and not plain.matched and plain.signal == "bm25"
    got = rank_passages(PASSAGES, QUESTION, expansion=WRITTEN)
    want = bm25_scores(PASSAGES, " ".join([QUESTION] * 5 + [WRITTEN]), stem=True)
    assert got.bm25 == pytest.approx(want) and got.order[0] == 1 and got.signal == "bm25+query2doc"
    assert not got.matched  # the written passage's words are not the question's: no page matched it
    asked = rank_passages(PASSAGES, "Where is the padlock combination?", expansion=WRITTEN)
    assert asked.matched


def test_the_embedding_ranks_by_the_expanded_query_and_matches_by_the_question(tmp_path):
    got = rank_passages(PASSAGES, QUESTION, tmp_path, expansion=WRITTEN)
    model = embed.embedder(embed.setting())

    def best_windows(query: str) -> np.ndarray:  # each passage's best window, computed here
        q = model.encode_query(query)
        return np.array([max(model.encode(vectors.windows(p)) @ q) for p in PASSAGES])

    # the windows are embedded in other batches there (16-bit products where native): within 1e-3
    assert got.semantic == pytest.approx(best_windows(f"{QUESTION} {WRITTEN}"), abs=1e-3)
    assert got.verdict == pytest.approx(best_windows(QUESTION), abs=1e-3)
    assert abs(got.semantic - got.verdict).max() > 0.05  # two different queries' cosines
    assert got.matched == (got.verdict.max() >= got.no_match) and got.signal.endswith("+query2doc")


def test_pages_expand_says_what_the_model_wrote(tiny_dir, tmp_path, monkeypatch):
    from kvcli import api
    from kvcli.report.record import result_record

    monkeypatch.setenv(embed.ENV, "none")
    options = api.AskOptions(model=str(tiny_dir("qwen2")), use_cache=False, max_new_tokens=2, cache_dir=tmp_path)
    session = api.Session.open(options)
    document = document_from_text("\n\n".join(PASSAGES))
    pipeline = api.parse_pipeline("pages:pages=1,skim=0,expand=5")
    result = session.ask(document, QUESTION, pipeline)
    assert result.selection.ranked_by == "bm25+query2doc"
    assert isinstance(result.selection.expansion, str)
    record = result_record(result, session, pipeline, document)
    assert record["read"]["expansion"] == result.selection.expansion
    plain = session.ask(document, QUESTION, api.parse_pipeline("pages:pages=1,skim=0"))
    assert (
        plain.selection.expansion is None
        and "expansion" not in result_record(plain, session, pipeline, document)["read"]
    )


def test_the_reading_s_progress_counts_the_pages_read_not_the_passage_written(tiny_dir, tmp_path, monkeypatch):
    """The passage's own passes run before the pages are chosen: the progress the user sees counts
    the pages' reading alone, rising to 1 at its end (not at 1 from its first layer on)."""
    from kvcli import api

    monkeypatch.setenv(embed.ENV, "none")
    options = api.AskOptions(model=str(tiny_dir("qwen2")), use_cache=False, max_new_tokens=2, cache_dir=tmp_path)
    session = api.Session.open(options)
    seen: list[float] = []
    asked = api.QuestionOptions(on_progress=seen.append)
    session.ask(document_from_text("\n\n".join(PASSAGES)), QUESTION, api.parse_pipeline("pages:expand=8"), asked)
    assert seen and seen == sorted(seen) and seen.count(1.0) == 1 and seen[-1] == 1.0
