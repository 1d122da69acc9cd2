"""Compression during decoding: re-apply an eviction scorer every ``interval`` generated tokens so
the cache stays within a budget (NVIDIA kvpress's ``DecodingPress``).

Methods such as SnapKV or KNorm compress once, after the prefill; a long answer then grows the
cache again. kvpress's ``DecodingPress`` wraps a scorer and, every ``compression_interval``
decoding steps, scores every cached entry — the prompt's survivors and the generated tokens — with
the hidden states of the recent steps, and keeps the best ``target_size`` per head. kvcli does the
same with any of its eviction scorers: ``decoding:base=knorm,budget=512,interval=64``.

* ``base``: ``snapkv``, ``pyramidkv``, ``tova``, ``knorm``, ``keydiff`` or ``streamingllm``, its
  knobs after ``:`` separated by ``;`` (as for ``adakv``). Attention-based scorers read the queries
  of the last ``buffer`` decoding steps since the previous compression (SnapKV's observation window
  = those steps; TOVA = the last step), recorded by observers on each step — no attention matrix,
  any kernel; GQA per query head, mean over the group, the cache never expanded.
* ``budget``: entries each KV head keeps after a compression — a count, or a ratio of the prompt.
  Every ``interval`` steps, a layer holding more keeps its ``budget`` best (per KV head, in their
  original order); entries a scorer always keeps (its window, sinks) stay. PyramidKV's per-layer
  budgets apply (computed for the cache's current length).
* It owns the decoding step only: the prefill is untouched, so ``snapkv:budget=512+decoding:...``
  compresses both after the prefill and while decoding. It needs a plain KV cache (full
  attention's, or after a uniform eviction); methods with their own cache layout (razor, duo,
  adakv, kvzip, expectedattention, blocksparse, lazyllm) are refused with one line.

Positions: kept tokens keep their original positions; new tokens continue at the next position.
``inspect`` reads what the cache held at the end (``kept`` covers the generated tokens too).
``budget`` >= prompt + answer never compresses (= full attention).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..caches import KVCache, LayerView
from ..errors import UsageError
from ..runtime import windows
from .adakv import base_spec, parse_base
from .base import Compressor, knob
from .scoring import Eviction, evict, parse_budget


def cover_appended(cache: KVCache) -> None:
    """After an earlier eviction, ``cache.kept`` lists each head's prompt entries only; extend it
    with the original positions of the tokens appended since (the most recent positions seen)."""
    if cache.kept is None:
        return
    for layer, kept in enumerate(cache.kept):
        extra = cache.seq_len(layer) - kept.shape[1]
        if extra > 0:
            tail = cache.positions[-extra:].view(1, -1).expand(kept.shape[0], -1)
            cache.kept[layer] = torch.cat([kept, tail], dim=1)


@dataclass
class Decoding(Compressor):
    """Decoding-time compression (NVIDIA kvpress's DecodingPress): every interval generated
    tokens, an eviction scorer keeps the best budget entries per KV head."""

    name: ClassVar[str] = "decoding"
    paper: ClassVar[str] = (
        "NVIDIA kvpress DecodingPress (Devoto et al. 2025, arXiv:2510.00636, decoding-phase compression)"
    )
    keep_all: ClassVar[str] = (
        "interval=1,budget=1000000"  # a budget above prompt + answer never evicts, though checked after every step
    )
    # decoding-time compression: the prefill's method compresses, decoding keeps it under budget
    short_document_spec: ClassVar[str] = "snapkv:budget=0.25,window=8+decoding:budget=0.25"
    title: ClassVar[str] = "decoding"
    acts: ClassVar[str] = (
        "owns each decoding step: every `interval` steps a scorer (as for `adakv`) keeps the best `budget` entries per "
        "KV head of the grown cache, scored with the queries of the recent steps (kvpress's DecodingPress); chain it "
        "after a prefill method (`snapkv:budget=512+decoding:budget=512`)"
    )
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "prefix KV (shared with full)"

    base: str = knob(
        "knorm",
        "the scorer: snapkv, pyramidkv, tova, knorm, keydiff or streamingllm, its knobs after ':' separated by ';'",
    )
    budget: str | int | float = knob(
        "1024", "entries each KV head keeps after a compression: a token count or a ratio of the prompt"
    )
    interval: int = knob(64, "decoding steps between compressions")
    buffer: int = knob(256, "the last decoding steps (since the previous compression) whose queries score the keys")

    _base: Eviction | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._base = parse_base(self.name, self.base)
        self.base = base_spec(self._base)
        self.budget = parse_budget(self.name, self.budget)
        if self.interval < 1:
            raise UsageError(f"{self.name}: interval must be at least 1, got {self.interval}")
        if self.buffer < 1:
            raise UsageError(f"{self.name}: buffer must be at least 1, got {self.buffer}")
        if isinstance(self.budget, int) and self.budget < self._base.always_kept():
            raise UsageError(
                f"{self.name}: budget={self.budget} is smaller than the {self._base.always_kept()} tokens {self._base.name} "
                f"always keeps; use budget >= {self._base.always_kept()}"
            )
        self._run: dict = {}

    @property
    def scorer(self) -> Eviction:
        return self._base

    def configure(self, lm) -> None:
        self._base.configure(lm)

    # --- the decoding step ------------------------------------------------------------------------
    def _state(self, cache) -> dict:
        """Per-run state (a new cache = a new answer): steps since the last compression, the
        recorded queries per layer, the budget (resolved against the prompt length)."""
        if self._run.get("cache") is None or self._run["cache"]() is not cache:
            if not isinstance(cache, KVCache):
                raise UsageError(
                    f"{self.name}: compresses a plain KV cache while decoding, not a {type(cache).__name__}; use it without that method"
                )
            n = cache.n_tokens
            k = max(1, round(self.budget * n)) if isinstance(self.budget, float) else self.budget
            self._run = {
                "cache": weakref.ref(cache),
                "steps": 0,
                "queries": {},
                "budget": max(k, self._base.always_kept()),
                "compressions": 0,
            }
        return self._run

    def _record(self, run: dict, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        if isinstance(key, LayerView):
            raise UsageError(
                f"{self.name}: compresses a plain KV cache while decoding; it cannot follow a method with a grouped cache"
            )
        held = run["queries"].get(layer)
        q = query if held is None else torch.cat([held, query], dim=2)
        run["queries"][layer] = q[:, :, -self.buffer :]

    device_token: ClassVar[bool] = True  # the token and its position stay on the device

    @torch.inference_mode()
    def decode_step(self, engine, token, position: int, cache) -> torch.Tensor:
        run = self._state(cache)
        observers = {}
        if self._base.uses_attention:
            observers = {layer: [functools.partial(self._record, run, layer)] for layer in range(engine.n_layers)}
        ids = torch.tensor([token]) if isinstance(token, int) else token.view(1)
        hidden = engine.forward(
            ids,
            engine.device_positions(position, position + 1),
            cache,
            observers=observers,
            recorded=torch.tensor([position]),
        )
        cache.trim_windows(engine.windows, slack=windows.WINDOW_SLACK)  # a hybrid's sliding layers: their window
        run["steps"] += 1
        if run["steps"] >= self.interval:
            self.compress_now(engine, cache, run)
        return engine.logits(hidden)[-1]

    def compress_now(self, engine, cache: KVCache, run: dict) -> None:
        """Keep each layer's ``budget`` best entries per KV head (scored on the current entries)."""
        lm = engine.lm
        k = run["budget"]
        cover_appended(cache)
        budgets = self._base.layer_budgets(lm, max(cache.seq_len(l) for l in range(cache.n_layers)), k)
        for layer, k_layer in enumerate(budgets):
            n = cache.seq_len(layer)
            if n <= k_layer or lm.windows.window(layer) is not None:
                continue  # nothing to evict, or a hybrid's sliding layer: its window bounds it (trim_windows)
            key = cache.keys[layer]
            if self._base.uses_attention:
                scores = self._base.layer_scores(run["queries"][layer], key)
            else:
                scores = self._base.static_scores(n, key.shape[1])
            evict(cache, layer, torch.topk(scores.to(key.device), k_layer, dim=-1).indices)
        run["steps"] = 0
        run["queries"] = {}
        run["compressions"] += 1
