"""TOVA: keep the tokens the last query attends to most (Oren et al., 2024, arXiv:2401.06104).

"Transformers are Multi-State RNNs" (Token Omission Via Attention): the cache is a bounded
multi-state; when it is full, drop the entry the *current* query attends to least. The score of a
key is the softmax attention of the last token, **averaged over all the heads of the layer**, so
every KV head of a layer keeps the same tokens (the paper's choice; it found per-head selection no
better), and the last token itself is always kept.

kvcli applies it once, after the prefill (as NVIDIA kvpress does): the last prompt token's query
(the end of the generation prompt) scores every key; each layer keeps its ``budget`` best. The
paper evicts one token per decoding step as the stream goes on; for short answers the one-shot
selection is what matters (the decoding-time variant is ``-c "decoding:base=tova,..."``).

Scores from q and K directly (one query row per layer, every query head reading its GQA group's
KV head, the cache never expanded); any attention kernel runs the model. Kept tokens keep their
original positions; decoding continues at the prompt length. Disk store: the prefix state is full
attention's (the KV of every layer); the last prompt token always runs on top of it
(``query_window`` = 1) and the eviction happens after. ``budget`` >= the prompt keeps everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .scoring import Eviction, window_attention


def tova_scores(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The last query row's attention to every key, mean over all query heads of the layer,
    the same for every KV head: (n_kv, kv_len); the last key scores +inf (always kept)."""
    probs = window_attention(query, key, 1)  # (n_kv, group, 1, kv_len)
    scores = probs.mean(dim=(0, 1, 2))
    scores[-1] = float("inf")
    return scores.expand(key.shape[1], -1)


@dataclass
class TOVA(Eviction):
    """TOVA (Oren et al., 2024): each layer keeps the keys the last token attends to most,
    averaged over the layer's heads (the same tokens in every head). arXiv:2401.06104."""

    name: ClassVar[str] = "tova"
    paper: ClassVar[str] = "Oren et al. 2024, Transformers are Multi-State RNNs (TOVA), arXiv:2401.06104"
    keep_all: ClassVar[str] = "budget={n}"  # a budget of the whole prompt (an explicit count may not exceed it)
    short_document_spec: ClassVar[str] = "tova:budget=0.25"
    title: ClassVar[str] = "TOVA"
    acts: ClassVar[str] = (
        "after prefill: the last prompt token's attention (from q·K), mean over all heads of the layer — the same "
        "tokens in every head; the last token always kept"
    )
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "prefix KV (shared with full); compresses per question"

    def query_window(self, lm) -> int:
        return 1

    def layer_scores(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return tova_scores(query, key)
