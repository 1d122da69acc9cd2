"""Finch: chunked, question-guided prefill; RoPE re-rotation; documents longer than the window."""

from __future__ import annotations

import random

import pytest
import torch

from kvcli.compressors import parse_one
from kvcli.compressors.finch import chunk_bounds, kept_counts, question_scores
from kvcli.engine import Engine
from kvcli.errors import DocumentError, UsageError
from kvcli.pipeline import Pipeline, check_window, run
from kvcli.prompt import build_prompt
from kvcli.rope import rerotate
from reference import causal_softmax, reference_qk
from tiny_models import FAMILIES, make_tiny_model

TOL = 1e-4
DOC = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} gulls." for i in range(12))
WORDS = "harbour lamp keeper gull tide stone rope boat night wind salt bell".split()


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def finch(lm, spec: str):
    f = parse_one(spec)
    f.configure(lm)
    return f


# --- keeping everything is full attention ------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [16, 1000])
def test_budget_covering_the_document_reproduces_full_attention(tiny_lm, family, chunk):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    n = prompt.n_tokens
    f = finch(lm, f"finch:target={prompt.prefix_len},chunk={chunk}")
    cache, logits, next_position = f.prefill(engine, prompt.ids, protected=prompt.n_suffix)
    _, full_logits = engine.prefill(prompt.ids)
    assert next_position == n
    assert torch.allclose(logits, full_logits, atol=TOL)
    assert cache.positions.tolist() == list(range(n))
    # and through the pipeline: 5 greedy tokens, identical
    full = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=5, stop_ids=set())
    got = run(engine, prompt, Pipeline.parse(f"finch:target={n},chunk={chunk}"), max_new_tokens=5, stop_ids=set())
    assert got.answer_ids == full.answer_ids and len(got.answer_ids) == 5


# --- the scores are the paper's ----------------------------------------------------------------


def reference_scores(lm, ids: torch.Tensor, n_question: int) -> list[torch.Tensor]:
    """One Finch step written out plainly: HF's own forward for the hidden states, q and k of each
    layer recomputed from them, GQA keys repeated, causal softmax, the question rows summed over
    heads over the context columns, divided by the rows that see each column."""
    n_context = ids.numel() - n_question
    out = []
    for q, k, attn in reference_qk(lm, ids):
        a = causal_softmax(q, k, attn.scaling)[0].sum(0)[-n_question:, :n_context]  # heads summed; question rows x context
        out.append(a.sum(0) / n_question)  # every question row sees every context column
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_one_step_keeps_the_papers_top_positions(tiny_lm, family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls did the keeper count on line 7?")
    keep = 40
    f = finch(lm, f"finch:target={keep},chunk=4000")  # one chunk: one selection over the whole context
    cache, _, next_position = f.prefill(engine, prompt.ids, protected=prompt.n_suffix)
    ref = reference_scores(lm, prompt.ids, prompt.n_suffix)
    for layer, kept in enumerate(cache.kept_positions):
        # the kept set is a top-k of the reference scores (random tiny models give near-ties:
        # compare scores, with a tolerance, rather than indices)
        s = ref[layer]
        kth = torch.topk(s, keep).values[-1]
        assert kept.numel() == keep and bool((s[kept] >= kth - 1e-5).all()), layer
        dropped = torch.ones_like(s, dtype=torch.bool)
        dropped[kept] = False
        assert bool((s[dropped] <= kth + 1e-5).all()), layer
        assert len(set(kept.tolist()) & set(torch.topk(s, keep).indices.tolist())) >= keep - 3
    assert next_position == keep + prompt.n_suffix
    assert len({tuple(k.tolist()) for k in cache.kept_positions}) > 1  # layers keep different tokens


def test_question_scores_gqa_never_expands_and_normalises():
    torch.manual_seed(0)
    query = torch.randn(1, 6, 5, 8)  # 6 query heads, 2 KV heads, 3 question rows of 5 run
    key = torch.randn(1, 2, 12, 8)  # 9 candidates + 3 question keys
    s = question_scores(query, key, 3, 9, 8**-0.5)
    k = key.repeat_interleave(3, dim=1)
    w = torch.matmul(query[:, :, -3:], k.transpose(-1, -2)) * 8**-0.5
    w = w.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril()[-3:], float("-inf")).softmax(-1)
    assert s.shape == (9,)
    assert torch.allclose(s, w[0].sum(0)[:, :9].sum(0) / 3, atol=1e-6)


def test_chunking_and_the_kept_schedule():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 7), (7, 10)]
    assert chunk_bounds(8, 8) == [(0, 8)]
    assert kept_counts(chunk_bounds(10, 4), 5) == [2, 4, 5]
    assert kept_counts(chunk_bounds(10, 4), 50) == [3, 7, 10]  # a target above the document keeps all


# --- RoPE re-rotation ----------------------------------------------------------------------------


def layer0_keys(engine, ids, positions):
    from kvcli.cache import KVCache

    cache = KVCache()
    engine.forward(ids, positions, cache, layers=range(1))
    return cache.keys[0]


def check_rerotation(lm):
    engine = Engine(lm)
    ids = build_prompt(lm.tokenizer, DOC, "q").ids[:40]
    n = ids.numel()
    gen = torch.Generator().manual_seed(0)
    p = torch.randperm(3000, generator=gen)[:n]
    q = torch.randperm(3000, generator=gen)[:n]
    # layer 0's key of a token depends on the token and its position only
    at_p, at_q = layer0_keys(engine, ids, p), layer0_keys(engine, ids, q)
    assert not torch.allclose(at_p, at_q, atol=1e-3)
    moved = rerotate(at_p, p, q, engine.rotary_emb)
    assert moved.shape == at_p.shape
    assert torch.allclose(moved, at_q, atol=1e-5), (moved - at_q).abs().max()
    # every layer: shifting the whole sequence changes no hidden state, only the rotation
    from kvcli.cache import KVCache

    a = engine.prefix_kv(ids)
    shifted = KVCache()
    engine.forward(ids, torch.arange(n) + 517, shifted)
    for layer in range(engine.n_layers):
        moved = rerotate(a.keys[layer], torch.arange(n), torch.arange(n) + 517, engine.rotary_emb)
        assert torch.allclose(moved, shifted.keys[layer], atol=1e-4), layer
        assert torch.allclose(a.values[layer], shifted.values[layer], atol=1e-4), layer  # values carry no position


@pytest.mark.parametrize("family", FAMILIES)
def test_rerotated_key_equals_the_key_computed_at_the_new_position(tiny_lm, family):
    overrides = {"partial_rotary_factor": 0.5} if family == "phi3" else {}  # phi3: half the dims rotate
    lm = tiny_lm(family, **overrides)
    if family == "phi3":
        assert engine_rot_dim(lm) == lm.head_dim // 2
    check_rerotation(lm)


def engine_rot_dim(lm) -> int:
    from kvcli.rope import rope_cos_sin

    cos, _ = rope_cos_sin(Engine(lm).rotary_emb, torch.arange(3), torch.zeros(1))
    return cos.shape[-1]


def test_rerotation_with_yarn_attention_scaling(tmp_path_factory):
    """yarn multiplies cos and sin by attention_scaling != 1: the delta rotation must not."""
    from kvcli.models import load_model

    folder = make_tiny_model(
        "llama",
        tmp_path_factory.mktemp("yarn"),
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 2048},
    )
    lm = load_model(str(folder))
    assert abs(Engine(lm).rotary_emb.attention_scaling - 1.0) > 0.01
    check_rerotation(lm)


# --- longer than the window ----------------------------------------------------------------------


def test_25k_token_document_on_a_1k_window(tiny_lm, monkeypatch):
    lm = tiny_lm("llama", max_position_embeddings=1024)
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, words(25000, seed=3), "Which word comes first?")
    assert prompt.n_tokens > 25_000
    pipeline = Pipeline.parse("finch:target=128")
    pipeline.configure(lm)
    f = pipeline.stages[0]
    assert f.target + f.chunk + 256 <= 1024
    check_window(prompt, lm, 4, pipeline)  # Finch: fine
    with pytest.raises(DocumentError, match="window"):
        check_window(prompt, lm, 4, Pipeline.parse("full"))
    with pytest.raises(DocumentError, match="window"):
        check_window(prompt, lm, 4)

    spans: list[int] = []
    forward = engine.forward

    def spying(ids, positions, cache, **kw):
        out = forward(ids, positions, cache, **kw)
        spans.append(max(int(positions.max()) + 1, cache.seq_len(0) if cache is not None else 0))
        assert cache is None or max(cache.seq_len(i) for i in range(cache.n_layers)) <= lm.max_context
        return out

    monkeypatch.setattr(engine, "forward", spying)
    result = run(engine, prompt, pipeline, max_new_tokens=4, stop_ids=set())
    assert len(result.answer_ids) == 4
    assert len(spans) > 30 and max(spans) <= lm.max_context
    # GQA shapes: n_kv heads per layer, never expanded; target + question + the 3 decoded tokens
    assert result.extra["kv_cache_bytes"] == 2 * lm.n_layers * lm.n_kv_heads * lm.head_dim * 4 * (128 + prompt.n_suffix + 3)


def test_compressed_cache_shapes(tiny_lm):
    lm = tiny_lm("qwen3")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, words(600, seed=1), "Which word?")
    cache, logits, next_position = finch(lm, "finch:target=50,chunk=100").prefill(engine, prompt.ids, protected=prompt.n_suffix)
    q = prompt.n_suffix
    assert logits.shape == (lm.model.config.vocab_size,)
    assert next_position == 50 + q
    assert cache.positions.tolist() == list(range(50 + q))
    for layer in range(lm.n_layers):
        assert cache.keys[layer].shape == (1, lm.n_kv_heads, 50 + q, lm.head_dim)
        assert cache.values[layer].shape == cache.keys[layer].shape
        kept = cache.kept_positions[layer]
        assert kept.numel() == 50 and torch.all(kept[1:] > kept[:-1]) and int(kept[-1]) < prompt.prefix_len


# --- knobs and the CLI ---------------------------------------------------------------------------


def test_knob_errors(tiny_lm):
    lm = tiny_lm("llama")
    for spec, needle in [("finch:target=0", "target"), ("finch:chunk=0", "chunk"), ("finch:target=x", "target")]:
        with pytest.raises(UsageError, match=needle):
            parse_one(spec)
    with pytest.raises(UsageError, match="window"):
        finch(lm, "finch:target=4096")
    with pytest.raises(UsageError, match="room"):
        finch(lm, "finch:target=1000,chunk=3096")
    assert parse_one("finch").prefix_state(lm) is None  # depends on the question: nothing to store


def test_cli_reads_a_document_longer_than_the_window_with_finch_only(tiny_dir, tmp_path, capsys, monkeypatch):
    import json

    from test_cli import run_cli

    short = str(tiny_dir("llama", num_hidden_layers=4, max_position_embeddings=256))
    doc = tmp_path / "long.txt"
    doc.write_text(words(2000, seed=1) + "\n", encoding="utf-8")
    code, out, err = run_cli(["ask", doc, "q", "-m", short, "--max-new-tokens", "4", "-c", "full"], capsys, monkeypatch)
    assert code == 1 and "window" in err and "Traceback" not in err
    code, out, err = run_cli(["ask", doc, "q", "-m", short, "--max-new-tokens", "4", "-c", "finch", "--json"], capsys, monkeypatch)
    assert code == 0, err
    record = json.loads(out)
    assert record["compressor"].startswith("finch:") and record["n_context_tokens"] > 256
