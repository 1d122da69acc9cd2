"""SnapKV: the end of the prompt votes for the KV entries worth keeping (Li et al., 2024,
arXiv:2404.14469).

"SnapKV: LLM Knows What You are Looking for Before Generation", Listing 1: after the prefill,
per layer and per head,

1. the last ``window`` prompt tokens (the *observation window*, 32 in the paper) attend to every
   key: ``softmax(q_win Kᵀ / sqrt(d))`` with the causal mask inside the window;
2. each key before the window gets the sum of the weights it received from the window (its vote);
3. the votes are pooled along the sequence (``kernel`` 7, max pool in the LongBench setting; avg
   also available) so neighbours of a selected token come with it ("clustering");
4. the ``budget - window`` best keys plus the window itself are kept.

kvcli details: GQA — votes are computed per query head and averaged over each KV head's group;
each KV head keeps its own tokens, all heads of a layer keep ``budget`` entries; the cache is
never expanded. Kept tokens keep their original positions (keys are stored after RoPE) and
decoding continues at the prompt length. The first answer token comes from the full prefill,
the compression applies to the following ones.

Disk store: the prefix state is full attention's (the KV of every layer, question-agnostic,
shared with ``-c full``); the pipeline re-runs the last ``window`` prompt tokens on top of it
(``query_window``) so the observation window is always scored, and the question-dependent
eviction happens after. ``budget`` >= the prompt keeps everything (= full attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UsageError
from .base import knob
from .scoring import Eviction, snap_scores

POOLS = ("max", "avg")


@dataclass
class SnapKV(Eviction):
    """SnapKV (Li et al., 2024): an observation window at the end of the prompt selects, per KV
    head, the entries to keep. arXiv:2404.14469."""

    name: ClassVar[str] = "snapkv"
    paper: ClassVar[str] = (
        "Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation, arXiv:2404.14469"
    )
    keep_all: ClassVar[str] = "budget={n}"  # a budget of the whole prompt (an explicit count may not exceed it)
    short_document_spec: ClassVar[str] = "snapkv:budget=0.25,window=8"
    title: ClassVar[str] = "SnapKV"
    acts: ClassVar[str] = "after prefill: window queries score keys, pooled, top-k per KV head"
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "prefix KV (shared with full); compresses per question"

    window: int = knob(32, "observation window: the last prompt tokens whose attention votes (always kept)")
    kernel: int = knob(7, "width of the pool over the votes (odd; 1 = none)")
    pool: str = knob("max", "pooling of the votes: max or avg")

    def check_knobs(self) -> None:
        if self.window < 1:
            raise UsageError(f"{self.name}: window must be at least 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise UsageError(f"{self.name}: kernel must be odd and at least 1, got {self.kernel}")
        self.pool = str(self.pool).strip().lower()
        if self.pool not in POOLS:
            raise UsageError(f"{self.name}: pool must be max or avg, got '{self.pool}'")

    def always_kept(self) -> int:
        return self.window

    def query_window(self, lm) -> int:
        return self.window

    def layer_scores(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return snap_scores(query, key, self.window, self.kernel, self.pool)
