"""StreamingLLM: attention sinks plus a recent window (Xiao et al., 2023, arXiv:2309.17453).

"Efficient Streaming Language Models with Attention Sinks": keep the first ``sinks`` tokens (4 in
the paper), which soak up attention whatever their content, and the most recent
``budget - sinks`` tokens; everything in between is evicted. No scores: the same tokens in every
layer and every KV head, so no attention is computed and any kernel runs the model.

Positions: the paper assigns positions *within the cache* (a rolling cache) so that streams longer
than the pre-training window stay in range; kvcli compresses one prompt inside the model's window,
keeps the keys as cached (after RoPE, at their original positions) and decodes at the prompt
length — the same choice as NVIDIA kvpress. Disk store: the prefix state is full attention's
(eviction happens after the prefill of the whole prompt); ``budget`` >= the prompt keeps everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UsageError
from .base import knob
from .scoring import Eviction


@dataclass
class StreamingLLM(Eviction):
    """StreamingLLM (Xiao et al., 2023): keep the attention sinks and the most recent tokens.
    arXiv:2309.17453."""

    name: ClassVar[str] = "streamingllm"
    paper: ClassVar[str] = (
        "Xiao et al. 2023, Efficient Streaming Language Models with Attention Sinks, arXiv:2309.17453"
    )
    keep_all: ClassVar[str] = "budget={n}"  # sinks + recent window cover the whole prompt
    short_document_spec: ClassVar[str] = "streamingllm:budget=0.25"
    title: ClassVar[str] = "StreamingLLM"
    acts: ClassVar[str] = "after prefill: sinks + recent window"
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "prefix KV (shared with full)"
    uses_attention: ClassVar[bool] = False

    sinks: int = knob(4, "first tokens always kept (attention sinks)")

    def check_knobs(self) -> None:
        if self.sinks < 0:
            raise UsageError(f"{self.name}: sinks must be at least 0, got {self.sinks}")

    def always_kept(self) -> int:
        return max(1, self.sinks)

    def static_scores(self, n: int, n_kv: int) -> torch.Tensor:
        """Later tokens score higher; the sinks score +inf."""
        scores = torch.arange(n, dtype=torch.float32)
        scores[: self.sinks] = float("inf")
        return scores.expand(n_kv, n)
