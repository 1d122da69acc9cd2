"""The embedded Qwen2.5-Coder-0.5B-Instruct (slow: converted once into the cache, ~1 min; skipped
where its packages are not installed, as on CI): kvcli's layer-by-layer attention reproduces
transformers' own logits on the real model: q/k/v biases, 14 query heads on 2 KV heads, RoPE base
1e6, the 32k window, its ChatML template."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.embedded import logits_both_ways

pytestmark = pytest.mark.slow


def test_qwen_05b_facts_and_logits_match_transformers(qwen_05b):
    lm = qwen_05b
    assert lm.family == "qwen2" and lm.name == "qwen2.5-coder-0.5b" and lm.max_context == 32768
    assert (lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim) == (24, 14, 2, 64)
    assert lm.model.model.layers[0].self_attn.k_proj.bias.abs().sum() > 0
    assert "<|im_start|>" in lm.tokenizer.chat_template
    ids, engine, got, ref = logits_both_ways(lm, 300, 150000)
    assert (got - ref).abs().max() < 2e-3 * ref.abs().max()
    assert torch.equal(got[-50:].argmax(-1), ref[-50:].argmax(-1))
    cache, logits = engine.prefill(ids[:280])
    for i in range(280, 300):
        logits = engine.step(int(ids[i]), i, cache)
        assert (logits - ref[i]).abs().max() < 2e-3 * ref[i].abs().max()
