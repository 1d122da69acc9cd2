"""Expected Attention: keeping everything equals full attention; the kept entries are the paper's
closed-form expected attention, recomputed naively from the Hugging Face model's own projections
(explicit rotation matrices, per-head loops); the compressed prefix is question-agnostic and
reused from the disk store (warm == cold, any question)."""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.caches import RaggedCache
from kvcli.compressors import parse_one
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from tests.helpers.reference import assert_same_logits
from tests.helpers.runs import full_reference, greedy_logits, prompt_for


def build(lm, spec):
    method = parse_one(spec)
    method.configure(lm)
    return method


def test_spec_round_trip_and_errors():
    ea = parse_one("expectedattention")
    assert (
        ea.spec()
        == "expectedattention:budget=1024,allocation=uniform,safeguard=0.2,sinks=4,future=512,queries=auto,covariance=true,vnorm=true,epsilon=0.0"
    )
    spec = "expectedattention:budget=0.3,allocation=adaptive,sinks=2,future=64,queries=100,covariance=false"
    assert parse_one(parse_one(spec).spec()).spec() == parse_one(spec).spec()
    for spec, message in [
        ("expectedattention:allocation=lots", "allocation must be one of"),
        ("expectedattention:safeguard=2", "between 0 and 1"),
        ("expectedattention:future=0", "future must be at least 1"),
        ("expectedattention:queries=1", "queries must be at least 2"),
        ("expectedattention:epsilon=-0.1", "epsilon must be a number >= 0"),
        ("expectedattention:budget=2,sinks=4", "smaller than the 4 tokens"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_one(spec)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_keep_everything_reproduces_full_attention(tiny_lm, family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    method = build(lm, f"expectedattention:budget={prompt.prefix_len}")
    cache = method.build_prefix(engine, prompt.ids[: prompt.prefix_len])
    got = greedy_logits(engine, cache, prompt.ids[prompt.prefix_len :], steps=5)
    assert_same_logits(got, full_reference(engine, prompt, steps=5))
    ref = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=5, stop_ids=set())
    assert (
        run(
            engine,
            prompt,
            Pipeline.parse(f"expectedattention:budget={prompt.prefix_len}"),
            max_new_tokens=5,
            stop_ids=set(),
        ).answer_ids
        == ref.answer_ids
    )
    with pytest.raises(UsageError, match="larger than the document prefix"):
        run(
            engine,
            prompt,
            Pipeline.parse(f"expectedattention:budget={prompt.prefix_len + 1}"),
            max_new_tokens=1,
            stop_ids=set(),
        )


# --- the paper's scores, naively --------------------------------------------------------------------


def naive_expected_scores(lm, ids, sinks, future, covariance=True, vnorm=True, epsilon=0.0, queries=None):
    """Per layer (n_kv, n) scores, from the HF model: pre-RoPE queries from q_proj, keys after RoPE,
    mean/covariance by definition (of the query rows after the sinks, or the last ``queries``),
    one explicit rotation matrix per future position, loops."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, n, d = lm.model, ids.numel(), lm.head_dim
    dev = lm.device  # every tensor of the reference where the model runs
    ids = ids.to(dev)
    group = lm.n_heads // lm.n_kv_heads
    half = d // 2
    P = torch.zeros(d, d, dtype=torch.float64, device=dev)  # rotate_half as a matrix: P x = [-x2, x1]
    P[:half, half:] = -torch.eye(half, dtype=torch.float64, device=dev)
    P[half:, :half] = torch.eye(half, dtype=torch.float64, device=dev)
    out = []
    with torch.inference_mode():
        hs = model(ids.view(1, -1), output_hidden_states=True).hidden_states
        cos_f, sin_f = model.model.rotary_emb(hs[0], torch.arange(n, n + future, device=dev).view(1, -1))
        R = sum(torch.diag(cos_f[0, p].double()) + torch.diag(sin_f[0, p].double()) @ P for p in range(future)) / future
        cos, sin = model.model.rotary_emb(hs[0], torch.arange(n, device=dev).view(1, -1))
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(hs[i])
            q = attn.q_proj(h).view(1, n, -1, d).transpose(1, 2)
            k = attn.k_proj(h).view(1, n, -1, d).transpose(1, 2)
            v = attn.v_proj(h).view(1, n, -1, d).transpose(1, 2)[0].double()
            _, k = apply_rotary_pos_emb(q, k, cos, sin)
            q, k = q[0].double(), k[0].double()
            scores = torch.zeros(lm.n_kv_heads, n, dtype=torch.float64, device=dev)
            for head in range(lm.n_heads):
                g = head // group
                rows = q[head, sinks if queries is None else max(sinks, n - queries) :]
                mu = rows.mean(dim=0)
                cov = (rows - mu).T @ (rows - mu) / rows.shape[0]
                mu_f, cov_f = R @ mu, R @ cov @ R.T
                logit = torch.tensor(
                    [
                        float(k[g, j] @ mu_f) / math.sqrt(d)
                        + (float(k[g, j] @ cov_f @ k[g, j]) / (2 * d) if covariance else 0.0)
                        for j in range(sinks, n)
                    ],
                    dtype=torch.float64,
                    device=dev,
                )
                scores[g, sinks:] += torch.softmax(logit, dim=0) / group
            if vnorm:  # kvpress: (scores + epsilon) * ||v||
                scores[:, sinks:] = (scores[:, sinks:] + epsilon) * v[:, sinks:].norm(dim=-1)
            scores[:, :sinks] = float("inf")
            out.append(scores)
    return out


@pytest.mark.parametrize(
    "family, knobs, chunk",
    [
        ("llama", "", None),
        ("qwen2", "", None),
        ("qwen2", ",covariance=false,vnorm=false", None),
        ("llama", ",epsilon=0.01", None),
        ("llama", "", 8),
        ("qwen2", ",queries=20", 7),
    ],
)
def test_selection_is_the_expected_attention(tiny_lm, family, knobs, chunk):
    """``chunk``: the prefix read chunk by chunk (as off the CPU), the query statistics merged across chunks."""
    lm = tiny_lm(family)
    engine = Engine(lm)
    engine.prefill_chunk = chunk
    prompt = prompt_for(lm)
    ids = prompt.ids[: prompt.prefix_len]
    n, budget, sinks, future = ids.numel(), 40, 3, 32
    method = build(lm, f"expectedattention:budget={budget},sinks={sinks},future={future}{knobs}")
    cache = method.build_prefix(engine, ids)
    assert isinstance(cache, RaggedCache) and all(int(l.min()) == int(l.max()) == budget for l in cache.lengths)
    epsilon = 0.01 if "epsilon" in knobs else 0.0
    want = naive_expected_scores(
        lm,
        ids,
        sinks,
        future,
        covariance="covariance=false" not in knobs,
        vnorm="vnorm=false" not in knobs,
        epsilon=epsilon,
        queries=20 if "queries=20" in knobs else None,
    )
    # the method's own scores equal the naive ones (float32 vs float64)
    _, got_scores = method.prefix_scores(engine, ids)
    for g, w in zip(got_scores, want):
        torch.testing.assert_close(g[:, sinks:].double().to(w.device), w[:, sinks:], rtol=1e-3, atol=1e-6)
    for l, scores in enumerate(want):
        for h in range(lm.n_kv_heads):
            kept = cache.kept[l][h].tolist()
            assert kept == sorted(kept) and kept[:sinks] == list(range(sinks))
            chosen = torch.zeros(n, dtype=torch.bool, device=scores.device)
            chosen[kept] = True
            assert scores[h][chosen].min() >= scores[h][~chosen].max() * (1 - 1e-4)
    engine.prefill_chunk = None


def test_scores_and_selection_are_kvpress_formula_on_a_hand_built_case():
    """kvpress's ExpectedAttentionPress written out on random tensors, RoPE as explicit matrices
    from its angles (no model, no kvcli.runtime.rope): pre-RoPE query mean/covariance over the tokens after
    the sinks, R̄ = mean of R_p over the next ``future`` positions, softmax over the non-sink keys of
    k·R̄μ/√d + kᵀR̄ΣR̄ᵀk/2d, mean over the GQA group, (· + ε)·‖v‖; sinks always kept."""
    from kvcli.compressors.expected_attention import expected_scores, mean_rotation, query_statistics
    from kvcli.compressors.scoring import allocate

    gen = torch.Generator().manual_seed(0)
    d, n_kv, group, n, sinks, future, epsilon, k = 8, 2, 3, 24, 2, 16, 0.01, 9
    half, n_heads = d // 2, n_kv * group
    inv_freq = 50.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / d)

    def R(p):  # RoPE at position p: dims (i, i + d/2) rotated by p * inv_freq[i]
        m = torch.zeros(d, d, dtype=torch.float64)
        for i in range(half):
            c, s = math.cos(p * inv_freq[i]), math.sin(p * inv_freq[i])
            m[i, i], m[i, i + half], m[i + half, i], m[i + half, i + half] = c, -s, s, c
        return m

    q_pre = torch.randn(n_heads, n, d, generator=gen, dtype=torch.float64) + torch.linspace(
        -1, 1, d, dtype=torch.float64
    )
    q = torch.stack([torch.stack([R(p) @ q_pre[h, p] for p in range(n)]) for h in range(n_heads)])  # as observed
    key = torch.randn(n_kv, n, d, generator=gen, dtype=torch.float64)
    value = torch.randn(n_kv, n, d, generator=gen, dtype=torch.float64) * torch.rand(
        n_kv, n, 1, generator=gen, dtype=torch.float64
    )
    R_bar = sum(R(p) for p in range(n, n + future)) / future
    want = torch.zeros(n_kv, n, dtype=torch.float64)
    for h in range(n_heads):
        g = h // group
        rows = q_pre[h, sinks:]
        mu, cov = rows.mean(0), (rows - rows.mean(0)).T @ (rows - rows.mean(0)) / rows.shape[0]
        mu_f, cov_f = R_bar @ mu, R_bar @ cov @ R_bar.T
        logits = torch.stack(
            [key[g, j] @ mu_f / math.sqrt(d) + key[g, j] @ cov_f @ key[g, j] / (2 * d) for j in range(sinks, n)]
        )
        want[g, sinks:] += torch.softmax(logits, 0) / group
    want[:, sinks:] = (want[:, sinks:] + epsilon) * value[:, sinks:].norm(dim=-1)

    def table(positions):  # (cos, sin) as the model's rotary embedding returns them: (len, d)
        angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq[None]
        return torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()

    cos, sin = table(range(n))
    mu, cov = query_statistics(q[None].float(), cos, sin, sinks)
    got = expected_scores(
        mu,
        cov,
        mean_rotation(*table(range(n, n + future)), d),
        key[None].float(),
        value[None].float(),
        sinks,
        True,
        epsilon,
    )
    assert torch.isinf(got[:, :sinks]).all()
    torch.testing.assert_close(got[:, sinks:].double(), want[:, sinks:], rtol=1e-4, atol=1e-7)
    mask = allocate([got], k, "uniform", 0.2)[0]
    for g in range(n_kv):
        best = set(range(sinks)) | set((sinks + torch.topk(want[g, sinks:], k - sinks).indices).tolist())
        assert set(mask[g].nonzero().flatten().tolist()) == best


# --- question-agnostic: the disk store keeps the compressed prefix ------------------------------------


def test_compressed_prefix_is_reused_for_any_question(tiny_lm, tmp_path):
    from tests.helpers.stores import Q1, Q2, ask, entry_files, session_for

    lm = tiny_lm("qwen2")
    spec = "expectedattention:budget=40,allocation=adaptive"
    cold = ask(session_for(lm, tmp_path), spec, Q1)
    warm = ask(session_for(lm, tmp_path), spec, Q1)
    other = ask(session_for(lm, tmp_path), spec, Q2)  # a new question: the same entry
    off = ask(session_for(lm, None, use_cache=False), spec, Q1)
    assert cold.extra["cache"]["status"] == "miss"
    assert warm.extra["cache"]["status"] == other.extra["cache"]["status"] == "hit"
    assert cold.answer_ids == warm.answer_ids == off.answer_ids and len(cold.answer_ids) == 8
    assert other.answer_ids == ask(session_for(lm, None, use_cache=False), spec, Q2).answer_ids
    assert len(entry_files(tmp_path)) == 1
    assert isinstance(cold.cache, RaggedCache) and cold.extra["kv_cache_bytes"] == warm.extra["kv_cache_bytes"]
    full = ask(session_for(lm, tmp_path), "full", Q1)
    assert cold.extra["kv_cache_bytes"] < full.extra["kv_cache_bytes"]


def test_what_inspect_reads(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    result = run(
        engine,
        prompt,
        Pipeline.parse("expectedattention:budget=0.25,allocation=adaptive"),
        max_new_tokens=3,
        stop_ids=set(),
    )
    k = round(0.25 * prompt.prefix_len)
    mask = result.kept_mask()
    assert mask.shape == (lm.n_layers, lm.n_kv_heads, prompt.n_tokens)
    assert mask[:, :, prompt.prefix_len :].all()  # the question is never compressed
    assert (mask[:, :, : prompt.prefix_len].sum(dim=(1, 2)) == k * lm.n_kv_heads).all()
    assert mask[:, :, :4].all()  # the sinks, in every head


def test_global_allocation_spends_the_whole_model_budget(tiny_lm):
    lm = tiny_lm("qwen2")
    ids = prompt_for(lm).ids[:120]
    cache = build(lm, "expectedattention:budget=30,allocation=global").build_prefix(Engine(lm), ids)
    assert sum(int(l.sum()) for l in cache.lengths) == 30 * lm.n_kv_heads * lm.n_layers
    assert len({int(l.sum()) for l in cache.lengths}) > 1  # layers differ


def test_chaining_an_eviction_after_it_is_refused(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    with pytest.raises(UsageError, match="cannot be cut back|not of a RaggedCache"):
        run(
            engine,
            prompt_for(lm),
            Pipeline.parse("expectedattention:budget=40+snapkv:budget=30,window=8"),
            max_new_tokens=2,
            stop_ids=set(),
        )
    with pytest.raises(UsageError, match="selects tokens before expectedattention"):
        Pipeline.parse("gemfilter+expectedattention")


def test_statistics_merged_across_chunks_are_those_of_all_rows():
    """The query mean and covariance of a prefix read in chunks (each chunk's own statistics,
    merged pairwise) are those of all its rows at once."""
    from kvcli.compressors.expected_attention import merge_statistics, query_statistics

    g = torch.Generator().manual_seed(3)
    n, heads, d, first = 50, 3, 8, 4
    query = torch.randn(1, heads, n, d, generator=g) * 2 + torch.randn(1, heads, 1, d, generator=g) * 3
    angles = torch.arange(n, dtype=torch.float32)[:, None] * torch.rand(1, d // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    mu, cov = query_statistics(query, cos, sin, first)
    merged = None
    for s, e in [(0, 3), (3, 11), (11, 12), (12, 40), (40, 50)]:
        skip = max(0, first - s)
        if skip < e - s:
            m, c = query_statistics(query[:, :, s:e], cos[s:e], sin[s:e], skip)
            merged = merge_statistics(merged, (e - s - skip, m, c))
    count, m, c = merged
    assert count == n - first
    torch.testing.assert_close(m, mu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c, cov, rtol=1e-4, atol=1e-4)
