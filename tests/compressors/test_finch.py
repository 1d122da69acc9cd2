"""Finch: chunked, question-guided prefill; RoPE re-rotation; documents longer than the window."""

from __future__ import annotations

import random

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, check_window, run
from kvcli.answer.prompt import build_prompt
from kvcli.compressors import parse_one
from kvcli.compressors.finch import DEFAULT_CHUNK, DEFAULT_KERNEL, chunk_bounds, kept_counts, question_scores
from kvcli.errors import DocumentError, UsageError
from kvcli.runtime.engine import Engine
from kvcli.runtime.rope import rerotate
from tests.helpers.reference import causal_softmax, finch_reference, reference_qk
from tests.helpers.tiny_models import FAMILIES, make_tiny_model

TOL = 1e-4
DOC = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} gulls." for i in range(12))
WORDS = ["harbour", "lamp", "keeper", "gull", "tide", "stone", "rope", "boat", "night", "wind", "salt", "bell"]


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
    f = finch(lm, f"finch:target={prompt.doc_end},chunk={chunk}")
    cache, logits, next_position = f.prefill(engine, prompt.ids, protected=prompt.n_after_document)
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
    """One Finch step written out plainly, as the authors' code does it (giulio98/context-compression,
    ``condition="question"``, ``normalize=True``): HF's own forward for the hidden states, q and k of
    each layer recomputed from them, GQA keys repeated, causal softmax summed over heads; the
    question rows x context columns; each row times its non-zero count / the sequence length
    (``non_zero_counts = arange(1, T + 1)[context:]``); summed over the rows."""
    n = ids.numel()
    n_context = n - n_question
    non_zero_counts = torch.arange(1, n + 1, device=lm.device)[n_context:]
    out = []
    for q, k, attn in reference_qk(lm, ids):
        summed = causal_softmax(q, k, attn.scaling)[0].sum(0)  # heads summed: (n, n)
        context_attention = summed[n_context:, :n_context] * (non_zero_counts.float() / n)[:, None]
        out.append(context_attention.sum(0))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_one_step_keeps_the_papers_top_positions(tiny_lm, family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls did the keeper count on line 7?")
    keep = 40
    f = finch(lm, f"finch:target={keep},chunk=4000,kernel=1")  # one chunk, no pool: the paper's scores alone
    cache, _, next_position = f.prefill(engine, prompt.ids, protected=prompt.n_after_document)
    ref = reference_scores(lm, prompt.ids, prompt.n_after_document)
    for layer, kept in enumerate(cache.kept_positions):
        # the kept set is a top-k of the reference scores (random tiny models give near-ties:
        # compare scores, with a tolerance, rather than indices)
        s = ref[layer].to(kept.device)  # where the kept positions are
        kth = torch.topk(s, keep).values[-1]
        assert kept.numel() == keep and bool((s[kept] >= kth - 1e-5).all()), layer
        dropped = torch.ones_like(s, dtype=torch.bool)
        dropped[kept] = False
        assert bool((s[dropped] <= kth + 1e-5).all()), layer
        assert len(set(kept.tolist()) & set(torch.topk(s, keep).indices.tolist())) >= keep - 3
    assert next_position == keep + prompt.n_after_document
    assert len({tuple(k.tolist()) for k in cache.kept_positions}) > 1  # layers keep different tokens


def finch_choices(monkeypatch, n_layers: int) -> list:
    """Record Finch's choice at every compressing step: the candidate indices it hands to the
    re-rotation, per layer in order -> a list (steps) of lists (layers)."""
    from kvcli.compressors import finch as finch_module

    calls: list[torch.Tensor] = []
    real = finch_module.rerotate_table

    def recording(key, old_index, new_index, cos, sin):
        calls.append(old_index.cpu().clone())
        return real(key, old_index, new_index, cos, sin)

    monkeypatch.setattr(finch_module, "rerotate_table", recording)

    class Steps(list):
        def take(self):
            assert len(calls) % n_layers == 0
            self[:] = [calls[i : i + n_layers] for i in range(0, len(calls), n_layers)]
            return self

    return Steps()


@pytest.mark.parametrize("family, chunk, kernel", [("llama", 64, 1), ("qwen3", 100, 1), ("llama", 64, 7)])
def test_chunks_keep_the_papers_selection_and_rerotated_keys(tiny_lm, monkeypatch, family, chunk, kernel):
    """Two or three chunks against :func:`finch_reference` (transformers' own forward on the kept
    cache, the paper's normalised scores, top-k per layer): every step's kept set is a top-k of
    the reference's scores, the final kept positions, each kept key equals the model's own key of
    that token at its new slot (RoPE of its pre-RoPE key at the slot) and the values, and the
    first answer logits."""
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls did the keeper count on line 7?")
    n_question, n_context = prompt.n_after_document, prompt.doc_end
    target = 40
    assert 2 <= -(-n_context // chunk) <= 3
    choices = finch_choices(monkeypatch, lm.n_layers)
    f = finch(lm, f"finch:target={target},chunk={chunk},kernel={kernel}")
    cache, logits, next_position = f.prefill(engine, prompt.ids, protected=n_question)
    choices.take()
    kept, keys, values, ref_logits, steps = finch_reference(
        lm, prompt.ids, n_question, chunk, target, kernel, follow=choices
    )
    assert steps == len(choices) == -(-n_context // chunk)
    assert next_position == target + n_question
    for layer in range(lm.n_layers):
        assert cache.kept_positions[layer].tolist() == kept[layer].tolist(), layer
        torch.testing.assert_close(cache.keys[layer][:, :, :target], keys[layer], atol=TOL, rtol=0)
        torch.testing.assert_close(cache.values[layer][:, :, :target], values[layer], atol=TOL, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=TOL, rtol=0)
    if kernel == 1:  # no pool: no plateaus, so the reference's own top-k is the same set
        alone = finch_reference(lm, prompt.ids, n_question, chunk, target, kernel)[0]
        assert [k.tolist() for k in alone] == [k.tolist() for k in cache.kept_positions]


def test_question_scores_gqa_never_expands_and_normalises():
    torch.manual_seed(0)
    query = torch.randn(1, 6, 5, 8)  # 6 query heads, 2 KV heads, 3 question rows of 5 run
    key = torch.randn(1, 2, 12, 8)  # 9 candidates + 3 question keys
    s = question_scores(query, key, 3, 9, 8**-0.5)
    k = key.repeat_interleave(3, dim=1)
    w = torch.matmul(query[:, :, -3:], k.transpose(-1, -2)) * 8**-0.5
    w = w.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril()[-3:], float("-inf")).softmax(-1)
    rows_see = torch.tensor([10.0, 11.0, 12.0])  # keys visible to each question row
    assert s.shape == (9,)
    assert torch.allclose(s, (w[0].sum(0)[:, :9] * (rows_see / 12)[:, None]).sum(0), atol=1e-6)


def test_normalisation_changes_the_ranking_as_the_paper_says():
    """A hand-built step where the causal-bias normalisation decides: 2 candidates (A = 0, B = 1),
    then 4 question rows. The first question row sees 3 keys and gives A 0.6; the last sees 6 and
    gives B 0.45 (and the first gives B 0.1). Raw sums rank A first (0.60 vs 0.55); normalised — each
    row times the keys it sees — B (3·0.1 + 6·0.45 = 3.0 vs 3·0.6 = 1.8). A column-count
    normalisation (every candidate is seen by every question row) ranks as the raw sum: A."""
    n_cand, n_q = 2, 4
    kv_len = n_cand + n_q
    probs = torch.full((n_q, kv_len), 0.0)
    probs[0, :3] = torch.tensor([0.6, 0.1, 0.3])  # row 0 sees A, B and itself
    probs[1, :4] = torch.tensor([0.0, 0.0, 0.5, 0.5])
    probs[2, :5] = torch.tensor([0.0, 0.0, 0.3, 0.3, 0.4])
    probs[3, :6] = torch.tensor([0.0, 0.45, 0.1, 0.15, 0.1, 0.2])
    # logits that give these probabilities: one-hot keys, each query row holds its log-probabilities
    # (zero probabilities -> a large negative logit, exp() of it ~ 1e-22: nothing)
    logits = torch.where(probs > 0, probs.clamp_min(1e-30).log(), torch.full_like(probs, -50.0))
    key = torch.eye(kv_len).view(1, 1, kv_len, kv_len)  # 1 KV head, d = kv_len
    query = logits.view(1, 1, n_q, kv_len)  # 1 query head: q_i · k_j = logits[i, j]
    s = question_scores(query, key, n_q, n_cand, 1.0)
    raw = probs[:, :n_cand].sum(0)
    sees = torch.arange(n_cand + 1, kv_len + 1, dtype=torch.float32)  # 3, 4, 5, 6
    normalised = (probs[:, :n_cand] * (sees / kv_len)[:, None]).sum(0)
    assert torch.allclose(s, normalised, atol=1e-5), (s, normalised)
    assert int(raw.argmax()) == 0 and int(normalised.argmax()) == 1  # the rankings differ
    assert int(s.argmax()) == 1  # Finch keeps B


def test_chunking_and_the_kept_schedule():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 7), (7, 10)]
    assert chunk_bounds(8, 8) == [(0, 8)]
    assert kept_counts(chunk_bounds(10, 4), 5) == [2, 4, 5]
    assert kept_counts(chunk_bounds(10, 4), 50) == [3, 7, 10]  # a target above the document keeps all


def test_default_chunk_is_in_the_papers_range_and_target_may_be_a_ratio(tiny_lm):
    assert DEFAULT_CHUNK == 1024 and 64 <= DEFAULT_CHUNK <= 2048  # the paper's chunks (Table 9)
    lm = tiny_lm("llama")  # window 4096
    f = finch(lm, "finch")
    assert (f.target, f.chunk) == (1024, 1024)
    assert f.spec() == f"finch:target=1024,chunk=1024,kernel={DEFAULT_KERNEL}"
    small = finch(tiny_lm("llama", max_position_embeddings=1024), "finch:target=128")
    assert small.chunk == 1024 - 128 - 256  # a small window shrinks the default chunk, never an explicit one
    ratio = finch(lm, "finch:target=0.25,chunk=64")
    assert ratio.spec() == f"finch:target=0.25,chunk=64,kernel={DEFAULT_KERNEL}" and ratio.target_tokens(401) == 100
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, words(600, seed=2), "Which word?")
    cache, _, next_position = ratio.prefill(engine, prompt.ids, protected=prompt.n_after_document)
    keep = round(0.25 * prompt.doc_end)
    assert next_position == keep + prompt.n_after_document
    assert all(k.numel() == keep for k in cache.kept_positions)
    for spec, needle in [
        ("finch:target=1.5", "target"),
        ("finch:target=-0.1", "target"),
        ("finch:target=abc", "target"),
    ]:
        with pytest.raises(UsageError, match=needle):
            parse_one(spec)


def test_the_user_prompt_after_the_document_is_never_compressed(tiny_lm):
    """Finch keeps the user prompt — the instructions between the document and the question
    included — and compresses the context (template head + document) only."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, words(600, seed=4), "Which word comes first?")
    assert prompt.n_after_document > prompt.n_suffix  # the template's middle: the instructions
    cache, _, next_position = finch(lm, "finch:target=40,chunk=128").prefill(
        engine, prompt.ids, protected=prompt.n_after_document
    )
    assert cache.suffix_positions.tolist() == list(range(prompt.doc_end, prompt.n_tokens))
    assert next_position == 40 + prompt.n_after_document
    for kept in cache.kept_positions:
        assert kept.numel() == 40 and int(kept.max()) < prompt.doc_end


# --- RoPE re-rotation ----------------------------------------------------------------------------


def layer0_keys(engine, ids, positions):
    from kvcli.caches import KVCache

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
    moved = rerotate(at_p, p, q, engine.rotary(0))
    assert moved.shape == at_p.shape
    assert torch.allclose(moved, at_q, atol=1e-5), (moved - at_q).abs().max()
    # every layer: shifting the whole sequence changes no hidden state, only the rotation
    from kvcli.caches import KVCache

    a = engine.prefix_kv(ids)
    shifted = KVCache()
    engine.forward(ids, torch.arange(n) + 517, shifted)
    for layer in range(engine.n_layers):
        moved = rerotate(
            a.keys[layer], torch.arange(n), torch.arange(n) + 517, engine.rotary(layer)
        )  # each layer its own RoPE (Gemma 3: local / global bases)
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
    from kvcli.runtime.rope import rope_cos_sin

    cos, _ = rope_cos_sin(Engine(lm).rotary(0), torch.arange(3), torch.zeros(1))
    return cos.shape[-1]


def test_rerotation_with_yarn_attention_scaling(tmp_path_factory, device):
    """yarn multiplies cos and sin by attention_scaling != 1: the delta rotation must not."""
    from kvcli.model import load_model

    folder = make_tiny_model(
        "llama",
        tmp_path_factory.mktemp("yarn"),
        rope_parameters={
            "rope_type": "yarn",
            "factor": 2.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 2048,
        },
    )
    lm = load_model(str(folder), device=str(device), dtype="float32")  # atol 1e-5: float32, not the GPU's bf16
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
    q = result.cache.suffix_positions.numel()  # the protected tokens the pipeline passed
    assert result.extra["kv_cache_bytes"] == 2 * lm.n_layers * lm.n_kv_heads * lm.head_dim * 4 * (128 + q + 3)


def test_compressed_cache_shapes(tiny_lm):
    lm = tiny_lm("qwen3")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, words(600, seed=1), "Which word?")
    cache, logits, next_position = finch(lm, "finch:target=50,chunk=100").prefill(
        engine, prompt.ids, protected=prompt.n_after_document
    )
    q = prompt.n_after_document
    assert logits.shape == (lm.model.config.vocab_size,)
    assert next_position == 50 + q
    assert cache.positions.tolist() == list(range(50 + q))
    for layer in range(lm.n_layers):
        assert cache.keys[layer].shape == (1, lm.n_kv_heads, 50 + q, lm.head_dim)
        assert cache.values[layer].shape == cache.keys[layer].shape
        kept = cache.kept_positions[layer]
        assert kept.numel() == 50 and torch.all(kept[1:] > kept[:-1]) and int(kept[-1]) < prompt.doc_end


# --- knobs and the CLI ---------------------------------------------------------------------------


def test_knob_errors(tiny_lm):
    lm = tiny_lm("llama")
    for spec, needle in [
        ("finch:target=0", "target"),
        ("finch:chunk=0", "chunk"),
        ("finch:target=x", "target"),
        ("finch:kernel=4", "kernel"),
        ("finch:kernel=0", "kernel"),
    ]:
        with pytest.raises(UsageError, match=needle):
            parse_one(spec)
    with pytest.raises(UsageError, match="window"):
        finch(lm, "finch:target=4096")
    with pytest.raises(UsageError, match="room"):
        finch(lm, "finch:target=1000,chunk=3096")
    assert parse_one("finch").prefix_state(lm) is None  # depends on the question: nothing to store


def test_pipeline_protects_every_token_after_the_document(tiny_lm, monkeypatch):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, words(300, seed=5), "Which word?")
    pipeline = Pipeline.parse("finch:target=40,chunk=128")
    f = pipeline.stages[0]
    seen = []
    real = f.prefill
    monkeypatch.setattr(
        f,
        "prefill",
        lambda engine, ids, prefix=None, protected=0: seen.append(protected) or real(engine, ids, prefix, protected),
    )
    run(engine, prompt, pipeline, max_new_tokens=1, stop_ids=set())
    assert seen == [prompt.n_after_document]


def test_cli_reads_a_document_longer_than_the_window_with_finch_only(tiny_dir, tmp_path, capsys, monkeypatch):
    import json

    from tests.helpers.cli_runner import run_cli

    short = str(tiny_dir("llama", num_hidden_layers=4, max_position_embeddings=256))
    doc = tmp_path / "long.txt"
    doc.write_text(words(2000, seed=1) + "\n", encoding="utf-8")
    code, out, err = run_cli(["ask", doc, "q", "-m", short, "--max-new-tokens", "4", "-c", "full"], capsys, monkeypatch)
    assert code == 1 and "window" in err and "Traceback" not in err
    code, out, err = run_cli(
        ["ask", doc, "q", "-m", short, "--max-new-tokens", "4", "-c", "finch", "--json"], capsys, monkeypatch
    )
    assert code == 0, err
    record = json.loads(out)
    assert record["compressor"].startswith("finch:") and record["n_context_tokens"] > 256
