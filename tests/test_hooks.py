"""The shared hook points: what each cache reports it kept (``kept_mask``, what ``inspect`` shows),
the decode-step hook, the per-layer engine API and the explicit attention mask."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.answer.prompt import build_prompt
from kvcli.caches import KVCache
from kvcli.compressors import Compressor, register
from kvcli.compressors.base import REGISTRY, Runtime
from kvcli.errors import UsageError
from kvcli.runtime import attention
from kvcli.runtime.engine import Engine

DOC = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} gulls." for i in range(12))
TOL = 1e-4


def answer(lm, spec, tmp_path=None, max_new_tokens=3):
    pipeline = Pipeline.parse(spec)
    pipeline.configure(lm, Runtime(cache_dir=tmp_path))
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    return run(Engine(lm), prompt, pipeline, max_new_tokens=max_new_tokens, stop_ids=set())


# --------------------------------------------------------------------------- kept_mask


def test_eviction_keeps_budget_entries_per_layer_and_head(tiny_lm):
    lm = tiny_lm("qwen2")
    result = answer(lm, "snapkv:budget=40,window=8")
    mask = result.kept_mask()
    assert (mask.sum(dim=-1) == 40).all()
    # the observation window (the last 8 prompt tokens) is always kept
    assert mask[:, :, -8:].all()


def test_streamingllm_keeps_exactly_sinks_and_recent(tiny_lm):
    lm = tiny_lm("llama")
    result = answer(lm, "streamingllm:budget=20,sinks=4")
    n = result.prompt.n_tokens
    want = torch.zeros(n, dtype=torch.bool)
    want[:4] = True
    want[n - 16 :] = True
    assert (result.kept_mask() == want).all()


def test_a_selector_maps_back_to_prompt_indices(tiny_lm):
    lm = tiny_lm("llama")
    result = answer(lm, "gemfilter:k=30,layer=2")
    mask = result.kept_mask()
    kept = torch.zeros(result.prompt.n_tokens, dtype=torch.bool)
    kept[result.selection.kept] = True
    assert (mask == kept).all()  # the second pass is full attention over the k tokens
    assert int(kept.sum()) == 30


def test_finch_keeps_target_document_tokens_per_layer(tiny_lm):
    lm = tiny_lm("llama")
    result = answer(lm, "finch:target=24,chunk=64")
    mask = result.kept_mask()
    # every layer holds the target of the document plus the user prompt after it (instructions, question)
    per_layer = mask[:, 0].sum(dim=-1)
    assert (per_layer == 24 + result.prompt.n_after_document).all()


# --------------------------------------------------------------------------- decode_step


def test_decode_step_owner_runs_every_step_and_only_one_may_own_it(tiny_lm):
    calls = []

    @register
    class CountingSteps(Compressor):
        """Full attention, counting its decoding steps (a test double)."""

        name = "test-counting-steps"
        keep_all = ""

        def decode_step(self, engine, token, position, cache):
            calls.append(position)
            return engine.step(token, position, cache)

    try:
        lm = tiny_lm("llama")
        full = answer(lm, "full", max_new_tokens=5)
        counted = answer(lm, "test-counting-steps", max_new_tokens=5)
        assert counted.answer_ids == full.answer_ids
        n = full.prompt.n_tokens
        assert calls == [n, n + 1, n + 2, n + 3]  # the first token comes from the prefill
        with pytest.raises(UsageError, match="decode_step"):
            Pipeline.parse("test-counting-steps+test-counting-steps")
    finally:
        REGISTRY.pop("test-counting-steps")


# --------------------------------------------------------------------------- engine API and masks


def test_layer_by_layer_equals_forward_and_explicit_causal_mask_changes_nothing(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    ids = build_prompt(lm.tokenizer, DOC, "How many gulls?").ids
    n = ids.numel()
    positions = torch.arange(n)
    want = engine.forward(ids, positions, KVCache())
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for kernel in ("sdpa", "eager"):
        engine.kernel = kernel
        with torch.inference_mode():
            hidden = engine.embed(ids)
            rope = engine.position_embeddings(hidden, positions)
            cache = KVCache()
            with attention.attention_context(engine.context(mask=causal)):
                for i in range(engine.n_layers):
                    hidden = engine.layer(i, hidden, positions, cache, rope)
        torch.testing.assert_close(hidden, want, atol=TOL, rtol=0)
    engine.kernel = lm.attn


def test_explicit_mask_lets_a_late_query_see_only_earlier_keys(tiny_lm):
    """A token whose KV slot comes after later tokens' (computed late) attends by the mask, not by
    slot order: its output equals computing it in its natural place."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    ids = build_prompt(lm.tokenizer, DOC, "How many gulls?").ids[:20]
    # run tokens 0..9 and 11..19 first, then token 10 alone, at position 10, in layer 0 only
    order = torch.cat([torch.arange(10), torch.arange(11, 20)])
    with torch.inference_mode():
        cache = KVCache()
        hidden = engine.embed(ids[order])
        mask = torch.ones(19, 19, dtype=torch.bool).tril()
        with attention.attention_context(engine.context(mask=mask)):
            engine.layer(0, hidden, order, cache)
        before = cache.copy()
        late = engine.embed(ids[10:11])
        allowed = torch.zeros(1, 20, dtype=torch.bool)
        allowed[0, :10] = True  # the keys of positions 0..9
        allowed[0, 19] = True  # its own key (appended last)
        with attention.attention_context(engine.context(mask=allowed)):
            out = engine.layer(0, late, torch.tensor([10]), cache)
        want = engine.layer(0, engine.embed(ids), torch.arange(20), KVCache())
        every_slot = torch.ones(1, 20, dtype=torch.bool)  # what slot order alone would let it see
        with attention.attention_context(engine.context(mask=every_slot)):
            unmasked = engine.layer(0, late, torch.tensor([10]), before)
    torch.testing.assert_close(out[0, 0], want[0, 10], atol=TOL, rtol=0)
    assert not torch.allclose(unmasked[0, 0], want[0, 10], atol=1e-3)  # so the mask, not the slots, decided


@pytest.mark.parametrize("spec", ["lazyllm+snapkv", "finch+h2o", "blocksparse+streamingllm", "snapkv+blocksparse"])
def test_compressing_after_a_method_that_owns_the_prefill_is_refused(spec):
    with pytest.raises(UsageError, match="runs its own prefill"):
        Pipeline.parse(spec)


def test_chains_that_work_are_accepted():
    for spec in (
        "gemfilter:k=64+snapkv:budget=32",
        "gemfilter:k=64+blocksparse",
        "gemfilter:k=64+lazyllm",
        "snapkv+h2o",
    ):
        stages = Pipeline.parse(spec).stages
        assert [s.name for s in stages] == [part.split(":")[0] for part in spec.split("+")], spec


@pytest.mark.parametrize("second", ["lazyllm", "blocksparse:block_size=4,initial=4,local_window=8,topk=2"])
def test_gemfilter_then_a_prefill_owner_runs_on_the_selected_tokens(tiny_lm, second):
    lm = tiny_lm("llama")
    result = answer(lm, f"gemfilter:k=40,layer=2+{second}", max_new_tokens=3)
    assert result.selection.n_kept == 40 and len(result.answer_ids) == 3
    mask = result.kept_mask()
    assert not mask[
        :, :, [i for i in range(result.prompt.n_tokens) if i not in set(result.selection.kept.tolist())]
    ].any()


def test_an_attending_observer_attends_only_where_the_attention_is_plain_causal():
    """An Attending observer replaces the kernel for causal attention over key/value tensors;
    with an explicit mask or a sliding window shorter than the keys it only observes. Of two, the
    first attends."""
    import types

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    calls = []

    def observing(name):
        def attend(query, key, value, scaling):
            calls.append(f"{name} attends")
            return torch.full((1, query.shape[2], query.shape[1], query.shape[3]), 7.0)

        return attention.Attending(lambda query, key: calls.append(f"{name} observes"), attend)

    module = types.SimpleNamespace(layer_idx=3)
    plain = attention.kvcli_attention(module, q, k, v, None)[0]
    for mask, window, want in [
        (None, None, ["a attends", "b observes"]),
        (None, 10, ["a attends", "b observes"]),
        (None, 9, ["a observes", "b observes"]),
        (torch.ones(6, 10, dtype=torch.bool).tril(4), None, ["a observes", "b observes"]),
    ]:
        calls.clear()
        ctx = attention.AttentionContext(observers={3: [observing("a"), observing("b")]}, mask=mask)
        with attention.attention_context(ctx):
            out = attention.kvcli_attention(module, q, k, v, None, sliding_window=window)[0]
        assert calls == want
        if want[0] == "a attends":
            assert torch.equal(out, torch.full_like(out, 7.0))
        else:
            torch.testing.assert_close(out, attention.attend("sdpa", module, q, k, v, 8**-0.5, window, mask=mask))
    assert plain.shape == (1, 6, 4, 8)
