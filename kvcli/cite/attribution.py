"""What the answer read: the attention of the answer's queries over the prompt tokens the method held.

While the answer is decoded, an observer on each citing layer (:class:`CitingHeads`) takes the
step's one query and the keys the layer attends (after the cache's update, so exactly what the
model reads at that step), computes the softmax weights of each query head over them — the query
heads of a GQA group as rows of their KV head, never expanded, one layer and one step at a time —
and adds each head's weights, times the head's citing weight, to the prompt position each key row
holds. A key that is not a prompt token (an answer token) is skipped; a prompt token the method
did not keep or retrieve gets nothing, so it can never be cited.

Where each row of a layer's keys comes from is the cache's (:meth:`held_positions`): a plain KV
cache (full attention, the eviction methods, Finch) holds its prompt rows first, in the order of
its positions; a cache that attends itself (a :class:`~kvcli.runtime.attention.LayerView`) reports the
weights itself where it can (:meth:`LayerView.read_weights`: the book's Initial + retrieved
blocks + Local), and cites nothing where it cannot (the reason is said).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..runtime.attention import LayerView, in_draft_pass


@dataclass(frozen=True)
class HeadWeights:
    """The citing weight of each (layer, query head): (n_layers, n_heads) float, zero for heads
    that do not cite; ``source`` says where the weights come from."""

    weights: torch.Tensor
    source: str

    def layers(self) -> list[int]:
        return [int(i) for i in torch.nonzero(self.weights.abs().sum(dim=1)).flatten()]

    @classmethod
    def uniform(cls, n_layers: int, n_heads: int, layers: list[int], source: str) -> HeadWeights:
        w = torch.zeros(n_layers, n_heads)
        w[layers] = 1.0 / (len(layers) * n_heads)
        return cls(w, source)


BATCH_LOGITS = 1 << 22  # logits (query heads x steps x rows) one flush computes at most: 16 MiB float32


@dataclass
class _Pending:
    """A layer's decoding steps not yet added: each step's query heads (n_heads, d) and the rows its
    keys had, the last step's keys (the earlier steps' are their first rows) and where the prompt
    rows come from (:meth:`CacheBase.held_positions`, read at the first step)."""

    queries: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    key: torch.Tensor | None = None
    positions: torch.Tensor | None = None


class CitingHeads:
    """Accumulates the answer's attention per position of the sequence the cache was built from
    (module docstring): ``n_positions`` of them (the prompt, or a selector's kept tokens).

    A plain cache's steps are added in batches: while a layer's keys only grow by the step's own
    row, each step's keys are the first rows of the last step's, so the steps' queries wait and
    one matrix product per layer reads them all (each step masked to the rows it had) when the
    layout changes (an eviction, a sliding window's cut), at ``BATCH_LOGITS``, or at the end
    (:meth:`prompt_scores`): the same weights as step by step, without a small product and a
    softmax per layer at every step (the cost of sources on a cache hit, docs/bench/cite). The
    earlier steps' rows are still what they read: a cache's buffer is only ever written past the
    rows it held (:func:`kvcli.caches.base.append_rows`), and an eviction writes new tensors."""

    def __init__(self, heads: HeadWeights, n_positions: int, cache) -> None:
        self.heads, self.n_positions, self.cache = heads, n_positions, cache
        self.scores = torch.zeros(n_positions, dtype=torch.float64)
        self.seen = torch.zeros(n_positions, dtype=torch.int32)  # how many rows some step read held it
        self.layers = heads.layers()
        self.pending = {layer: _Pending() for layer in self.layers}
        self.steps = 0
        self.seconds = 0.0
        self.unsupported: str | None = None
        self.rewound = dict.fromkeys(self.layers, getattr(cache, "rewound", 0))  # per layer: what _forget saw

    def observers(self) -> dict[int, list]:
        return {layer: [self._observer(layer)] for layer in self.layers}

    def _observer(self, layer: int):
        def observe(query: torch.Tensor, key) -> None:
            if self.unsupported or (query.shape[2] != 1 and not in_draft_pass()):
                return  # a pass of many queries not checking a draft: a prompt's, a method's recomputed tokens
            t0 = time.perf_counter()
            if isinstance(key, LayerView):
                got = key.read_weights(query)
                if got is None:
                    self.unsupported = f"{type(key.cache).__name__} does not report what a decoding step reads"
                    return
                self.add(*got, self.heads.weights[layer])
            elif not self._wait(layer, query, key):
                return
            self.steps += query.shape[2] if layer == self.layers[0] else 0
            self.seconds += time.perf_counter() - t0

        return observe

    def _wait(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> bool:
        """Keep a plain cache's step (or a pass's rows: a draft checked, :mod:`kvcli.runtime.lookup`)
        waiting for :meth:`flush`; False where the cache cannot say where its rows come from. Rows a
        pass fed and the cache took back since (the drafts the model did not choose) go first."""
        self._forget(layer)
        pending, rows, n = self.pending[layer], key.shape[2], query.shape[2]
        if pending.rows and (
            rows - n + 1 != pending.rows[-1] + 1 or (len(pending.rows) + n) * query.shape[1] * rows > BATCH_LOGITS
        ):
            self.flush(layer)
            pending = self.pending[layer]
        if not pending.rows:
            try:
                pending.positions = self.cache.held_positions(layer)
            except NotImplementedError as e:
                self.unsupported = str(e)
                return False
        pending.queries.extend(query[0, :, j, :] for j in range(n))
        pending.rows.extend(range(rows - n + 1, rows + 1))
        pending.key = key
        return True

    def _forget(self, layer: int) -> None:
        """Drop ``layer``'s waiting steps whose rows the cache took back since (``rewound``: the
        last rows appended, drafts the model did not choose; their queries' tokens are not the answer's)."""
        back = getattr(self.cache, "rewound", 0) - self.rewound[layer]
        if back:
            self.rewound[layer] += back
            pending = self.pending[layer]
            keep = max(0, len(pending.rows) - back)
            if layer == self.layers[0]:
                self.steps -= len(pending.rows) - keep
            pending.queries, pending.rows = pending.queries[:keep], pending.rows[:keep]

    def flush(self, layer: int) -> None:
        """Add ``layer``'s waiting steps (class docstring): their softmax weights over the rows
        each had, summed over the steps, through :meth:`add`."""
        pending = self.pending[layer]
        if not pending.rows:
            return
        queries = torch.stack(pending.queries)  # (steps, n_heads, d)
        n_steps, n_heads, d = queries.shape
        key = pending.key[0, :, : pending.rows[-1]].to(torch.float32)  # (n_kv, rows, d)
        n_kv = key.shape[0]
        group = n_heads // n_kv
        q = queries.view(n_steps, n_kv, group, d).permute(1, 2, 0, 3).reshape(n_kv, group * n_steps, d)
        logits = torch.bmm(q.to(torch.float32), key.transpose(1, 2)).view(n_kv, group, n_steps, -1) / math.sqrt(d)
        if n_steps > 1:  # each step reads the rows it had
            had = torch.tensor(pending.rows, device=key.device).view(-1, 1)
            logits.masked_fill_(torch.arange(key.shape[1], device=key.device).view(1, -1) >= had, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        probs = probs[:, :, 0] if n_steps == 1 else probs.sum(dim=2)  # (n_kv, group, rows)
        self.add(pending.positions, probs[..., : pending.positions.shape[1]], self.heads.weights[layer])
        self.pending[layer] = _Pending()

    def add(self, positions: torch.Tensor, probs: torch.Tensor, weights: torch.Tensor) -> None:
        """``positions`` (n_kv, rows): the position each key row holds (-1 or past the sequence:
        none); ``probs`` (n_kv, group, rows): each query head's weights; ``weights`` (n_heads,).
        Added on the device the step ran on, with no data-dependent shape: a decoding step that
        cites waits for nothing (the scores cross to the host once, in :meth:`prompt_scores`)."""
        n_kv, g, _ = probs.shape
        dtype = torch.float32 if probs.device.type == "mps" else torch.float64
        per_row = (probs.to(dtype) * weights.view(n_kv, g, 1).to(probs.device, dtype)).sum(dim=1)
        if self.scores.device != per_row.device or self.scores.dtype != dtype:
            self.scores, self.seen = self.scores.to(per_row.device, dtype), self.seen.to(per_row.device)
        pos = positions.to(per_row.device)
        inside = (pos >= 0) & (pos < self.n_positions)
        index = torch.where(inside, pos, 0).reshape(-1)
        self.scores.index_add_(0, index, torch.where(inside, per_row, 0).reshape(-1))
        self.seen.index_add_(0, index, inside.reshape(-1).to(self.seen.dtype))

    def prompt_scores(self, n_prompt: int, kept: torch.Tensor | None = None) -> torch.Tensor:
        """(n_prompt,) the scores at prompt indices (``kept``: the prompt index of each position,
        a selector's kept tokens; None: the same), NaN where no step read the token. The steps
        still waiting are added first (their time counted in ``seconds``)."""
        t0 = time.perf_counter()
        for layer in self.layers:
            self._forget(layer)  # drafts fed past the answer's end, taken back
            self.flush(layer)
        self.seconds += time.perf_counter() - t0
        out = torch.full((n_prompt,), math.nan, dtype=torch.float64)
        seen, scores = self.seen.cpu() > 0, self.scores.cpu().to(torch.float64)
        index = torch.arange(self.n_positions) if kept is None else kept.cpu()
        out[index[seen]] = scores[seen]
        return out


def step_weights(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Softmax weights of one step's query heads over the layer's keys: ``query`` (1, n_heads, 1, d),
    ``key`` (1, n_kv, rows, d) -> (n_kv, group, rows) float32, a GQA group's heads as rows of their
    KV head. Scaled by 1/sqrt(d) (the models kvcli runs; Gemma's query_pre_attn_scalar aside)."""
    _, n_heads, _, d = query.shape
    n_kv = key.shape[1]
    q = query[0, :, -1, :].reshape(n_kv, n_heads // n_kv, d).to(torch.float32)
    logits = torch.matmul(q, key[0].to(torch.float32).transpose(-1, -2)) / math.sqrt(d)
    return torch.softmax(logits, dim=-1)


HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"  # learned citing weights: <model name>.safetensors


def citing_heads(lm) -> HeadWeights:
    """The heads whose attention cites, for ``lm``: the weights learned for it where kvcli ships
    them (``kvcli/heads/<model name>.safetensors``: a (layers, heads) tensor ``weights`` and, in
    the header, how they were made), else every head of every layer weighted alike."""
    path = HEADS_DIR / f"{lm.name}.safetensors"
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            weights, made = f.get_tensor("weights").float(), (f.metadata() or {}).get("made", path.name)
        if weights.shape == (lm.n_layers, lm.n_heads):
            return HeadWeights(weights, made)
    return HeadWeights.uniform(lm.n_layers, lm.n_heads, list(range(lm.n_layers)), "every head of every layer, averaged")


def save_heads(path: Path, weights: torch.Tensor, made: str) -> None:
    """Write learned citing weights as :func:`citing_heads` reads them (safetensors, no pickle)."""
    from safetensors.torch import save_file

    from ..files import atomic_write

    atomic_write(path, lambda tmp: save_file({"weights": weights.float().contiguous()}, tmp, metadata={"made": made}))
