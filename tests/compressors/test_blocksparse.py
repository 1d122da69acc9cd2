"""Block-sparse retrieval attention (KTransformers' long-context framework, InfLLM + Quest):
covering every block equals full attention, chunked prefill equals one pass, Quest's bound holds,
the article's two equivalences (SnapKV without pooling, Quest) hold as presets, selections are
reused across layers and tokens, and the pipeline, stats and knob errors work."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvcli import notices
from kvcli.answer.pipeline import Pipeline, default_prefill, run
from kvcli.answer.prefix import Prefix
from kvcli.answer.prompt import build_prompt
from kvcli.caches.blocks import BlockCache, ScoredKVCache
from kvcli.caches.representatives import (
    block_representatives,
    block_scores,
    infllm_accumulate,
    infllm_scores,
    quest_upper_bound,
)
from kvcli.compressors import parse_one
from kvcli.compressors.base import Runtime
from kvcli.compressors.blocksparse import BlockSparse, default_local, default_topk
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from kvcli.store import KVStore
from tests.helpers.reference import assert_same_logits, causal_softmax, reference_qk

TOL = 1e-4
DOC = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} gulls." for i in range(12))
SMALL = "block_size=8,initial=4,local_window=8"  # ~25 blocks on the ~214-token test prompt


def prompt_for(lm, question="How many gulls?"):
    return build_prompt(lm.tokenizer, DOC, question)


def stage_for(lm, spec: str) -> BlockSparse:
    stage = Pipeline.parse(spec).stages[0]
    stage.configure(lm)
    return stage


def blocksparse_logits(engine, spec, ids, steps=5, prefix=None, trace=False, protected=0):
    """Prefill + compress + ``steps`` greedy decode steps with ``spec``: (logits per step, cache)."""
    stage = stage_for(engine.lm, spec)
    cache, logits, position = stage.prefill(engine, ids, prefix=prefix, protected=protected)
    cache = stage.compress(engine, cache)
    if trace:
        cache.trace = []
    out = [logits]
    for i in range(steps):
        out.append(stage.decode_step(engine, int(torch.argmax(out[-1])), position + i, cache))
    return out, cache


_FULL: dict = {}


def full_logits(engine, ids, steps=5):
    key = (engine.lm.name, id(engine.lm), tuple(ids.tolist()), steps)
    if key not in _FULL:
        _FULL[key] = _full_logits(engine, ids, steps)
    return _FULL[key]


def _full_logits(engine, ids, steps):
    cache, logits = engine.prefill(ids)
    out = [logits]
    for i in range(steps):
        out.append(engine.step(int(torch.argmax(out[-1])), ids.numel() + i, cache))
    return out


# --- covering every block == full attention ------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("rep", ["max", "mean", "quest", "dynamic", "infllm", "fixed"])
def test_topk_covering_every_block_reproduces_full_attention(tiny_lm, family, rep):
    lm = tiny_lm(family)
    engine = Engine(lm)
    ids = prompt_for(lm).ids
    want = full_logits(engine, ids)
    # one shared gather (llama) / per-KV-head gathers (qwen2); chunked prefill either way
    heads, chunk = ("shared", 16) if family == "llama" else ("separate", 100)
    spec = f"blocksparse:{SMALL},topk=1000,representative={rep},representative_num=2,head_select={heads},chunk={chunk}"
    got, cache = blocksparse_logits(engine, spec, ids)
    assert cache.n_blocks == 25 and cache.selections == 5 * lm.n_layers  # scored, not bypassed
    assert cache.stats()["kv_attended_frac"] == pytest.approx(1.0)
    assert_same_logits(got, want)


def test_preselecting_every_block_reproduces_full_attention(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    ids = prompt_for(lm).ids
    got, cache = blocksparse_logits(
        engine, f"blocksparse:{SMALL},topk=1000,preselect=true,preselect_blocks=1000,head_select=separate", ids
    )
    assert cache.stats()["preselected_blocks"] == 25
    assert_same_logits(got, full_logits(engine, ids))


def test_chunked_prefill_equals_one_pass(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    ids = prompt_for(lm).ids
    one, logits_one, _ = stage_for(lm, "blocksparse:chunk=4096").prefill(engine, ids)
    chunked, logits_chunked, n = stage_for(lm, "blocksparse:chunk=7").prefill(engine, ids)
    assert n == ids.numel() and torch.equal(chunked.positions, torch.arange(n))
    torch.testing.assert_close(logits_chunked, logits_one, atol=TOL, rtol=0)
    for a, b in zip(chunked.keys + chunked.values, one.keys + one.values):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_prefix_state_is_full_attentions_and_gives_the_same_answer(tiny_lm):
    """The prefix KV (as the disk store gives it) + the question's tokens == prefill from scratch,
    also when the observation window reaches back into the prefix (it is cut back and re-run)."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    spec = f"blocksparse:{SMALL},topk=3,preselect=true,window=24"  # window > the 11 question tokens
    stage = stage_for(lm, spec)
    assert stage.prefix_state(lm) == parse_one("full").prefix_state(lm)
    prefix = Prefix.of(engine, prompt, stage, None, {})
    assert prefix is not None and prompt.n_tokens - prefix.n_tokens < 24
    with_prefix, c1 = blocksparse_logits(engine, spec, prompt.ids, prefix=prefix)
    scratch, c2 = blocksparse_logits(engine, spec, prompt.ids)
    assert_same_logits(with_prefix, scratch)
    assert all(torch.equal(a, b) for a, b in zip(c1.candidates, c2.candidates))


# --- InfLLM's representative score ------------------------------------------------------------------

QUESTIONS = ("How many gulls?", "Which line has the most gulls, and how many did the keeper count there?")


def naive_infllm(q: torch.Tensor, k: torch.Tensor, local: int, rows: int, n_kv: int) -> torch.Tensor:
    """InfLLM's equation 1 from the whole q·kᵀ matrix: r_m = mean over the query rows g of its
    successors m < g <= m + local (g < rows) of q_g · k_m, per query head, then the mean over each
    KV head's query heads; -inf where no row follows. q, k: (1, H, n, d), k GQA-repeated."""
    dots = torch.matmul(q[0].double(), k[0].double().transpose(-1, -2))  # (H, n, n): [head, row g, key m]
    n = dots.shape[-1]
    out = torch.full((dots.shape[0], n), float("-inf"), dtype=torch.float64, device=dots.device)
    for m in range(n):
        successors = list(range(m + 1, min(m + local, rows - 1) + 1))
        if successors:
            out[:, m] = dots[:, successors, m].mean(dim=-1)
    return out.view(n_kv, -1, n).mean(dim=1)


def test_infllm_accumulate_equals_the_naive_score_across_row_chunks():
    """Random q/k, 600 rows in passes of 100 (as chunked prefill hands them), 64-row blocks inside
    a pass, a 40-token window, 3 query heads per KV head, rows from 450 on do not vote."""
    torch.manual_seed(0)
    n, d, local, rows = 600, 8, 40, 450
    q, k = torch.randn(1, 6, n, d), torch.randn(1, 2, n, d)
    total = torch.zeros(2, n)
    for s in range(0, n, 100):
        infllm_accumulate(total, q[:, :, s : s + 100], k[:, :, : s + 100], local, 0, rows, chunk=64)
    got = infllm_scores(total, local, rows)
    want = naive_infllm(q, k.repeat_interleave(3, dim=1), local, rows, 2)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    assert bool(torch.isinf(got[:, rows - 1 :]).all()) and bool(torch.isfinite(got[:, : rows - 1]).all())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_infllm_representatives_equal_a_naive_reference(tiny_lm, family):
    """Through blocksparse's chunked prefill (37-token chunks) on a real model: the per-token scores
    equal equation 1 computed from Hugging Face's own q and k, and each block's representatives
    are its keys of the highest scores; the question's queries never vote."""
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    rows, local = prompt.prefix_len, 8
    stage = stage_for(lm, f"blocksparse:{SMALL},representative=infllm,representative_num=2,chunk=37")
    kv, _, _ = stage.prefill(engine, prompt.ids, protected=prompt.n_suffix)
    scores = stage.infllm_scores()
    cache = stage.compress(engine, kv)
    assert cache.representative == "infllm" and cache.n_blocks == 25
    for layer, (q, k, _) in enumerate(reference_qk(lm, prompt.ids)):
        want = naive_infllm(q, k, local, rows, lm.n_kv_heads)
        torch.testing.assert_close(scores[layer].double().to(want.device), want, atol=1e-4, rtol=1e-5)
        ctx = cache.keys[layer][0]  # (n_kv, n_blocks * 8, d)
        for head in range(lm.n_kv_heads):
            for b in range(cache.n_blocks):
                block = want[head, 4 + 8 * b : 4 + 8 * (b + 1)]
                top = torch.sort(torch.topk(block, 2).indices).values.to(ctx.device)
                torch.testing.assert_close(cache.reps[layer][head, b], ctx[head, 8 * b + top].float())


def _reps(engine, spec, question, prefix_store=None):
    lm = engine.lm
    prompt = prompt_for(lm, question)
    stage = stage_for(lm, spec)
    prefix = None if prefix_store is None else Prefix.of(engine, prompt, stage, prefix_store, {})
    logits, cache = blocksparse_logits(engine, spec, prompt.ids, steps=2, prefix=prefix, protected=prompt.n_suffix)
    whole = (prompt.prefix_len - cache.initial) // cache.block_size  # blocks inside the document prefix
    return prompt, cache, whole, logits, prefix


def test_infllm_representatives_do_not_change_with_the_question_dynamic_ones_do(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    for rep, same in (("infllm", True), ("dynamic", False)):
        spec = f"blocksparse:{SMALL},representative={rep}"
        (p1, c1, w1, _, _), (p2, c2, w2, _, _) = (_reps(engine, spec, q) for q in QUESTIONS)
        assert p1.prefix_len == p2.prefix_len and p1.n_tokens != p2.n_tokens and w1 == w2 >= 20
        equal = [torch.allclose(a[:, :w1], b[:, :w1], atol=1e-5, rtol=1e-5) for a, b in zip(c1.reps, c2.reps)]
        assert all(equal) if same else not all(equal), rep


def test_infllm_prefix_state_keeps_the_scores_and_serves_any_question(tiny_lm, tmp_path):
    """representative=infllm stores full attention's KV plus the score sums of the document's own
    queries (its own entry, not -c full's); a second question loads it, its representatives of
    the document blocks are the first question's bit for bit, and the answer equals a prefill
    from scratch."""
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    spec = f"blocksparse:{SMALL},representative=infllm,topk=3"
    stage = stage_for(lm, spec)
    state = stage.prefix_state(lm)
    assert state["kind"] == "kv+infllm" and state != parse_one("full").prefix_state(lm)
    store = KVStore.open(tmp_path)
    p1, c1, w, l1, prefix1 = _reps(engine, spec, QUESTIONS[0], store)
    p2, c2, _, l2, prefix2 = _reps(engine, spec, QUESTIONS[1], store)
    assert (prefix1.fetched.status, prefix2.fetched.status) == ("miss", "hit")
    assert isinstance(prefix2.copy(), ScoredKVCache) and prefix2.copy().rows_scored == p2.prefix_len
    assert all(torch.equal(a[:, :w], b[:, :w]) for a, b in zip(c1.reps, c2.reps))
    _, scratch, _, l_scratch, _ = _reps(engine, spec, QUESTIONS[1])
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(c2.reps, scratch.reps))
    assert_same_logits(l2, l_scratch)
    # the stored entry round-trips (what the store verified when it loaded it)
    tensors, facts = prefix2.copy().to_tensors()
    back = ScoredKVCache.from_tensors(tensors, json.loads(json.dumps(facts)))
    assert back.rows_scored == p2.prefix_len
    assert all(torch.equal(a, b) for a, b in zip(back.rep_sums, prefix2.copy().rep_sums))
    with pytest.raises(ValueError, match="representative-score"):
        ScoredKVCache.from_tensors({k: v for k, v in tensors.items() if k != "rep.1"}, facts)


# --- Quest's upper bound --------------------------------------------------------------------------


def test_quest_upper_bound_is_at_least_the_true_max():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        d = int(torch.randint(1, 65, (1,), generator=gen))
        size = int(torch.randint(1, 33, (1,), generator=gen))
        n_blocks = int(torch.randint(1, 6, (1,), generator=gen))
        scale = float(torch.rand(1, generator=gen)) * 10 + 0.01
        shift = (torch.rand(d, generator=gen) - 0.5) * 4
        keys = torch.randn(n_blocks, size, d, generator=gen) * scale + shift
        q = torch.randn(d, generator=gen) * float(torch.rand(1, generator=gen) * 5)
        ub = quest_upper_bound(q, keys.amax(dim=1), keys.amin(dim=1))  # (n_blocks,)
        true_max = (keys @ q).amax(dim=1)
        assert bool((ub >= true_max - 1e-4 * (1 + true_max.abs())).all())
        # and the cache's scorer uses exactly that bound (one KV head, one query head)
        reps = block_representatives(keys[None], "quest", 2)
        torch.testing.assert_close(block_scores(q[None], reps, "quest", shared=False)[0], ub)
        if size == 1:  # a one-token block: the bound is the dot product itself
            torch.testing.assert_close(ub, true_max, atol=1e-4, rtol=1e-5)


# --- the article's equivalences as presets ----------------------------------------------------------


def snapkv_cache(engine, ids, spec):
    pipeline = Pipeline.parse(spec)
    cache, logits = default_prefill(engine, ids, None, pipeline.compressors())
    for stage in pipeline.compressors():
        cache = stage.compress(engine, cache)
    out = [logits]
    for i in range(5):
        out.append(engine.step(int(torch.argmax(out[-1])), ids.numel() + i, cache))
    return cache, out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_preset_snapkv_is_snapkv_without_pooling(tiny_lm, family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    ids = prompt_for(lm).ids
    n, w, budget = ids.numel(), 8, 40
    stage = stage_for(lm, f"blocksparse:preset=snapkv,window={w},preselect_blocks={budget - w}")
    assert (stage.block_size, stage.preselect, stage.initial, stage.local_window, stage.head_select, stage.topk) == (
        1,
        True,
        0,
        w,
        "separate",
        budget - w,
    )
    snap, snap_out = snapkv_cache(engine, ids, f"snapkv:budget={budget},window={w},kernel=1")
    got, cache = blocksparse_logits(engine, f"blocksparse:preset=snapkv,window={w},preselect_blocks={budget - w}", ids)
    assert cache.n_blocks == n - w
    for layer in range(lm.n_layers):
        for head in range(lm.n_kv_heads):
            picked = cache.candidates[layer][head].cpu().tolist() + list(range(n - w, n))  # block b = token b
            assert picked == snap.kept[layer][head].tolist()
    # decoding attends to exactly those tokens (+ the generated ones): SnapKV's logits
    assert_same_logits(got, snap_out)
    steps = [(budget + i + 1) / (n + i + 1) for i in range(5)]
    assert cache.stats()["kv_attended_frac"] == pytest.approx(sum(steps) / 5)


def test_preset_quest_selects_blocks_per_kv_head_by_the_upper_bound(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    ids = prompt_for(lm).ids
    spec = "blocksparse:preset=quest,topk=2"
    stage = stage_for(lm, spec)
    assert (stage.representative, stage.preselect, stage.head_select, stage.block_size, stage.dense_layers) == (
        "quest",
        False,
        "separate",
        16,
        2,
    )
    _, cache = blocksparse_logits(engine, spec, ids, trace=True)
    group = lm.n_heads // lm.n_kv_heads
    by_layer = cache.stats()["kv_attended_frac_by_layer"]
    assert by_layer[:2] == [1.0, 1.0] and all(f < 0.5 for f in by_layer[2:])  # Quest skips the first two layers
    differ = 0
    assert len(cache.trace) == 5 * 2
    for entry in cache.trace:
        layer, q, blocks = entry["layer"], entry["query"], entry["blocks"]
        assert entry["computed"] and blocks.shape == (lm.n_kv_heads, 2)
        ctx = cache.keys[layer][0].float().cpu()  # (n_kv, n_blocks * 16, d), where the trace keeps the query
        for head in range(lm.n_kv_heads):
            k = ctx[head].reshape(cache.n_blocks, 16, -1)
            kmax, kmin = k.amax(dim=1), k.amin(dim=1)
            qs = q[head * group : (head + 1) * group].float()  # the query heads of this KV head
            ub = torch.stack([torch.maximum(qq * kmax, qq * kmin).sum(-1) for qq in qs]).sum(0)
            chosen = torch.zeros(cache.n_blocks, dtype=torch.bool)
            chosen[blocks[head]] = True
            assert ub[chosen].min() >= ub[~chosen].max() - 1e-4
        differ += int(not torch.equal(blocks[0], blocks[1]))
    assert differ > 0  # KV heads really choose separately


# --- the selection with few blocks, every representative, against a reference -------------------------


def reference_representatives(
    keys: torch.Tensor, kind: str, num: int, votes: torch.Tensor | None, block_size: int
) -> torch.Tensor:
    """The article's representatives written out block by block: keys (n_blocks * block_size, d)
    of one KV head's Context -> (n_blocks, num, d); ``votes`` (n_blocks * block_size,) for dynamic."""
    out = []
    for b in range(keys.shape[0] // block_size):
        block = keys[b * block_size : (b + 1) * block_size]
        piece = block_size // num
        if kind == "max":
            reps = [block[i * piece : (i + 1) * piece].max(dim=0).values for i in range(num)]
        elif kind == "mean":
            reps = [block[i * piece : (i + 1) * piece].mean(dim=0) for i in range(num)]
        elif kind == "fixed":
            reps = [block[i * piece] for i in range(num)]
        else:  # dynamic: the num best-voted tokens of the block
            v = votes[b * block_size : (b + 1) * block_size]
            best = sorted(range(block_size), key=lambda t: -float(v[t]))[:num]
            reps = [block[t] for t in sorted(best)]
        out.append(torch.stack(reps))
    return torch.stack(out)


@pytest.mark.parametrize(
    "rep, heads",
    [("dynamic", "shared"), ("max", "shared"), ("mean", "separate"), ("fixed", "shared"), ("dynamic", "separate")],
)
def test_few_blocks_are_the_best_scored_by_a_reference(tiny_lm, rep, heads):
    """topk=2 of 25 blocks: at every decode step and layer, the two chosen blocks (per KV head, or
    one pair for the layer when shared) are the two best by InfLLM's equation 2 — sum over the
    representatives of q · r, summed over the query heads of each KV head (and over the KV heads
    when shared) — with the representatives computed by hand from Hugging Face's own keys
    (dynamic: the attention of the last ``window`` prompt queries, summed, mean over the group)."""
    lm = tiny_lm("qwen2")  # GQA: 2 query heads per KV head
    engine = Engine(lm)
    ids = prompt_for(lm).ids
    window = 16
    spec = f"blocksparse:{SMALL},topk=2,representative={rep},representative_num=2,head_select={heads},window={window}"
    _, cache = blocksparse_logits(engine, spec, ids, trace=True)
    n_kv, group = lm.n_kv_heads, lm.n_heads // lm.n_kv_heads
    assert cache.n_blocks == 25 and len(cache.trace) == 5 * lm.n_layers
    reps = []
    for q, k, attn in reference_qk(lm, ids):
        ctx = k[0, ::group, 4 : 4 + 25 * 8].float()  # (n_kv, 200, d): one copy of each KV head
        votes = causal_softmax(q, k, attn.scaling)[0, :, -window:, 4 : 4 + 25 * 8].sum(dim=1)  # (n_heads, 200)
        votes = votes.view(n_kv, group, -1).mean(dim=1)
        reps.append(torch.stack([reference_representatives(ctx[h], rep, 2, votes[h], 8) for h in range(n_kv)]))
    for entry in cache.trace:
        r = reps[entry["layer"]]  # (n_kv, 25, 2, d)
        query = entry["query"].float().view(n_kv, group, -1).to(r.device)  # the step's query heads, by KV head
        scores = torch.einsum("hgd,hbrd->hb", query, r)  # sum over the group's heads and the representatives
        if heads == "shared":
            scores = scores.sum(dim=0, keepdim=True)
        blocks = entry["blocks"]
        assert entry["computed"] and blocks.shape == (scores.shape[0], 2)
        for h in range(scores.shape[0]):
            chosen = torch.zeros(25, dtype=torch.bool, device=scores.device)
            chosen[blocks[h].to(scores.device)] = True
            assert float(scores[h][chosen].min()) >= float(scores[h][~chosen].max()) - 1e-4, (
                entry["step"],
                entry["layer"],
                h,
            )
    picked = {tuple(e["blocks"].flatten().tolist()) for e in cache.trace}
    assert len(picked) > 1  # the choice changes with the layer or the step: it is not a fixed pair


# --- dense layers, reuse across layers and tokens ------------------------------------------------------


def test_dense_layers_attend_to_everything(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    _, cache = blocksparse_logits(
        engine, f"blocksparse:{SMALL},topk=1,dense_layers=2,representative=mean", prompt_for(lm).ids
    )
    by_layer = cache.stats()["kv_attended_frac_by_layer"]
    assert by_layer[:2] == [1.0, 1.0] and all(f < 0.2 for f in by_layer[2:])
    assert cache.selections == 5 * 2


def test_layer_step_and_token_step_reuse_selections(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    _, cache = blocksparse_logits(
        engine,
        f"blocksparse:{SMALL},topk=2,layer_step=2,token_step=2,head_select=separate",
        prompt_for(lm).ids,
        trace=True,
    )
    # selections at steps 0, 2, 4 in layers 0 and 2; the other 14 (step, layer) pairs reuse them
    assert cache.stats()["decode_steps"] == 5
    assert (cache.selections, cache.reuses) == (6, 14)
    last = {}
    for e in cache.trace:
        group = e["layer"] // 2
        assert e["computed"] == (e["step"] % 2 == 0 and e["layer"] % 2 == 0)
        if not e["computed"]:
            assert torch.equal(e["blocks"], last[group])
        last[group] = e["blocks"]


# --- the cache's report ----------------------------------------------------------------------------------


def test_kept_mask_stats_and_bytes(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    ids = prompt_for(lm).ids
    n = ids.numel()
    _, cache = blocksparse_logits(engine, f"blocksparse:{SMALL},topk=3,preselect=true,preselect_blocks=6", ids)
    mask = cache.kept_mask(n)
    assert mask.shape == (lm.n_layers, lm.n_kv_heads, n) and bool(mask.all())  # nothing thrown away
    stats = json.loads(json.dumps(cache.stats()))
    assert stats["decode_steps"] == 5 and stats["blocks"] == 25 and stats["preselected_blocks"] == 6
    assert 0 < stats["kv_attended_frac"] < 0.3
    assert stats["initial_tokens"] + stats["context_tokens"] + stats["local_tokens"] == n
    full_bytes = 2 * lm.n_layers * lm.n_kv_heads * (n + 5) * lm.head_dim * 4
    assert cache.nbytes() > full_bytes and cache.get_seq_length(0) == n + 5
    other = cache.copy()
    other.fkeys[0] = other.fkeys[0][:, :, :1]
    assert cache.get_seq_length(0) == n + 5


# --- pipeline, offload, knobs ------------------------------------------------------------------------------


def test_end_to_end_pipeline(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    ref = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=6, stop_ids=set())
    same = run(
        engine, prompt, Pipeline.parse(f"blocksparse:{SMALL},topk=1000,chunk=64"), max_new_tokens=6, stop_ids=set()
    )
    assert same.answer_ids == ref.answer_ids
    infllm = run(
        engine,
        prompt,
        Pipeline.parse(f"blocksparse:{SMALL},topk=1000,chunk=64,representative=infllm"),
        max_new_tokens=6,
        stop_ids=set(),
    )
    assert infllm.answer_ids == ref.answer_ids and infllm.extra["method_stats"]["representative"] == "infllm"
    # after a selector the selected tokens are scored from scratch (no prefix state applies)
    picked = run(
        engine,
        prompt,
        Pipeline.parse(
            "gemfilter:k=120,layer=2+blocksparse:block_size=8,initial=4,local_window=8,topk=2,representative=infllm"
        ),
        max_new_tokens=3,
        stop_ids=set(),
    )
    assert picked.selection.n_kept == 120 and len(picked.answer_ids) == 3
    sparse = run(engine, prompt, Pipeline.parse(f"blocksparse:{SMALL},topk=2"), max_new_tokens=6, stop_ids=set())
    assert len(sparse.answer_ids) == 6 and isinstance(sparse.cache, BlockCache)
    assert sparse.extra["method_stats"]["decode_steps"] == 5
    assert sparse.extra["method_stats"]["kv_attended_frac"] < 0.3
    assert bool(sparse.kept_mask().all())
    quest = run(engine, prompt, Pipeline.parse("blocksparse:preset=quest,topk=2"), max_new_tokens=3, stop_ids=set())
    assert len(quest.answer_ids) == 3 and quest.extra["method_stats"]["head_select"] == "separate"


@pytest.mark.cpu_only("--kv-offload cpu does nothing only where the model already runs on the CPU")
def test_kv_offload_on_cpu_is_a_noop_with_a_note(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    pipeline = Pipeline.parse(f"blocksparse:{SMALL},topk=2")
    pipeline.stages[0].runtime = Runtime(kv_offload="cpu")
    notices.reset()
    result = run(engine, prompt, pipeline, max_new_tokens=4, stop_ids=set())
    assert any("--kv-offload cpu has no effect" in m for m in notices.collected())
    assert result.extra["method_stats"]["kv_offload"] == "none"
    plain = run(engine, prompt, Pipeline.parse(f"blocksparse:{SMALL},topk=2"), max_new_tokens=4, stop_ids=set())
    assert plain.answer_ids == result.answer_ids
    notices.reset()


@pytest.mark.cpu_only("the Context blocks are views of a KV already on the host; from a GPU they are copies")
def test_offloaded_block_cache_holds_the_context_in_storage_and_gathers_the_chosen_blocks(tiny_lm):
    """The --kv-offload cpu layout, built on CPU (storage and compute on the same device here, so
    the copies can be checked, not the transfer): the Context blocks of a KV already in host
    memory (the offloaded prefill's) are views of it, not copies (a host copy of the whole KV
    would hold it twice); Initial + Local stay with the compute device, and a decode step
    gathers exactly Initial + the selected blocks' tokens + Local, per KV head."""
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    kv = engine.prefix_kv(prompt_for(lm).ids)
    n = kv.get_seq_length(0)
    cache = BlockCache.from_kv(
        kv, local=8, initial=4, block_size=8, representative="max", topk=2, head_select="separate", offload=True
    )
    assert cache.offload and cache.stats()["kv_offload"] == "cpu" and cache.n_blocks == 25
    for layer in range(lm.n_layers):
        k = kv.keys[layer]
        assert cache.keys[layer].untyped_storage().data_ptr() == k.untyped_storage().data_ptr()  # a view, no copy
        assert torch.equal(cache.keys[layer], k[:, :, 4:204]) and torch.equal(
            cache.values[layer], kv.values[layer][:, :, 4:204]
        )
        assert torch.equal(cache.fkeys[layer], torch.cat([k[:, :, :4], k[:, :, 204:]], dim=2))
    cache.trace = []
    cache.step = 0
    torch.manual_seed(0)
    for layer in range(lm.n_layers):
        query = torch.randn(1, lm.n_heads, 1, lm.head_dim)
        keys, values = cache.gather(layer, query)
        blocks = cache.trace[-1]["blocks"]  # (n_kv, 2): each KV head's chosen blocks
        assert blocks.shape == (lm.n_kv_heads, 2)
        for h in range(lm.n_kv_heads):
            tokens = list(range(4)) + [4 + 8 * int(b) + i for b in blocks[h] for i in range(8)] + list(range(204, n))
            assert torch.equal(keys[0, h], kv.keys[layer][0, h, tokens]), (layer, h)
            assert torch.equal(values[0, h], kv.values[layer][0, h, tokens]), (layer, h)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kv_offload_on_cuda_keeps_the_kv_in_cpu_memory(tiny_dir):
    from kvcli.model import load_model

    lm = load_model(str(tiny_dir("llama", num_hidden_layers=4)), device="cuda")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    spec = f"blocksparse:{SMALL},topk=2,preselect=true"
    plain = run(engine, prompt, Pipeline.parse(spec), max_new_tokens=6, stop_ids=set())
    pipeline = Pipeline.parse(spec)
    pipeline.stages[0].runtime = Runtime(kv_offload="cpu")
    off = run(engine, prompt, pipeline, max_new_tokens=6, stop_ids=set())
    assert off.answer_ids == plain.answer_ids
    assert off.extra["method_stats"]["kv_offload"] == "cpu"
    assert all(k.device.type == "cpu" for k in off.cache.keys)
    assert all(r.device.type == "cuda" for r in off.cache.reps)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("blocksparse:block_size=0", "block_size must be at least 1"),
        ("blocksparse:topk=0", "topk must be at least 1"),
        ("blocksparse:representative=median", "representative must be one of"),
        ("blocksparse:head_select=each", "head_select must be shared or separate"),
        ("blocksparse:preset=infllm", "preset must be one of"),
        ("blocksparse:layer_step=0", "layer_step must be at least 1"),
        ("blocksparse:token_step=0", "token_step must be at least 1"),
        ("blocksparse:window=0", "window must be at least 1"),
        ("blocksparse:initial=-1", "initial must be at least 0"),
        ("blocksparse:preselect=maybe", "expects bool"),
    ],
)
def test_bad_knobs(spec, message):
    with pytest.raises(UsageError, match=message):
        Pipeline.parse(spec)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("blocksparse:representative=quest,representative_num=3", "always 2"),
        ("blocksparse:block_size=4,representative_num=8,representative=max", "exceeds block_size"),
        ("blocksparse:dense_layers=9", "exceeds the model's 4 layers"),
        ("blocksparse:representative=infllm,local_window=0", "local_window must be at least 1"),
    ],
)
def test_knobs_checked_against_the_model(tiny_lm, spec, message):
    with pytest.raises(UsageError, match=message):
        stage_for(tiny_lm("llama"), spec)


def test_defaults_and_presets_fill_only_unset_knobs(tiny_lm):
    lm = tiny_lm("llama")  # 4096-token window
    stage = stage_for(lm, "blocksparse")
    assert (stage.block_size, stage.representative, stage.head_select, stage.preselect) == (
        128,
        "dynamic",
        "shared",
        False,
    )
    assert stage.local_window == default_local(4096) == 128 and stage.topk == default_topk(4096, 128) == 3
    assert default_local(131072) == 4096 and default_topk(131072, 128) == 96  # the article's values at 128K
    assert stage.preselect_blocks == 6
    quest = stage_for(lm, "blocksparse:preset=quest,block_size=32,head_select=shared")
    assert (quest.block_size, quest.head_select, quest.representative) == (32, "shared", "quest")
    snap = stage_for(lm, "blocksparse:preset=snapkv")
    assert (snap.window, snap.local_window, snap.preselect_blocks, snap.topk) == (32, 32, 992, 992)
    assert "blocksparse" in parse_one("blocksparse").spec() and math.isfinite(stage.chunk)
