"""H2O: heavy hitters plus recent tokens (Zhang et al., 2023, arXiv:2306.14048).

"H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models": a few
tokens receive most of the attention; the cache keeps those *heavy hitters* — ranked by the
attention they have accumulated, the column sums of the attention matrix — and the most recent
tokens, half of the budget each in the paper's experiments (``recent`` knob).

kvcli applies it once, to the prompt (the setting NVIDIA kvpress evaluates): the accumulated
score of each key is the sum of its attention weights over *every* prompt query, per query head,
averaged over the GQA group of its KV head; each KV head keeps its own heavy hitters. Each layer
is evicted as soon as the prefill has run it (the later layers never read it again), so the
uncompressed KV of every layer is never held at once. The decoded tokens are then appended
without further eviction (the paper's step-by-step greedy eviction during generation matters for
long outputs, not for short answers).

The score is the paper's *sum* (its code: ``attn_weights.sum(...)`` over the query rows), so a
key seen by more queries — an early one — accumulates more. kvpress's ``ObservedAttentionPress``
("related to H2O") divides each column by the number of queries that see it (a mean) instead.
Either way a needle that only the question attends to scores low: on RULER at 4x the heavy
hitters are punctuation, newlines and filler words, a quarter of them in the first tenth of the
prompt, and the needle's digits are evicted in the heads that copy them (README, Accuracy).

Kernel: one pass, no second attention. In the final prefill pass each layer's observer is an
:class:`kvcli.runtime.attention.Attending` one: it computes the layer's causal attention itself
(:func:`kvcli.compressors.scoring.attention_and_column_sums`) — one KV head at a time, blocks of
16-64 query rows of its query heads together (GQA never expanded), logits only against the keys
the block can see, softmax once in float32, the weights summed per column (the score) and
multiplied by V (the layer's output) — and the kernel (SDPA, eager or flash) is not called for
that layer. The full attention matrix is never materialised (one reused buffer holds a block).
Where the attention is not plain causal (a sliding window shorter than the prompt, an explicit
mask), the observer only sums the same blocks' weights and the kernel runs: two computations, as
before. ``benchmarks/h2o_ttft.py`` (SmolLM2, one thread, full and H2O alternating in one process,
a 2-core machine shared with other jobs so the process's CPU time is the steady measure): H2O's
TTFT costs 1.08× full attention's at 4k tokens and 1.30× at 8k, against 2.2× and 2.9× for the
earlier observer that recomputed the attention beside SDPA in 256-row blocks. The kept entries
are the same (at 8k one near-tie, 6e-7 apart, flips in one of the 90 layer x KV-head sets:
float rounding of the attention output).

Positions: kept tokens keep their original positions; decoding continues at the prompt length.

Disk store: none. The scores need the queries of every prompt token, so there is no state to
reuse: ``prefix_state`` is None and every run prefills the whole prompt (``query_window`` is the
whole prompt too, in case another stage hands it full attention's prefix). A reusable state is
possible — the column sums of the document's own queries are question-agnostic and could be
stored next to its KV — but is not implemented.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UsageError
from ..runtime.attention import Attending
from .base import knob
from .scoring import Eviction, attention_and_column_sums, column_sums, group_mean

WHOLE_PROMPT = 2**62  # query_window: every token


@dataclass
class H2O(Eviction):
    """H2O (Zhang et al., 2023): keep the heavy hitters (most accumulated attention) and the
    most recent tokens. arXiv:2306.14048."""

    name: ClassVar[str] = "h2o"
    paper: ClassVar[str] = (
        "Zhang et al. 2023, H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models, arXiv:2306.14048"
    )
    keep_all: ClassVar[str] = "budget={n}"  # a budget of the whole prompt (an explicit count may not exceed it)
    short_document_spec: ClassVar[str] = "h2o:budget=0.25"
    title: ClassVar[str] = "H2O"
    acts: ClassVar[str] = (
        "after prefill: cumulative attention of every query (its observer computes each layer's attention in blocks and "
        "sums the weights: one pass, no SDPA call) + recent"
    )
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "nothing (needs every query)"

    recent: float = knob(0.5, "fraction of the budget given to the most recent tokens (the rest: heavy hitters)")

    def check_knobs(self) -> None:
        if not 0 <= self.recent <= 1:
            raise UsageError(f"{self.name}: recent must be between 0 and 1, got {self.recent}")

    def prefix_state(self, lm) -> None:
        return None  # needs every query of the prompt: nothing reusable (see the module docstring)

    def query_window(self, lm) -> int:
        return WHOLE_PROMPT

    def layer_scores(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return group_mean(column_sums(query, key))

    def prefill_observers(self, lm, n_tokens: int) -> dict:
        # each layer's observer attends too: the softmax weights that sum to the scores give its output
        return {
            layer: [Attending(fn, functools.partial(self._attend, layer)) for fn in fns]
            for layer, fns in super().prefill_observers(lm, n_tokens).items()
        }

    def _attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        out, sums = attention_and_column_sums(query, key, value, scaling)
        self._scores[layer] = group_mean(sums)
        return out

    def final_scores(self, scores: torch.Tensor, n: int) -> torch.Tensor:
        n_recent = min(n, round(self.resolve(n) * self.recent))
        if not n_recent:
            return scores
        recent = torch.arange(scores.shape[-1], device=scores.device) >= n - n_recent  # always kept
        return scores.masked_fill(recent, float("inf"))
