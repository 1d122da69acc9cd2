"""Every method on the tiny hybrids (Gemma 2 / 3: sliding, full, sliding, full; window 16),
compressing: compression acts on the full-attention layers, the sliding layers hold exactly their
window (the last w - 1 prompt tokens) as under full attention, and compression_ratio is 1.0 for
full attention itself."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.compressors.base import REGISTRY
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from tests.helpers.runs import configured, prompt_for
from tests.helpers.specs import COMPRESSING, NOT_ON_HYBRIDS  # the latter refused in one line: test_contract checks it
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one intra-op thread in this module)
from tests.helpers.tiny_models import HYBRID_FAMILIES, HYBRID_WINDOW

# not the prompt's last w - 1 tokens in a sliding layer: LazyLLM's (its sets; here every sliding
# layer is scored for the next pruning layer, so it keeps its slots: test_window_layouts),
# GemFilter's and Finch's (their positions are their selection's)
UNTRIMMED = {"lazyllm", "finch", "gemfilter"}


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("name", sorted(set(REGISTRY) - set(NOT_ON_HYBRIDS)))
def test_compressing_on_a_hybrid(tiny_lm, isolated_cache_dir, family, name):
    lm = tiny_lm(family)
    prompt = prompt_for(lm)
    n = prompt.n_tokens
    result = run(
        Engine(lm), prompt, configured(COMPRESSING[name], lm, isolated_cache_dir), max_new_tokens=3, stop_ids=set()
    )
    assert result.answer_ids
    mask = result.kept_mask()
    if mask is None:
        return
    if name not in UNTRIMMED:
        for layer in (0, 2):  # the sliding layers: their window, nothing else, every head
            held = mask[layer].nonzero()[:, 1].unique().tolist()
            assert held == list(range(n - (HYBRID_WINDOW - 1), n)), (layer, held)
    if name == "full":
        assert result.compression_ratio == pytest.approx(1.0)
    elif name not in {"blocksparse", "razor", "duo"} and name in {
        "snapkv",
        "pyramidkv",
        "h2o",
        "tova",
        "knorm",
        "keydiff",
        "adakv",
        "expectedattention",
        "kvzip",
        "streamingllm",
    }:
        # the full-attention layers were compressed: fewer entries than the prompt
        for layer in (1, 3):
            assert mask[layer].sum(dim=-1).max() < n
        assert result.compression_ratio > 1.0


def test_gemfilter_refuses_a_sliding_filter_layer_and_defaults_to_a_full_one(tiny_lm):
    lm = tiny_lm("gemma3")
    gem = Pipeline.parse("gemfilter:k=30,layer=2")
    with pytest.raises(UsageError, match="sliding-window layer.*full-attention layer: 1, 3"):
        gem.configure(lm)
    auto = Pipeline.parse("gemfilter:k=30")
    auto.configure(lm)
    assert auto.stages[0].layer in lm.windows.full_layers


def test_decoding_time_eviction_leaves_the_sliding_layers_to_their_window(tiny_lm, isolated_cache_dir):
    """``decoding`` evicts while the answer is written: the full layers go back to its budget, the
    sliding layers are never evicted (only cut back to their window), so their entries stay the
    latest tokens in order, which their window mask counts on."""
    lm = tiny_lm("gemma3")
    prompt = prompt_for(lm)
    engine = Engine(lm)
    spec = "snapkv:budget=0.25,window=8+decoding:budget=0.25,interval=4"
    result = run(engine, prompt, configured(spec, lm, isolated_cache_dir), max_new_tokens=80, stop_ids=set())
    cache = result.cache
    assert len(result.answer_ids) == 80
    seen = cache.n_tokens
    for layer in (0, 2):
        assert HYBRID_WINDOW - 1 <= cache.seq_len(layer) <= HYBRID_WINDOW - 1 + 64
    for layer in (1, 3):
        assert cache.seq_len(layer) < seen - HYBRID_WINDOW
    # layer 0's keys depend on the token and its position only: its entries are the latest tokens'
    fed = torch.cat([prompt.ids, torch.tensor(result.answer_ids[:-1])])
    assert fed.numel() == seen
    m = cache.seq_len(0)
    ref = engine.prefix_kv(fed, n_layers=1).keys[0][:, :, -m:]
    assert torch.allclose(cache.keys[0], ref, atol=1e-5)
