"""Finch: prompt-guided KV cache compression, chunk by chunk (Corallo & Papotti, TACL 2024).

"FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models", section 5.1. Finch
reads a document longer than the model's window. The prompt is cut into the *context* (the
template head and the document: ``P`` tokens) and the *user prompt* — every token after the
document: the template's instructions ("Answer the question using only the document above..."),
the question and the chat template's closing tokens (``Prompt.n_after_document``, passed as
``protected``). The paper compresses the context only and keeps the user prompt whole,
"particularly its instructions" (section 4):

1. the context is split into chunks of at most ``chunk`` tokens (balanced sizes; default 1024,
   in the paper's range of 64-2,048 — see :data:`DEFAULT_CHUNK`);
2. each chunk is prefilled on top of the compressed cache so far, followed by the user prompt
   (the *question* below). Per layer, from the queries and keys the attention hands to observers
   (never ``output_attentions``):

   * the question rows' softmax attention over every key (cache + chunk + the question's own,
     causally), **summed over heads** (GQA: each query head reads its group's KV head; the cache is
     never expanded);
   * restricted to the cache + chunk columns (the prompt-guided submatrix);
   * **normalised** for the causal position bias: each question row's attention is multiplied by
     its number of non-zero entries (the keys it sees) over the step's length, as the authors' code
     does (``non_zero_counts / tot_seq_len``, github.com/giulio98/context-compression, and kvpress's
     ``FinchPress``): a row that sees more keys spreads the same probability mass thinner, so
     without it the first question rows dominate. Then summed over the question rows;
   * the top ``k_i`` positions are kept (sorted back into document order), per layer: layers keep
     different tokens. ``k_i = ceil(target · seen_i / P)`` grows with the tokens seen so far and
     reaches ``target`` at the last chunk (the paper's update rule: a constant compression rate);
   * **kvcli's departure** (``kernel``, default :data:`DEFAULT_KERNEL` = 21): before the top-k,
     the scores are max-pooled over ``kernel`` neighbouring candidates (cache slots in document
     order, then the chunk), SnapKV's clustering (:func:`kvcli.compressors.scoring.pool`), so a
     token next to a relevant one comes with it. The paper, the authors' code and kvpress's
     ``FinchPress`` do not pool (``kernel=1``). Without it the question's attention picks single
     tokens — the first digit of a number and not the rest — and on RULER's needle tasks at 4×
     (embedded model, 1k / 2k tokens) ``kernel=21`` scored 66.7 / 64.6 against 16.7 / 12.5
     (``kernel=1``) and 8.3 / 16.7 (``7``), full attention 81.2 / 72.9; on one 4.7k-token passkey document ``kernel=1`` answered at
     once where 21 needed a wrong start first and 7 failed: the tables, the commands and the
     caveats are in ``docs/finch.md``;
3. the kept keys are re-rotated (:mod:`kvcli.runtime.rope`) from their position to their slot, so the
   cache always holds positions ``0..k_i-1`` and the next chunk follows right after; values carry
   no position. The question's own KV is dropped after every step;
4. finally the question runs once more, on the ``target``-token cache only, at positions
   ``target..target+q-1``; its logits start the answer and decoding continues at ``target + q``.

``target`` is a token count or a ratio of the context (``target=0.25``: a quarter of ``P``), as
the eviction methods' ``budget`` (:func:`kvcli.compressors.scoring.parse_budget`).

The model never sees more than ``target + chunk + q`` positions at once (and ``target + q +
max_new_tokens`` while decoding), whatever the document's length: where the window is smaller the
chunk shrinks to fit. With ``target >= P`` nothing is dropped and the result is full attention's
(chunks only change the order of an exact causal computation); chunks that would drop nothing are
run without the question.

Cache layout after :meth:`Finch.prefill`: ``keys[l]``/``values[l]``: (1, n_kv, k + q, d), the same
count ``k = min(target, P)`` in every layer but different tokens; ``positions`` = ``0..k+q-1``
(the re-positioned, contiguous slots: what RoPE was applied with); ``kept_positions[l]`` (an
extra attribute): the original prompt positions of the ``k`` context slots of layer ``l``;
``suffix_positions``: the original positions of the question's ``q`` slots that follow them.

Disk store: the compressed cache depends on the question, so there is no question-agnostic
prefix state to reuse (``prefix_state`` is None): every question reads the document again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..caches import KVCache
from ..errors import DocumentError, UsageError
from ..runtime.attention import StopForward
from ..runtime.rope import rerotate_table, rope_cos_sin
from .base import Compressor, knob
from .scoring import parse_budget, pool, resolve_budget

DEFAULT_TARGET = 1024
# The paper runs chunks of 64-2,048 tokens (Table 9) and finds 1024 better than 256 for
# single-document QA (smaller chunks help multi-document QA; larger ones are faster: fewer steps).
# kvcli answers questions about one document, so 1024.
DEFAULT_CHUNK = 1024
DEFAULT_KERNEL = 21  # not the paper's (1: no pool); measured on RULER, see the module docstring and docs/finch.md
QUESTION_ROOM = 512  # positions a small window keeps for the question and the answer when the default chunk shrinks


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


def question_scores(
    query: torch.Tensor, key: torch.Tensor, n_question: int, n_candidates: int, scaling: float
) -> torch.Tensor:
    """Finch's per-token relevance at one layer: (n_candidates,) float32.

    query (1, n_heads, q_len, d) with the question in its last ``n_question`` rows; key
    (1, n_kv, kv_len, d) whose first ``n_candidates`` entries are the cache + chunk and whose last
    ``n_question`` are the question's own. Softmax attention of the question rows over every key
    (causal among the question), summed over heads; each question row multiplied by its number of
    non-zero entries (the keys it sees) / ``kv_len`` (the positional-bias normalisation); summed
    over the question rows, for the candidate columns.
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
    non_zero = visible.sum(dim=1).to(torch.float32)  # keys each question row sees
    return (sub * (non_zero / kv_len)[:, None]).sum(dim=0)


@dataclass
class Finch(Compressor):
    """Finch (Corallo & Papotti, 2024): the document is read chunk by chunk; after each chunk the
    attention of the user prompt (instructions + question, never compressed) keeps, per layer, the
    most relevant KV pairs (re-positioned with RoPE), so a document longer than the window fits a
    ``target``-token cache. TACL 2024, doi
    10.1162/tacl_a_00716 (arXiv:2408.00167)."""

    name: ClassVar[str] = "finch"
    auto_kv_bits: ClassVar[int] = 8  # its layout is quantized: --kv-bits auto holds it in 8 bits (docs/kv-bits.md)
    paper: ClassVar[str] = (
        "Corallo & Papotti 2024, FINCH: Prompt-guided Key-Value Cache Compression, TACL (arXiv:2408.00167)"
    )
    keep_all: ClassVar[str] = "target={n}"  # a target at least the context: no chunk compresses anything
    short_document_spec: ClassVar[str] = "finch:target=60"
    title: ClassVar[str] = "Finch"
    acts: ClassVar[str] = (
        "owns the prefill: document chunks, each run with the compressed cache so far and the user prompt (everything "
        "after the document: instructions + question); per layer the user prompt's (position-normalised) attention "
        "keeps the top positions; kept keys re-rotated"
    )
    positions: ClassVar[str] = "re-positioned 0..target-1 (RoPE re-rotation, `kvcli/runtime/rope.py`)"
    disk_cache: ClassVar[str] = "nothing (depends on the question)"
    table_knobs: ClassVar[tuple[str, ...] | None] = ("target", "chunk")

    target: str | int | float | None = knob(
        None,
        f"KV cache size the context (template head + document) is compressed to: a token count (>= 1) or a ratio of "
        f"it (0 < x < 1); auto = {DEFAULT_TARGET} tokens (at most a quarter of the window)",
    )
    chunk: int = knob(
        DEFAULT_CHUNK,
        "context tokens read per step (the paper: 64-2,048; 1024 for single-document QA); shrinks to fit a small window",
    )
    kernel: int = knob(
        DEFAULT_KERNEL,
        "width of a max pool over the scores before the top-k, as SnapKV's (odd; 1 = the paper's: none; 21 measured best on RULER, docs/finch.md)",
    )

    def __post_init__(self) -> None:
        if self.target is not None:
            self.target = parse_budget(self.name, self.target, "target")
        if self.chunk < 1:
            raise UsageError(f"finch: chunk must be at least 1, got {self.chunk}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise UsageError(f"finch: kernel must be odd and at least 1, got {self.kernel}")

    def configure(self, lm) -> None:
        window = lm.max_context
        if self.target is None:
            self.target = min(DEFAULT_TARGET, window // 4) if window else DEFAULT_TARGET
        if not window or isinstance(self.target, float):
            return  # a ratio: checked per prompt (window_needed, prefill)
        if self.target >= window:
            raise UsageError(
                f"finch: target={self.target} does not fit the {window:,}-token window of {lm.name}; use target < {window}"
            )
        if "chunk" not in self.explicit_knobs:
            room = min(QUESTION_ROOM, window // 4)
            self.chunk = max(1, min(self.chunk, window - self.target - room))
        elif self.target + self.chunk >= window:
            raise UsageError(
                f"finch: target={self.target} + chunk={self.chunk} leave no room for the question in the "
                f"{window:,}-token window of {lm.name}; use target + chunk < {window}"
            )

    def target_tokens(self, n_context: int) -> int:
        """The compressed cache size for a context of ``n_context`` tokens: the count (at most the
        context: a larger target keeps everything) or ``round(ratio · n_context)``."""
        return resolve_budget(self.name, self.target, n_context, explicit=False)

    def chunk_tokens(self, window: int, target: int, n_question: int) -> int:
        """The chunk actually read per step: ``chunk``, less where the window could not hold
        target + chunk + question (0 or less: it cannot fit at all)."""
        return min(self.chunk, window - target - n_question) if window else self.chunk

    # --- the window it needs -----------------------------------------------------------------------
    def window_needed(self, lm, n_prompt: int, n_suffix: int, max_new_tokens: int) -> int:
        """Chunk passes: at most min(P, target + chunk) + q positions; decoding: min(P, target) + q
        + max_new_tokens (P: the context, q = ``n_suffix``: the protected tokens after it, which
        the pipeline must count as it passes them to :meth:`prefill`)."""
        n_context = n_prompt - n_suffix
        target = self.target_tokens(n_context) if n_context > 0 else 0
        chunk = max(1, self.chunk_tokens(lm.max_context, target, n_suffix))
        passes = min(n_context, target + chunk) + n_suffix
        decode = target + n_suffix + max_new_tokens
        return max(passes, decode)

    def prefix_state(self, lm) -> None:
        """None: the compressed cache depends on the question (see the module docstring)."""
        return None

    # --- the method -----------------------------------------------------------------------------
    def prefill(self, engine, ids: torch.Tensor, prefix=None, protected: int = 0):
        """``ids`` (n,) = [context][user prompt]; the last ``protected`` tokens are the user prompt,
        never compressed: the pipeline passes every token after the document
        (``Prompt.n_after_document``: instructions, question, generation prompt). Returns (cache,
        first_logits, next_position)."""
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
        target = self.target_tokens(n_context)
        window = lm.max_context
        chunk = self.chunk_tokens(window, target, n_question)
        if chunk < 1:
            raise DocumentError(
                f"finch: the question is {n_question:,} tokens; with target={target} it does not fit the "
                f"{window:,}-token window of {lm.name}"
            )
        bounds = chunk_bounds(n_context, chunk)
        counts = kept_counts(bounds, target)
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
            kernel = self.kernel

            def observer(layer: int):
                attn = engine.layers[layer].self_attn
                scaling = float(getattr(attn, "scaling", 0) or 0) or None

                def fn(query: torch.Tensor, key: torch.Tensor) -> None:
                    s = scaling if scaling is not None else query.shape[-1] ** -0.5
                    scores[layer] = pool(question_scores(query, key, n_question, n_candidates, s)[None], kernel, "max")[
                        0
                    ]
                    if layer == n_layers - 1:
                        raise StopForward  # the last layer's output is never needed

                return fn

            observers = {layer: [observer(layer)] for layer in range(n_layers)}
            step_ids = torch.cat([context[start:end], question])
            engine.forward(step_ids, torch.arange(m, n_candidates + n_question), cache, observers=observers)
            # each layer's own RoPE (Gemma 3: local / global bases). On a hybrid, a sliding layer
            # selects like the others: its window then covers its last w - 1 kept slots
            tables = {}
            for first_layer, layers in engine.rope_groups().items():
                t = rope_cos_sin(engine.rotary(first_layer), torch.arange(n_candidates + n_question), cache.keys[0])
                tables.update({layer: t for layer in layers})
            slots = torch.arange(keep, device=cache.keys[0].device)
            for layer in range(n_layers):
                cos, sin = tables[layer]
                idx = torch.topk(scores[layer], keep).indices.sort().values
                k_all, v_all = cache.keys[layer], cache.values[layer]
                cache.keys[layer] = rerotate_table(
                    k_all.index_select(2, idx), idx.to(cos.device), slots.to(cos.device), cos, sin
                )
                cache.values[layer] = v_all.index_select(2, idx)
                kept_positions[layer] = torch.cat([kept_positions[layer], chunk_pos])[idx.cpu()]
            cache.positions = torch.arange(keep)
            m = keep
        cache.kept_positions = kept_positions
        cache.suffix_positions = torch.arange(n_context, n)
        cache, logits = engine.prefill(question, positions=torch.arange(m, m + n_question), cache=cache)
        return cache, logits, m + n_question
