"""Expected Attention: keep the entries future queries are expected to attend to (Devoto, Jeblick &
Jégou, 2025, arXiv:2510.00636; NVIDIA kvpress's ``ExpectedAttentionPress``).

"Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution". The queries that will read the cache (the question, the answer) are not known when
the document is compressed, but their distribution is: per layer and query head, model the
pre-RoPE queries as a Gaussian with the mean μ and covariance Σ of the queries seen so far. A
future query at position p is ``R_p q``; averaging the rotation over the next ``future`` positions
(``R̄ = mean_p R_p``, linear in cos/sin) gives the expected logit of a key k (after RoPE, as cached)
in closed form, ``E[exp(qᵀk/√d)] = exp(μ̄ᵀk/√d + ½ kᵀ Σ̄ k / d)`` with ``μ̄ = R̄μ`` and
``Σ̄ = R̄ Σ R̄ᵀ``. The scores are those expected logits softmaxed over the keys (mean over each KV
head's GQA group), times ``‖v‖`` (a key's contribution to the residual stream scales with its
value) — ``(scores + epsilon) · ‖v‖`` as kvpress, whose ``epsilon`` defaults to 0 but is 1e-2 in the
configuration its leaderboard evaluates (``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``:
``expectedattention:allocation=adaptive,epsilon=0.01``; on the embedded model's RULER it is ε that
matters, 0 -> 58.3 at 2x, README Accuracy); the first ``sinks`` tokens are left out of the
statistics and the softmax and always kept.

kvcli details:

* the statistics come from the queries of the prefix pass itself (every token after the sinks, as
  kvpress; ``queries=N``: only the last N), recovered before RoPE by rotating the observed queries
  back (:func:`kvcli.compressors.scoring.prerope`; q_norm/k_norm families need nothing special);
  future positions start after the prefix (where the question and the answer will be);
* the scores depend on the document only, so the method is **question-agnostic**: it compresses
  the prefix (document + template) once; the compressed cache is its prefix state in the disk store
  and serves every later question, whose tokens run on top of it uncompressed (as kvpress appends the
  question after compressing the context). ``budget`` counts per KV head of the prefix;
* ``allocation``: ``uniform`` (every KV head keeps ``budget``; kvpress's press), ``adaptive``
  (AdaKV's head-wise split, the paper's best setting, ``AdaKVPress(ExpectedAttentionPress)``) or
  ``global`` (over all layers); non-uniform heads are stored padded and masked
  (:class:`kvcli.caches.ragged.RaggedCache`);
* GQA: per query head from the grouped queries, mean over the group; the cache is never expanded
  and no attention matrix is materialised (one expected row per head). Kept tokens keep their
  original positions. ``budget`` >= the prefix keeps everything (= full attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..caches import KVCache
from ..errors import UsageError
from ..runtime.kernels import by_keys
from ..runtime.rope import rope_cos_sin
from .base import knob
from .scoring import PrefixEviction, prerope


def query_statistics(
    query: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, first: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (n_heads, d) and covariance (n_heads, d, d) of the pre-RoPE query rows ``first..``
    of ``query`` (1, n_heads, n, d) observed at positions 0..n-1 with (cos, sin) (n, rot)."""
    q = prerope(query[0, :, first:], cos[first:], sin[first:])  # (n_heads, m, d) float32
    mu = q.mean(dim=1)
    centred = q - mu[:, None]
    return mu, centred.transpose(1, 2) @ centred / q.shape[1]


def merge_statistics(a: tuple | None, b: tuple) -> tuple:
    """(count, mean, covariance) of two sets of rows from each set's own (Chan et al.'s pairwise
    update): the statistics of a prefix read chunk by chunk, each chunk's computed as one pass's."""
    if a is None:
        return b
    na, mu_a, cov_a = a
    nb, mu_b, cov_b = b
    n = na + nb
    delta = mu_b - mu_a
    mu = mu_a + delta * (nb / n)
    cov = (cov_a * na + cov_b * nb + delta[:, :, None] * delta[:, None, :] * (na * nb / n)) / n
    return n, mu, cov


def mean_rotation(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """R̄ = mean over positions of the RoPE rotation matrices: (head_dim, head_dim). Rotation is
    linear in (cos, sin), so R̄ is the rotation "by" the mean cos and sin (scale included)."""
    from ..runtime.rope import apply_rotation

    eye = torch.eye(head_dim, dtype=torch.float32, device=cos.device)
    # apply_rotation maps each row x to R̄x: rows of the result are R̄'s columns
    return apply_rotation(eye, cos.mean(dim=0, keepdim=True), sin.mean(dim=0, keepdim=True)).T


def expected_scores(
    mu: torch.Tensor,
    cov: torch.Tensor | None,
    rot: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: int,
    vnorm: bool,
    epsilon: float = 0.0,
) -> torch.Tensor:
    """Scores (n_kv, n) of one layer's keys/values (1, n_kv, n, d) for future queries ~ N(mu, cov)
    (n_heads, d[, d]) rotated by ``rot`` (d, d), ``(expected attention + epsilon) · ‖v‖`` with
    ``vnorm``; the first ``sinks`` entries +inf."""
    n_kv, n, d = key[0].shape
    group = mu.shape[0] // n_kv
    mu_r = (mu @ rot.T).view(n_kv, group, d)  # R̄ μ for every head
    cov_r = None if cov is None else (rot @ cov @ rot.T).view(n_kv, group, d, d)  # R̄ Σ R̄ᵀ

    def logits_of(k: torch.Tensor) -> torch.Tensor:  # k (n_kv, m, d) float32 -> (n_kv, group, m)
        logits = torch.einsum("knd,kgd->kgn", k, mu_r) / math.sqrt(d)
        if cov_r is not None:
            ks = k[:, None]  # (n_kv, 1, m, d)
            logits = logits + ((ks @ cov_r) * ks).sum(dim=-1) / (2 * d)
        return logits

    # keys (and values) sliced past the sinks, then upcast a chunk at a time where not float32
    logits = by_keys(key[0, :, sinks:], logits_of)
    scores = torch.softmax(logits, dim=-1).mean(dim=1)  # (n_kv, n - sinks)
    if vnorm:
        scores = (scores + epsilon) * by_keys(value[0, :, sinks:], lambda v: v.norm(dim=-1))
    return torch.cat([scores.new_full((n_kv, sinks), float("inf")), scores], dim=-1)


@dataclass
class ExpectedAttention(PrefixEviction):
    """Expected Attention (Devoto et al., 2025): keep the prefix entries that future queries —
    modelled as a Gaussian of the queries seen, rotated to future positions — are expected to
    attend to, weighted by the value norm. Question-agnostic: the compressed cache serves every
    later question. arXiv:2510.00636."""

    name: ClassVar[str] = "expectedattention"
    paper: ClassVar[str] = (
        "Devoto, Jeblick & Jégou 2025, Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution, arXiv:2510.00636"
    )
    keep_all: ClassVar[str] = (
        "budget={prefix}"  # the budget counts the document prefix (the question is never compressed): all of it
    )
    short_document_spec: ClassVar[str] = "expectedattention:budget=0.25"
    title: ClassVar[str] = "Expected Attention"
    acts: ClassVar[str] = (
        "compresses the document prefix once: future queries modelled as a Gaussian of the prefix's pre-RoPE queries, "
        "rotated to the next `future` positions; closed-form expected attention × ‖v‖; `allocation=adaptive` (AdaKV "
        "split) or `global`; the question is never compressed"
    )
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "the compressed prefix — any question"
    table_knobs: ClassVar[tuple[str, ...] | None] = ("budget", "allocation", "sinks", "future", "...")

    sinks: int = knob(4, "first tokens always kept and left out of the statistics and the softmax")
    future: int = knob(512, "future positions the query rotation is averaged over")
    queries: int | None = knob(
        None, "statistics from the last N prefix tokens' queries; auto = every token after the sinks"
    )
    covariance: bool = knob(True, "use the queries' covariance (false: the mean alone)")
    vnorm: bool = knob(True, "weight the expected attention by the value norm")
    epsilon: float = knob(
        0.0, "vnorm: scores are (expected attention + epsilon) x value norm (kvpress; its leaderboard uses 0.01)"
    )

    def check_knobs(self) -> None:
        if self.sinks < 0:
            raise UsageError(f"{self.name}: sinks must be at least 0, got {self.sinks}")
        if self.future < 1:
            raise UsageError(f"{self.name}: future must be at least 1, got {self.future}")
        if not (self.epsilon >= 0 and math.isfinite(self.epsilon)):
            raise UsageError(f"{self.name}: epsilon must be a number >= 0, got {self.epsilon}")
        if self.queries is not None and self.queries < 2:
            raise UsageError(f"{self.name}: queries must be at least 2 (a covariance), got {self.queries}")

    def always_kept(self) -> int:
        return max(1, self.sinks)

    @torch.inference_mode()
    def prefix_scores(self, engine, prefix_ids: torch.Tensor) -> tuple[KVCache, list[torch.Tensor]]:
        lm = engine.lm
        n = prefix_ids.numel()
        sinks = min(self.sinks, n - 1)
        first = sinks if self.queries is None else max(sinks, n - self.queries)
        device = engine.device
        like = torch.empty(0, device=device)
        # each layer's own RoPE (Gemma 3: local / global bases): one table per group of layers
        tables, rots = {}, {}
        for first_layer, layers in engine.rope_groups().items():
            rotary = engine.rotary(first_layer)
            cos, sin = rope_cos_sin(rotary, torch.arange(n), like)
            f_cos, f_sin = rope_cos_sin(rotary, torch.arange(n, n + self.future), like)
            rot = mean_rotation(f_cos, f_sin, lm.head_dim)
            tables.update({layer: (cos, sin) for layer in layers})
            rots.update({layer: rot for layer in layers})
        stats: dict[int, tuple] = {}

        def observe(layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
            # the pass's query rows are positions start..kv_len-1 (the whole prefix, or a chunk of it)
            q_len, kv_len = query.shape[-2], key.shape[-2]
            start = kv_len - q_len
            skip = max(0, first - start)
            if skip < q_len:
                cos, sin = tables[layer]  # the layer's own RoPE
                mu, cov = query_statistics(query, cos[start:kv_len], sin[start:kv_len], skip)
                stats[layer] = merge_statistics(stats.get(layer), (q_len - skip, mu, cov))

        observers = {layer: [lambda q, k, layer=layer: observe(layer, q, k)] for layer in range(lm.n_layers)}
        # chunk by chunk off the CPU (Engine.prefill_chunk): the statistics merge across chunks
        kv = engine.prefix_kv(prefix_ids, observers=observers)
        scores = []
        for layer in range(lm.n_layers):
            _, mu, cov = stats.pop(layer)
            scores.append(
                expected_scores(
                    mu,
                    cov if self.covariance else None,
                    rots[layer],
                    kv.keys[layer],
                    kv.values[layer],
                    sinks,
                    self.vnorm,
                    self.epsilon,
                )
            )
        return kv, scores
