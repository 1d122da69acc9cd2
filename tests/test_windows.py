"""The windows object (kvcli.runtime.windows): each layer's sliding window read from the config as the
model's own attention modules apply it, and what a sliding layer holds, drops and still needs —
each checked against an independent computation (the attention modules, the causal mask's
definition, a cache cut back step by step)."""

from __future__ import annotations

import pytest
import torch

from kvcli.caches import KVCache
from kvcli.caches.blocks import OffloadKVCache
from kvcli.runtime.windows import WINDOW_SLACK, Windows
from tests.helpers.tiny_models import FAMILIES, tiny_config

CONFIGS = [(family, {}) for family in FAMILIES] + [
    ("mistral", dict(sliding_window=48)),  # every layer slides over the config's window
    ("phi3", dict(sliding_window=32)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1, num_hidden_layers=3)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=32, max_window_layers=2, num_hidden_layers=3)),
    ("gemma2", dict(num_hidden_layers=5)),
    ("gemma3", dict(num_hidden_layers=7, layer_types=None)),  # the config's own pattern: 5 sliding, 1 full
    ("gemma3", dict(sliding_window=8192)),  # a window longer than the context limits nothing
    ("mistral", dict(sliding_window=4096)),  # as long as the context (4096): the same
]


@pytest.mark.parametrize(
    "family, overrides", CONFIGS, ids=[f"{f}-{'-'.join(map(str, o.values()))}" for f, o in CONFIGS]
)
def test_the_windows_are_those_the_attention_modules_apply(family, overrides):
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    text = model.config.get_text_config()
    # what each layer's attention passes to the kernel: its own ``sliding_window`` (the families
    # whose layers differ), else the config's (Mistral, Phi-3)
    applied = [
        vars(layer.self_attn).get("sliding_window", getattr(text, "sliding_window", None))
        for layer in model.get_decoder().layers
    ]
    windows = Windows.of_config(text, text.num_hidden_layers)
    assert list(windows.attention) == applied
    limit = text.max_position_embeddings
    assert list(windows.layers) == [w if w is not None and w < limit else None for w in applied]
    assert windows.full_layers == [i for i, w in enumerate(applied) if w is None or w >= limit]
    assert windows.hybrid == any(w is not None and w < limit for w in applied)
    assert windows.shortest == min((w for w in applied if w is not None and w < limit), default=None)
    for i in range(windows.n_layers):
        assert windows.window(i) == windows.layers[i] and windows.attention_window(i) == applied[i]


def test_the_loaded_model_and_its_engine_share_one_windows_object(tiny_lm):
    from kvcli.runtime.engine import Engine

    lm = tiny_lm("gemma2")
    assert lm.windows is lm.windows and Engine(lm).windows is lm.windows
    assert list(lm.windows.layers) == [16, None, 16, None] and lm.windows.sliding_layers == (0, 2)
    assert not tiny_lm("llama").windows.hybrid


@pytest.mark.parametrize("w", [1, 2, 5, 16])
def test_a_sliding_layer_holds_what_the_next_query_reaches(w):
    windows = Windows((w, None), max_context=1000)
    for n in range(0, 40):
        # the next token sits at position n; it attends key k iff n - w < k <= n
        reached = torch.tensor([n - w < k for k in range(n)], dtype=torch.bool)
        assert torch.equal(windows.holds(0, n), reached), n
        assert windows.holds(1, n) is None


def _cache(n: int, layers: int = 2) -> KVCache:
    """A cache whose entries are their own positions (keys and values (1, 1, n, 1))."""
    cache = KVCache()
    kv = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)
    for layer in range(layers):
        cache.update(kv, kv, layer)
    cache.record_positions(torch.arange(n))
    return cache


def _append(cache: KVCache, position: int) -> None:
    row = torch.tensor([[[[float(position)]]]])
    for layer in range(cache.n_layers):
        cache.update(row, row, layer)
    cache.record_positions(torch.tensor([position]))


@pytest.mark.parametrize("w, n", [(16, 40), (16, 10), (5, 200), (100, 64)])
def test_what_decoding_holds_is_what_the_cut_cache_holds(w, n):
    """A cache read and cut as the pipeline and decoding cut it (the prompt: w - 1 entries; each
    step: once w - 1 + WINDOW_SLACK are exceeded) holds the prompt entries held_after counts."""
    windows = Windows((w, None), max_context=10_000)
    cache = _cache(n)
    cache.trim_windows(windows)
    for fed in range(0, 3 * WINDOW_SLACK + 7):
        if fed:
            _append(cache, n + fed - 1)
            cache.trim_windows(windows, slack=WINDOW_SLACK)
        held = int((cache.keys[0] < n).sum())  # prompt entries still in the sliding layer
        assert held == Windows.held_after(n, w, fed), fed
        assert int((cache.keys[1] < n).sum()) == n  # the full layer keeps the prompt
        assert cache.keys[0].shape[2] <= w - 1 + WINDOW_SLACK
        assert torch.equal(cache.keys[0].view(-1), torch.arange(n + fed - cache.keys[0].shape[2], n + fed).float())
        assert cache.dropped.get(0, 0) == n + fed - cache.keys[0].shape[2]
        assert windows.mean_held(n, fed) == pytest.approx((held + n) / 2)


def test_the_room_and_the_slack_of_a_cut():
    windows = Windows((16, None, 16), max_context=10_000)
    for room, slack in ((0, 0), (40, 0), (0, 64), (4, 3)):
        for n in range(0, 120):
            keep = min(n, 15 + room) if n > 15 + room + slack else n
            assert windows.excess(0, n, slack, room) == n - keep
            assert windows.excess(1, n, slack, room) == 0
    cache = _cache(100, layers=3)
    cache.trim_windows(windows, room=4, layers=(0, 1))  # layer 2 not asked
    assert [cache.get_seq_length(i) for i in range(3)] == [19, 100, 100] and dict(cache.dropped) == {0: 81}


def test_a_layout_that_does_not_cut_keeps_its_entries():
    windows = Windows((16, None), max_context=10_000)
    cache = OffloadKVCache()
    kv = torch.zeros(1, 1, 50, 1)
    for layer in range(2):
        cache.update(kv, kv, layer)
    assert not cache.cuts_windows
    cache.trim_windows(windows)
    assert cache.get_seq_length(0) == 50 and not cache.dropped


@pytest.mark.parametrize("w", [1, 3, 16])
def test_can_resume_is_whether_the_cut_layer_still_holds_the_window(w):
    """A pass resumed at position m reads, in the sliding layer, keys m - (w - 1) .. m - 1; after
    cutting the cache back to m tokens the layer holds positions d .. m - 1 (d: the entries it
    dropped, at most m)."""
    windows = Windows((w, None), max_context=10_000)
    n = 40
    for dropped in range(0, n + 1):
        cache = _cache(n)
        if dropped:
            cache.drop_front(0, dropped)
        for m in range(0, n + 1):
            held = set(range(min(dropped, m), m))
            needed = set(range(max(0, m - (w - 1)), m))
            assert windows.can_resume(cache, m) == (needed <= held), (dropped, m)
    assert Windows.none(2).can_resume(_cache(n), 7)
