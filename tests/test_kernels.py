"""The attention kernels as a GPU runs them: flash-attn's call (through a stand-in module that
checks the call and computes flash-attn's documented semantics independently)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvcli.caches import KVCache
from kvcli.runtime.engine import Engine
from tests.helpers.runs import random_ids


def flash_reference(q, k, v, softmax_scale, causal, window_size):
    """flash-attn 2's documented ``flash_attn_func``: (b, s, h, d) layout, KV heads shared by
    groups of query heads, causal aligned to the bottom right, ``window_size=(left, right)``:
    query i may see key j iff i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    left, right = window_size
    if causal:
        right = 0
    for head in range(h):
        kh = head // (h // hk)
        for i in range(sq):
            j = torch.arange(sk, device=q.device)
            ok = torch.ones(sk, dtype=torch.bool, device=q.device)
            if right >= 0:
                ok &= j <= i + sk - sq + right
            if left >= 0:
                ok &= j >= i + sk - sq - left
            s = (q[0, i, head].double() @ k[0, :, kh].double().T) * softmax_scale
            w = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
            out[0, i, head] = (w @ v[0, :, kh].double()).to(q.dtype)
    return out


@pytest.fixture
def fake_flash(monkeypatch):
    """``fake_flash()`` installs a ``flash_attn`` module whose ``flash_attn_func`` checks the call
    and records it (after the model is loaded: transformers probes the real package at import)."""
    calls = []

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **kw):
        assert q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == 1
        assert q.shape[-1] == k.shape[-1] and k.shape == v.shape
        assert q.shape[2] % k.shape[2] == 0 and q.shape[2] > k.shape[2]  # (b, s, h, d), GQA not expanded
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        assert dropout_p == 0.0 and not kw.get("return_attn_probs", False)
        calls.append(
            dict(
                q_len=q.shape[1],
                kv_len=k.shape[1],
                heads=q.shape[2],
                causal=causal,
                scale=softmax_scale,
                window=tuple(window_size),
            )
        )
        return flash_reference(q, k, v, softmax_scale, causal, window_size)

    def install():
        module = types.ModuleType("flash_attn")
        module.flash_attn_func = flash_attn_func
        monkeypatch.setitem(sys.modules, "flash_attn", module)
        return calls

    return install


@pytest.mark.parametrize("family, window", [("llama", None), ("mistral", 8)])
def test_flash_kernel_calls_flash_attn_as_documented(tiny_lm, fake_flash, family, window):
    """--attn flash: prefill, a block on top of a cache and decoding run flash_attn_func directly
    (not transformers' flash_attention_forward, which looks "kvcli" up and raises) with the
    layer's scale, causal mode and window, and give sdpa's logits."""
    lm = tiny_lm(family, **({"sliding_window": window} if window else {}))
    ids = random_ids(30, seed=4)
    engine = Engine(lm)
    ref = engine.logits(engine.forward(ids, torch.arange(30), KVCache()))
    engine.kernel = "flash"
    calls = fake_flash()
    cache = KVCache()
    parts = [
        engine.logits(engine.forward(ids[:20], torch.arange(20), cache)),
        engine.logits(engine.forward(ids[20:29], torch.arange(20, 29), cache)),
        engine.logits(engine.forward(ids[29:], torch.tensor([29]), cache)),
    ]
    assert torch.allclose(torch.cat(parts), ref, atol=1e-4)
    scale = engine.layers[0].self_attn.scaling
    expected_window = (-1, -1) if window is None else (window - 1, 0)
    assert [(c["q_len"], c["kv_len"]) for c in calls] == [(20, 20)] * 4 + [(9, 29)] * 4 + [(1, 30)] * 4
    assert all(
        c["causal"] and c["scale"] == scale and c["window"] == expected_window and c["heads"] == lm.n_heads
        for c in calls
    )


def test_razor_head_probe_stays_on_the_query_device():
    """RazorAttention's echo/induction scores accumulate on the query's device: on ``meta`` (any
    device but the CPU) mixing in a CPU tensor raises; the CPU result is unchanged."""
    from kvcli.compressors.razor_heads import echo_induction_scores

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 24, 8, generator=g), torch.randn(1, 2, 24, 8, generator=g)
    echo, induction = echo_induction_scores(q.to("meta"), k.to("meta"), 6, 0.3)
    assert echo.device.type == induction.device.type == "meta" and echo.shape == (4,)
    cpu = echo_induction_scores(q, k, 6, 0.3)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in cpu)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("q_len, kv_len", [(100, 100), (70, 90), (5, 60)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_sliding_window_attention_by_query_blocks(monkeypatch, kernel, q_len, kv_len, softcap):
    """A long pass of a sliding-window layer attends block by block (kernels._by_query_blocks):
    each query sees exactly its window, against a float64 softmax written out here, with the
    queries the whole sequence or the last q_len keys (a chunk on a prefix), GQA as it is, and
    Gemma 2's soft-capped scores. No block or mask of the whole pass is made; a few queries on a
    prefix longer than the window (5 on 55) attend only the keys their window reaches."""
    from kvcli.runtime import kernels

    window, block = 8, 16
    monkeypatch.setattr(kernels, "window_block", lambda w: block)
    widths = []
    real_attend = kernels.attend

    def spy(kernel, module, query, key, *args, **kwargs):
        widths.append(key.shape[2])
        return real_attend(kernel, module, query, key, *args, **kwargs)

    monkeypatch.setattr(kernels, "attend", spy)
    torch.manual_seed(0)
    h, kvh, d = 4, 2, 8
    q = torch.randn(1, h, q_len, d, dtype=torch.float64)
    k, v = torch.randn(1, kvh, kv_len, d, dtype=torch.float64), torch.randn(1, kvh, kv_len, d, dtype=torch.float64)
    module = types.SimpleNamespace(kvcli_softcap=softcap)
    got = kernels.attend(kernel, module, q, k, v, 0.3, window)
    s = q @ k.repeat_interleave(h // kvh, 1).transpose(-1, -2) * 0.3
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    rows = torch.arange(q_len)[:, None] + kv_len - q_len
    cols = torch.arange(kv_len)[None, :]
    s = s.masked_fill(~((cols <= rows) & (cols > rows - window)), float("-inf"))
    want = (torch.softmax(s, -1) @ v.repeat_interleave(h // kvh, 1)).transpose(1, 2)
    # eager's softmax and the soft-capped kernel run in float32, SDPA in the inputs' float64
    assert torch.allclose(got, want, atol=1e-10 if kernel == "sdpa" and softcap is None else 1e-6)
    assert max(widths[1:]) <= block + window - 1 and len(widths) == 1 + -(-q_len // block)
