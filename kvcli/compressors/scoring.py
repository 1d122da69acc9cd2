"""Shared machinery of the KV eviction methods (SnapKV, PyramidKV, H2O, StreamingLLM, TOVA, KNorm,
KeyDiff, AdaKV, Expected Attention, KVzip, decoding-time compression).

* **budgets**: a knob ``budget`` is a token count (an integer >= 1) or a ratio of the prompt
  (0 < x < 1); :func:`parse_budget` checks it once, :func:`resolve_budget` turns it into a count
  for a prompt of ``n`` tokens;
* **scores** from the observers of the final prefill pass (``fn(query, key)``, see
  :mod:`kvcli.runtime.attention`): attention probabilities are computed from q and K directly — per query
  head, each reading the KV head of its GQA group (the cache is never expanded) — then reduced to
  one score per KV head by the mean over the group (:func:`group_mean`);
* **eviction**: :func:`evict` keeps, per layer and per KV head, the chosen entries (in their
  original order) and records their original positions in ``KVCache.kept``;
* **head-adaptive budgets** (AdaKV, KVzip, Expected Attention): :func:`adaptive_mask`,
  :func:`global_masks`, :func:`allocate` choose entries per head with different counts per head,
  stored in a :class:`kvcli.caches.ragged.RaggedCache`; :class:`PrefixEviction` compresses the
  question-agnostic prefix once (its compressed cache is the disk store's prefix state).

Positions: keys are cached after RoPE, so kept tokens keep their original positions; nothing is
re-rotated. ``KVCache.positions`` keeps every prompt position seen and decoding continues at the
prompt length (the pipeline's ``next_position``), so new tokens sit where they would without
eviction. The scaling of the scores is ``1/sqrt(head_dim)`` (every supported family uses it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..caches import KVCache, LayerView, RaggedCache
from ..errors import UsageError
from ..runtime import accelerator
from ..runtime.kernels import by_keys
from ..runtime.measure import long_lived
from .base import Compressor, knob, require_full_layers

QUERY_CHUNK = 256  # query rows per block of KVzip's reconstruction scores
BLOCK_WEIGHTS = 2**21  # most attention weights per block of query rows in column_sums (8 MiB in float32)
BLOCK_WEIGHTS_ACCELERATOR = 2**26  # the same off the CPU (256 MiB in float32): large blocks, few launches


# --------------------------------------------------------------------------- budgets


def parse_budget(method: str, value, knob_name: str = "budget") -> int | float:
    """``"512"`` -> 512 (tokens), ``"0.25"`` -> 0.25 (ratio); UsageError for anything else."""
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        number = float("nan")
    if not math.isfinite(number) or number <= 0 or (number >= 1 and number != int(number)):
        raise UsageError(
            f"{method}: {knob_name} must be a token count (integer >= 1) or a ratio of the prompt "
            f"(0 < x < 1), got '{text}'"
        )
    return number if number < 1 else int(number)


def check_budget_covers_kept(method) -> None:
    """A count ``budget`` must hold at least the tokens ``method`` always keeps (window, sinks)."""
    if isinstance(method.budget, int) and method.budget < method.always_kept():
        raise UsageError(
            f"{method.name}: budget={method.budget} is smaller than the {method.always_kept()} tokens it always keeps; "
            f"use budget >= {method.always_kept()}"
        )


def resolve_budget(method: str, budget: int | float, n: int, explicit: bool, minimum: int = 1) -> int:
    """The number of entries to keep per layer for a prompt of ``n`` tokens.

    A ratio gives ``round(ratio * n)``, at least ``minimum`` (the tokens the method always keeps).
    A count larger than the prompt is an error when the user set it, else it keeps everything.
    """
    if isinstance(budget, float):
        return min(n, max(minimum, round(budget * n)))
    if budget > n:
        if explicit:
            raise UsageError(
                f"{method}: budget={budget} is larger than the prompt ({n} tokens); "
                f"use budget <= {n}, a ratio (e.g. budget=0.25), or -c full to keep everything"
            )
        return n
    return budget


# --------------------------------------------------------------------------- scores


def _grouped(query: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(1, n_heads, q, d) -> (n_kv, group, q, d) float32: query head h reads KV head h // group."""
    _, n_heads, q_len, d = query.shape
    return query[0].reshape(n_kv, n_heads // n_kv, q_len, d).to(torch.float32)


def _probs(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Causal softmax of q (n_kv, g, r, d) against k (n_kv, kv, d) (any dtype: upcast a chunk of
    keys at a time, :func:`kvcli.runtime.kernels.by_keys`); ``rows`` (r,) are the key indices of the query
    rows (each sees keys up to and including its own). -> (n_kv, g, r, kv) float32."""
    logits = by_keys(k, lambda kc: torch.matmul(q, kc.transpose(-1, -2).unsqueeze(1))) / math.sqrt(q.shape[-1])
    cols = torch.arange(k.shape[-2], device=k.device)
    logits = logits.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def window_attention(query: torch.Tensor, key: torch.Tensor, window: int) -> torch.Tensor:
    """Attention of the last ``window`` query rows to every key: (n_kv, group, window, kv_len).

    query: (1, n_heads, q_len, d) — its rows are the last q_len keys; key: (1, n_kv, kv_len, d).
    """
    kv_len, q_len = key.shape[-2], query.shape[-2]
    window = min(window, q_len)
    k = key[0]
    q = _grouped(query[:, :, q_len - window :], key.shape[1])  # the window sliced before the upcast
    rows = torch.arange(kv_len - window, kv_len, device=key.device)
    return _probs(q, k, rows)


def column_sums(query: torch.Tensor, key: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Accumulated attention each key receives from every query row of the pass (H2O's score),
    per query head: (n_kv, group, kv_len) float32, scaled by ``1/sqrt(head_dim)``. Computed a block
    of ``chunk`` rows at a time from q and K (default: :func:`block_rows`; the (q_len x kv_len)
    matrix is never materialised; any attention kernel can run the model)."""
    return _column_sums(query, key, None, 1.0 / math.sqrt(query.shape[-1]), chunk)[1]


def attention_and_column_sums(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's causal attention and :func:`column_sums` from the same blocks of softmax
    weights (one computation instead of the kernel's plus the observer's): returns the output
    (1, q_len, n_heads, d) in ``query``'s dtype — what :func:`kvcli.runtime.kernels.attend` returns, up to
    float rounding — and the column sums (n_kv, group, kv_len) float32. value: (1, n_kv, kv_len, d)."""
    return _column_sums(query, key, value, scaling, chunk)


def block_rows(group: int, kv_len: int) -> int:
    """Query rows per block: about :data:`BLOCK_WEIGHTS` weights (the ``group`` query heads of one
    KV head x rows x kv_len), 16 to 64 rows (64 up to 10k keys in groups of 3). Blocks this small
    stay in the CPU's caches: on one core, 64-row blocks of one KV head computed SmolLM2's attention
    at 4k and 8k keys in 1.3-1.4x SDPA's time, 64-row blocks of all heads at once in 1.6-1.7x."""
    return max(16, min(64, BLOCK_WEIGHTS // max(1, group * kv_len)))


def accelerator_block_rows(group: int, kv_len: int) -> int:
    """:func:`block_rows` off the CPU (a GPU: each block is a few kernel launches): about
    :data:`BLOCK_WEIGHTS_ACCELERATOR` weights, 16 to 4096 rows — ~512 rows at 32k keys in groups
    of 4 (256 MiB of float32 weights), not 16: 32x fewer launches."""
    return max(16, min(4096, BLOCK_WEIGHTS_ACCELERATOR // max(1, group * kv_len)))


def _column_sums(query, key, value, scaling, chunk):
    """One KV head at a time, blocks of query rows of its query heads together: logits of the keys
    the block can see (columns past its last row are never computed; only the block's own diagonal
    square is masked), softmax in float32, the weights summed per column and — with ``value`` —
    multiplied by V. -> (output or None, sums)."""
    kv_len, q_len = key.shape[-2], query.shape[-2]
    n_kv, n_heads, d = key.shape[1], query.shape[1], query.shape[-1]
    group = n_heads // n_kv
    rows = chunk or (accelerator_block_rows if accelerator.on_accelerator(key.device) else block_rows)(group, kv_len)
    q_all = _grouped(query, n_kv) * scaling  # (n_kv, group, q_len, d)
    total = torch.zeros(n_kv, group, kv_len, dtype=torch.float32, device=key.device)
    out = (
        None
        if value is None
        else torch.empty(n_kv, group, q_len, value.shape[-1], dtype=torch.float32, device=key.device)
    )
    # one buffer for every block's weights (the softmax runs in place, row by row)
    work = torch.empty(group * min(rows, q_len) * kv_len, dtype=torch.float32, device=key.device)
    future = torch.ones(rows, rows, dtype=torch.bool, device=key.device).triu(1)
    offset = kv_len - q_len
    for h in range(n_kv):
        # one KV head upcast at a time (a no-op for float32 keys, the CPU's)
        k, v = key[0, h].to(torch.float32), None if value is None else value[0, h].to(torch.float32)
        for start in range(0, q_len, rows):
            end = min(q_len, start + rows)
            r, visible = end - start, offset + end  # keys the last row of this block can see
            q = q_all[h, :, start:end].reshape(group * r, d)
            weights = torch.mm(q, k[:visible].t(), out=work[: group * r * visible].view(group * r, visible))
            # row i of the block sees keys up to offset + start + i: mask the rest of the diagonal square
            weights.view(group, r, visible)[..., offset + start :].masked_fill_(future[:r, :r], float("-inf"))
            torch.softmax(weights, dim=-1, out=weights)
            total[h, :, :visible] += weights.view(group, r, visible).sum(dim=1)
            if v is not None:
                out[h, :, start:end] = torch.mm(weights, v[:visible]).view(group, r, -1)
    if out is not None:
        out = out.view(n_heads, q_len, -1).transpose(0, 1).unsqueeze(0).contiguous().to(query.dtype)
    return out, total


def group_mean(scores: torch.Tensor) -> torch.Tensor:
    """Per-query-head scores (n_kv, group, ...) -> one score per KV head (n_kv, ...)."""
    return scores.mean(dim=1)


def pool(scores: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """Smooth (n_kv, n) scores along the sequence with a ``kind`` ("max"/"avg") pool of ``kernel``."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    fn = F.max_pool1d if kind == "max" else F.avg_pool1d
    return fn(scores.unsqueeze(0), kernel_size=kernel, stride=1, padding=kernel // 2)[0]


def snap_scores(query: torch.Tensor, key: torch.Tensor, window: int, kernel: int, kind: str) -> torch.Tensor:
    """SnapKV's vote (Li et al. 2024, Listing 1): the attention of the last ``window`` queries to
    each earlier key, summed over the window, mean over each GQA group, pooled. -> (n_kv, kv_len);
    the window itself scores +inf (always kept)."""
    probs = window_attention(query, key, window)  # (n_kv, g, w, kv_len)
    w = probs.shape[2]
    n = key.shape[-2]
    votes = pool(group_mean(probs[..., : n - w].sum(dim=2)), kernel, kind)
    return torch.cat([votes, votes.new_full((votes.shape[0], w), float("inf"))], dim=-1)


# --------------------------------------------------------------------------- eviction


def require_kv_cache(method: str, cache) -> KVCache:
    if not isinstance(cache, KVCache):
        raise UsageError(
            f"{method}: evicts entries of a plain KV cache, not of a {type(cache).__name__}; use it without that method"
        )
    return cache


def original_positions(cache: KVCache, layer: int, n_kv: int) -> torch.Tensor:
    """(n_kv, seq_len) original positions of the entries of ``layer`` (before this eviction); a
    sliding layer cut back to its window (``cache.dropped``): those of the entries it dropped
    first, as ``KVCache.kept`` lists them."""
    if cache.kept is not None and layer < len(cache.kept):
        return cache.kept[layer]
    n = cache.seq_len(layer) + cache.dropped.get(layer, 0)
    return torch.arange(n).expand(n_kv, n)


def complete_kept(cache: KVCache, n_layers: int | None = None) -> None:
    """After layers were evicted one at a time during the prefill (:meth:`Eviction.compress_layer`),
    ``cache.kept`` covers the layers up to the last one evicted: extend it to the first ``n_layers``
    layers (default: every layer; the others kept every entry)."""
    n_layers = cache.n_layers if n_layers is None else n_layers
    if cache.kept is not None and len(cache.kept) < n_layers:
        n_kv = cache.keys[0].shape[1]
        cache.kept.extend(original_positions(cache, i, n_kv) for i in range(len(cache.kept), n_layers))


def evict(cache: KVCache, layer: int, keep: torch.Tensor) -> None:
    """Keep, in layer ``layer``, the entries ``keep`` (n_kv, m) — indices into its current entries,
    the same count m for every KV head — in their original order.

    During the prefill (``compress_layer``) the layers after ``layer`` may not exist yet:
    ``cache.kept`` then lists the layers up to this one (:func:`complete_kept` ends it). The kept
    entries are long-lived: on CPU, while a prompt is read, they get their own mapping
    (:func:`kvcli.runtime.measure.long_lived`), off the heap the pass's activations reuse."""
    if cache.dropped.get(layer, 0):
        raise ValueError(f"layer {layer} was cut back to its sliding window: it is never evicted")
    keep = torch.sort(keep.to(torch.long), dim=-1).values
    n_kv = keep.shape[0]
    positions = original_positions(cache, layer, n_kv)
    if cache.kept is None:
        cache.kept = []
    complete_kept(cache, layer + 1)
    keys, values = cache.keys[layer], cache.values[layer]
    idx = keep.to(keys.device)[None, :, :, None].expand(-1, -1, -1, keys.shape[-1])
    with long_lived(keys.device, idx.numel() * keys.element_size()):
        cache.keys[layer] = keys.gather(2, idx)
        cache.values[layer] = values.gather(2, idx)
    cache.kept[layer] = positions.gather(1, keep.cpu())


def keep_top(cache: KVCache, layer: int, scores: torch.Tensor, k: int) -> None:
    """Keep the ``k`` best entries of each KV head of ``layer``. ``scores`` (n_kv, n_prompt) are
    indexed by original position (+inf: always kept, e.g. SnapKV's window, StreamingLLM's sinks);
    a layer that holds k entries or fewer is left alone."""
    current = entry_scores(cache, layer, scores)
    if k >= current.shape[-1]:
        return
    evict(cache, layer, torch.topk(current, k, dim=-1).indices)


def entry_scores(cache: KVCache, layer: int, scores: torch.Tensor) -> torch.Tensor:
    """Scores (n_kv, n_prompt) indexed by original position -> scores of the layer's current
    entries (n_kv, seq_len) (after an earlier eviction in the same pipeline, only the kept ones)."""
    if cache.kept is None or layer >= len(cache.kept):
        return scores
    return scores.gather(1, cache.kept[layer].to(scores.device))


# --------------------------------------------------------------------------- the shared method


@dataclasses.dataclass
class Eviction(Compressor):
    """What every eviction method shares: the ``budget`` knob, observers that score the keys of
    every layer in the final prefill pass, and the eviction of the best entries per KV head —
    layer by layer during that pass (:meth:`compress_layer`) where the method can, else all at
    once in :meth:`compress`.

    Subclasses define :meth:`layer_scores` (None: the method needs no attention, scores come from
    :meth:`static_scores`), :meth:`always_kept` and optionally :meth:`layer_budgets` and
    :meth:`final_scores`. A method that ranks with another method's scores (AdaKV) returns it as
    :attr:`scorer` and chooses the entries its own way in :meth:`keep`; the observers and the
    checks of :meth:`compress` serve both."""

    auto_kv_bits: ClassVar[int] = 8  # its layout is quantized: --kv-bits auto holds it in 8 bits (docs/kv-bits.md)

    budget: str | int | float = knob(
        "1024", "entries kept per layer: a token count (>= 1) or a ratio of the prompt (0 < x < 1)"
    )
    _scores: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    # the final pass in progress: its prompt length, its layer budgets and the layers compress_layer evicted
    _pass: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    uses_attention: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.budget = parse_budget(self.name, self.budget)
        self.check_knobs()
        check_budget_covers_kept(self)

    # --- what subclasses define -------------------------------------------------------------------
    def check_knobs(self) -> None:
        """Raise UsageError for bad knob values."""

    def always_kept(self) -> int:
        """Tokens kept whatever the scores (window, sinks): the smallest budget that works."""
        return 1

    def layer_scores(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """(n_kv, kv_len) scores of one layer's keys from the pass's queries (higher: keep)."""
        raise NotImplementedError

    def static_scores(self, n: int, n_kv: int) -> torch.Tensor:
        """(n_kv, n) scores for methods that need no attention."""
        raise NotImplementedError

    def final_scores(self, scores: torch.Tensor, n: int) -> torch.Tensor:
        """The scores (n_kv, n) of one layer as the eviction ranks them, for a prompt of ``n``
        tokens whose budget is :meth:`resolve` (H2O marks its recent tokens +inf here)."""
        return scores

    def layer_budgets(self, lm, n: int, k: int) -> list[int]:
        """Entries kept in each layer for a prompt of ``n`` tokens and a budget of ``k``."""
        return [k] * lm.n_layers

    @property
    def scorer(self) -> Eviction:
        """The method whose scores rank the entries: the method itself (AdaKV: its base)."""
        return self

    def keep(self, cache: KVCache, scores: list[torch.Tensor | None], budgets: list[int]):
        """Keep, per layer, the ``budgets[l]`` best entries of each KV head by ``scores[l]``
        (n_kv, n_prompt), indexed by original position (None: a layer already evicted during the
        prefill); returns the cache."""
        for layer, (layer_scores, k_layer) in enumerate(zip(scores, budgets)):
            if layer_scores is not None:
                keep_top(cache, layer, layer_scores, k_layer)
        return cache

    # --- the hooks --------------------------------------------------------------------------------
    def configure(self, lm) -> None:
        require_full_layers(lm, self.name)

    def resolve(self, n: int) -> int:
        return resolve_budget(self.name, self.budget, n, "budget" in self.explicit_knobs, min(n, self.always_kept()))

    def prefill_observers(self, lm, n_tokens: int) -> dict:
        self._scores = {}
        self._pass = {"n": n_tokens, "evicted": set()}
        if not self.scorer.uses_attention or self.resolve(n_tokens) >= n_tokens:
            return {}  # nothing to score (keep everything) or scores without attention
        # a hybrid's sliding layers keep their window (CacheBase.trim_windows): scored nowhere
        return {layer: [functools.partial(self._observe, layer)] for layer in lm.windows.full_layers}

    def _observe(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        if isinstance(key, LayerView):
            raise UsageError(
                f"{self.name}: evicts entries of a plain KV cache; it cannot follow a method with a grouped cache"
            )
        self._scores[layer] = self.scorer.layer_scores(query, key)

    def compresses_by_layer(self) -> bool:
        """Whether :meth:`compress_layer` evicts: a method whose layers are chosen independently
        (the default :meth:`keep`); AdaKV builds one padded cache at the end."""
        return type(self).keep is Eviction.keep

    @torch.inference_mode()
    def compress_layer(self, engine, cache, layer: int) -> None:
        """Evict the entries of ``layer`` now, in the final prefill pass, right after the layer ran:
        the pass no longer reads them, so the whole uncompressed KV is never held at once (the
        selection is the one :meth:`compress` makes: same scores, same budgets)."""
        n = self._pass.get("n")
        if n is None or not self.compresses_by_layer() or not isinstance(cache, KVCache):
            return
        k = self.resolve(n)
        sliding = engine.windows.window(layer) is not None
        if k >= n or (self.scorer.uses_attention and layer not in self._scores) or sliding:
            return  # keeps everything, or not scored (compress reports what is missing), or a sliding layer
        scores = (
            self._scores.pop(layer)
            if self.scorer.uses_attention
            else self.scorer.static_scores(n, cache.keys[layer].shape[1])
        )
        if "budgets" not in self._pass:
            self._pass["budgets"] = self.layer_budgets(engine.lm, n, k)
        keep_top(cache, layer, self.final_scores(scores, n), self._pass["budgets"][layer])
        self._pass["evicted"].add(layer)

    @torch.inference_mode()
    def compress(self, engine, cache):
        cache = require_kv_cache(self.name, cache)
        lm = engine.lm
        n = cache.n_tokens
        k = self.resolve(n)
        scores, self._scores = self._scores, {}
        evicted, self._pass = self._pass.get("evicted", set()), {}
        if k >= n:
            return cache
        scorer = self.scorer
        full = lm.windows.full_layers  # a hybrid's sliding layers keep their window: never evicted here
        if scorer.uses_attention and len(scores) + len(evicted) != len(full):
            raise UsageError(
                f"{self.name}: no attention scores were observed in the prefill "
                "(another method ran the prefill itself); use it with the default prefill"
            )
        if not scorer.uses_attention:
            static = scorer.static_scores(n, lm.n_kv_heads)
            scores = {layer: static for layer in full}
        ranked = [
            None if layer in evicted or layer not in scores else self.final_scores(scores[layer], n)
            for layer in range(cache.n_layers)
        ]
        cache = self.keep(cache, ranked, self.layer_budgets(lm, n, k))
        if isinstance(cache, KVCache):
            complete_kept(cache)
        return cache


# --------------------------------------------------------------------------- head-adaptive budgets
# (AdaKV, KVzip, ExpectedAttention: the KV heads of a layer keep different numbers of entries; the
# result is a kvcli.caches.ragged.RaggedCache whose padding the attention masks out exactly.)


def top_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(n_kv, n) scores -> (n_kv, n) bool: the ``k`` best entries of every head (all if k >= n)."""
    n = scores.shape[-1]
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if k >= n:
        return mask.fill_(True)
    return mask.scatter_(-1, torch.topk(scores, k, dim=-1).indices, True)


def adaptive_mask(scores: torch.Tensor, k: int, safeguard: float) -> torch.Tensor:
    """AdaKV's allocation (Feng et al. 2024, arXiv:2407.11550, Algorithm 1 + the safeguard of its
    later versions and of NVIDIA kvpress): a layer keeps ``k`` entries per head *on average* —
    the ``k * n_kv`` best of the scores of all its heads flattened together — but every head keeps
    at least its own ``floor(safeguard * k)`` best. (n_kv, n) scores -> (n_kv, n) bool.
    Entries scoring +inf (windows, sinks) are always kept, by every head."""
    n_kv, n = scores.shape
    if k >= n:
        return torch.ones(n_kv, n, dtype=torch.bool, device=scores.device)
    s = scores.to(torch.float32).clone()
    safe = min(k, math.floor(safeguard * k + 1e-9))
    if safe > 0:
        s.scatter_(-1, torch.topk(s, safe, dim=-1).indices, float("inf"))
    chosen = torch.topk(s.flatten(), k * n_kv).indices
    mask = torch.zeros(n_kv * n, dtype=torch.bool, device=scores.device)
    mask[chosen] = True
    return mask.view(n_kv, n)


def global_masks(scores: list[torch.Tensor], total: int) -> list[torch.Tensor]:
    """Keep the ``total`` best entries over every layer and head together (KVzip's non-uniform
    budgets). ``scores``: per layer (n_kv, n_l) -> per layer (n_kv, n_l) bool."""
    sizes = [s.numel() for s in scores]
    flat = torch.cat([s.to(torch.float32).flatten().cpu() for s in scores])
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[torch.topk(flat, min(total, flat.numel())).indices] = True
    return [m.view(s.shape) for m, s in zip(torch.split(mask, sizes), scores)]


def prerope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: queries or keys (..., n, head_dim) rotated by the model's (cos, sin) (n, rot_dim)
    (:func:`kvcli.runtime.rope.rope_cos_sin`, ``attention_scaling`` included) -> the vectors before RoPE,
    float32. A rotation by -angle, divided by the scale squared (cos² + sin²); dimensions past
    rot_dim (partial rotary) pass through."""
    from ..runtime.rope import apply_rotation

    scale2 = (cos * cos + sin * sin).clamp_min(1e-30)
    return apply_rotation(x.to(torch.float32), cos / scale2, -sin / scale2)


# --------------------------------------------------------------------------- question-agnostic eviction

ALLOCATIONS = ("uniform", "adaptive", "global")


def allocate(scores: list[torch.Tensor], k: int, allocation: str, safeguard: float) -> list[torch.Tensor]:
    """Per-layer keep masks for scores (n_kv, n) of every layer and ``k`` entries per KV head on
    average: ``uniform`` (every head keeps its k best), ``adaptive`` (AdaKV: k × n_kv per layer split
    across heads by score, :func:`adaptive_mask`) or ``global`` (k × n_kv × n_layers over the whole
    model, KVzip's non-uniform budgets, :func:`global_masks`)."""
    if allocation == "uniform":
        return [top_mask(s, k) for s in scores]
    if allocation == "adaptive":
        return [adaptive_mask(s, k, safeguard) for s in scores]
    return global_masks(scores, k * sum(s.shape[0] for s in scores))


@dataclasses.dataclass
class PrefixEviction(Compressor):
    """Eviction of the question-agnostic prefix (document + template), once per document: the
    compressed cache is the method's prefix state, kept by the disk store and reused for every
    question; the question's tokens then run on top of it, never compressed (the setting of NVIDIA
    kvpress, which compresses the context before the question is seen).

    Subclasses define :meth:`prefix_scores` (the full KV of the prefix and per-layer scores)."""

    budget: str | int | float = knob(
        "1024",
        "entries kept per layer and KV head of the document prefix (the question is never compressed): a token count or a ratio of the prefix",
    )
    allocation: str = knob(
        "uniform",
        "uniform: every KV head keeps budget; adaptive: AdaKV, budget x KV heads per layer split by score; global: budget x KV heads x layers over the whole model",
    )
    safeguard: float = knob(0.2, "adaptive: every KV head keeps at least this fraction of the budget")

    def __post_init__(self) -> None:
        self.budget = parse_budget(self.name, self.budget)
        self.allocation = str(self.allocation).strip().lower()
        if self.allocation not in ALLOCATIONS:
            raise UsageError(
                f"{self.name}: allocation must be one of {', '.join(ALLOCATIONS)}, got '{self.allocation}'"
            )
        if not 0.0 <= self.safeguard <= 1.0:
            raise UsageError(f"{self.name}: safeguard must be between 0 and 1, got {self.safeguard}")
        self.check_knobs()
        check_budget_covers_kept(self)

    def check_knobs(self) -> None:
        """Raise UsageError for bad knob values."""

    def always_kept(self) -> int:
        return 1

    def configure(self, lm) -> None:
        require_full_layers(lm, self.name)

    def resolve(self, n: int) -> int:
        """Entries per KV head for a prefix of ``n`` tokens (the question is not counted)."""
        if isinstance(self.budget, int) and self.budget > n and "budget" in self.explicit_knobs:
            raise UsageError(
                f"{self.name}: budget={self.budget} is larger than the document prefix ({n} tokens: the document "
                f"and the template before the question); use budget <= {n}, a ratio (e.g. budget=0.25), or -c full"
            )
        return resolve_budget(self.name, self.budget, n, False, min(n, self.always_kept()))

    def prefix_state(self, lm) -> dict:
        from .base import knob_text

        return {"kind": self.name, **{f.name: knob_text(getattr(self, f.name)) for f in self.knobs()}}

    def prefix_scores(self, engine, prefix_ids: torch.Tensor) -> tuple[KVCache, list[torch.Tensor]]:
        """The KV of every layer for ``prefix_ids`` at positions 0..n-1, and per layer (n_kv, n)
        scores (higher: keep; +inf: always kept)."""
        raise NotImplementedError

    @torch.inference_mode()
    def build_prefix(self, engine, prefix_ids: torch.Tensor):
        """The compressed KV of the prefix (a RaggedCache), or its full KV when the budget holds it."""
        n = prefix_ids.numel()
        k = self.resolve(n)
        if k >= n:
            return engine.prefix_kv(prefix_ids)
        kv, scores = self.prefix_scores(engine, prefix_ids)
        # a hybrid's sliding layers keep their window (the last w - 1 tokens, all the question's
        # first token reaches), outside the allocation (KVzip's global pool is the full layers')
        lm = engine.lm
        full = lm.windows.full_layers
        chosen = dict(zip(full, allocate([scores[layer] for layer in full], k, self.allocation, self.safeguard)))
        masks = [
            chosen[layer]
            if layer in chosen
            else lm.windows.holds(layer, n, scores[layer].device).expand_as(scores[layer])
            for layer in range(len(scores))
        ]
        return RaggedCache.from_selection(kv, masks, consume=True)
