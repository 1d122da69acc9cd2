"""kvcli.cite.attribution: the answer's attention per prompt position, against an explicit computation
(every query head against its KV head's keys, written out one at a time)."""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.answer.question import QuestionOptions
from kvcli.cite.attribution import CitingHeads, HeadWeights, step_weights
from kvcli.runtime.attention import draft_pass


def explicit(query, key, head):
    """Head ``head``'s softmax weights over the keys, the GQA group read by hand."""
    n_heads, n_kv = query.shape[1], key.shape[1]
    k = key[0, head // (n_heads // n_kv)]
    logits = [float(query[0, head, -1] @ k[r]) / math.sqrt(query.shape[-1]) for r in range(k.shape[0])]
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    return [x / sum(e) for x in e]


def test_step_weights_are_each_query_heads_softmax_over_its_kv_heads_keys():
    g = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 6, 1, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    got = step_weights(query, key)
    assert got.shape == (2, 3, 5)
    for head in range(6):
        assert torch.allclose(got[head // 3, head % 3], torch.tensor(explicit(query, key, head)), atol=1e-6)


class FakeCache:
    def __init__(self, rows):
        self.rows = rows

    def held_positions(self, layer):
        return self.rows[layer]


def test_citing_heads_add_weighted_heads_to_the_positions_rows_hold():
    g = torch.Generator().manual_seed(1)
    n_heads, n_kv, d = 4, 2, 8
    weights = torch.zeros(3, n_heads)
    weights[1] = torch.tensor([0.5, 0.0, 2.0, 1.0])
    # layer 1 holds prompt positions per KV head (an eviction), then one answer row
    held = torch.tensor([[0, 2, 5], [1, 2, 6]])
    reader = CitingHeads(HeadWeights(weights, "test"), n_positions=7, cache=FakeCache({1: held}))
    observers = reader.observers()
    assert list(observers) == [1]
    query, key = torch.randn(1, n_heads, 1, d, generator=g), torch.randn(1, n_kv, 4, d, generator=g)
    observers[1][0](torch.randn(1, n_heads, 3, d), key)  # a prompt pass: ignored
    observers[1][0](query, key)
    reader.flush(1)  # a plain cache's steps wait for a batch (the next test)
    want = [0.0] * 7
    for head in range(n_heads):
        probs = explicit(query, key, head)
        for row, pos in enumerate(held[head // 2].tolist()):
            want[pos] += float(weights[1, head]) * probs[row]  # the answer row (3) is no prompt token
    assert torch.allclose(reader.scores, torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert reader.steps == 1
    assert (reader.seen > 0).tolist() == [True, True, True, False, False, True, True]
    scores = reader.prompt_scores(9, kept=torch.tensor([0, 1, 2, 3, 5, 6, 8]))  # a selector kept 7 of 9
    assert [math.isnan(x) for x in scores.tolist()] == [False, False, False, True, True, True, False, True, False]
    assert scores[8] == reader.scores[6] and scores[6] == reader.scores[5]


def test_a_pass_of_several_queries_counts_as_its_rows_one_by_one():
    """A draft checked while decoding (kvcli.runtime.lookup): the pass's query j read the rows
    before the pass and j + 1 of its own, as the same tokens decoded one a step would."""
    g = torch.Generator().manual_seed(2)
    n_heads, n_kv, d = 4, 2, 8
    weights = torch.zeros(2, n_heads)
    weights[1] = torch.tensor([1.0, 0.5, 0.0, 2.0])
    held = torch.tensor([[0, 1, 3], [0, 2, 4]])  # three prompt rows, then the answer's
    query, key = torch.randn(1, n_heads, 3, d, generator=g), torch.randn(1, n_kv, 6, d, generator=g)
    readers = [CitingHeads(HeadWeights(weights, "test"), n_positions=5, cache=FakeCache({1: held})) for _ in range(2)]
    readers[0].observers()[1][0](query, key)  # outside a draft's check: a prompt pass, ignored
    assert readers[0].steps == 0
    with draft_pass():
        readers[0].observers()[1][0](query, key)
    for j in range(3):
        readers[1].observers()[1][0](query[:, :, j : j + 1], key[:, :, : 4 + j])
    for reader in readers:
        reader.flush(1)
        assert reader.steps == 3
    assert torch.allclose(readers[0].scores, readers[1].scores, atol=1e-9)
    assert readers[0].scores.sum() > 0


@pytest.mark.parametrize("batch_logits", [1 << 22, 40])
def test_steps_added_in_batches_are_the_steps_one_by_one(monkeypatch, batch_logits):
    """Five decoding steps: the keys grow by the step's row for three, then an eviction (fewer rows,
    other positions) and two more. The scores are each step's explicit weights over the rows it
    had, mapped through the positions held at that step; also with batches cut short (40 logits:
    a flush every step or two)."""
    import kvcli.cite.attribution as attribution

    monkeypatch.setattr(attribution, "BATCH_LOGITS", batch_logits)
    g = torch.Generator().manual_seed(2)
    n_heads, n_kv, d = 4, 2, 8
    weights = torch.zeros(1, n_heads)
    weights[0] = torch.tensor([1.0, 0.5, 0.0, 2.0])
    cache = FakeCache({0: torch.tensor([[0, 1, 3], [0, 2, 3]])})
    reader = CitingHeads(HeadWeights(weights, "test"), n_positions=4, cache=cache)
    [observe] = reader.observers()[0]
    keys = torch.randn(1, n_kv, 6, d, generator=g)
    want = [0.0] * 4
    for step in range(5):
        if step == 3:  # evicted: two prompt rows left, then this step's row
            cache.rows[0] = torch.tensor([[1, 3], [0, 3]])
            keys = torch.cat([keys[:, :, 1:3], torch.randn(1, n_kv, 1, d, generator=g)], dim=2)
        rows = 3 + step + 1 if step < 3 else 2 + (step - 3) + 1
        if step > 3:
            keys = torch.cat([keys, torch.randn(1, n_kv, 1, d, generator=g)], dim=2)
        key = keys[:, :, :rows]
        query = torch.randn(1, n_heads, 1, d, generator=g)
        held = cache.rows[0]
        for head in range(n_heads):
            probs = explicit(query, key, head)
            for row, pos in enumerate(held[head // 2].tolist()):
                want[pos] += float(weights[0, head]) * probs[row]
        observe(query, key)
    got = reader.prompt_scores(4)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert reader.steps == 5


# --- wired into decoding: full attention's citing scores against transformers' own attentions ------


def test_an_answer_cites_the_unit_its_steps_read_most(tiny_lm, monkeypatch):
    """Session.ask -> Result.sources: the top source holds the unit with the largest citing score
    (the scores themselves: the next test)."""
    import kvcli.answer.citing
    from kvcli.answer.pipeline import Pipeline
    from kvcli.cite.sources import DocumentUnits
    from kvcli.documents import document_from_text
    from tests.helpers.stores import DOC, Q1, session_for

    lm = tiny_lm("llama")
    seen = {}
    real = kvcli.answer.citing.cite  # Session.ask imports it as it answers

    def spy(document, result, question="", **kwargs):
        seen["scores"] = result.extra["citing"]["scores"].clone()
        return real(document, result, question, **kwargs)

    monkeypatch.setattr(kvcli.answer.citing, "cite", spy)
    monkeypatch.setattr(kvcli.answer.citing, "LEXICAL_WEIGHT", 0.0)  # the attention alone ranks
    doc = document_from_text(DOC)
    result = session_for(lm, None, use_cache=False).ask(
        doc, Q1, Pipeline.parse("full"), QuestionOptions(max_new_tokens=5, force_tokens=True)
    )
    units, read = DocumentUnits.of(doc).scores(
        result.prompt.doc_offsets, seen["scores"][result.prompt.doc_start : result.prompt.doc_end].numpy()
    )
    assert read.all() and int(units.argmax()) in result.sources.items[0].units
    assert result.extra["sources_s"] >= 0 and "citing" not in result.extra
    assert (
        session_for(lm, None, use_cache=False)
        .ask(doc, Q1, Pipeline.parse("full"), QuestionOptions(sources=False))
        .sources
        is None
    )


def test_pipeline_citing_scores_match_transformers(tiny_lm, tiny_dir):
    from transformers import AutoModelForCausalLM

    from kvcli.answer.pipeline import Pipeline, run
    from kvcli.answer.prompt import build_prompt, load_template
    from kvcli.runtime.engine import Engine
    from tests.helpers.stores import DOC, Q1

    lm = tiny_lm("llama")
    engine = Engine(lm)
    weights = torch.rand(lm.n_layers, lm.n_heads, generator=torch.Generator().manual_seed(3))
    weights[2] = 0.0
    prompt = build_prompt(lm.tokenizer, DOC, Q1, load_template())
    pipeline = Pipeline.parse("full").resolve(prompt, lm, 5)
    pipeline.configure(lm)
    result = run(engine, prompt, pipeline, max_new_tokens=5, stop_ids=set(), cite=HeadWeights(weights, "test"))
    got = result.extra["citing"]["scores"]
    n = prompt.n_tokens
    ids = torch.cat([prompt.ids, torch.tensor(result.answer_ids[:4])])
    ref = AutoModelForCausalLM.from_pretrained(
        str(tiny_dir("llama", num_hidden_layers=4)), attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        attentions = ref(ids.view(1, -1), output_attentions=True).attentions
    want = torch.zeros(n, dtype=torch.float64)
    for layer, att in enumerate(attentions):
        want += (att[0, :, n:, :n].double().sum(dim=1) * weights[layer].double().view(-1, 1)).sum(dim=0)
    assert result.extra["citing"]["steps"] == 4
    assert torch.allclose(got, want, atol=1e-5)


# --- the book (infllm): what a step reads, by position, reproduces the book's own attention --------


@pytest.mark.parametrize("knobs", ["retrieval=question", "filter_layer=2,answer_positions=ordered"])
def test_the_books_read_weights_times_its_values_are_its_attention(tiny_lm, monkeypatch, knobs):
    from kvcli.answer.pipeline import Pipeline
    from kvcli.caches.book import BookCache
    from kvcli.documents import document_from_text
    from tests.helpers.stores import DOC, Q1, session_for

    lm = tiny_lm("llama")
    checked = []
    real_attend = BookCache.attend

    def attend(self, layer, module, query, scaling, kernel):
        got = self.read_weights(layer, query) if query.shape[2] == 1 and not self.reading else None
        values = None
        if got is not None:  # the values of the rows, by absolute position, read before the step appends
            _, value = self._pending[layer]
            local_v = torch.cat([self.tail_v[layer].to(value.device, value.dtype), value], dim=2)[0]
            positions, weights = got

            def v(h, p):
                if p >= self.origin:
                    return local_v[h, p - self.origin]
                if p < self.initial:
                    return self.init_v[layer][0, h, p].to(value.device, value.dtype)
                return self.storage.read(f"v.{layer}", h, p, p + 1)[0].to(value.device, value.dtype)

            values = torch.stack([torch.stack([v(h, p) for p in row]) for h, row in enumerate(positions.tolist())])
        out = real_attend(self, layer, module, query, scaling, kernel)
        if got is not None:
            g = query.shape[1] // self.n_kv
            want = torch.einsum("kgr,krd->kgd", weights, values.float()).reshape(query.shape[1], -1)
            assert torch.allclose(out[0, 0].float(), want, atol=1e-4)
            assert positions.min() >= 0 and (positions < self.origin).any()  # Memory or Initial rows too
            checked.append(g)
        return out

    monkeypatch.setattr(BookCache, "attend", attend)
    spec = f"infllm:block_size=8,initial=4,local_window=16,topk=3,chunk=12,repr_topk=2,kv_dtype=model,{knobs}"
    result = session_for(lm, None, use_cache=False).ask(
        document_from_text(DOC), Q1, Pipeline.parse(spec), QuestionOptions(max_new_tokens=4, force_tokens=True)
    )
    assert len(checked) == 3 * lm.n_layers  # every layer of the 3 steps that fed a token
    assert result.sources.items and all(s.start < s.end for s in result.sources.items)


def test_a_book_that_retrieves_at_every_step_cites_nothing_and_says_why(tiny_lm):
    from kvcli.answer.pipeline import Pipeline
    from kvcli.documents import document_from_text
    from tests.helpers.stores import DOC, Q1, session_for

    spec = "infllm:block_size=8,initial=4,local_window=16,topk=3,chunk=12,repr_topk=2,retrieval=step,filter_layer=-1"
    result = session_for(tiny_lm("llama"), None, use_cache=False).ask(
        document_from_text(DOC), Q1, Pipeline.parse(spec), QuestionOptions(max_new_tokens=3, force_tokens=True)
    )
    assert result.sources.items == () and "does not report" in result.sources.reason


def test_ragged_heads_read_weights_times_values_are_their_attention(tiny_lm, monkeypatch):
    """AdaKV's heads hold different counts (padding): the weights over a padded layer's slots,
    times its values, are the layer's attention output; positions are the heads' own."""
    from kvcli.answer.pipeline import Pipeline
    from kvcli.caches.ragged import RaggedLayer
    from kvcli.documents import document_from_text
    from tests.helpers.stores import DOC, Q1, session_for

    checked = []
    real = RaggedLayer.attend

    def attend(self, module, query, scaling, sliding_window, kernel):
        out = real(self, module, query, scaling, sliding_window, kernel)
        if query.shape[2] == 1:
            positions, weights = self.read_weights(query)
            v = self.cache.values[self.layer_idx][0, :, : positions.shape[1]].float()
            want = torch.einsum("kgr,krd->kgd", weights, v).reshape(query.shape[1], -1)
            current = self.cache.values[self.layer_idx][0, :, -1].float()  # the step's own row
            g = query.shape[1] // v.shape[0]
            rest = 1 - weights.sum(-1)  # the weight on the step's own token
            want = want + (rest.reshape(-1, 1) * current.repeat_interleave(g, dim=0))
            assert torch.allclose(out[0, 0].float(), want, atol=1e-5)
            padding = positions == -1  # (n_kv, rows)
            assert padding.any() and all((weights[h][:, padding[h]] == 0).all() for h in range(v.shape[0]))
            checked.append(1)
        return out

    monkeypatch.setattr(RaggedLayer, "attend", attend)
    result = session_for(tiny_lm("llama"), None, use_cache=False).ask(
        document_from_text(DOC),
        Q1,
        Pipeline.parse("adakv:budget=0.25"),
        QuestionOptions(max_new_tokens=3, force_tokens=True),
    )
    assert checked and result.sources.items


CITING = [
    "full",
    "razor",
    "snapkv:budget=0.25",
    "finch",
    "gemfilter:k=64",
    "h2o:budget=0.25",
    "adakv:budget=0.25",
    "lazyllm",
    "kvzip",
    "streamingllm:budget=64",
    # retrieval=question on every device: on an accelerator the auto preset is InfLLM's paper one, whose
    # steps each retrieve their own blocks and cite nothing (test_a_book_that_retrieves_at_every_step_...)
    "infllm:block_size=8,initial=4,local_window=16,topk=3,chunk=12,repr_topk=2,retrieval=question",
]
SILENT = ["blocksparse"]  # its cache does not report what a decoding step reads (yet)


@pytest.mark.parametrize("spec", CITING + SILENT)
def test_every_method_cites_what_it_kept_or_says_why_not(tiny_lm, spec):
    from kvcli.answer.pipeline import Pipeline
    from kvcli.documents import document_from_text
    from tests.helpers.stores import DOC, Q1, session_for

    result = session_for(tiny_lm("llama"), None, use_cache=False).ask(
        document_from_text(DOC), Q1, Pipeline.parse(spec), QuestionOptions(max_new_tokens=3, force_tokens=True)
    )
    if spec in SILENT:
        assert result.sources.items == () and "does not report" in result.sources.reason
        return
    assert result.sources.items, result.sources.reason
    mask = result.kept_mask()
    if mask is not None:  # a source holds a token the method kept
        held = mask.any(dim=(0, 1))
        for s in result.sources.items:
            tokens = [
                i
                for i in range(result.prompt.doc_start, result.prompt.doc_end)
                if s.start <= result.prompt.char_span(i)[0] < s.end
            ]
            assert held[tokens].any()


def test_razor_read_weights_times_values_are_its_attention(tiny_lm, monkeypatch):
    """RazorAttention's two head groups (every token / sinks + window + a compensation token
    weighing N_d): the weights per KV head times the group's values are the layer's output."""
    from kvcli.answer.pipeline import Pipeline
    from kvcli.caches.razor import RazorLayer
    from kvcli.documents import document_from_text
    from tests.helpers.stores import DOC, Q1, session_for

    checked = []
    real = RazorLayer.attend

    def attend(self, module, query, scaling, sliding_window, kernel):
        out = real(self, module, query, scaling, sliding_window, kernel)
        if query.shape[2] == 1:
            positions, weights = self.read_weights(query)
            cache, layer = self.cache, self.layer_idx
            g = query.shape[1] // cache.protected.shape[1]
            for kv in range(cache.protected.shape[1]):
                group = (
                    cache.protected[layer][: kv + 1].sum() - 1
                    if cache.protected[layer, kv]
                    else (~cache.protected[layer][: kv + 1]).sum() - 1
                )
                values = (cache.pv if cache.protected[layer, kv] else cache.cv)[layer][0, int(group)].float()
                rows = int((positions[kv] != -1).sum()) + int(not cache.protected[layer, kv] and cache.compensated)
                w = weights[kv, :, :rows].to(values.device)
                own = (1 - w.sum(-1, keepdim=True)) * values[-1]  # the step's own row
                want = w @ values[:rows] + own
                assert torch.allclose(out[0, 0, kv * g : (kv + 1) * g].float(), want, atol=1e-5)
            checked.append(1)
        return out

    monkeypatch.setattr(RazorLayer, "attend", attend)
    result = session_for(tiny_lm("llama"), None, use_cache=False).ask(
        document_from_text(DOC),
        Q1,
        Pipeline.parse("razor:window=16,sinks=4"),
        QuestionOptions(max_new_tokens=3, force_tokens=True),
    )
    assert checked and result.sources.items


def test_learned_citing_weights_are_read_back_for_their_model_only(tmp_path, monkeypatch, tiny_lm):
    from kvcli.cite import attribution

    lm = tiny_lm("llama")
    monkeypatch.setattr(attribution, "HEADS_DIR", tmp_path)
    default = attribution.citing_heads(lm)
    assert default.layers() == list(range(lm.n_layers)) and torch.allclose(default.weights.sum(), torch.tensor(1.0))
    w = torch.rand(lm.n_layers, lm.n_heads)
    attribution.save_heads(tmp_path / f"{lm.name}.safetensors", w, "learned on nothing, for this test")
    got = attribution.citing_heads(lm)
    assert torch.equal(got.weights, w) and got.source == "learned on nothing, for this test"
    attribution.save_heads(
        tmp_path / f"{lm.name}.safetensors", torch.rand(lm.n_layers + 1, lm.n_heads), "another model's"
    )
    assert attribution.citing_heads(lm).source == default.source  # the wrong shape: not these weights
