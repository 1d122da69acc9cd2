"""AdaKV and the ragged cache: head-adaptive budgets over a base scorer. Keeping everything equals
full attention; padding slots are ignored exactly (garbage in them changes nothing); the ragged
attention equals a per-head softmax written by hand; the selection is the paper's allocation,
checked against a naive reimplementation on the Hugging Face model's attention."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.caches import KVCache, RaggedCache
from kvcli.compressors import parse_one
from kvcli.errors import UsageError
from kvcli.runtime.attention import AttentionContext, attention_context, kvcli_attention
from kvcli.runtime.engine import Engine
from tests.helpers.reference import assert_same_logits, causal_softmax, reference_qk
from tests.helpers.runs import decode_logits, prefill_and_compress, prompt_for

TOL = 1e-4


# --- specs -----------------------------------------------------------------------------------------


def test_spec_round_trip_and_errors():
    ada = parse_one("adakv")
    assert ada.spec() == "adakv:budget=1024,base=snapkv:window=32;kernel=7;pool=max,safeguard=0.2"
    spec = "adakv:budget=0.25,base=pyramidkv:window=8;beta=10,safeguard=0.1"
    assert (
        parse_one(spec).spec() == "adakv:budget=0.25,base=pyramidkv:window=8;kernel=7;pool=max;beta=10.0,safeguard=0.1"
    )
    assert parse_one(parse_one(spec).spec()).spec() == parse_one(spec).spec()
    assert parse_one("adakv:base=knorm:window=4,budget=16").scorer.window == 4
    for spec, message in [
        ("adakv:base=h2o", "base must be an eviction scorer"),
        ("adakv:base=gemfilter", "base must be an eviction scorer"),
        ("adakv:base=adakv", "cannot be adakv itself"),
        ("adakv:base=snapkv:budget=64", "set the budget on adakv"),
        ("adakv:base=snapkv:window=0", "window must be at least 1"),
        ("adakv:base=nope", "unknown compressor"),
        ("adakv:safeguard=1.5", "between 0 and 1"),
        ("adakv:budget=16", "smaller than the 32 tokens"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_one(spec)


# --- keeping everything == full attention; padding is ignored exactly ------------------------------


def padded_with_garbage(kv: KVCache, extra: list[int]) -> RaggedCache:
    """Every entry of ``kv`` kept, then ``extra[l]`` padding slots per layer filled with large random
    keys and values (a leak of even one of them into the softmax would show in the logits)."""
    everything = [torch.ones(k.shape[1], k.shape[2], dtype=torch.bool, device=k.device) for k in kv.keys]
    rag = RaggedCache.from_selection(kv, everything)
    gen = torch.Generator().manual_seed(0)  # on the CPU: the same junk on every device
    for l, g in enumerate(extra):
        k = rag.keys[l]
        junk = (50 * torch.randn(1, k.shape[1], g, k.shape[3], generator=gen)).to(k.device, k.dtype)
        rag.keys[l] = torch.cat([k, junk], dim=2)
        rag.values[l] = torch.cat([rag.values[l], -junk], dim=2)
        kept = rag.kept[l]
        rag.kept[l] = torch.cat([kept, torch.full((k.shape[1], g), -1, dtype=kept.dtype, device=kept.device)], dim=1)
    return rag


@pytest.mark.parametrize("family, attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen2", "eager")])
def test_padding_slots_are_ignored_exactly(tiny_lm, family, attn):
    lm = tiny_lm(family, attn=attn)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    prefix = prompt.ids[: prompt.prefix_len]
    rag = padded_with_garbage(engine.prefix_kv(prefix), [3, 0, 7, 1])
    assert [rag.padded(l) for l in range(4)] == [True, False, True, True]
    # the question on top of the padded prefix, then 5 greedy steps == full attention
    cache, first = engine.prefill(prompt.ids[prompt.prefix_len :], cache=rag)
    got = decode_logits(engine, cache, first, prompt.n_tokens)
    full_cache, full_first = engine.prefill(prompt.ids)
    assert_same_logits(got, decode_logits(engine, full_cache, full_first, prompt.n_tokens))
    assert cache.kept_mask(prompt.n_tokens).all()


# --- the ragged attention, by hand -------------------------------------------------------------------


def ragged(tiny_lm, family="qwen2", spec="adakv:budget=30,base=snapkv:window=4;kernel=1,safeguard=0.2"):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    cache, _ = prefill_and_compress(engine, prompt.ids, spec)
    return lm, engine, prompt, cache


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_ragged_attention_is_a_per_head_softmax(tiny_lm, kernel):
    lm, engine, prompt, cache = ragged(tiny_lm)
    assert isinstance(cache, RaggedCache)
    full, _ = engine.prefill(prompt.ids)
    group = lm.n_heads // lm.n_kv_heads
    torch.manual_seed(0)
    for layer in range(lm.n_layers):
        lengths = cache.lengths[layer].tolist()
        assert sum(lengths) == 30 * lm.n_kv_heads
        new_k = torch.randn(1, lm.n_kv_heads, 3, lm.head_dim).to(lm.device)  # drawn on the CPU: the same on any device
        new_v = torch.randn(1, lm.n_kv_heads, 3, lm.head_dim).to(lm.device)
        grown = cache.copy()
        key, value = grown.update(new_k, new_v, layer)
        query = torch.randn(1, lm.n_heads, 3, lm.head_dim).to(lm.device)
        with attention_context(AttentionContext(kernel=kernel)):
            out, _ = kvcli_attention(types.SimpleNamespace(layer_idx=layer), query, key, value, None, scaling=0.25)
        for h in range(lm.n_heads):
            g = h // group
            kept = cache.kept[layer][g][: lengths[g]]
            ks = torch.cat([full.keys[layer][0, g, kept], new_k[0, g]]).double()
            vs = torch.cat([full.values[layer][0, g, kept], new_v[0, g]]).double()
            for row in range(3):
                visible = len(kept) + row + 1  # the new tokens attend causally among themselves
                w = torch.softmax(0.25 * ks[:visible] @ query[0, h, row].double(), dim=0)
                torch.testing.assert_close(out[0, row, h].double(), w @ vs[:visible], atol=1e-5, rtol=0)
    assert any(len(set(l.tolist())) > 1 for l in cache.lengths)  # heads really hold different counts


# --- the selection is AdaKV's allocation -----------------------------------------------------------


def naive_adakv(scores: torch.Tensor, k: int, safeguard: float) -> list[set[int]]:
    """Algorithm 1 with the safeguard, one entry at a time: every head's floor(safeguard*k) best are
    forced; then the best of all heads' scores flattened until the layer holds k * n_kv."""
    n_kv, n = scores.shape
    safe = math.floor(safeguard * k)
    kept = [set(sorted(range(n), key=lambda j: -float(scores[h, j]))[:safe]) for h in range(n_kv)]
    rest = sorted(
        ((float(scores[h, j]), h, j) for h in range(n_kv) for j in range(n) if j not in kept[h]), reverse=True
    )
    for _, h, j in rest[: k * n_kv - sum(len(s) for s in kept)]:
        kept[h].add(j)
    return kept


def assert_same_choice(got: list[set[int]], want: list[set[int]], scores: torch.Tensor, safe: int, tol=1e-5):
    """``got`` is an AdaKV allocation of ``scores`` (n_kv, n): every head holds its ``safe`` best
    (any entry scoring above its safe-th best by ``tol`` is kept), and the entries beyond those
    forced ones are the best of every head's remaining scores flattened (the least kept of them
    scores at least the best one left out, within ``tol``); as many as ``want`` holds in all.
    Ties within ``tol`` may break either way; nothing else may differ."""
    n_kv, n = scores.shape
    assert sum(map(len, got)) == sum(map(len, want))
    forced = [set(sorted(range(n), key=lambda j: -float(scores[h, j]))[:safe]) for h in range(n_kv)]
    for h in range(n_kv):
        assert len(got[h]) >= safe, h
        if safe:
            floor = min(float(scores[h, j]) for j in forced[h])
            assert all(j in got[h] for j in range(n) if float(scores[h, j]) > floor + tol), (
                h,
                "a forced entry is missing",
            )
    chosen = [float(scores[h, j]) for h in range(n_kv) for j in got[h] - forced[h]]
    left = [float(scores[h, j]) for h in range(n_kv) for j in range(n) if j not in got[h]]
    if chosen and left:
        assert min(chosen) >= max(left) - tol, (min(chosen), max(left))


# PyramidKV's budgets (Cai et al. 2024, section 3) for 4 layers, budget 30, window 4 (kept in every
# layer; a = 26 selected on average), beta 20: top a / 20 = 1.3, bottom 2a - 1.3 = 50.7, arithmetic
# in between: 50.7, 34.23, 17.77, 1.3 -> 51, 34, 18, 1 (total 4 x 26; largest remainders up) + 4.
PYRAMID_4_LAYERS_30_4 = [55, 38, 22, 5]


@pytest.mark.parametrize(
    "family, base, budget, safeguard",
    [("qwen2", "snapkv", 30, 0.3), ("llama", "snapkv", 24, 0.8), ("qwen2", "pyramidkv", 30, 0.8)],
)
def test_selection_is_adakvs_allocation(tiny_lm, family, base, budget, safeguard):
    """(A safeguard of 0.8 binds on these prompts: without it the selection differs.)"""
    window = 4
    spec = f"adakv:budget={budget},base={base}:window={window};kernel=1,safeguard={safeguard}"
    lm, engine, prompt, cache = ragged(tiny_lm, family, spec)
    n = prompt.n_tokens
    budgets = [budget] * lm.n_layers if base == "snapkv" else PYRAMID_4_LAYERS_30_4
    assert lm.n_layers == 4
    for l, (q, k, attn) in enumerate(reference_qk(lm, prompt.ids)):
        probs = causal_softmax(q, k, 1 / math.sqrt(attn.head_dim))[0]  # (n_heads, n, n)
        votes = probs[:, -window:, :].sum(dim=1).view(lm.n_kv_heads, -1, n).mean(dim=1)  # SnapKV, no pooling
        votes[:, n - window :] = float("inf")  # the observation window, kept by every head
        want = naive_adakv(votes, budgets[l], safeguard)
        got = [set(cache.kept[l][h][: int(cache.lengths[l][h])].tolist()) for h in range(lm.n_kv_heads)]
        assert sum(map(len, got)) == budgets[l] * lm.n_kv_heads
        assert all(set(range(n - window, n)) <= s for s in got)
        assert all(len(s) >= math.floor(safeguard * budgets[l]) for s in got)
        assert_same_choice(got, want, votes, math.floor(safeguard * budgets[l]))


def test_a_concentrated_head_gives_its_room_to_a_spread_one():
    """By hand: head 0 puts all its score on one token, head 1 spreads it. Uniform top-4 keeps 3
    near-zero entries in head 0; AdaKV (safeguard 1 entry per head) moves them to head 1."""
    from kvcli.compressors.scoring import adaptive_mask, top_mask

    scores = torch.tensor(
        [
            [5.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09],
            [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1],
        ]
    )
    ada, uni = adaptive_mask(scores, 4, 0.25), top_mask(scores, 4)
    assert ada[0].nonzero().flatten().tolist() == [0]
    assert ada[1].nonzero().flatten().tolist() == list(range(7))
    assert uni.sum(-1).tolist() == [4, 4]
    assert float((scores * ada).sum()) == pytest.approx(9.9) and float((scores * uni).sum()) == pytest.approx(8.64)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_adakv_never_keeps_less_vote_mass_than_snapkv(tiny_lm, family):
    """At the same budget AdaKV keeps, per layer, at least the SnapKV vote mass that SnapKV keeps
    (uniform top-k is one of the splits AdaKV chooses the best of; the safeguard is inside every
    head's top-k), votes recomputed from the Hugging Face model's attention."""
    window, budget = 4, 24
    lm, engine, prompt, ada = ragged(
        tiny_lm, family, f"adakv:budget={budget},base=snapkv:window={window};kernel=1,safeguard=0.2"
    )
    snap, _ = prefill_and_compress(engine, prompt.ids, f"snapkv:budget={budget},window={window},kernel=1")
    n = prompt.n_tokens
    gained = 0.0
    for l, (q, k, attn) in enumerate(reference_qk(lm, prompt.ids)):
        probs = causal_softmax(q, k, 1 / math.sqrt(attn.head_dim))[0]
        votes = probs[:, -window:, : n - window].sum(dim=1).view(lm.n_kv_heads, -1, n - window).mean(dim=1)
        mass = lambda kept: sum(
            float(votes[h, [j for j in kept[h] if j < n - window]].sum()) for h in range(lm.n_kv_heads)
        )
        got = mass([cache_row[: int(ada.lengths[l][h])].tolist() for h, cache_row in enumerate(ada.kept[l])])
        want = mass([snap.kept[l][h].tolist() for h in range(lm.n_kv_heads)])
        assert got >= want - 1e-5
        gained += got - want
    assert gained > 0  # and it does move entries on this prompt


# --- the pipeline: answers, inspect, stats, the store ------------------------------------------------


def test_pipeline_answers_and_reports_what_each_head_kept(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    spec = "adakv:budget=0.2,base=snapkv:window=8"
    result = run(engine, prompt, Pipeline.parse(spec), max_new_tokens=4, stop_ids=set())
    assert len(result.answer_ids) == 4 and isinstance(result.cache, RaggedCache)
    k = round(0.2 * prompt.n_tokens)
    mask = result.kept_mask()  # what inspect reads: each head's entries + the 3 decoded tokens
    assert mask.shape == (lm.n_layers, lm.n_kv_heads, prompt.n_tokens)
    for l in range(lm.n_layers):
        assert mask[l].sum(dim=-1).tolist() == result.cache.lengths[l].tolist()
        assert int(mask[l].sum()) == k * lm.n_kv_heads
    stats = result.extra["method_stats"]
    assert stats["kv_entries"] == lm.n_layers * (k * lm.n_kv_heads + 3 * lm.n_kv_heads)
    assert stats["kv_slots"] >= stats["kv_entries"] and stats["head_entries_min"] < stats["head_entries_max"]
    assert result.extra["kv_cache_bytes"] == 2 * stats["kv_slots"] * lm.head_dim * 4


def test_inspect_reports_per_head_counts(tiny_dir):
    from kvcli import api
    from kvcli.documents import document_from_text
    from kvcli.report.inspection import inspect_kept
    from tests.helpers.runs import DOC

    session = api.Session.open(api.AskOptions(model=str(tiny_dir("llama", num_hidden_layers=4)), use_cache=False))
    ins = inspect_kept(
        session, document_from_text(DOC), "How many gulls?", api.parse_pipeline("adakv:budget=40,base=snapkv:window=8")
    )
    assert ins.view == "per-head" and len(ins.layers) == 4
    assert all(row.kept_mean == 40 for row in ins.layers)
    assert any(row.kept_min < row.kept_max for row in ins.layers)
    assert json.dumps(ins.to_json())


def test_chains(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    # a uniform eviction first, then AdaKV chooses among what it kept
    cache, _ = prefill_and_compress(engine, prompt.ids, "snapkv:budget=80,window=8+adakv:budget=40,base=knorm:window=8")
    snap, _ = prefill_and_compress(engine, prompt.ids, "snapkv:budget=80,window=8")
    for l in range(lm.n_layers):
        assert int(cache.lengths[l].sum()) == 40 * lm.n_kv_heads
        for h in range(lm.n_kv_heads):
            assert set(cache.kept[l][h][: int(cache.lengths[l][h])].tolist()) <= set(snap.kept[l][h].tolist())
    # nothing evicts entries of a ragged cache
    with pytest.raises(UsageError, match="not of a RaggedCache"):
        run(
            engine,
            prompt,
            Pipeline.parse("adakv:budget=40,base=snapkv:window=8+snapkv:budget=20,window=8"),
            max_new_tokens=2,
            stop_ids=set(),
        )


def test_warm_disk_cache_equals_cold(tiny_lm, tmp_path):
    from tests.helpers.stores import ask, session_for

    lm = tiny_lm("qwen2")
    spec = "adakv:budget=40,base=snapkv:window=8"
    cold = ask(session_for(lm, tmp_path), spec)
    warm = ask(session_for(lm, tmp_path), spec)
    off = ask(session_for(lm, None, use_cache=False), spec)
    assert cold.extra["cache"]["status"] == "miss" and warm.extra["cache"]["status"] == "hit"
    assert cold.answer_ids == warm.answer_ids == off.answer_ids and len(cold.answer_ids) == 8


def test_ragged_cache_round_trip(tiny_lm, tmp_path):
    from safetensors.torch import load_file, save_file

    lm, engine, prompt, cache = ragged(tiny_lm)
    tensors, facts = cache.to_tensors()
    save_file(tensors, str(tmp_path / "e.safetensors"))
    back = RaggedCache.from_tensors(
        load_file(str(tmp_path / "e.safetensors")), json.loads(json.dumps(facts)), device=cache.keys[0].device
    )
    for a, b in zip(
        (*back.keys, *back.values, *back.kept, *back.lengths), (*cache.keys, *cache.values, *cache.kept, *cache.lengths)
    ):
        assert torch.equal(a, b)
    token = torch.tensor([7])
    position = torch.tensor([prompt.n_tokens])
    a = engine.logits(engine.forward(token, position, back))[-1]
    b = engine.logits(engine.forward(token, position, cache.copy()))[-1]
    assert torch.equal(a, b)
    for bad, message in [
        ({k: v for k, v in tensors.items() if k != "kept.1"}, "tensor names"),
        (dict(tensors, **{"lengths.0": tensors["lengths.0"] + 1}), "lengths"),
        (dict(tensors, **{"kept.0": tensors["kept.0"].clamp_min(0)}), "kept positions"),
        (dict(tensors, **{"k.2": tensors["k.2"][:, :, 1:]}), "k.2|layer 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            RaggedCache.from_tensors(bad, facts)
    with pytest.raises(ValueError, match="incomplete"):
        RaggedCache.from_tensors(tensors, {"n_layers": 4})
