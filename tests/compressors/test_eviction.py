"""KV eviction (SnapKV, PyramidKV, H2O, StreamingLLM): keeping everything equals full attention,
the kept entries are the papers' choices, GQA caches stay unexpanded, budgets and pipelines work."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvcli.answer.pipeline import Pipeline, run
from kvcli.answer.pipeline import default_prefill as scoring_default_prefill
from kvcli.caches import KVCache
from kvcli.compressors import parse_one, scoring
from kvcli.compressors.pyramidkv import pyramid_budgets
from kvcli.compressors.scoring import attention_and_column_sums, column_sums, window_attention
from kvcli.errors import UsageError
from kvcli.runtime import attention
from kvcli.runtime.engine import Engine
from kvcli.runtime.kernels import attend
from tests.helpers.reference import causal_softmax, reference_qk
from tests.helpers.runs import assert_top_k, prefill_and_compress, prompt_for

TOL = 1e-4
METHODS = ["snapkv", "pyramidkv", "h2o", "streamingllm"]


# --- keeping everything == full attention --------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_default_budget_on_a_short_prompt_keeps_everything(tiny_lm, method):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)  # far fewer tokens than the default budget (1024)
    ref = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=5, stop_ids=set())
    got = run(engine, prompt, Pipeline.parse(method), max_new_tokens=5, stop_ids=set())
    assert got.answer_ids == ref.answer_ids
    assert got.extra["kv_cache_bytes"] == ref.extra["kv_cache_bytes"]


# --- the kept entries are the papers' ------------------------------------------------------------


def reference_attention(lm, ids):
    """Per layer, the full softmax attention (n_heads, n, n) of the model, computed the HF way:
    q and k recomputed from the hidden states, RoPE, repeat_kv, causal softmax."""
    return [causal_softmax(q, k, 1 / math.sqrt(attn.head_dim))[0] for q, k, attn in reference_qk(lm, ids)]


def per_kv_head(scores, n_kv):
    """(n_heads, n) -> (n_kv, n): mean over each GQA group."""
    return scores.view(n_kv, -1, scores.shape[-1]).mean(dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_snapkv_keeps_the_papers_selection(tiny_lm, family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n, w, budget = prompt.n_tokens, 8, 40
    cache, _ = prefill_and_compress(engine, prompt.ids, f"snapkv:budget={budget},window={w},kernel=7,pool=max")
    for l, attn in enumerate(reference_attention(lm, prompt.ids)):
        votes = per_kv_head(attn[:, -w:, :-w].sum(dim=-2), lm.n_kv_heads)
        votes = F.max_pool1d(votes[None], kernel_size=7, padding=3, stride=1)[0]
        for h in range(lm.n_kv_heads):
            assert_top_k(cache.kept[l][h], votes[h], budget - w, tail=range(n - w, n))


# PyramidKV (Cai et al. 2024, section 3) for 4 layers, budget 40, window 8 (the window kept in every
# layer, a = 40 - 8 = 32 selected on average), beta 20: top layer a / beta = 1.6, bottom 2a - 1.6 =
# 62.4, arithmetic in between (step 20.27): 62.4, 42.13, 21.87, 1.6 -> whole entries with the same
# total (4 x 32 = 128; the two largest remainders round up: layers 2 and 3) 62, 42, 22, 2; + window.
PYRAMID_4_LAYERS_40_8 = [70, 50, 30, 10]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pyramidkv_keeps_the_papers_selection_with_the_papers_budgets(tiny_lm, family):
    lm = tiny_lm(family)
    assert lm.n_layers == 4
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n, w = prompt.n_tokens, 8
    cache, _ = prefill_and_compress(engine, prompt.ids, f"pyramidkv:budget=40,window={w},kernel=7,pool=max,beta=20")
    assert [cache.seq_len(l) for l in range(lm.n_layers)] == PYRAMID_4_LAYERS_40_8
    for l, attn in enumerate(reference_attention(lm, prompt.ids)):
        votes = per_kv_head(attn[:, -w:, :-w].sum(dim=-2), lm.n_kv_heads)
        votes = F.max_pool1d(votes[None], kernel_size=7, padding=3, stride=1)[0]
        for h in range(lm.n_kv_heads):
            assert_top_k(cache.kept[l][h], votes[h], PYRAMID_4_LAYERS_40_8[l] - w, tail=range(n - w, n))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", [None, 16])  # the default blocks (one, for this prompt), 16-row blocks
def test_h2o_keeps_heavy_hitters_and_recent_tokens(tiny_lm, monkeypatch, family, rows):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n, budget = prompt.n_tokens, 40
    if rows:
        monkeypatch.setattr(scoring, "block_rows", lambda group, kv_len: rows)
        assert n > 4 * rows
    kernel_calls = []
    monkeypatch.setattr(attention, "attend", lambda *a, **kw: kernel_calls.append(1) or attend(*a, **kw))
    cache, first = prefill_and_compress(engine, prompt.ids, f"h2o:budget={budget}")
    # H2O computed every layer's attention itself, from the weights it sums: no kernel ran
    assert kernel_calls == []
    full, want = prefill_and_compress(engine, prompt.ids, "full")
    assert len(kernel_calls) == lm.n_layers
    torch.testing.assert_close(first, want, atol=TOL, rtol=0)
    for l, attn in enumerate(reference_attention(lm, prompt.ids)):
        heavy = per_kv_head(attn.sum(dim=-2), lm.n_kv_heads)[:, : n - 20]
        for h in range(lm.n_kv_heads):
            assert_top_k(cache.kept[l][h], heavy[h], 20, tail=range(n - 20, n))
    # where it may not attend (here: never), it observes and the kernel runs: the same selection
    monkeypatch.setattr(attention, "_plain_causal", lambda *a: False)
    kernel_calls.clear()
    observed, first_observed = prefill_and_compress(engine, prompt.ids, f"h2o:budget={budget}")
    assert len(kernel_calls) == lm.n_layers
    assert all(torch.equal(a, b) for a, b in zip(observed.kept, cache.kept))
    torch.testing.assert_close(first_observed, want, atol=TOL, rtol=0)


def test_scores_from_q_and_k_match_the_attention_matrix():
    torch.manual_seed(0)
    q, k = torch.randn(1, 6, 50, 8), torch.randn(1, 2, 70, 8)  # 20 cached tokens + 50 new, GQA 3
    logits = torch.matmul(q, k.repeat_interleave(3, dim=1).transpose(-1, -2)) / math.sqrt(8)
    allowed = torch.arange(70)[None, :] <= torch.arange(20, 70)[:, None]
    attn = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)[0]  # (6, 50, 70)
    assert torch.allclose(column_sums(q, k, chunk=16).reshape(6, 70), attn.sum(dim=1), atol=1e-5)
    assert torch.allclose(window_attention(q, k, 10).reshape(6, 10, 70), attn[:, -10:], atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 1, 7, 16, 50])
@pytest.mark.parametrize("cached", [0, 20])
def test_attention_and_column_sums_equal_the_kernel_and_the_attention_matrix(chunk, cached):
    """H2O's one pass: the kernel's output and the column sums of the attention matrix, from the
    same blocks, whatever their size (the last one short) and with keys cached before the queries."""
    torch.manual_seed(0)
    kv_len = cached + 50
    q, k, v = torch.randn(1, 6, 50, 8), torch.randn(1, 2, kv_len, 8), torch.randn(1, 2, kv_len, 8)  # GQA 3
    logits = torch.matmul(q, k.repeat_interleave(3, dim=1).transpose(-1, -2)) / math.sqrt(8)
    allowed = torch.arange(kv_len)[None, :] <= torch.arange(cached, kv_len)[:, None]
    attn = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)[0]  # (6, 50, kv_len)
    out, sums = attention_and_column_sums(q, k, v, 1 / math.sqrt(8), chunk)
    assert out.shape == (1, 50, 6, 8) and out.is_contiguous()
    torch.testing.assert_close(out, attend("sdpa", None, q, k, v, 1 / math.sqrt(8)), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        out[0], torch.matmul(attn, v[0].repeat_interleave(3, dim=0)).transpose(0, 1), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(sums.reshape(6, kv_len), attn.sum(dim=1), atol=1e-5, rtol=0)
    assert torch.equal(sums, column_sums(q, k, chunk))  # the observer alone sums the same weights
    half = attention_and_column_sums(
        q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), 1 / math.sqrt(8), chunk
    )
    assert half[0].dtype == torch.bfloat16 and half[1].dtype == torch.float32


def test_streamingllm_keeps_sinks_and_recent(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n = prompt.n_tokens
    cache, _ = prefill_and_compress(engine, prompt.ids, "streamingllm:budget=20,sinks=4")
    expected = list(range(4)) + list(range(n - 16, n))
    for kept in cache.kept:
        assert all(row == expected for row in kept.tolist())


# --- shapes, budgets, positions -----------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", ["48", "0.25"])
def test_gqa_shapes_after_compression(tiny_lm, method, budget):
    lm = tiny_lm("qwen2")  # 4 query heads, 2 KV heads
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n = prompt.n_tokens
    cache, _ = prefill_and_compress(
        engine, prompt.ids, f"{method}:budget={budget},window=8" if "kv" in method[-2:] else f"{method}:budget={budget}"
    )
    k = 48 if budget == "48" else round(0.25 * n)
    sizes = [cache.seq_len(l) for l in range(lm.n_layers)]
    if method == "pyramidkv":
        assert sum(sizes) == k * lm.n_layers and sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    else:
        assert sizes == [k] * lm.n_layers
    for l in range(lm.n_layers):
        assert cache.keys[l].shape == (1, lm.n_kv_heads, sizes[l], lm.head_dim) == cache.values[l].shape
        assert cache.kept[l].shape == (lm.n_kv_heads, sizes[l])
        assert all(row == sorted(row) and row[-1] == n - 1 for row in cache.kept[l].tolist())
    # every prompt position is still recorded: decoding continues at the prompt length
    assert cache.positions.tolist() == list(range(n))
    result = run(
        engine,
        prompt,
        Pipeline.parse(f"{method}:budget={budget}" + (",window=8" if method.endswith("kv") else "")),
        max_new_tokens=4,
        stop_ids=set(),
    )
    assert len(result.answer_ids) == 4


def test_per_head_selection_differs_between_kv_heads(tiny_lm):
    lm = tiny_lm("qwen2")
    cache, _ = prefill_and_compress(Engine(lm), prompt_for(lm).ids, "snapkv:budget=24,window=8")
    assert any(not torch.equal(kept[0], kept[1]) for kept in cache.kept)


def test_pyramid_budgets_follow_the_paper():
    for layers, n, budget, window in [(30, 4000, 256, 32), (4, 100, 60, 8), (32, 8000, 2048, 32), (7, 500, 33, 32)]:
        b = pyramid_budgets(layers, n, budget, window, 20.0)
        assert sum(b) == layers * budget
        assert b == sorted(b, reverse=True) and max(b) <= n and min(b) >= window
    b = pyramid_budgets(30, 4000, 256, 32, 20.0)
    assert abs((b[-1] - 32) - 224 / 20) <= 1 and abs((b[0] - 32) - (2 * 224 - 224 / 20)) <= 1
    assert pyramid_budgets(4, 100, 60, 8, 20.0)[0] == 100  # the bottom layer would exceed the prompt


def test_decoding_positions_after_eviction(tiny_lm):
    """The compressed cache decodes like full attention with the evicted keys masked out."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n = prompt.n_tokens
    cache, first = prefill_and_compress(engine, prompt.ids, "streamingllm:budget=30,sinks=4")
    token = int(torch.argmax(first))
    hidden = engine.forward(torch.tensor([token]), torch.tensor([n]), cache)
    ours = engine.logits(hidden)[-1]
    # reference: the same sinks + recent window as a fresh prompt whose tokens keep their original
    # positions (keys are cached after RoPE), then the new token at position n
    keep = torch.tensor(list(range(4)) + list(range(n - 26, n)))
    ref_cache, _ = engine.prefill(prompt.ids, positions=torch.arange(n))
    ref_cache.keys = [k[:, :, keep] for k in ref_cache.keys]
    ref_cache.values = [v[:, :, keep] for v in ref_cache.values]
    hidden = engine.forward(torch.tensor([token]), torch.tensor([n]), ref_cache)
    assert torch.allclose(ours, engine.logits(hidden)[-1], atol=TOL)
    assert cache.positions[-1].item() == n  # the decoded token is recorded after the prompt


# --- pipelines -----------------------------------------------------------------------------------


def test_gemfilter_then_snapkv(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n = prompt.n_tokens
    result = run(
        engine,
        prompt,
        Pipeline.parse("gemfilter:k=64,layer=2+snapkv:budget=24,window=8"),
        max_new_tokens=3,
        stop_ids=set(),
    )
    # GemFilter read 64 tokens, SnapKV then held 24 of them per layer and head
    assert result.selection.n_kept == 64 and result.n_kept_tokens == 24 and len(result.answer_ids) == 3
    assert result.extra["kv_cache_bytes"] == lm.n_layers * 2 * lm.n_kv_heads * (24 + 2) * lm.head_dim * 4
    # everything kept by both: full attention
    ref = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=5, stop_ids=set())
    both = run(
        engine, prompt, Pipeline.parse(f"gemfilter:k={n},layer=2+snapkv:budget={n}"), max_new_tokens=5, stop_ids=set()
    )
    assert both.answer_ids == ref.answer_ids


def test_two_evictions_chain(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    cache, _ = prefill_and_compress(engine, prompt_for(lm).ids, "snapkv:budget=60,window=8+h2o:budget=30")
    assert [cache.seq_len(l) for l in range(lm.n_layers)] == [30] * lm.n_layers
    snap, _ = prefill_and_compress(engine, prompt_for(lm).ids, "snapkv:budget=60,window=8")
    for l in range(lm.n_layers):  # h2o chose among what snapkv kept
        for h in range(lm.n_kv_heads):
            assert set(cache.kept[l][h].tolist()) <= set(snap.kept[l][h].tolist())


@pytest.mark.parametrize(
    "spec, message",
    [
        ("snapkv:budget=0", "token count"),
        ("snapkv:budget=1.5", "token count"),
        ("h2o:budget=lots", "token count"),
        ("snapkv:budget=16", "smaller than the 32 tokens"),
        ("snapkv:window=0", "window must be at least 1"),
        ("pyramidkv:kernel=4", "kernel must be odd"),
        ("snapkv:pool=median", "pool must be max or avg"),
        ("pyramidkv:beta=0", "beta must be at least 1"),
        ("h2o:recent=1.5", "recent must be between 0 and 1"),
        ("streamingllm:sinks=-2", "sinks must be at least 0"),
        ("streamingllm:budget=2,sinks=4", "smaller than the 4 tokens"),
        ("snapkv:bugdet=5", "unknown knob"),
        ("gemfilter:k=64+", "empty compressor"),
        ("snapkv+snapky", "unknown compressor"),
    ],
)
def test_bad_knobs(spec, message):
    with pytest.raises(UsageError, match=message):
        Pipeline.parse(spec)


@pytest.mark.parametrize("method", METHODS)
def test_budget_larger_than_the_prompt(tiny_lm, method):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    with pytest.raises(UsageError, match="larger than the prompt"):
        run(engine, prompt_for(lm), Pipeline.parse(f"{method}:budget=100000"), max_new_tokens=2, stop_ids=set())


def test_spec_and_registry():
    from kvcli.compressors import REGISTRY

    assert {"snapkv", "pyramidkv", "h2o", "streamingllm"} <= set(REGISTRY)
    assert parse_one("snapkv:budget=0.25").spec() == "snapkv:budget=0.25,window=32,kernel=7,pool=max"
    assert parse_one("h2o:budget=512").spec() == "h2o:budget=512,recent=0.5"
    assert parse_one("pyramidkv").budget == 1024


# --- disk store -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["snapkv:budget=40,window=8", "pyramidkv:budget=40,window=8", "streamingllm:budget=40"]
)
def test_warm_disk_cache_equals_cold(tiny_lm, tmp_path, spec):
    from tests.helpers.stores import ask, session_for

    lm = tiny_lm("qwen2")
    cold = ask(session_for(lm, tmp_path), spec)
    warm = ask(session_for(lm, tmp_path), spec)
    off = ask(session_for(lm, None, use_cache=False), spec)
    full = ask(session_for(lm, tmp_path), "full")  # the same prefix state as full attention
    assert cold.extra["cache"]["status"] == "miss"
    assert warm.extra["cache"]["status"] == "hit" and full.extra["cache"]["status"] == "hit"
    assert len(cold.answer_ids) == 8
    assert cold.answer_ids == warm.answer_ids == off.answer_ids
    assert cold.extra["kv_cache_bytes"] == warm.extra["kv_cache_bytes"] < full.extra["kv_cache_bytes"]


def test_h2o_keeps_no_prefix_state(tiny_lm, tmp_path):
    from tests.helpers.stores import ask, entry_files, session_for

    lm = tiny_lm("qwen2")
    first = ask(session_for(lm, tmp_path), "h2o:budget=40")
    second = ask(session_for(lm, tmp_path), "h2o:budget=40")
    assert first.extra["cache"]["status"] == second.extra["cache"]["status"] == "off"
    assert first.answer_ids == second.answer_ids and entry_files(tmp_path) == []


# --- evicting each layer during the prefill -----------------------------------------------------


LAYER_BY_LAYER = [
    "snapkv:budget=40,window=8",
    "pyramidkv:budget=40,window=8",
    "h2o:budget=40",
    "streamingllm:budget=40",
    "snapkv:budget=60,window=8+h2o:budget=30",
    "snapkv:budget=60,window=8+adakv:budget=30,base=snapkv:window=8",
]
NO_PREFIX_STATE = {"h2o:budget=40"}  # H2O scores every query row of the prompt: nothing to store


@pytest.mark.parametrize(
    "spec, prefix",
    [
        (spec, prefix)
        for prefix in (None, "computed here", "held by the store")
        for spec in LAYER_BY_LAYER
        if prefix is None or spec not in NO_PREFIX_STATE
    ],
)
def test_layer_by_layer_eviction_equals_eviction_after_the_pass(tiny_lm, monkeypatch, spec, prefix):
    """Each layer evicted as soon as the pass ran it (kvcli's default) keeps the very entries that
    evicting after the whole pass keeps, and the pass never holds the uncompressed KV of every
    layer: with the prefix state computed in the pass (no store), not even for an instant."""
    from kvcli.answer.prefix import Prefix
    from kvcli.compressors.base import Compressor

    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n = prompt.n_tokens

    def prefill_and_compress(by_layer: bool):
        pipeline = Pipeline.parse(spec)
        pipeline.configure(lm)
        peak = [0]
        original = engine.layer

        def layer(*args, **kwargs):  # the KV the cache holds after every layer of any part of the pass
            out = original(*args, **kwargs)
            peak[0] = max(peak[0], sum(c.nbytes() for c in caches))
            return out

        caches = []
        state = None if prefix is None else Prefix.of(engine, prompt, pipeline.reader(), None, {})
        assert (state is None) == (prefix is None), f"{spec}: a prefix state was expected with prefix={prefix}"
        if prefix == "held by the store":  # as a disk store on the CPU holds it (its memo keeps it)
            state.stored = state.shared = True
        with monkeypatch.context() as m:
            m.setattr(engine, "layer", layer)
            m.setattr(KVCache, "__init__", lambda self, _init=KVCache.__init__: (_init(self), caches.append(self))[0])
            if not by_layer:
                m.setattr(Compressor, "compresses_by_layer", lambda self: False)
                for cls in {type(s) for s in pipeline.stages}:
                    m.setattr(cls, "compresses_by_layer", lambda self: False)
            cache, logits = scoring_default_prefill(engine, prompt.ids, state, pipeline.compressors())
            for stage in pipeline.compressors():
                cache = stage.compress(engine, cache)
        return cache, logits, peak[0]

    after, after_logits, after_peak = prefill_and_compress(by_layer=False)
    during, during_logits, during_peak = prefill_and_compress(by_layer=True)
    assert torch.equal(during_logits, after_logits)
    assert type(during) is type(after)
    for l in range(lm.n_layers):
        assert torch.equal(during.kept[l], after.kept[l])
        assert torch.equal(during.keys[l], after.keys[l]) and torch.equal(during.values[l], after.values[l])
    full_kv = lm.n_layers * 2 * lm.n_kv_heads * n * lm.head_dim * 4
    assert after_peak >= full_kv
    if prefix != "held by the store":
        # at most the layer in progress uncompressed (plus the prefix part's copy of it) on top of the kept ones
        assert during_peak <= full_kv * (2 + (lm.n_layers - 1) * 60 / n) / lm.n_layers
