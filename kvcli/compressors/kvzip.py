"""KVzip: keep the entries the model needs to reconstruct its own context (Kim et al., 2025,
arXiv:2505.23416).

"KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction". After the prefill, the
model is asked to repeat the context ("Repeat the previous context exactly." + the chat turn +
the context itself, teacher-forced), chunk by chunk on top of the cache; a KV pair's importance is
the **maximum attention it receives from any reconstruction query** (over the query heads of its
GQA group too). A KV pair the model needs to rebuild the whole document serves any question about
it, so the compressed cache is query-agnostic. Budgets are non-uniform: the best entries over all
layers and heads together (``allocation=global``, the paper's head-level eviction); ``layer``-wise
(``adaptive``: AdaKV's split per layer) and ``uniform`` (every head ``budget``) are knobs.

As in the paper's code (and NVIDIA kvpress's ``KVzipPress``): chunks of ``chunk`` tokens (2000);
chunk i > 0 is prompted "Repeat the part of the previous context exactly, starting with" + the
last ``overlap`` tokens of chunk i-1; each chunk's scores come from the softmax of the
reconstruction queries over the sink keys, the chunk's keys and the reconstruction's own keys
(causal among themselves) — not over the whole prefix; the repeated tokens' KV is dropped after
each chunk. The first ``sinks`` tokens (auto: the chat template's head — system prompt and the
start of the user turn, which the paper never evicts) are always kept.

kvcli details: chunks shrink so that the prefix, the reconstruction prompt and the chunk fit in
the model's window (a document filling most of the window costs more, smaller passes); the
reconstruction prompt goes where the question would (kvcli's prefix ends with
the template's "Question: "), followed by the chat template's end of turn and generation prompt.
Scores from queries and keys per chunk, in blocks of query rows (never the full attention matrix,
and no attention weights from the model: any kernel runs it); GQA never expanded. Kept tokens keep
their original positions. Question-agnostic: the compressed prefix is the method's disk-store
state and serves every later question (whose tokens run on top, uncompressed); the scoring costs
about one more prefill of the document, paid once per document. ``budget`` (per KV head of the
prefix, on average) >= the prefix keeps everything (= full attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import notices
from ..caches import KVCache
from ..errors import UsageError
from ..runtime.attention import StopForward
from .base import knob
from .scoring import QUERY_CHUNK, PrefixEviction

FIRST_PROMPT = "Repeat the previous context exactly."
NEXT_PROMPT = "Repeat the part of the previous context exactly, starting with "
DEFAULT_SINKS = 4  # when the chat template's head cannot be found (kvpress's n_sink)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def template_pieces(tokenizer) -> tuple[list[int], list[int]]:
    """(head, tail) token ids of kvcli's default prompt template through the chat template: what
    precedes the document, and what follows the question (end of turn + generation prompt)."""
    from ..templates import load_template, render_pieces

    head, _middle, tail = render_pieces(tokenizer, load_template())
    return _encode(tokenizer, head), _encode(tokenizer, tail)


def reconstruction_inputs(
    tokenizer, context: torch.Tensor, chunk: int, overlap: int
) -> list[tuple[int, int, torch.Tensor]]:
    """``(start, end, ids)`` per chunk of ``context`` (ids of the tokens to reconstruct): the
    repeat prompt, the end of the user turn, then the chunk itself (teacher-forced)."""
    _, tail = template_pieces(tokenizer)
    out = []
    for start in range(0, context.numel(), chunk):
        end = min(context.numel(), start + chunk)
        if start == 0:
            prompt = _encode(tokenizer, FIRST_PROMPT)
        else:
            prompt = _encode(tokenizer, NEXT_PROMPT) + context[max(0, start - overlap) : start].tolist()
        ids = torch.tensor(prompt + tail, dtype=torch.long)
        out.append((start, end, torch.cat([ids, context[start:end]])))
    return out


def chunk_scores(
    query: torch.Tensor, key: torch.Tensor, sinks: int, start: int, end: int, scaling: float, rows: int = QUERY_CHUNK
) -> torch.Tensor:
    """KVzip's score of the prefix entries start..end-1 (n_kv, end - start): the maximum, over the
    reconstruction queries and each KV head's query heads, of their softmax attention over
    [sink keys, keys start..end-1, the reconstruction's own keys (causal)].

    query: (1, n_heads, r, d) — the reconstruction tokens, the last r of ``key`` (1, n_kv, n + r, d)."""
    _, n_heads, r, d = query.shape
    n_kv = key.shape[1]
    k = key[0]
    sub = torch.cat([k[:, :sinks], k[:, start:end], k[:, -r:]], dim=1).to(
        torch.float32
    )  # (n_kv, m, d): sliced, then upcast
    ctx = slice(sinks, sinks + end - start)
    q = query[0].to(torch.float32).reshape(n_kv, n_heads // n_kv, r, d)
    best = torch.zeros(n_kv, end - start, dtype=torch.float32, device=key.device)
    own = torch.arange(r, device=key.device)
    for a in range(0, r, rows):
        b = min(r, a + rows)
        logits = torch.matmul(q[:, :, a:b], sub.transpose(-1, -2).unsqueeze(1)) * scaling  # (n_kv, g, b-a, m)
        future = own[None, :] > own[a:b, None]  # repeat row i sees repeat keys 0..i
        logits[..., sub.shape[1] - r :] = logits[..., sub.shape[1] - r :].masked_fill(future, float("-inf"))
        probs = torch.softmax(logits, dim=-1)[..., ctx]
        best = torch.maximum(best, probs.amax(dim=(1, 2)))
    return best


@dataclass
class KVzip(PrefixEviction):
    """KVzip (Kim et al., 2025): each prefix KV pair scored by the most attention it gets while
    the model reconstructs the context; the best over all layers and heads are kept.
    Question-agnostic: the compressed cache serves every later question. arXiv:2505.23416."""

    name: ClassVar[str] = "kvzip"
    paper: ClassVar[str] = (
        "Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction, arXiv:2505.23416"
    )
    keep_all: ClassVar[str] = (
        "budget={prefix}"  # the budget counts the document prefix (the question is never compressed): all of it
    )
    short_document_spec: ClassVar[str] = "kvzip:budget=0.25"
    title: ClassVar[str] = "KVzip"
    acts: ClassVar[str] = (
        "compresses the document prefix once: the model repeats the context chunk by chunk on top of it; each entry's "
        "score = the most attention any reconstruction query gives it; best entries over all layers and heads "
        "(`sinks=auto`: the chat template's head, never evicted); about one more prefill of the document"
    )
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "the compressed prefix — any question"
    table_knobs: ClassVar[tuple[str, ...] | None] = ("budget", "allocation", "sinks", "chunk", "overlap")

    allocation: str = knob(
        "global",
        "global: budget x KV heads x layers over the whole model (the paper); adaptive: per layer (AdaKV split); uniform: every KV head keeps budget",
    )
    sinks: int | None = knob(
        None,
        "first tokens never evicted and in every chunk's softmax; auto = the chat template's head (system prompt + user turn start)",
    )
    chunk: int = knob(2000, "context tokens reconstructed per pass")
    overlap: int = knob(8, "tokens of the previous chunk quoted in the next chunk's prompt")

    def check_knobs(self) -> None:
        if self.sinks is not None and self.sinks < 0:
            raise UsageError(f"{self.name}: sinks must be at least 0, got {self.sinks}")
        if self.chunk < 1:
            raise UsageError(f"{self.name}: chunk must be at least 1, got {self.chunk}")
        if self.overlap < 0:
            raise UsageError(f"{self.name}: overlap must be at least 0, got {self.overlap}")

    def always_kept(self) -> int:
        return max(1, self.sinks or 0)

    def configure(self, lm) -> None:
        super().configure(lm)
        if self.sinks is None:
            head, _ = template_pieces(lm.tokenizer)
            self.sinks = len(head) or DEFAULT_SINKS
        if isinstance(self.budget, int) and self.budget < self.always_kept():
            raise UsageError(
                f"{self.name}: budget={self.budget} is smaller than the {self.sinks} sink tokens it always keeps"
            )

    def chunk_within_window(self, lm, n: int) -> int:
        """``chunk``, shrunk so that the prefix (n tokens), the reconstruction prompt and the chunk
        fit in the model's window (the reconstruction runs at positions n, n+1, ...)."""
        if not lm.max_context:
            return self.chunk
        head = max(len(_encode(lm.tokenizer, FIRST_PROMPT)), len(_encode(lm.tokenizer, NEXT_PROMPT)) + self.overlap)
        room = lm.max_context - n - head - len(template_pieces(lm.tokenizer)[1])
        if room < 1:
            notices.warn(
                f"kvzip: the {n:,}-token document leaves no room in the {lm.max_context:,}-token window of {lm.name} "
                f"for the reconstruction prompt; positions past the window are used"
            )
        return max(1, min(self.chunk, room))

    @torch.inference_mode()
    def prefix_scores(self, engine, prefix_ids: torch.Tensor) -> tuple[KVCache, list[torch.Tensor]]:
        lm = engine.lm
        if self.sinks is None:
            self.configure(lm)
        n = prefix_ids.numel()
        sinks = min(self.sinks, n - 1)
        kv = engine.prefix_kv(prefix_ids)
        scaling = 1.0 / math.sqrt(lm.head_dim)
        scores = [torch.full((lm.n_kv_heads, n), float("inf"), device=engine.device) for _ in range(lm.n_layers)]
        chunk = self.chunk_within_window(lm, n)
        for start, end, ids in reconstruction_inputs(lm.tokenizer, prefix_ids[sinks:], chunk, self.overlap):

            def observe(layer: int, query: torch.Tensor, key: torch.Tensor, a=sinks + start, b=sinks + end) -> None:
                scores[layer][:, a:b] = chunk_scores(query, key, sinks, a, b, scaling)
                if layer == lm.n_layers - 1:
                    raise StopForward  # only the queries and keys are needed

            observers = {l: [lambda q, k, l=l: observe(l, q, k)] for l in range(lm.n_layers)}
            # on a copy: the reconstruction's own KV is dropped after each chunk, and each layer's
            # (the prefix + the chunk, a new buffer) as soon as the layer has run
            work = kv.copy()

            def drop(layer: int, work=work) -> None:
                work.keys[layer], work.values[layer] = kv.keys[layer], kv.values[layer]

            engine.forward(ids, torch.arange(n, n + ids.numel()), work, observers=observers, after_layer=drop)
        return kv, scores
