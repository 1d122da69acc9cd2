"""Finch: prompt-guided KV cache compression, chunk by chunk (Corallo & Papotti, TACL 2024).

"FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models", section 5.1. Finch
reads a document longer than the model's window:

1. the question-agnostic part of the prompt (template head, document, template middle: ``P``
   tokens) is split into chunks of at most ``chunk`` tokens (balanced sizes);
2. each chunk is prefilled on top of the compressed cache so far, followed by the *question*
   (the question and the chat template's closing tokens: the prompt's suffix). Per layer, from the
   queries and keys the attention hands to observers (never ``output_attentions``):

   * the question rows' softmax attention over every key (chunk + cache + the question's own,
     causally), **summed over heads** (GQA: each query head reads its group's KV head; the cache is
     never expanded) and over the question rows;
   * restricted to the chunk + cache columns (the prompt-guided submatrix);
   * **normalised** for the causal position bias as in the paper: each column's sum is divided by
     the number of question rows that can see it (its non-zero attention entries). The question
     comes after every chunk and cache token, so all of them see every candidate: the divisor is
     the question length for every candidate and the ranking is that of the plain sum — the step
     is kept, literally, so that the scores are the paper's;
   * the top ``k_i`` positions are kept (sorted back into document order), per layer: layers keep
     different tokens. ``k_i = ceil(target · seen_i / P)`` grows with the tokens seen so far and
     reaches ``target`` at the last chunk (the paper's update rule: a constant compression rate);
3. the kept keys are re-rotated (:mod:`kvcli.rope`) from their position to their slot, so the
   cache always holds positions ``0..k_i-1`` and the next chunk follows right after; values carry
   no position. The question's own KV is dropped after every step;
4. finally the question runs once more, on the ``target``-token cache only, at positions
   ``target..target+q-1``; its logits start the answer and decoding continues at ``target + q``.

The model never sees more than ``target + chunk + q`` positions at once (and ``target + q +
max_new_tokens`` while decoding), whatever the document's length. With ``target >= P`` nothing is
dropped and the result is full attention's (chunks only change the order of an exact causal
computation); chunks that would drop nothing are run without the question.

Cache layout after :meth:`Finch.prefill`: ``keys[l]``/``values[l]``: (1, n_kv, k + q, d), the same
count ``k = min(target, P)`` in every layer but different tokens; ``positions`` = ``0..k+q-1``
(the re-positioned, contiguous slots: what RoPE was applied with); ``kept_positions[l]`` (an
extra attribute): the original prompt positions of the ``k`` document slots of layer ``l``;
``suffix_positions``: the original positions of the question's ``q`` slots that follow them.

Disk store: the compressed cache depends on the question, so there is no question-agnostic
prefix state to reuse (``prefix_state`` is None): every question reads the document again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..attention import StopForward
from ..cache import KVCache
from ..errors import DocumentError, UsageError
from ..rope import rerotate_table, rope_cos_sin
from .base import Compressor, knob, register

DEFAULT_TARGET = 1024
QUESTION_ROOM = 512  # positions the automatic chunk size leaves for the question and the answer


def chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """Split 0..n-1 into ceil(n / chunk) contiguous pieces of balanced sizes (each <= chunk)."""
    if n <= 0:
        return []
    count = math.ceil(n / chunk)
    edges = [round(i * n / count) for i in range(count + 1)]
    return [(edges[i], edges[i + 1]) for i in range(count)]


def kept_counts(bounds: list[tuple[int, int]], target: int) -> list[int]:
    """Cache size after each chunk: ceil(target · seen / P), never more than seen; the last is
    min(target, P)."""
    total = bounds[-1][1]
    return [min(end, math.ceil(target * end / total)) for _, end in bounds]


def question_scores(query: torch.Tensor, key: torch.Tensor, n_question: int, n_candidates: int, scaling: float) -> torch.Tensor:
    """Finch's per-token relevance at one layer: (n_candidates,) float32.

    query (1, n_heads, q_len, d) with the question in its last ``n_question`` rows; key
    (1, n_kv, kv_len, d) whose first ``n_candidates`` entries are the cache + chunk and whose last
    ``n_question`` are the question's own. Softmax attention of the question rows over every key
    (causal among the question), summed over heads and question rows, normalised per column by the
    number of question rows that see it.
    """
    _, n_heads, _, d = query.shape
    n_kv, kv_len = key.shape[1], key.shape[2]
    group = n_heads // n_kv
    q = query[0, :, -n_question:, :].to(torch.float32).reshape(n_kv, group, n_question, d)
    k = key[0].to(torch.float32).unsqueeze(1)  # (n_kv, 1, kv_len, d): broadcast over the group, never expanded
    logits = torch.matmul(q, k.transpose(-1, -2)) * scaling  # (n_kv, group, n_question, kv_len)
    rows = torch.arange(n_question, device=key.device)[:, None] + (kv_len - n_question)
    cols = torch.arange(kv_len, device=key.device)[None, :]
    visible = cols <= rows  # (n_question, kv_len)
    logits = logits.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(logits, dim=-1).sum(dim=(0, 1))  # sum over heads: (n_question, kv_len)
    sub = weights[:, :n_candidates]  # the prompt-guided submatrix: question rows x (cache + chunk)
    counts = visible[:, :n_candidates].sum(dim=0).clamp_min(1)  # non-zero entries per column
    return sub.sum(dim=0) / counts


@register
@dataclass
class Finch(Compressor):
    """Finch (Corallo & Papotti, 2024): the document is read chunk by chunk; after each chunk the
    question's attention keeps, per layer, the most relevant KV pairs (re-positioned with RoPE),
    so a document longer than the window fits a ``target``-token cache. TACL 2024, doi
    10.1162/tacl_a_00716 (arXiv:2408.00167)."""

    name: ClassVar[str] = "finch"
    paper: ClassVar[str] = "Corallo & Papotti 2024, FINCH: Prompt-guided Key-Value Cache Compression, TACL (arXiv:2408.00167)"

    target: int | None = knob(None, f"KV cache size (tokens) the document is compressed to; auto = {DEFAULT_TARGET} (at most a quarter of the window)")
    chunk: int | None = knob(None, f"document tokens read per step; auto = the window minus target minus {QUESTION_ROOM} (room for the question and the answer)")

    def __post_init__(self) -> None:
        if self.target is not None and self.target < 1:
            raise UsageError(f"finch: target must be at least 1, got {self.target}")
        if self.chunk is not None and self.chunk < 1:
            raise UsageError(f"finch: chunk must be at least 1, got {self.chunk}")

    def configure(self, lm) -> None:
        window = lm.max_context
        if self.target is None:
            self.target = min(DEFAULT_TARGET, window // 4) if window else DEFAULT_TARGET
        if window and self.target >= window:
            raise UsageError(f"finch: target={self.target} does not fit the {window:,}-token window of {lm.name}; use target < {window}")
        if self.chunk is None:
            room = min(QUESTION_ROOM, window // 4) if window else QUESTION_ROOM
            self.chunk = max(1, window - self.target - room) if window else 4 * self.target
        elif window and self.target + self.chunk >= window:
            raise UsageError(
                f"finch: target={self.target} + chunk={self.chunk} leave no room for the question in the "
                f"{window:,}-token window of {lm.name}; use target + chunk < {window}"
            )

    # --- the window it needs -----------------------------------------------------------------------
    def window_needed(self, lm, n_prompt: int, n_suffix: int, max_new_tokens: int) -> int:
        """Chunk passes: at most min(P, target + chunk) + q positions; decoding: min(P, target) + q
        + max_new_tokens (P: prompt tokens before the question, q: the question's)."""
        n_context = n_prompt - n_suffix
        passes = min(n_context, self.target + self.chunk) + n_suffix
        decode = min(n_context, self.target) + n_suffix + max_new_tokens
        return max(passes, decode)

    def prefix_state(self, lm) -> None:
        """None: the compressed cache depends on the question (see the module docstring)."""
        return None

    # --- the method -----------------------------------------------------------------------------
    def prefill(self, engine, ids: torch.Tensor, prefix=None, protected: int = 0):
        """``ids`` (n,) = [context][question]; the last ``protected`` tokens are the question (and
        the generation prompt). Returns (cache, first_logits, next_position)."""
        lm = engine.lm
        n = ids.numel()
        n_question = min(max(protected, 1), n)
        n_context = n - n_question
        context, question = ids[:n_context], ids[n_context:]
        if n_context == 0:
            cache, logits = engine.prefill(question)
            cache.kept_positions = [torch.zeros(0, dtype=torch.long)] * cache.n_layers
            cache.suffix_positions = torch.arange(n)
            return cache, logits, n
        chunk = self.chunk
        window = lm.max_context
        if window and self.target + chunk + n_question > window:
            chunk = window - self.target - n_question
            if chunk < 1:
                raise DocumentError(
                    f"finch: the question is {n_question:,} tokens; with target={self.target} it does not fit the "
                    f"{window:,}-token window of {lm.name}"
                )
        bounds = chunk_bounds(n_context, chunk)
        counts = kept_counts(bounds, self.target)
        n_layers = engine.n_layers
        cache = KVCache()
        kept_positions: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long) for _ in range(n_layers)]
        m = 0  # cache length (the same in every layer), its slots at positions 0..m-1
        for (start, end), keep in zip(bounds, counts):
            c = end - start
            n_candidates = m + c
            chunk_pos = torch.arange(start, end)
            if keep >= n_candidates:  # nothing to drop: the question need not run
                engine.forward(context[start:end], torch.arange(m, m + c), cache)
                kept_positions = [torch.cat([kp, chunk_pos]) for kp in kept_positions]
                cache.positions = torch.arange(n_candidates)
                m = n_candidates
                continue
            scores: dict[int, torch.Tensor] = {}

            def observer(layer: int):
                attn = engine.layers[layer].self_attn
                scaling = float(getattr(attn, "scaling", 0) or 0) or None

                def fn(query: torch.Tensor, key: torch.Tensor) -> None:
                    s = scaling if scaling is not None else query.shape[-1] ** -0.5
                    scores[layer] = question_scores(query, key, n_question, n_candidates, s)
                    if layer == n_layers - 1:
                        raise StopForward  # the last layer's output is never needed

                return fn

            observers = {layer: [observer(layer)] for layer in range(n_layers)}
            step_ids = torch.cat([context[start:end], question])
            engine.forward(step_ids, torch.arange(m, n_candidates + n_question), cache, observers=observers)
            cos, sin = rope_cos_sin(engine.rotary_emb, torch.arange(n_candidates + n_question), cache.keys[0])
            slots = torch.arange(keep, device=cos.device)
            for layer in range(n_layers):
                idx = torch.topk(scores[layer], keep).indices.sort().values
                k_all, v_all = cache.keys[layer], cache.values[layer]
                cache.keys[layer] = rerotate_table(k_all.index_select(2, idx), idx.to(cos.device), slots, cos, sin)
                cache.values[layer] = v_all.index_select(2, idx)
                kept_positions[layer] = torch.cat([kept_positions[layer], chunk_pos])[idx.cpu()]
            cache.positions = torch.arange(keep)
            m = keep
        cache.kept_positions = kept_positions
        cache.suffix_positions = torch.arange(n_context, n)
        cache, logits = engine.prefill(question, positions=torch.arange(m, m + n_question), cache=cache)
        return cache, logits, m + n_question
