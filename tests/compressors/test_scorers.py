"""TOVA, KNorm and KeyDiff: cheap scorers over the eviction base. Keeping everything equals full
attention; the kept entries are the papers' choices, checked against the arithmetic written out on
the Hugging Face model's own queries and keys; budgets, GQA shapes and the disk store."""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.compressors import parse_one
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from tests.helpers.reference import causal_softmax, reference_qk
from tests.helpers.runs import assert_top_k, prefill_and_compress, prompt_for

TOL = 1e-4
METHODS = ["tova", "knorm", "keydiff"]


def reference_keys(lm, ids):
    """Per layer the cached keys the HF way: (n_kv, n, d) after RoPE (one per GQA group)."""
    group = lm.n_heads // lm.n_kv_heads
    return [k[0, ::group].float() for _, k, _ in reference_qk(lm, ids)]


# --- specs ----------------------------------------------------------------------------------------


def test_specs_round_trip():
    assert parse_one("tova").spec() == "tova:budget=1024"
    assert parse_one("knorm:budget=0.25").spec() == "knorm:budget=0.25,window=32"
    assert parse_one("keydiff:budget=64,window=0").spec() == "keydiff:budget=64,window=0"
    for spec in ("tova:budget=0.5", "knorm:budget=100,window=8", "keydiff"):
        assert parse_one(parse_one(spec).spec()).spec() == parse_one(spec).spec()
    for spec, message in [
        ("knorm:window=-1", "window must be at least 0"),
        ("keydiff:budget=8,window=16", "smaller than the 16 tokens"),
        ("tova:budget=0", "token count"),
        ("knorm:kernel=3", "unknown knob"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_one(spec)


# --- keeping everything == full attention ---------------------------------------------------------


# --- the kept entries are the papers' -------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tova_keeps_what_the_last_token_attends_to(tiny_lm, family):
    lm = tiny_lm(family)
    prompt = prompt_for(lm)
    n, budget = prompt.n_tokens, 30
    cache, _ = prefill_and_compress(Engine(lm), prompt.ids, f"tova:budget={budget}")
    for l, (q, k, attn) in enumerate(reference_qk(lm, prompt.ids)):
        last = causal_softmax(q, k, 1 / math.sqrt(attn.head_dim))[0, :, -1]  # (n_heads, n)
        score = last.mean(dim=0)  # the mean over every query head of the layer
        assert torch.equal(cache.kept[l][0], cache.kept[l][1])  # the same tokens in every KV head
        for h in range(lm.n_kv_heads):
            assert_top_k(cache.kept[l][h], score[: n - 1], budget - 1, tail=[n - 1])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_knorm_keeps_the_lowest_norm_keys(tiny_lm, family):
    lm = tiny_lm(family)
    prompt = prompt_for(lm)
    n, budget, window = prompt.n_tokens, 30, 6
    cache, _ = prefill_and_compress(Engine(lm), prompt.ids, f"knorm:budget={budget},window={window}")
    for l, keys in enumerate(reference_keys(lm, prompt.ids)):
        for h in range(lm.n_kv_heads):
            norms = torch.sqrt((keys[h] ** 2).sum(dim=-1))  # (n,)
            assert_top_k(cache.kept[l][h], -norms[: n - window], budget - window, tail=range(n - window, n))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_keydiff_keeps_the_keys_least_like_the_mean(tiny_lm, family):
    lm = tiny_lm(family)
    prompt = prompt_for(lm)
    n, budget = prompt.n_tokens, 30
    cache, _ = prefill_and_compress(Engine(lm), prompt.ids, f"keydiff:budget={budget},window=0")
    for l, keys in enumerate(reference_keys(lm, prompt.ids)):
        for h in range(lm.n_kv_heads):
            # (the padding token's embedding is zero in these tiny models: a zero key, cosine 0)
            unit = keys[h] / keys[h].norm(dim=-1, keepdim=True).clamp_min(1e-12)
            anchor = unit.mean(dim=0)
            cosine = (unit @ anchor) / anchor.norm()
            kept = cache.kept[l][h]
            assert kept.numel() == budget and kept.tolist() == sorted(kept.tolist())
            chosen = torch.zeros(n, dtype=torch.bool, device=cosine.device)
            chosen[kept.to(cosine.device)] = True
            assert cosine[chosen].max() <= cosine[~chosen].min() + 1e-5
    assert any(not torch.equal(kept[0], kept[1]) for kept in cache.kept)  # per KV head


# --- budgets, shapes, pipelines, the store ---------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", ["40", "0.3"])
def test_gqa_shapes_and_answers(tiny_lm, method, budget):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n = prompt.n_tokens
    spec = f"{method}:budget={budget}" + ("" if method == "tova" else ",window=8")
    cache, _ = prefill_and_compress(engine, prompt.ids, spec)
    k = 40 if budget == "40" else round(0.3 * n)
    for l in range(lm.n_layers):
        assert cache.keys[l].shape == (1, lm.n_kv_heads, k, lm.head_dim)
        assert all(row[-1] == n - 1 for row in cache.kept[l].tolist())
    result = run(engine, prompt, Pipeline.parse(spec), max_new_tokens=4, stop_ids=set())
    assert len(result.answer_ids) == 4
    assert result.kept_mask().sum(dim=-1).eq(k).all()  # what inspect reads


@pytest.mark.parametrize("spec", ["tova:budget=40", "knorm:budget=40,window=8", "keydiff:budget=40,window=8"])
def test_warm_disk_cache_equals_cold(tiny_lm, tmp_path, spec):
    from tests.helpers.stores import ask, session_for

    lm = tiny_lm("qwen2")
    cold = ask(session_for(lm, tmp_path), spec)
    warm = ask(session_for(lm, tmp_path), spec)
    off = ask(session_for(lm, None, use_cache=False), spec)
    full = ask(session_for(lm, tmp_path), "full")  # the prefix state is full attention's
    assert cold.extra["cache"]["status"] == "miss"
    assert warm.extra["cache"]["status"] == "hit" and full.extra["cache"]["status"] == "hit"
    assert cold.answer_ids == warm.answer_ids == off.answer_ids and len(cold.answer_ids) == 8
    assert cold.extra["kv_cache_bytes"] == warm.extra["kv_cache_bytes"] < full.extra["kv_cache_bytes"]


# --- the command line: every new method through `kvcli ask` and `kvcli inspect` ------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "tova:budget=40",
        "knorm:budget=0.3",
        "keydiff:budget=40,window=8",
        "adakv:budget=40,base=snapkv:window=8",
        "expectedattention:budget=0.3,allocation=adaptive",
        "kvzip:budget=0.3",
        "duo:sinks=4,recent=16,tokens=64,length=40",
        "snapkv:budget=40,window=8+decoding:base=knorm:window=4,budget=40,interval=2",
    ],
)
def test_cli_ask_and_inspect(cli, tiny_dir, tmp_path, spec):
    import json

    from tests.helpers.runs import DOC

    model = str(tiny_dir("llama", num_hidden_layers=4))
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    code, out, err = cli(
        "ask",
        doc,
        "How many gulls?",
        "-c",
        spec,
        "--model",
        model,
        "--json",
        "--max-new-tokens",
        "4",
        "--cache-dir",
        tmp_path / "c",
    )
    assert code == 0, err
    record = json.loads(out)
    assert record["compressor"].split(":")[0] == spec.split(":")[0] and record["cache"] == "miss"
    assert "answer" in record and record["n_context_tokens"] > 40
    code, out, err = cli("inspect", doc, "How many gulls?", "-c", spec, "--model", model, "--json", "--no-cache")
    assert code == 0, err
    record = json.loads(out)
    assert record["view"] == "per-head" and len(record["layers"]) == 4
    assert 0 < record["n_kept_tokens"] < record["n_prompt_tokens"]
