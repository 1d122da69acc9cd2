"""A query block on top of a longer KV attends without a dense mask off the CPU (lower-right
causal), and the CPU keeps its boolean mask, bit for bit."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

from kvcli.caches import KVCache
from kvcli.runtime import kernels
from tests.helpers.runs import random_ids


@contextlib.contextmanager
def sdpa_masks(monkeypatch):
    """Records the ``attn_mask`` of every SDPA call kvcli's kernels make (torch.nn.functional
    itself is left alone: a CausalBias recognises the real function)."""
    seen = []

    class Recording:
        def __getattr__(self, name):
            return getattr(F, name)

        @staticmethod
        def scaled_dot_product_attention(*args, **kwargs):
            seen.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
            return F.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(kernels, "F", Recording())
    yield seen


def test_query_block_on_a_longer_kv_gets_no_dense_mask_off_the_cpu(meta_engine, monkeypatch):
    """The question pass on a stored prefix, a prefill chunk and KVzip's reconstruction passes
    are all this call: queries on top of a cache."""
    engine = meta_engine
    ids = random_ids(40, seed=3)
    cache = KVCache()
    with sdpa_masks(monkeypatch) as seen:
        engine.forward(ids[:30], torch.arange(30), cache)  # square: plain causal
        engine.forward(ids[30:], torch.arange(30, 40), cache)  # 10 queries on 40 keys
    assert seen[:2] == [None, None]
    assert len(seen) == 4 and all(isinstance(m, CausalBias) for m in seen[2:])
    assert (seen[2].seq_len_q, seen[2].seq_len_kv) == (10, 40)


@pytest.mark.parametrize("q_len, kv_len", [(7, 19), (2, 3), (5, 6)])
def test_lower_right_is_the_cpu_mask(q_len, kv_len):
    """What CUDA receives equals, numerically, the boolean mask the CPU runs (GQA kept)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, q_len, 8, generator=g)
    k, v = torch.randn(1, 2, kv_len, 8, generator=g), torch.randn(1, 2, kv_len, 8, generator=g)
    assert isinstance(kernels.causal(q_len, kv_len, None, "cpu"), torch.Tensor)
    bias = kernels.causal(q_len, kv_len, None, "meta")
    assert isinstance(bias, CausalBias)
    mask = kernels.causal_mask(q_len, kv_len, None, "cpu")
    assert torch.allclose(kernels.sdpa(q, k, v, bias, 0.3), kernels.sdpa(q, k, v, mask, 0.3), atol=1e-6)
    assert kernels.causal(q_len, kv_len, 2, "meta").dtype == torch.bool  # a window: the boolean mask
