"""KNorm: keep the keys with the lowest L2 norm (Devoto et al., 2024, arXiv:2406.11430).

"A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression": across layers and
heads, a key with a *low* L2 norm usually receives *high* attention, so the norm of a key
predicts its importance before any query sees it. Each KV head keeps its ``budget`` keys of
lowest norm; no attention is computed (any kernel, flash included, runs the model).

kvcli details: scores are per KV head (the keys are the KV heads'; GQA needs no reduction and the
cache is never expanded); the norm is taken on the cached key (after RoPE — a rotation, so the
norm is the pre-RoPE one whenever the rotary embedding does not rescale). NVIDIA kvpress compresses
the context only and appends the question uncompressed; kvcli compresses after the whole prompt,
so the last ``window`` prompt tokens (the question and the generation prompt) are always kept,
like SnapKV's window — ``window=0`` is the paper's rule alone. Kept tokens keep their original
positions; decoding continues at the prompt length. Disk store: the prefix state is full
attention's (the KV of every layer); the eviction happens after the question's tokens ran on top.
``budget`` >= the prompt keeps everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UsageError
from .base import knob
from .scoring import Eviction


def protect_last(scores: torch.Tensor, window: int) -> torch.Tensor:
    """(n_kv, n) scores with the last ``window`` entries set to +inf (always kept)."""
    if window > 0:
        scores[..., -window:] = float("inf")
    return scores


def knorm_scores(key: torch.Tensor, window: int) -> torch.Tensor:
    """(1, n_kv, n, d) keys -> (n_kv, n): minus the L2 norm of each key; the last ``window`` +inf."""
    return protect_last(-key[0].to(torch.float32).norm(dim=-1), window)


class KeyScorer(Eviction):
    """Shared by KNorm and KeyDiff: scores from the keys alone, the last ``window`` tokens kept."""

    def check_knobs(self) -> None:
        if self.window < 0:
            raise UsageError(f"{self.name}: window must be at least 0, got {self.window}")

    def always_kept(self) -> int:
        return max(1, self.window)


@dataclass
class KNorm(KeyScorer):
    """KNorm (Devoto et al., 2024): each KV head keeps the keys of lowest L2 norm (plus the last
    window prompt tokens). arXiv:2406.11430."""

    name: ClassVar[str] = "knorm"
    paper: ClassVar[str] = (
        "Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression, arXiv:2406.11430"
    )
    keep_all: ClassVar[str] = "budget={n}"  # a budget of the whole prompt (an explicit count may not exceed it)
    short_document_spec: ClassVar[str] = "knorm:budget=0.25,window=8"
    title: ClassVar[str] = "KNorm"
    acts: ClassVar[str] = (
        "after prefill: per KV head the keys of lowest L2 norm (no attention computed); the last `window` tokens (the "
        "question) always kept, `window=0` = the paper's rule"
    )
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "as TOVA"

    window: int = knob(32, "last prompt tokens always kept (the question); 0 = the paper's rule alone")

    def layer_scores(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return knorm_scores(key, self.window)
