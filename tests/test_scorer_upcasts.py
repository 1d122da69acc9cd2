"""Scorers upcast to float32 a slice or a chunk of keys at a time, never a whole layer (keys of a
GPU's bfloat16); float32 keys (the CPU's) as before; H2O's blocks large off the CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcli.compressors import expected_attention, kvzip, lazyllm, scoring
from kvcli.runtime import kernels
from kvcli.runtime.attention import last_query_scores


class Upcasts(TorchDispatchMode):
    """The largest float32 tensor made from a tensor of another dtype (elements)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (
            func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)
            and src is not None
            and src.dtype != torch.float32
            and isinstance(out, torch.Tensor)
            and out.dtype == torch.float32
        ):
            self.largest = max(self.largest, out.numel())
        return out


N, D, N_KV, HEADS = 40, 8, 2, 4
g = torch.Generator().manual_seed(0)
Q = torch.randn(1, HEADS, 12, D, generator=g)
K = torch.randn(1, N_KV, N, D, generator=g)
V = torch.randn(1, N_KV, N, D, generator=g)


def scorers():
    mu, rot = torch.randn(HEADS, D, generator=g), torch.eye(D)
    return {
        "snapkv window": lambda q, k, v: scoring.window_attention(q, k, 4),
        "h2o column sums": lambda q, k, v: scoring.attention_and_column_sums(q, k, v, 0.3)[1],
        "gemfilter last query": lambda q, k, v: last_query_scores(q, k),
        "lazyllm last token": lambda q, k, v: lazyllm.last_token_attention(q, k, None),
        "expected attention": lambda q, k, v: expected_attention.expected_scores(mu, None, rot, k, v, 2, True),
        "kvzip chunk": lambda q, k, v: kvzip.chunk_scores(q, k, 2, 10, 20, 0.3),
    }


# the most elements upcast at once: a chunk of 8 keys, one KV head, or KVzip's slice (2 sinks,
# keys 10..19 and the 12 reconstruction keys)
BOUND = {"kvzip chunk": N_KV * (2 + 10 + 12) * D}


@pytest.mark.parametrize("name", list(scorers()))
def test_scorers_never_upcast_a_whole_layer(monkeypatch, name):
    fn = scorers()[name]
    monkeypatch.setattr(kernels, "KEY_CHUNK", 8)
    ref = fn(Q, K.to(torch.bfloat16).float(), V.to(torch.bfloat16).float())  # a whole-layer upcast
    counter = Upcasts()
    with counter:
        got = fn(Q, K.to(torch.bfloat16), V.to(torch.bfloat16))
    assert torch.allclose(got.float(), ref.float(), atol=1e-6, rtol=1e-5)
    assert 0 < counter.largest <= BOUND.get(name, N_KV * N * D // 2), counter.largest  # never the layer


def test_float32_keys_are_scored_in_one_call(monkeypatch):
    """The CPU's float32 keys: by_keys makes a single call, whatever the chunk (its arithmetic unchanged)."""
    monkeypatch.setattr(kernels, "KEY_CHUNK", 8)
    calls = []
    kernels.by_keys(K[0], lambda k: calls.append(k.shape) or k.sum(-1))
    assert calls == [(N_KV, N, D)]
    calls.clear()
    out = kernels.by_keys(K[0].to(torch.bfloat16), lambda k: calls.append(k.shape) or k.sum(-1))
    assert calls == [(N_KV, 8, D)] * 5 and out.shape == (N_KV, N)


def test_h2o_blocks_are_large_off_the_cpu():
    assert scoring.block_rows(4, 32768) == 16  # tuned on the CPU: unchanged
    assert scoring.accelerator_block_rows(4, 32768) == 512 and scoring.accelerator_block_rows(4, 131072) == 128
    q = torch.randn(1, HEADS, N, D, generator=g)  # 40 query rows, groups of 2 query heads
    seen = []
    real = torch.mm

    def mm(a, b, **kw):
        seen.append(a.shape[0])  # group x rows of a block
        return real(a, b, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scoring, "BLOCK_WEIGHTS_ACCELERATOR", 2 * 24 * N)  # 24 rows a block off the CPU
        mp.setattr(torch, "mm", mm)
        scoring.attention_and_column_sums(q.to("meta"), K.to("meta"), V.to("meta"), 0.3)
        assert seen[0] == 2 * 24
        seen.clear()
        scoring.attention_and_column_sums(q, K, V, 0.3)  # the CPU: 64-row blocks, here all 40 rows
        assert seen[0] == 2 * 40
    # the sums do not depend on the block size
    a = scoring.attention_and_column_sums(Q, K, V, 0.3, chunk=3)
    b = scoring.attention_and_column_sums(Q, K, V, 0.3, chunk=12)
    assert torch.allclose(a[1], b[1], atol=1e-5) and torch.allclose(a[0], b[0], atol=1e-5)
