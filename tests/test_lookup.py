"""Drafts from the text read, checked a pass at a time (kvcli.runtime.lookup): greedy decoding's own
tokens, log-probabilities, cache and sources, whatever the drafts were; the drafts themselves
against a plain search of the text."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer import pipeline as answering
from kvcli.cite.attribution import CitingHeads, HeadWeights
from kvcli.compressors.base import REGISTRY
from kvcli.runtime.attention import listening
from kvcli.runtime.engine import Engine
from kvcli.runtime.lookup import NGRAMS, PromptLookup, usable
from tests.helpers.runs import configured, prompt_for, random_ids
from tests.helpers.specs import COMPRESSING

N_PROMPT, STEPS = 40, 24


def latest_continuation(seq: list[int], room: int) -> list[int]:
    """The reference: for n in NGRAMS, longest first, the tokens after the latest earlier window equal
    to the last n, by a plain scan."""
    for n in NGRAMS:
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + room]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_a_draft_is_what_followed_the_latest_occurrence_of_the_answers_tail(seed):
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(0, 6, (60,), generator=g)  # a small alphabet: many repeats
    answer = torch.randint(0, 6, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
    lookup = PromptLookup(source, max_draft=5)
    for room in (0, 3, 9):
        assert lookup.propose(answer, room) == latest_continuation(source.tolist() + answer, min(room, 5))


def test_no_draft_where_the_tail_never_occurred_before():
    assert PromptLookup(torch.tensor([1, 2, 3, 4]), 8).propose([7, 8, 9], 8) == []
    assert PromptLookup(torch.tensor([5, 7, 8]), 8).propose([7, 8], 8) == [7, 8]  # the 2-gram (7, 8) at 1
    assert PromptLookup(torch.tensor([7, 8, 9, 1, 7, 8, 9, 2]), 8).propose([7, 8, 9], 8) == [2, 7, 8, 9]


def decode(engine, ids, source, max_draft, cite=None, steps=STEPS, stop=frozenset()):
    cache, logits = engine.prefill(ids)
    lookup = None if source is None else PromptLookup(source, max_draft)
    logprobs: list[torch.Tensor] = []
    reader = None if cite is None else CitingHeads(cite, ids.numel(), cache)
    with listening({} if reader is None else reader.observers()):
        out = engine.decode(logits, cache, ids.numel(), steps, set(stop), logprobs=logprobs, drafts=lookup)
    scores = None if reader is None else reader.prompt_scores(ids.numel())
    return out, torch.stack(logprobs), cache, lookup, scores


@pytest.fixture(scope="module")
def engine(tiny_lm):
    return Engine(tiny_lm("llama"))  # its greedy answers vary (the tiny Qwen2's repeat one token)


@pytest.fixture(scope="module")
def plain(engine):
    """Step by step: the tokens, log-probabilities and cache every drafted run must reproduce."""
    return decode(engine, random_ids(N_PROMPT, seed=3), None, 0)


def drafting_sources(answer: list[int]) -> dict[str, torch.Tensor]:
    """Texts to draft from: the answer itself (every draft taken), the answer with every fifth token
    changed (drafts taken in part, then refused), and noise (drafts refused at once)."""
    spoiled = [t if i % 5 != 3 else (t + 1) % 100 for i, t in enumerate(answer)]
    return {
        "answer": torch.tensor(answer),
        "spoiled": torch.tensor(spoiled * 2),
        "noise": random_ids(200, seed=11),
    }


@pytest.mark.parametrize("source", ["answer", "spoiled", "noise"])
@pytest.mark.parametrize("max_draft", [1, 3, 8])
def test_drafted_decoding_chooses_the_same_tokens_and_leaves_the_same_cache(engine, plain, source, max_draft):
    want, want_lp, want_cache, _, _ = plain
    text = drafting_sources(want)[source]
    got, got_lp, cache, lookup, _ = decode(engine, random_ids(N_PROMPT, seed=3), text, max_draft)
    assert got == want
    torch.testing.assert_close(got_lp, want_lp, atol=1e-4, rtol=1e-4)
    # the cache holds the prompt and the answer's fed tokens, nothing drafted past them
    assert cache.positions.tolist() == want_cache.positions.tolist()
    for k, want_k in zip(cache.keys + cache.values, want_cache.keys + want_cache.values):
        torch.testing.assert_close(k, want_k, atol=1e-4, rtol=1e-4)
    if source == "answer":  # the answer drafts itself: nearly every token comes from a pass's rows
        assert lookup.taken >= (STEPS - 3) * max_draft // (max_draft + 1) - 2
    if source == "spoiled" and max_draft > 1:  # some taken, some refused
        assert 0 < lookup.taken < lookup.drafted


def test_the_rows_taken_back_are_written_over_in_place(engine, plain):
    """A refused draft's rows are taken back and the next pass writes over them: the layer's buffer
    is not copied (its storage stays the same) while the answer grows within its room."""
    text = drafting_sources(plain[0])["spoiled"]
    cache, logits = engine.prefill(random_ids(N_PROMPT, seed=3))
    engine.decode(logits, cache, N_PROMPT, 2, set())  # the first appends move the layers to buffers with room
    before = [k.untyped_storage().data_ptr() for k in cache.keys]
    lookup = PromptLookup(text, 3)
    engine.decode(engine.step(plain[0][1], N_PROMPT + 1, cache), cache, N_PROMPT + 2, 12, set(), drafts=lookup)
    assert lookup.taken < lookup.drafted  # some rows were taken back
    assert [k.untyped_storage().data_ptr() for k in cache.keys] == before


def test_a_stop_token_ends_the_answer_as_step_by_step(engine, plain):
    want = plain[0]
    stop = want[9]
    first = want.index(stop)
    got, _, cache, _, _ = decode(engine, random_ids(N_PROMPT, seed=3), torch.tensor(want), 8, stop={stop})
    assert got == want[:first]
    assert cache.n_tokens <= N_PROMPT + first  # the stop token's own row, drafted or not, is not kept


def test_the_sources_are_those_step_by_step(engine, plain, tiny_lm):
    lm = tiny_lm("llama")
    config = lm.model.config
    cite = HeadWeights.uniform(config.num_hidden_layers, config.num_attention_heads, [1, 3], "test")
    ids = random_ids(N_PROMPT, seed=3)
    *_, want = decode(engine, ids, None, 0, cite=cite)
    for source in ("answer", "spoiled", "noise"):
        *_, lookup, got = decode(engine, ids, drafting_sources(plain[0])[source], 4, cite=cite)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, equal_nan=True)


def test_where_drafts_are_not_checked(engine, tiny_lm):
    from kvcli.caches import KVCache, QuantKVCache

    assert usable(engine, KVCache()) is None
    assert "cannot take rows back" in usable(engine, QuantKVCache(8))
    hybrid = Engine(tiny_lm("gemma3"))
    assert "sliding" in usable(hybrid, KVCache())


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_method_answers_the_same_with_drafts(name, tiny_lm, isolated_cache_dir, monkeypatch):
    """Through the whole pipeline, each method compressing: the answer's tokens and log-probabilities
    with drafts (from the answer itself, spoiled: taken and refused) equal those step by step; a
    method whose decoding cannot check them (its own step, a layout that cannot take rows back)
    decodes step by step."""
    lm = tiny_lm("llama")
    prompt = prompt_for(lm)

    def answer(lookup: int, text=None):
        if text is not None:  # the drafts' text: the reference answer, spoiled, whatever the method read
            monkeypatch.setattr(answering, "PromptLookup", lambda _kept, n: PromptLookup(text, n))
        pipeline = configured(COMPRESSING[name], lm, isolated_cache_dir)
        result = answering.run(
            Engine(lm), prompt, pipeline, max_new_tokens=16, stop_ids=set(), logprobs=True, lookup=lookup
        )
        return result.answer_ids, torch.tensor(result.answer_logprobs), result.extra.get("lookup")

    want, want_lp, none = answer(0)
    assert none is None
    got, got_lp, stats = answer(3, drafting_sources(want)["spoiled"])
    assert got == want
    torch.testing.assert_close(got_lp, want_lp, atol=1e-4, rtol=1e-4)
    if name in ("full", "snapkv", "streamingllm", "h2o"):  # the plain layout, evicted or not: drafts checked
        assert stats["lookup_taken"] > 0 and stats["lookup_drafted"] > stats["lookup_taken"]
