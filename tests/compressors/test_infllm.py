"""InfLLM's stored book (kvcli.compressors.infllm, kvcli.caches.book, kvcli.caches.bookfile,
kvcli.store.book): the reading and the question checked against InfLLM written out plainly on
transformers' own layers (positions, memory blocks, representatives, retrieval, one softmax);
the stored entry (16-bit, opened in place, CRC-checked) answers as the in-memory book does; an
entry over the cap answers without storing and says so; an interrupted read leaves no entry, only
a partial one that the next read resumes (tests/test_book_resume.py); knob errors are one line."""

from __future__ import annotations

import pytest
import torch

from kvcli import notices
from kvcli.answer.pipeline import Pipeline, run
from kvcli.answer.prompt import build_prompt
from kvcli.caches.book import BookCache
from kvcli.caches.bookfile import HEADER_ROOM, NewFile
from kvcli.caches.representatives import partition
from kvcli.compressors import parse_one
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from kvcli.runtime.windows import Windows
from kvcli.store import KVStore
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one intra-op thread in this module)

DOC = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} gulls near rock {i % 5}." for i in range(10))
SPEC = "infllm:block_size=8,initial=4,local_window=16,topk=3,chunk=12,repr_topk=2,kv_dtype=model"


def stage(lm, spec=SPEC):
    s = parse_one(spec)
    s.configure(lm)
    return s


class _Prefix:
    """The pipeline's Prefix, reduced to what InfLLM.prefill reads."""

    def __init__(self, book, n):
        self.book, self.n_tokens = book, n

    def take(self):
        return self.book.copy()


# --------------------------------------------------------------------------- the reference


def infllm_reference(
    lm,
    doc_ids,
    question_ids,
    *,
    initial,
    block_size,
    local,
    topk,
    repr_topk,
    chunk,
    follow=None,
    tol=1e-5,
    answer_topk=None,
    ordered=False,
    token_scores=False,
    attention_scores=False,
    filter_layer=None,
):
    """InfLLM (Xiao et al. 2024) on a llama's own modules, one query at a time.

    The document runs in chunks of ``chunk``. Before a chunk starting at s, Memory holds the blocks
    j (tokens initial + j*bs ...) whose end is at most s - local (at most those the whole document
    will have); Local starts after the last of them (at 0 while there is none). Each block's
    representatives: its repr_topk tokens with the highest mean q·k from their ``local`` successors
    (the group's query heads averaged; RoPE at true positions). A chunk's blocks: the topk by
    (sum of the chunk's queries rotated to position ``local``) · (sum of the representatives' keys
    before RoPE), per KV head (its group's query heads summed). A query at p attends, in one
    softmax, to Initial and the chosen blocks (keys before RoPE, query at ``local``) and to Local
    tokens t in [origin, p] (query at p - origin, key at t - origin). The question is one more
    chunk, with every block in Memory. Returns (logits of the last question token, the blocks
    the question chose per layer).

    ``follow``: {(pass start, layer): blocks per KV head} the method chose; each must be a top-k of
    the reference's own scores (a near-tie, within ``tol``, may break either way) and the reference
    continues with it, so one near-tie cannot make the two diverge.

    ``ordered`` (``answer_positions=ordered``): in the question's pass, Initial and the chosen
    blocks' tokens, in document order, are positions 0, 1, ..., and a query at p is position
    (their count) + p - origin, as if Local followed them. ``token_scores``
    (``answer_scores=tokens``): the question scores block j by the best of its tokens' keys (before
    RoPE) against the summed queries. ``attention_scores`` (``answer_scores=attention``): each
    question query (rotated to ``local``) takes a softmax over every Memory key (before RoPE) of
    its KV head, scaled as the model's attention; block j scores the weight its tokens get,
    summed over the queries and the group's heads. ``filter_layer`` r: the question runs first as
    a probe up to layer r, whose queries' softmax weights over every Memory key, summed over all
    the layer's heads and the block's tokens, choose ``answer_topk`` blocks; then the question's
    pass attends to those blocks at every layer and KV head."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = lm.model.model
    dev = lm.device  # every tensor of the reference where the model runs
    n_doc = doc_ids.numel()
    _, max_blocks, _ = partition(n_doc, initial, local, block_size)
    ids = torch.cat([doc_ids, question_ids]).to(dev)
    n = ids.numel()
    n_kv = model.layers[0].self_attn.config.num_key_value_heads
    d = model.layers[0].self_attn.head_dim
    group = model.layers[0].self_attn.config.num_attention_heads // n_kv
    pre_q = [torch.zeros(1, n_kv * group, n, d, device=dev) for _ in model.layers]
    pre_k = [torch.zeros(1, n_kv, n, d, device=dev) for _ in model.layers]
    vals = [torch.zeros(1, n_kv, n, d, device=dev) for _ in model.layers]

    def rot(x, positions):
        cos, sin = model.rotary_emb(x, torch.as_tensor(positions, device=dev).view(1, -1))
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    def repsum(layer, j):
        lo = initial + j * block_size
        out = torch.zeros(n_kv, d, device=dev)
        for h in range(n_kv):
            scores = []
            for t in range(lo, lo + block_size):
                kt = rot(pre_k[layer][:, h : h + 1, t : t + 1], [t])[0, 0, 0]
                qs = [
                    rot(pre_q[layer][:, h * group + g : h * group + g + 1, u : u + 1], [u])[0, 0, 0]
                    for u in range(t + 1, t + local + 1)
                    for g in range(group)
                ]
                scores.append(float((torch.stack(qs) @ kt).sum()) / len(qs))
            top = sorted(range(block_size), key=lambda i: -scores[i])[:repr_topk]
            out[h] = sum(pre_k[layer][0, h, lo + i] for i in top)
        return out

    chosen_by_question = []
    edges = list(range(0, n_doc, chunk)) + [n_doc]
    passes = (
        list(zip(edges[:-1], edges[1:])) + ([("probe", n_doc, n)] if filter_layer is not None else []) + [(n_doc, n)]
    )
    shared = None
    reps: list[dict] = [dict() for _ in model.layers]
    logits = None
    with torch.inference_mode():
        for item in passes:
            probe, (s, e) = item[0] == "probe", item[-2:]
            blocks = [j for j in range(max_blocks) if initial + (j + 1) * block_size <= s - local]
            origin = initial + len(blocks) * block_size if blocks else 0
            hidden = model.embed_tokens(ids[s:e].view(1, -1))
            for layer_i, layer in enumerate(model.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(hidden)
                c = e - s
                q = attn.q_proj(h).view(1, c, -1, d).transpose(1, 2)
                k = attn.k_proj(h).view(1, c, -1, d).transpose(1, 2)
                v = attn.v_proj(h).view(1, c, -1, d).transpose(1, 2)
                pre_q[layer_i][:, :, s:e], pre_k[layer_i][:, :, s:e], vals[layer_i][:, :, s:e] = q, k, v
                for j in blocks:
                    if j not in reps[layer_i]:
                        reps[layer_i][j] = repsum(layer_i, j)
                picks = []
                if blocks and shared is not None and not probe:
                    picks = [shared] * n_kv
                elif blocks and probe and layer_i == filter_layer:
                    q_mem = rot(q, [local] * c)
                    mem_t = [t for j in blocks for t in range(initial + j * block_size, initial + (j + 1) * block_size)]
                    w = torch.zeros(len(mem_t), device=dev)
                    for hh in range(n_kv):
                        for gg in range(group):
                            for i in range(c):
                                w += torch.softmax(
                                    torch.stack(
                                        [q_mem[0, hh * group + gg, i] @ pre_k[layer_i][0, hh, t] for t in mem_t]
                                    )
                                    * attn.scaling,
                                    dim=0,
                                )
                    top = torch.topk(w.view(len(blocks), block_size).sum(dim=1), min(answer_topk, len(blocks))).indices
                    shared = sorted(blocks[int(i)] for i in top)
                    break
                elif blocks:
                    q_mem = rot(q, [local] * c)
                    qsum = q_mem[0].sum(dim=1).reshape(n_kv, group, d).sum(dim=1)
                    for hh in range(n_kv):
                        if attention_scores and e > n_doc:
                            mem_t = [
                                t
                                for j in blocks
                                for t in range(initial + j * block_size, initial + (j + 1) * block_size)
                            ]
                            w = torch.zeros(len(mem_t), device=dev)
                            for gg in range(group):
                                for i in range(c):
                                    w += torch.softmax(
                                        torch.stack(
                                            [q_mem[0, hh * group + gg, i] @ pre_k[layer_i][0, hh, t] for t in mem_t]
                                        )
                                        * attn.scaling,
                                        dim=0,
                                    )
                            sc = w.view(len(blocks), block_size).sum(dim=1)
                        elif token_scores and e > n_doc:
                            sc = torch.tensor(
                                [
                                    max(
                                        float(qsum[hh] @ pre_k[layer_i][0, hh, t])
                                        for t in range(initial + j * block_size, initial + (j + 1) * block_size)
                                    )
                                    for j in blocks
                                ],
                                device=dev,
                            )
                        else:
                            sc = torch.stack([qsum[hh] @ reps[layer_i][j][hh] for j in blocks])
                        k_pass = answer_topk if e > n_doc and answer_topk else topk  # the question's own budget
                        top = torch.topk(sc, min(k_pass, len(blocks))).indices
                        pick = sorted(blocks[int(i)] for i in top)
                        if follow is not None:
                            theirs = follow[(s, layer_i)][hh]
                            kth = float(sc[top].min())
                            assert all(float(sc[blocks.index(j)]) >= kth - tol * (1 + abs(kth)) for j in theirs), (
                                s,
                                layer_i,
                                hh,
                                theirs,
                                pick,
                                [float(sc[blocks.index(j)]) for j in theirs + pick],
                            )
                            pick = theirs
                        picks.append(pick)
                if e > n_doc and not probe:
                    chosen_by_question.append(picks)
                out = torch.zeros(1, c, n_kv * group, d, device=dev)
                for i in range(c):
                    p = s + i
                    for hh in range(n_kv):
                        mem = []
                        if blocks:
                            mem = list(range(initial)) + [
                                t
                                for j in picks[hh]
                                for t in range(initial + j * block_size, initial + (j + 1) * block_size)
                            ]
                        loc = list(range(origin, p + 1))
                        in_order = ordered and e > n_doc and mem
                        k_mem = pre_k[layer_i][0, hh, mem]
                        if in_order:
                            k_mem = rot(pre_k[layer_i][:, hh : hh + 1, mem], list(range(len(mem))))[0, 0]
                        k_loc = rot(pre_k[layer_i][:, hh : hh + 1, loc], [t - origin for t in loc])[0, 0]
                        v_all = torch.cat([vals[layer_i][0, hh, mem], vals[layer_i][0, hh, loc]])
                        for g in range(group):
                            qh = pre_q[layer_i][:, hh * group + g : hh * group + g + 1, p : p + 1]
                            q_loc = rot(qh, [p - origin])[0, 0, 0]
                            q_m = rot(qh, [len(mem) + p - origin if in_order else local])[0, 0, 0]
                            w = torch.cat([k_mem @ q_m, k_loc @ q_loc]) * attn.scaling
                            out[0, i, hh * group + g] = w.softmax(-1) @ v_all
                hidden = hidden + attn.o_proj(out.reshape(1, c, -1))
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            logits = lm.model.lm_head(model.norm(hidden))[0, -1].float()
    return logits, chosen_by_question


def read_traced(s, engine, ids):
    """``s.read(engine, ids)`` with the book (and the copies made of it) recording every retrieval
    into one list: (book, trace)."""
    trace = []
    original = BookCache.__init__

    def traced(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.trace = trace

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BookCache, "__init__", traced)
        book = s.read(engine, ids)
    return book, trace


@pytest.mark.parametrize(
    "answer_topk, positions, scores, filter_layer",
    [
        (None, "same", "representatives", None),
        (6, "same", "representatives", None),
        (6, "ordered", "representatives", None),
        (3, "same", "tokens", None),
        (3, "ordered", "attention", None),
        (3, "ordered", "representatives", 1),
    ],
)
def test_reading_and_question_match_infllm_written_out(tiny_lm, answer_topk, positions, scores, filter_layer):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls near rock 3?")
    ids, n_doc = prompt.ids, prompt.prefix_len
    s = stage(
        lm,
        SPEC
        + (f",answer_topk={answer_topk}" if answer_topk else "")
        + f",answer_positions={positions},answer_scores={scores}"
        + (f",filter_layer={filter_layer}" if filter_layer is not None else ""),
    )
    book, trace = read_traced(s, engine, ids[:n_doc])
    assert book.n_blocks > 3 and book.n_blocks == partition(n_doc, 4, 16, 8)[1]
    cache, logits, _ = s.prefill(engine, ids, prefix=_Prefix(book, n_doc))
    follow = {(start, layer): chosen for start, layer, chosen in trace}
    assert len(follow) == len(trace) > 40  # every pass of every layer after the first block retrieved
    want, chosen = infllm_reference(
        lm,
        ids[:n_doc],
        ids[n_doc:],
        initial=4,
        block_size=8,
        local=16,
        topk=3,
        repr_topk=2,
        chunk=12,
        follow=follow,
        answer_topk=answer_topk,
        ordered=positions == "ordered",
        token_scores=scores == "tokens",
        attention_scores=scores == "attention",
        filter_layer=filter_layer,
    )
    for layer, picks in enumerate(chosen):
        assert cache.question_blocks()[layer].tolist() == picks
        assert len(picks[0]) == min(answer_topk or 3, book.n_blocks)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


def test_a_local_window_over_the_prompt_is_full_attention(tiny_lm):
    from tests.helpers.runs import full_reference

    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    want = full_reference(engine, prompt, 3)
    s = stage(lm, f"infllm:local_window={prompt.n_tokens},kv_dtype=model,chunk=50")
    book = s.read(engine, prompt.ids[: prompt.prefix_len])
    assert book.n_blocks == 0
    cache, logits, pos = s.prefill(engine, prompt.ids, prefix=_Prefix(book, prompt.prefix_len))
    got = [logits]
    for i in range(3):
        got.append(s.decode_step(engine, int(got[-1].argmax()), pos + i, cache))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- the store


def _answer(lm, store, spec="infllm:block_size=8,initial=4,local_window=16,topk=3,chunk=12,repr_topk=2"):
    pipeline = Pipeline.parse(spec)
    pipeline.configure(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls near rock 3?")
    return run(Engine(lm), prompt, pipeline, max_new_tokens=4, stop_ids=set(), store=store, meta={"document": "doc"})


def test_stored_book_is_16_bit_opened_in_place_and_answers_the_same(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    notices.reset()
    store = KVStore.open(tmp_path)
    cold = _answer(lm, store)
    said = notices.drain()
    assert any("storing the document's KV" in m and "KiB" in m for m in said)
    files = list((tmp_path / "kv").glob("*.safetensors"))
    assert len(files) == 1 and cold.extra["cache"]["status"] == "miss"
    assert (
        files[0].stat().st_size
        == cold.extra["cache"]["entry_bytes"]
        == stage(lm, "infllm:block_size=8,initial=4,local_window=16,topk=3,chunk=12,repr_topk=2").stored_bytes(
            lm, cold.prompt.prefix_len
        )
    )
    from safetensors import safe_open

    with safe_open(str(files[0]), framework="pt") as f:  # an ordinary safetensors file
        assert f.get_tensor("k.0").dtype == torch.float16
    warm = _answer(lm, KVStore.open(tmp_path))  # a new process: opened from the file
    assert warm.extra["cache"]["status"] == "hit"
    assert warm.answer_ids == cold.answer_ids
    off = _answer(lm, None)
    assert off.answer_ids == cold.answer_ids
    # a damaged entry is dropped with a warning and read again
    data = bytearray(files[0].read_bytes())
    data[-5] ^= 0xFF
    files[0].write_bytes(bytes(data))
    notices.reset()
    again = _answer(lm, KVStore.open(tmp_path))
    assert again.extra["cache"]["status"] == "miss" and again.answer_ids == cold.answer_ids
    assert any("damaged" in m for m in notices.drain())


def test_a_book_over_the_cap_answers_without_storing_and_says_so(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    notices.reset()
    store = KVStore.open(tmp_path, max_bytes=10_000)
    result = _answer(lm, store)
    assert result.extra["cache"]["status"] == "off" and result.answer_ids
    said = notices.drain()
    assert any("over the cache cap" in m and "without storing" in m for m in said)
    assert not list((tmp_path / "kv").glob("*.safetensors"))
    assert not [p for p in (tmp_path / "kv").glob(".*.tmp")]


def test_an_interrupted_read_leaves_no_entry_but_a_partial_one_the_next_read_finishes(tiny_lm, tmp_path, monkeypatch):
    lm = tiny_lm("llama")
    calls = {"n": 0}
    original = BookCache.end_chunk

    def interrupted(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(BookCache, "end_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _answer(lm, KVStore.open(tmp_path))
    [partial] = [p.name for p in (tmp_path / "kv").iterdir() if p.name != "locks"]
    assert partial.endswith(".partial.safetensors")  # never served as the entry
    monkeypatch.setattr(BookCache, "end_chunk", original)
    result = _answer(lm, KVStore.open(tmp_path))
    assert result.extra["cache"]["status"] == "miss" and result.answer_ids == _answer(lm, None).answer_ids
    assert [p.name for p in (tmp_path / "kv").iterdir() if p.name != "locks"] == [partial.replace(".partial", "")]


def test_the_stored_size_is_known_before_reading(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    s = stage(lm, "infllm:block_size=8,initial=4,local_window=16,topk=3,chunk=12")
    for n in (10, 200, 1000):
        _, n_blocks, _ = partition(n, 4, 16, 8)
        per_token = 2 * lm.n_layers * lm.n_kv_heads * lm.head_dim * 2
        assert (
            s.stored_bytes(lm, n)
            == 8 + HEADER_ROOM + n * per_token + lm.n_layers * lm.n_kv_heads * n_blocks * lm.head_dim * 4
        )


def test_the_span_needed_is_bounded_by_the_window_not_the_document(tiny_lm):
    lm = tiny_lm("llama")
    s = stage(lm, "infllm:local_window=64,chunk=32")
    assert s.window_needed(lm, 10 * lm.max_context, 20, 16) == 64 + 128 + 36
    assert s.window_needed(lm, 100, 20, 16) == 116
    # answer_positions=ordered: Initial and the question's blocks sit before Local, in the window
    s = stage(lm, "infllm:local_window=64,chunk=32,answer_topk=2,answer_positions=ordered")
    assert s.window_needed(lm, 10 * lm.max_context, 20, 16) == 128 + 2 * 128 + 64 + 128 + 36


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("infllm:kv_dtype=int3", "kv_dtype must be one of"),
        ("infllm:retrieval=sometimes", "retrieval must be one of step, question"),
        ("infllm:answer_positions=shuffled", "answer_positions must be one of same, ordered"),
        ("infllm:filter_layer=99", "filter_layer must be a layer index from 0 to 3 \\(or -1: none\\)"),
        ("infllm:answer_scores=mean", "answer_scores must be one of representatives, tokens, attention"),
        ("infllm:preset=gpu", "preset must be one of auto, paper, cpu"),
        ("infllm:block_size=0", "block_size must be at least 1"),
        ("infllm:repr_topk=9,block_size=8", "repr_topk=9 exceeds block_size=8"),
    ],
)
def test_knob_errors_are_one_line(tiny_lm, spec, needle):
    with pytest.raises(UsageError, match=needle):
        stage(tiny_lm("llama"), spec)


def test_what_a_read_holds_in_memory_is_bounded_by_the_span_not_the_document(tiny_lm, tmp_path, monkeypatch):
    """Local never exceeds local_window + block_size after a pass (+ chunk during one), whatever
    the length; with a file storage the document's KV is on disk, not in memory."""
    from kvcli.caches.bookfile import FileStorage

    lm = tiny_lm("llama")
    engine = Engine(lm)
    s = stage(lm, "infllm:block_size=8,initial=4,local_window=16,topk=3,chunk=12,repr_topk=2")
    seen = []
    original = BookCache.end_chunk

    def watched(self):
        seen.append(self.local_len)
        original(self)
        seen.append(self.local_len)

    monkeypatch.setattr(BookCache, "end_chunk", watched)
    ids = torch.randint(5, 200, (900,))
    book = s.read(engine, ids, NewFile(tmp_path / "book"))
    assert isinstance(book.storage, FileStorage) and book.n_blocks == partition(900, 4, 16, 8)[1]
    assert max(seen) <= 16 + 8 + 12 and max(seen[1::2]) < 16 + 8 + 4  # before / after each move to Memory
    per_token = 2 * lm.n_layers * lm.n_kv_heads * lm.head_dim * 2
    held = sum(t.numel() * t.element_size() for t in (*book.tail_k, *book.tail_v, *book.init_k, *book.init_v))
    assert held < 40 * per_token  # Local + Initial, not the 900 tokens


def test_attention_parts_merge_into_one_softmax():
    """attention_lse (fused on the CPU, written out elsewhere) + merge_lse = one softmax over the
    union of the keys, a causal bias included; checked against the scores written out."""
    from kvcli.runtime.kernels import attention_lse, merge_lse

    torch.manual_seed(0)
    q, q2 = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    k1, v1, k2, v2 = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    allowed = torch.ones(6, 9, dtype=torch.bool).tril(3)
    bias = torch.zeros(6, 9).masked_fill(~allowed, float("-inf"))
    scores = (
        torch.cat([q2 @ k1.transpose(-1, -2), (q @ k2.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))], dim=-1)
        * 0.3
    )
    want = scores.softmax(-1) @ torch.cat([v1, v2], dim=2)
    for fused in (True, False):
        got = merge_lse(
            attention_lse(q, k2, v2, bias, 0.3, fused=fused), attention_lse(q2, k1, v1, None, 0.3, fused=fused)
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "where, spec, want",
    [
        ("cpu", "infllm", (1024, 8, "question")),  # auto on the CPU: the measured CPU span
        ("meta", "infllm", (4096, 16, "step")),  # auto on an accelerator: InfLLM's settings
        ("cpu", "infllm:preset=paper", (4096, 16, "step")),
        ("meta", "infllm:preset=cpu", (1024, 8, "question")),
        ("cpu", "infllm:preset=paper,topk=3,retrieval=question", (4096, 3, "question")),  # a knob given wins
        ("cpu", "infllm:local_window=64", (64, 8, "question")),
    ],
)
def test_the_preset_fills_the_knobs_not_given(where, spec, want):
    from types import SimpleNamespace

    lm = SimpleNamespace(device=torch.device(where), max_context=8192, name="m", n_layers=30, windows=Windows.none(30))
    s = parse_one(spec)
    s.configure(lm)
    assert (s.local_window, s.topk, s.retrieval) == want
    assert (s.filter_layer, s.answer_positions) == (-1, "same")  # no filter layer measured for this model
    small = SimpleNamespace(
        device=torch.device(where), max_context=2048, name="m", n_layers=30, windows=Windows.none(30)
    )
    s = parse_one("infllm:preset=paper")
    s.configure(small)  # scaled to a smaller window: half of it for Local, a quarter for Memory
    assert (s.local_window, s.topk) == (1024, 4)


def test_attention_scores_are_the_questions_softmax_weight_per_block():
    """answer_scores=attention: block b scores the softmax weight its keys get from each question
    query, summed over the queries and the GQA group's heads (a peaked block beats a block of
    many middling keys that a sum of raw logits would prefer; a block of many middling keys beats
    a single peak that a max would prefer)."""
    from kvcli.caches.bookfile import MemoryStorage, tensor_specs

    bs, d = 4, 2
    book = BookCache(
        MemoryStorage(tensor_specs(1, 1, 3 * bs, d, 3, torch.float32)),
        3 * bs,
        1,
        1,
        d,
        initial=0,
        block_size=bs,
        local=0,
        topk=1,
        repr_topk=1,
    )
    logits = torch.tensor(
        [
            10.0,
            -10,
            -10,
            -10,  # one key far above the rest
            1.5,
            1.5,
            1.5,
            1.5,  # many middling keys
            2.5,
            -10,
            -10,
            -10,
        ]
    )  # one key a little above them
    book.storage.write("k.0", (0, 0, 3 * bs), torch.stack([logits, torch.zeros(3 * bs)], dim=1))
    book.n_blocks = 3
    q_mem = torch.tensor([1.0, 0.0]).expand(1, 2, 2, d)  # two query heads of one KV head, two queries each
    got = book._attention_scores(0, q_mem, 3, scaling=0.5)
    want = 4 * torch.softmax(logits * 0.5, dim=0).view(3, bs).sum(dim=1)
    torch.testing.assert_close(got, want[None])
    assert got[0].argsort(descending=True).tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "where, spec, want",
    [
        ("cpu", "infllm", (17, "ordered")),  # the cpu preset: the model's measured filter layer, its blocks in order
        ("meta", "infllm", (-1, "same")),  # paper (an accelerator): InfLLM's per-layer retrieval, one position
        ("cpu", "infllm:preset=paper", (-1, "same")),
        ("cpu", "infllm:filter_layer=-1", (-1, "same")),  # off: InfLLM's retrieval and positions
        ("cpu", "infllm:filter_layer=-1,answer_positions=ordered", (-1, "ordered")),
        ("cpu", "infllm:answer_positions=same", (17, "same")),
        ("meta", "infllm:filter_layer=5", (5, "ordered")),
    ],
)
def test_the_cpu_preset_answers_through_the_models_filter_layer(where, spec, want):
    from types import SimpleNamespace

    lm = SimpleNamespace(
        device=torch.device(where),
        max_context=8192,
        name="smollm2-135m-instruct",
        n_layers=30,
        windows=Windows.none(30),
    )
    s = parse_one(spec)
    s.configure(lm)
    assert (s.filter_layer, s.answer_positions) == want
    note = s.reading_note(lm, 100_000)  # the over-window line says how a question is answered
    assert ("attention selects, in document order" in note) == (want[0] >= 0) and (f"layer-{want[0]} " in note) == (
        want[0] >= 0
    )


def test_the_rope_table_is_built_once_per_device_however_often_the_device_switches(tiny_lm, monkeypatch):
    """A pass on a GPU rotates on two devices (the chunk's keys and queries on the GPU, Local's keys
    kept on the host): each device's table is built once, at the positions Local needs, never
    rebuilt at a switch (it was, at twice its size: 25·2^k positions after k switches, a CUDA OOM).
    ``meta`` stands for the other device; the rotations are the same numbers as the host's."""
    import kvcli.caches.book as book_module
    from kvcli.caches.bookfile import MemoryStorage, tensor_specs

    lm = tiny_lm("llama")
    n_kv, d, bs, local = lm.n_kv_heads, lm.head_dim, 8, 16
    book = BookCache(
        MemoryStorage(tensor_specs(1, n_kv, 64, d, 8, torch.float32)),
        64,
        1,
        n_kv,
        d,
        initial=4,
        block_size=bs,
        local=local,
        topk=3,
        repr_topk=2,
    ).bind(Engine(lm))
    built = []
    real = book_module.rope_cos_sin

    def counting(rotary, positions, like):
        built.append((like.device.type, positions.numel()))
        return real(rotary, positions, like)

    monkeypatch.setattr(book_module, "rope_cos_sin", counting)
    x = torch.randn(1, n_kv, 5, d, generator=torch.Generator().manual_seed(0)).to(lm.device)
    old, new = torch.arange(5), torch.arange(3, 8)
    want = book.rotate(x, old, new)
    for i in range(10):
        got = book.rotate(x if i % 2 else x.to("meta"), old, new)
        assert got.shape == x.shape
        if got.device == x.device:
            torch.testing.assert_close(got, want)
    assert sorted(built) == sorted([(lm.device.type, local + bs + 1), ("meta", local + bs + 1)])
    # a position past the table's end grows that device's table, and only then
    book.rotate(x.to("meta"), old, new + local + bs)
    book.rotate(x, old, new)
    assert built[-1] == ("meta", 2 * (local + bs + 1)) and len(built) == 3
