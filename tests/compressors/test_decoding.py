"""Compression during decoding (kvpress's DecodingPress): never compressing equals full attention;
every ``interval`` steps each KV head keeps the scorer's best ``budget`` entries — checked against
norms / attention recomputed independently (the HF model's q/k for the decoded sequence)."""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.caches import KVCache
from kvcli.compressors import parse_one
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from tests.helpers.reference import assert_same_logits, causal_softmax, reference_qk
from tests.helpers.runs import prompt_for


def decoding_for(lm, spec):
    method = parse_one(spec)
    method.configure(lm)
    return method


def steps(engine, method, prompt, n_steps, cache=None, first=None):
    """Prefill (unless given), then ``n_steps`` greedy decoding steps through ``method``; returns the
    cache, the logits of every step (the first from the prefill) and the tokens fed."""
    if cache is None:
        cache, first = engine.prefill(prompt.ids)
    logits, tokens = [first], []
    for i in range(n_steps):
        tokens.append(int(torch.argmax(logits[-1])))
        logits.append(method.decode_step(engine, tokens[-1], prompt.n_tokens + i, cache))
    return cache, logits, tokens


def test_spec_round_trip_and_errors():
    assert parse_one("decoding").spec() == "decoding:base=knorm:window=32,budget=1024,interval=64,buffer=256"
    spec = "decoding:base=snapkv:window=8;kernel=1,budget=0.5,interval=4,buffer=16"
    assert parse_one(parse_one(spec).spec()).spec() == parse_one(spec).spec()
    for spec, message in [
        ("decoding:interval=0", "interval must be at least 1"),
        ("decoding:buffer=0", "buffer must be at least 1"),
        ("decoding:base=h2o", "base must be an eviction scorer"),
        ("decoding:base=snapkv,budget=8", "smaller than the 32 tokens snapkv always keeps"),
        ("decoding:budget=-1", "token count"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_one(spec)
    with pytest.raises(UsageError, match="both own the decode_step"):
        Pipeline.parse("blocksparse+decoding")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("base", ["snapkv:window=4", "knorm:window=2"])
def test_never_compressing_reproduces_full_attention(tiny_lm, family, base):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    method = decoding_for(lm, f"decoding:base={base},budget={prompt.n_tokens + 10},interval=2")
    _, got, _ = steps(engine, method, prompt, 6)
    full = parse_one(f"decoding:base={base},budget={prompt.n_tokens + 10},interval=1000")
    _, want, _ = steps(engine, full, prompt, 6)
    ref_cache, first = engine.prefill(prompt.ids)
    plain = [first]
    for i in range(6):
        plain.append(engine.step(int(torch.argmax(plain[-1])), prompt.n_tokens + i, ref_cache))
    assert_same_logits(got, plain)
    assert_same_logits(want, plain)
    ref = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=6, stop_ids=set())
    assert (
        run(
            engine,
            prompt,
            Pipeline.parse(f"decoding:base={base},budget=1024,interval=2"),
            max_new_tokens=6,
            stop_ids=set(),
        ).answer_ids
        == ref.answer_ids
    )


def test_knorm_keeps_the_lowest_norms_of_the_grown_cache(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n, budget, window = prompt.n_tokens, 50, 2
    method = decoding_for(lm, f"decoding:base=knorm:window={window},budget={budget},interval=3")
    cache, _, tokens = steps(engine, method, prompt, 2)  # not yet compressed
    assert cache.kept is None and cache.seq_len(0) == n + 2
    method.decode_step(engine, 7, n + 2, cache)  # third step: appends, then compresses
    # the keys of prompt + the 3 fed tokens, from HF's own forward (one copy of each KV head)
    group = lm.n_heads // lm.n_kv_heads
    ids = torch.cat([prompt.ids, torch.tensor(tokens + [7])])
    before = [k[:, ::group] for _, k, _ in reference_qk(lm, ids)]
    for l in range(lm.n_layers):
        assert cache.seq_len(l) == budget
        for h in range(lm.n_kv_heads):
            norms = before[l][0, h].norm(dim=-1)[: n + 3 - window]  # entries before the window
            kept = cache.kept[l][h].tolist()
            assert kept[-window:] == list(range(n + 3 - window, n + 3))
            chosen = torch.zeros(n + 3 - window, dtype=torch.bool, device=norms.device)
            chosen[kept[:-window]] = True  # the lowest norms (ties — zero keys — either way)
            assert int(chosen.sum()) == budget - window and norms[chosen].max() <= norms[~chosen].min() + 1e-6
    # and decoding goes on: 3 more steps, another compression
    method.decode_step(engine, 8, n + 3, cache)
    method.decode_step(engine, 9, n + 4, cache)
    assert cache.seq_len(0) == budget + 2
    method.decode_step(engine, 10, n + 5, cache)
    assert [cache.seq_len(l) for l in range(lm.n_layers)] == [budget] * lm.n_layers
    assert all(row[-1] == n + 5 for kept in cache.kept for row in kept.tolist())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_snapkv_votes_with_the_decoded_queries(tiny_lm, family):
    """The first compression, after 4 steps of full attention: SnapKV's window = the last 3
    decoded tokens' queries; reference from HF's own q/k over prompt + the 4 decoded tokens."""
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n, budget, window = prompt.n_tokens, 40, 3
    method = decoding_for(lm, f"decoding:base=snapkv:window={window};kernel=1,budget={budget},interval=4")
    cache, _, tokens = steps(engine, method, prompt, 4)
    seq = torch.cat([prompt.ids, torch.tensor(tokens)])
    total = n + 4
    for l, (q, k, attn) in enumerate(reference_qk(lm, seq)):
        probs = causal_softmax(q, k, 1 / math.sqrt(attn.head_dim))[0]
        votes = probs[:, -window:, : total - window].sum(dim=1).view(lm.n_kv_heads, -1, total - window).mean(dim=1)
        for h in range(lm.n_kv_heads):
            kept = cache.kept[l][h].tolist()
            assert kept[-window:] == list(range(total - window, total)) and len(kept) == budget
            chosen = torch.zeros(total - window, dtype=torch.bool, device=votes.device)
            chosen[kept[:-window]] = True
            assert votes[h][chosen].min() >= votes[h][~chosen].max() - 1e-6


def test_streamingllm_base_rolls_the_window(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n = prompt.n_tokens
    method = decoding_for(lm, "decoding:base=streamingllm:sinks=4,budget=20,interval=2")
    cache, _, _ = steps(engine, method, prompt, 6)
    want = list(range(4)) + list(range(n + 6 - 16, n + 6))
    assert all(row == want for kept in cache.kept for row in kept.tolist())


def test_after_a_prefill_eviction_and_in_the_pipeline(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    spec = "snapkv:budget=40,window=8+decoding:base=snapkv:window=4,budget=30,interval=3"
    result = run(engine, prompt, Pipeline.parse(spec), max_new_tokens=7, stop_ids=set())
    cache = result.cache
    assert len(result.answer_ids) == 7 and isinstance(cache, KVCache)
    # 6 decoding steps: compressions after steps 3 and 6; every kept position is a real token's
    assert [cache.seq_len(l) for l in range(lm.n_layers)] == [30] * lm.n_layers
    assert all(0 <= p < prompt.n_tokens + 6 for kept in cache.kept for p in kept.flatten().tolist())
    mask = result.kept_mask()  # what inspect reads: the prompt entries still held
    assert mask.shape == (lm.n_layers, lm.n_kv_heads, prompt.n_tokens) and (mask.sum(dim=-1) < 30).all()


@pytest.mark.parametrize("spec", ["adakv:budget=40,base=snapkv:window=8", "expectedattention:budget=40"])
def test_other_cache_layouts_are_refused(tiny_lm, spec):
    lm = tiny_lm("qwen2")
    with pytest.raises(UsageError, match="compresses a plain KV cache while decoding"):
        run(Engine(lm), prompt_for(lm), Pipeline.parse(f"{spec}+decoding:budget=32"), max_new_tokens=3, stop_ids=set())
