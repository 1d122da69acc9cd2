"""KVzip: keeping everything equals full attention; the scores are the maximum attention each
prefix entry receives while the model reconstructs the context, recomputed from the Hugging Face
model's own q/k on [prefix + reconstruction prompt + chunk] sequences; the global budget; the
compressed prefix reused from the disk store for any question."""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.answer.prompt import build_prompt
from kvcli.caches import RaggedCache
from kvcli.compressors import parse_one
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from tests.helpers.reference import reference_qk
from tests.helpers.runs import prompt_for


def build(lm, spec):
    method = parse_one(spec)
    method.configure(lm)
    return method


def test_spec_round_trip_and_errors(tiny_lm):
    assert (
        parse_one("kvzip").spec() == "kvzip:budget=1024,allocation=global,safeguard=0.2,sinks=auto,chunk=2000,overlap=8"
    )
    spec = "kvzip:budget=0.2,allocation=uniform,sinks=4,chunk=512,overlap=0"
    assert parse_one(parse_one(spec).spec()).spec() == parse_one(spec).spec()
    lm = tiny_lm("llama")
    head = build_prompt(lm.tokenizer, "doc", "q").doc_start  # the chat template's head before the document
    assert build(lm, "kvzip").sinks == head > 4
    for spec, message in [
        ("kvzip:chunk=0", "chunk must be at least 1"),
        ("kvzip:overlap=-1", "overlap must be at least 0"),
        ("kvzip:sinks=-1", "sinks must be at least 0"),
        ("kvzip:allocation=layer", "allocation must be one of"),
        ("kvzip:budget=2,sinks=4", "smaller than the 4 tokens"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_one(spec)
    with pytest.raises(UsageError, match="smaller than the"):
        build(lm, "kvzip:budget=8")  # auto sinks (the chat head) > 8


# --- the paper's scores, from the HF model -------------------------------------------------------------


def naive_kvzip_scores(lm, prefix, sinks, chunk, overlap):
    """Per layer (n_kv, n): for each chunk, HF's own q/k of the sequence prefix + reconstruction
    prompt + chunk; per query head the softmax of each reconstruction row over [sinks, chunk keys,
    the reconstruction's keys up to itself]; the max over rows and the heads of each KV group."""
    tok = lm.tokenizer
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    question = "Q?"
    p = build_prompt(tok, "doc", question)
    tail = p.ids[p.prefix_len + len(enc(question)) :].tolist()  # end of the user turn + generation prompt
    n, group = prefix.numel(), lm.n_heads // lm.n_kv_heads
    scores = [torch.full((lm.n_kv_heads, n), float("inf")) for _ in range(lm.n_layers)]
    context = prefix[sinks:].tolist()
    for i, start in enumerate(range(0, len(context), chunk)):
        piece = context[start : start + chunk]
        ask = (
            enc("Repeat the previous context exactly.")
            if i == 0
            else enc("Repeat the part of the previous context exactly, starting with ")
            + context[max(0, start - overlap) : start]
        )
        rep = ask + tail + piece
        r = len(rep)
        seq = torch.cat([prefix, torch.tensor(rep)])
        a, b = sinks + start, sinks + start + len(piece)
        cols = list(range(sinks)) + list(range(a, b)) + list(range(n, n + r))
        for l, (q, k, _attn) in enumerate(reference_qk(lm, seq)):
            for h in range(lm.n_heads):
                logits = q[0, h, n:].double() @ k[0, h, cols].double().T / math.sqrt(lm.head_dim)  # (r, |cols|)
                for row in range(r):
                    logits[row, sinks + (b - a) + row + 1 :] = float("-inf")  # causal among the repeat
                probs = torch.softmax(logits, dim=-1)[:, sinks : sinks + b - a].max(dim=0).values.cpu()  # scores: host
                g = h // group
                prev = scores[l][g, a:b]
                scores[l][g, a:b] = probs.float() if h % group == 0 else torch.maximum(prev, probs.float())
    return scores


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_scores_and_global_selection_are_kvzips(tiny_lm, family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prefix = prompt_for(lm).ids[: prompt_for(lm).prefix_len]
    n, budget, sinks, chunk, overlap = prefix.numel(), 40, 5, 64, 3
    method = build(lm, f"kvzip:budget={budget},sinks={sinks},chunk={chunk},overlap={overlap}")
    want = naive_kvzip_scores(lm, prefix, sinks, chunk, overlap)
    _, got = method.prefix_scores(engine, prefix)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-6)
    cache = method.build_prefix(engine, prefix)
    assert isinstance(cache, RaggedCache)
    total = budget * lm.n_kv_heads * lm.n_layers
    assert sum(int(l.sum()) for l in cache.lengths) == total
    # the kept entries are the best `total` of all layers and heads together (sinks everywhere)
    flat = torch.cat([w.flatten() for w in want])
    threshold = torch.topk(flat, total).values[-1]
    for l in range(lm.n_layers):
        for h in range(lm.n_kv_heads):
            kept = cache.kept[l][h][: int(cache.lengths[l][h])]
            chosen = torch.zeros(n, dtype=torch.bool)
            chosen[kept] = True
            assert chosen[:sinks].all()
            assert (want[l][h][chosen] >= threshold * (1 - 1e-4)).all()
            assert (want[l][h][~chosen] <= threshold * (1 + 1e-4)).all()
    assert len({int(x) for l in cache.lengths for x in l}) > 1  # non-uniform budgets


# --- question-agnostic: the disk store keeps the compressed prefix -----------------------------------


def test_compressed_prefix_is_reused_for_any_question(tiny_lm, tmp_path):
    from tests.helpers.stores import Q1, Q2, ask, entry_files, session_for

    lm = tiny_lm("llama")
    spec = "kvzip:budget=0.3,chunk=100"
    cold = ask(session_for(lm, tmp_path), spec, Q1)
    warm = ask(session_for(lm, tmp_path), spec, Q1)
    other = ask(session_for(lm, tmp_path), spec, Q2)
    off = ask(session_for(lm, None, use_cache=False), spec, Q1)
    assert cold.extra["cache"]["status"] == "miss"
    assert warm.extra["cache"]["status"] == other.extra["cache"]["status"] == "hit"
    assert cold.answer_ids == warm.answer_ids == off.answer_ids and len(cold.answer_ids) == 8
    assert other.answer_ids == ask(session_for(lm, None, use_cache=False), spec, Q2).answer_ids
    assert len(entry_files(tmp_path)) == 1 and isinstance(warm.cache, RaggedCache)
    # inspect's view: the question and the sinks kept by every head, the prefix by budget
    mask = warm.kept_mask()
    n_prefix = warm.prompt.prefix_len
    assert mask[:, :, n_prefix:].all() and mask[:, :, : build(lm, spec).sinks].all()
    assert int(mask[:, :, :n_prefix].sum()) == round(0.3 * n_prefix) * lm.n_kv_heads * lm.n_layers


def test_chunks_fit_in_the_window(tiny_lm):
    lm = tiny_lm("llama", max_position_embeddings=300)
    assert lm.max_context == 300
    method = build(lm, "kvzip")
    prefix = prompt_for(lm).ids[: prompt_for(lm).prefix_len]
    n = prefix.numel()
    chunk = method.chunk_within_window(lm, n)
    assert 1 <= chunk < 300 - n
    from kvcli.compressors.kvzip import reconstruction_inputs

    for _, _, ids in reconstruction_inputs(lm.tokenizer, prefix[method.sinks :], chunk, method.overlap):
        assert n + ids.numel() <= 300
    assert build(tiny_lm("llama"), "kvzip").chunk_within_window(tiny_lm("llama"), n) == 2000
