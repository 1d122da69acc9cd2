"""KeyDiff: keep the keys least similar to the layer's mean key (Park et al., 2025,
arXiv:2504.15364).

"KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments": keys that point in a distinctive direction attract attention
that the others share, so each KV head keeps the keys with the *lowest* cosine similarity to its
anchor — the mean of its L2-normalised keys. No attention is computed (any kernel runs the model).

The paper evicts block by block while the prompt streams in; kvcli scores once after the prefill
(NVIDIA kvpress's ``KeyDiffPress``, whose anchor is the same mean of normalised keys). Per KV head
(GQA needs no reduction; the cache is never expanded), on the cached keys (after RoPE). As for
KNorm, the last ``window`` prompt tokens (the question) are always kept — ``window=0`` is the
paper's rule alone. Kept tokens keep their original positions; decoding continues at the prompt
length. Disk store: the prefix state is full attention's; ``budget`` >= the prompt keeps everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import knob
from .knorm import KeyScorer, protect_last


def keydiff_scores(key: torch.Tensor, window: int) -> torch.Tensor:
    """(1, n_kv, n, d) keys -> (n_kv, n): minus the cosine similarity of each key to the mean of
    its head's normalised keys; the last ``window`` +inf."""
    k = key[0].to(torch.float32)
    anchor = F.normalize(k, dim=-1).mean(dim=1, keepdim=True)  # (n_kv, 1, d)
    return protect_last(-F.cosine_similarity(k, anchor, dim=-1), window)


@dataclass
class KeyDiff(KeyScorer):
    """KeyDiff (Park et al., 2025): each KV head keeps the keys least similar (cosine) to its mean
    normalised key (plus the last window prompt tokens). arXiv:2504.15364."""

    name: ClassVar[str] = "keydiff"
    paper: ClassVar[str] = (
        "Park et al. 2025, KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference, arXiv:2504.15364"
    )
    keep_all: ClassVar[str] = "budget={n}"  # a budget of the whole prompt (an explicit count may not exceed it)
    short_document_spec: ClassVar[str] = "keydiff:budget=0.25,window=8"
    title: ClassVar[str] = "KeyDiff"
    acts: ClassVar[str] = (
        "after prefill: per KV head the keys least similar (cosine) to the head's mean normalised key; last `window` "
        "tokens kept"
    )
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "as TOVA"

    window: int = knob(32, "last prompt tokens always kept (the question); 0 = the paper's rule alone")

    def layer_scores(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return keydiff_scores(key, self.window)
