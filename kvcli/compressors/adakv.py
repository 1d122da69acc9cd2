"""AdaKV: head-wise adaptive budgets over any eviction scorer (Feng et al., 2024, arXiv:2407.11550).

"Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference":
the heads of a layer do not need the same share of the cache — some concentrate their attention
on a few tokens, others spread it. With a layer budget of ``budget × n_kv_heads`` entries, AdaKV
keeps the best entries of the *flattened* scores of all the layer's heads (Algorithm 1), so a head
whose scores are concentrated gives its room to heads that need more; a *safeguard* keeps, in every
head, at least its own ``floor(safeguard × budget)`` best entries (α = 0.2 in the paper's later
versions and in NVIDIA kvpress's ``AdaKVPress``).

``adakv:base=snapkv,budget=0.25,safeguard=0.2`` — the scorer (``base``) is any eviction method
that scores keys per KV head in kvcli's final prefill pass: ``snapkv`` (Ada-SnapKV, the paper's
main variant), ``pyramidkv`` (Ada-Pyramid: the pyramid sets each layer's budget, AdaKV splits it
across heads), ``tova``, ``knorm``, ``keydiff``, ``streamingllm``. The base's own knobs go after
its name, separated by ``;`` (``base=snapkv:window=16;kernel=5``); the base's budget is AdaKV's.
Entries a base always keeps (SnapKV's window, sinks) stay kept in every head. H2O is refused (its
recent window is not part of its scores).

GQA: scores are the base's (per query head, mean over each KV head's group); budgets are per KV
head; the cache is never expanded. Kept tokens keep their original positions; decoding continues
at the prompt length. Heads now hold different numbers of entries: the layer is stored padded to
its widest head (:class:`kvcli.caches.ragged.RaggedCache`) and the attention masks the padding out
exactly; ``method_stats`` reports ``kv_entries`` vs ``kv_slots`` (the padding is memory too —
the paper's own kernels use variable-length flash attention instead). Disk store: the prefix state
is the base's (full attention's KV); the selection happens per question after the prefill.
``budget`` >= the prompt keeps everything (= full attention).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..caches import KVCache, RaggedCache
from ..errors import UsageError
from .base import knob, knob_text, parse_one
from .scoring import Eviction, adaptive_mask, entry_scores

BASE_KNOB_SEPARATOR = ";"


def parse_base(owner: str, text: str) -> Eviction:
    """``"snapkv:window=16;kernel=5"`` -> SnapKV(window=16, kernel=5): an eviction scorer whose
    selection is a per-layer top-k of its scores (so an adaptive split of the budget applies)."""
    name, _, rest = str(text).strip().partition(":")
    if name.strip().lower() == owner:
        raise UsageError(f"{owner}: base cannot be {owner} itself")
    base = parse_one(name + (":" + rest.replace(BASE_KNOB_SEPARATOR, ",") if rest else ""))
    if (
        not isinstance(base, Eviction)
        or type(base).compress is not Eviction.compress
        or type(base).keep is not Eviction.keep
        or type(base).final_scores is not Eviction.final_scores
    ):
        raise UsageError(
            f"{owner}: base must be an eviction scorer (snapkv, pyramidkv, tova, knorm, keydiff, streamingllm), got '{base.name}'"
        )
    if "budget" in base.explicit_knobs:
        raise UsageError(f"{owner}: set the budget on {owner} (budget=...), not on its base")
    return base


def base_spec(base: Eviction) -> str:
    """The base's canonical spec without its budget, knobs separated by ``;``."""
    parts = [f"{f.name}={knob_text(getattr(base, f.name))}" for f in base.knobs() if f.name != "budget"]
    return base.name + (":" + BASE_KNOB_SEPARATOR.join(parts) if parts else "")


@dataclass
class AdaKV(Eviction):
    """AdaKV (Feng et al., 2024): a base scorer's entries chosen per layer across its KV heads —
    budget x KV heads entries a layer, split by score, at least safeguard x budget per head.
    arXiv:2407.11550."""

    name: ClassVar[str] = "adakv"
    paper: ClassVar[str] = (
        "Feng et al. 2024, Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference, arXiv:2407.11550"
    )
    keep_all: ClassVar[str] = "budget={n}"  # a per-head budget of the whole prompt (default base: snapkv)
    short_document_spec: ClassVar[str] = "adakv:budget=0.25,base=snapkv:window=8"
    title: ClassVar[str] = "AdaKV"
    acts: ClassVar[str] = (
        "wraps a scorer (snapkv, pyramidkv, tova, knorm, keydiff, streamingllm): per layer the best `budget × KV heads` "
        "of all heads' scores flattened, at least `safeguard × budget` per head; heads hold different counts, stored "
        "padded to the widest head and masked exactly (`method_stats`: `kv_entries` vs `kv_slots`)"
    )
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "prefix KV (shared with full); compresses per question"
    spec_note: ClassVar[str] = "(base knobs after `:`, `;`-separated: `base=pyramidkv:window=16;beta=20`)"
    auto_kv_bits: ClassVar[int] = 16  # heads holding different counts: a layout not quantized

    base: str = knob(
        "snapkv",
        "the scorer: snapkv, pyramidkv, tova, knorm, keydiff or streamingllm, its knobs after ':' separated by ';'",
    )
    safeguard: float = knob(
        0.2, "every KV head keeps at least this fraction of the per-head budget (its own best entries)"
    )

    _base: Eviction | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _lm: object = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )  # configure's model (its windows)

    def check_knobs(self) -> None:
        self._base = parse_base(self.name, self.base)
        self.base = base_spec(self._base)
        if not 0.0 <= self.safeguard <= 1.0:
            raise UsageError(f"{self.name}: safeguard must be between 0 and 1, got {self.safeguard}")

    @property
    def scorer(self) -> Eviction:
        return self._base

    def always_kept(self) -> int:
        return self._base.always_kept()

    def configure(self, lm) -> None:
        super().configure(lm)
        self._base.configure(lm)
        self._lm = lm

    def query_window(self, lm) -> int:
        return self._base.query_window(lm)

    def prefix_state(self, lm):
        return self._base.prefix_state(lm)

    def layer_budgets(self, lm, n: int, k: int) -> list[int]:
        return self._base.layer_budgets(lm, n, k)

    def keep(self, cache: KVCache, scores: list[torch.Tensor], budgets: list[int]) -> RaggedCache:
        """The base's scores, chosen per layer across its KV heads (:func:`adaptive_mask`)."""
        n = cache.n_tokens
        masks = [
            # a hybrid's sliding layer (no scores): its window, as full attention holds it
            self._lm.windows.holds(layer, n, cache.keys[layer].device).expand(cache.keys[layer].shape[1], -1)
            if s is None
            else adaptive_mask(entry_scores(cache, layer, s), k_layer, self.safeguard)
            for layer, (s, k_layer) in enumerate(zip(scores, budgets))
        ]
        return RaggedCache.from_selection(cache, masks, consume=True)  # the pipeline keeps only the result
