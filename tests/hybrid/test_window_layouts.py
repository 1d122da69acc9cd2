"""The layouts of their own — the ragged heads (AdaKV, KVzip, ExpectedAttention), block retrieval
and LazyLLM's per-layer tokens — keep only a sliding layer's window on the tiny hybrids (Gemma 2 /
3: sliding, full, sliding, full; window 16), as the plain cache does: at most w - 1 entries once
the prompt is read, w - 1 + WINDOW_SLACK while decoding, and the logits of every step are those of
the same run with nothing dropped (each layout's ``cuts_windows`` switched off)."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer.pipeline import run
from kvcli.caches.base import CacheBase
from kvcli.caches.blocks import BlockCache
from kvcli.caches.lazy import LazyCache
from kvcli.caches.ragged import RaggedCache
from kvcli.runtime.engine import Engine
from kvcli.runtime.windows import WINDOW_SLACK
from tests.helpers.runs import configured, prompt_for
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one intra-op thread in this module)
from tests.helpers.tiny_models import HYBRID_FAMILIES, HYBRID_WINDOW

W = HYBRID_WINDOW
SLIDING = (0, 2)
STEPS = W + WINDOW_SLACK + 20  # decoding cuts a sliding layer back at least once

# spec -> (its layout, the sliding layers that must stay within their window)
CASES = {
    "kvzip:budget=0.25": (RaggedCache, SLIDING),
    "expectedattention:budget=0.25": (RaggedCache, SLIDING),
    "adakv:budget=0.25,base=snapkv:window=8": (RaggedCache, SLIDING),
    "blocksparse:block_size=8,initial=8,local_window=16,topk=2": (BlockCache, SLIDING),
    # LazyLLM: a token still in the Aux Cache may be revived into a layer from its pruning layer
    # on and attend its own window there, and the layer before a pruning layer is scored over all
    # its slots: while selections go on (reselect=1) only layer 0 (before the pruning layer 2,
    # not scored) keeps just its window; with reselect=0 nothing is revived or scored again
    "lazyllm:layers=2,keep=0.5": (LazyCache, (0,)),
    "lazyllm:layers=2,keep=0.5,reselect=0": (LazyCache, SLIDING),
    "lazyllm:layers=1/3,keep=0.6/0.4": (LazyCache, ()),  # layers 0 and 2 are scored: both kept whole
}


def _run(lm, spec, profiles, steps, monkeypatch, trimmed: bool):
    """The pipeline's run of ``spec``; the logits of the prompt and of every decoding step, and
    after each cut (CacheBase.trim_windows) the entries each sliding layer holds."""
    layout = CASES[spec][0]
    with monkeypatch.context() as m:
        if not trimmed:
            m.setattr(layout, "cuts_windows", False)  # trim_windows then leaves the layer whole
        logits, held = [], []
        original = Engine.logits
        m.setattr(Engine, "logits", lambda self, hidden: logits.append(original(self, hidden)) or logits[-1])
        engine = Engine(lm)
        trim = CacheBase.trim_windows

        def trim_and_count(cache, windows, slack=0, **prefix_cut):
            trim(cache, windows, slack=slack, **prefix_cut)
            if not prefix_cut:  # a prefix state's layer by layer (Engine.prefix_kv): not counted
                held.append([cache.get_seq_length(i) for i in SLIDING])

        m.setattr(CacheBase, "trim_windows", trim_and_count)
        result = run(engine, prompt_for(lm), configured(spec, lm, profiles), max_new_tokens=steps, stop_ids=set())
    assert isinstance(result.cache, layout)
    return result, logits, held


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("spec", list(CASES))
def test_a_sliding_layer_keeps_its_window_and_the_logits_do_not_change(
    tiny_lm, isolated_cache_dir, monkeypatch, family, spec
):
    lm = tiny_lm(family)
    bounded = CASES[spec][1]
    trimmed, logits, held = _run(lm, spec, isolated_cache_dir, STEPS, monkeypatch, trimmed=True)
    whole, ref, _ = _run(lm, spec, isolated_cache_dir, STEPS, monkeypatch, trimmed=False)
    assert trimmed.answer_ids == whole.answer_ids and len(trimmed.answer_ids) == STEPS
    assert len(logits) == len(ref) >= STEPS
    for step, (a, b) in enumerate(zip(logits, ref)):
        assert torch.allclose(a, b, atol=1e-5), step
    n = trimmed.prompt.n_tokens
    assert n > 2 * W
    # after the prompt (the first cut): w - 1 entries (LazyLLM: those of its set, maybe fewer);
    # while decoding: never more than the slack on top
    for i, layer in enumerate(SLIDING):
        if layer in bounded:
            assert held[0][i] == W - 1 or (CASES[spec][0] is LazyCache and held[0][i] < W - 1), held[0]
            assert all(h[i] <= W - 1 + WINDOW_SLACK for h in held), [h[i] for h in held]
    # what is held is what is counted: a bounded sliding layer holds only the tokens its window can
    # still reach (the last ones; LazyLLM's sets may skip some), any other layer what the untrimmed
    # run holds (over every token seen, the answer's included)
    seen = trimmed.cache.n_tokens
    mask, ref_mask = trimmed.cache.kept_mask(seen), whole.cache.kept_mask(seen)
    # (a sliding layer LazyLLM may revive into drops what lies below every revivable token's window)
    for layer in range(4):
        if layer in SLIDING:
            start = int(mask[layer].any(dim=0).nonzero().min())
            assert torch.equal(mask[layer], ref_mask[layer] & (torch.arange(seen) >= start)), layer
            if layer in bounded:
                assert start >= seen - (W - 1 + WINDOW_SLACK), layer
        else:
            assert torch.equal(mask[layer], ref_mask[layer]), layer
    if bounded:
        assert trimmed.n_kept_tokens < whole.n_kept_tokens
        assert trimmed.extra["kv_cache_bytes"] < whole.extra["kv_cache_bytes"]
    else:
        assert trimmed.n_kept_tokens == whole.n_kept_tokens


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_full_attention_is_1_after_a_long_answer_and_a_method_is_credited_for_its_evictions(
    tiny_lm, isolated_cache_dir, family
):
    """The answer's tokens push the prompt out of the sliding layers (cut back every WINDOW_SLACK
    steps); compression_ratio counts full attention's own holding after as many steps, so full
    attention stays 1.0 whatever the answer's length, and SnapKV gets (what full holds) / (what
    it holds), both counted from what the layers hold."""
    lm = tiny_lm(family)
    prompt = prompt_for(lm)
    n = prompt.n_tokens
    for steps in (1, W + WINDOW_SLACK + 20):
        full = run(Engine(lm), prompt, configured("full", lm, isolated_cache_dir), max_new_tokens=steps, stop_ids=set())
        snap = run(
            Engine(lm),
            prompt,
            configured("snapkv:budget=0.25,window=8", lm, isolated_cache_dir),
            max_new_tokens=steps,
            stop_ids=set(),
        )
        for result in (full, snap):
            mask = result.kept_mask()
            assert result.n_kept_tokens == pytest.approx(float(mask.sum()) / (mask.shape[0] * mask.shape[1]))
        assert full.compression_ratio == pytest.approx(1.0)
        # full attention's layers, counted from its own cache: the same holding snapkv's ratio credits
        assert snap.compression_ratio == pytest.approx(full.n_kept_tokens / snap.n_kept_tokens)
        if steps > 1:  # the sliding layers hold fewer prompt tokens than w - 1 by now
            held = full.kept_mask()[0, 0].sum()
            assert held < W - 1 and full.n_kept_tokens < (2 * n + 2 * (W - 1)) / 4
