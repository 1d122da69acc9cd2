"""RazorAttention: retrieval heads keep everything, the other heads a window (Tang et al., 2024).

"RazorAttention: Efficient KV Cache Compression Through Retrieval Heads", arXiv:2407.15891.

1. Retrieval heads are found once per model with a data-free probe (§3.3, :mod:`kvcli.compressors.razor_heads`):
   K random tokens repeated 4 times; per head the *echo* score (attention to the previous
   occurrence of the current token) and the *induction* score (attention to the token that
   followed it); the top 14% induction heads and top 1% echo heads are protected (Table 2). With
   GQA a KV head is protected when any of its query heads is (§4.1.1).
2. Compression (Algorithm 1): protected KV heads keep their whole cache; every other KV head
   keeps the first ``sinks`` tokens (N_0 = 4) and the most recent ``L_h = max(S_0, N / C)``
   tokens, and the N_d dropped tokens become one *compensation token* whose key and value are the
   means of the dropped keys and values after RoPE (equation 4).
3. Non-retrieval heads attend with the compensation token weighted by N_d (equation 5), here a
   ``log(N_d)`` bias on its logit; retrieval heads attend normally.

When the compression happens (knob ``order``):

* ``order=paper`` (default) — the paper's order. Algorithm 1 takes "the original KV cache" as its
  input and its output is "generated output tokens": the whole prompt (document *and* question)
  is prefilled with full attention, then the KV is compressed per head before decoding. Every
  head sees the whole context while the prompt is read, so the first answer token is exactly
  full attention's; compression acts from the second one on. N is the whole prompt, so the
  recent window is the last ``L_h`` tokens of the prompt — it ends with the question and the
  generation prompt, and so reaches ``n_suffix`` tokens less far into the document than in
  ``prefix`` order. The prefix state in the disk store is full attention's KV (shared with
  ``-c full``); the profile of retrieval heads is the only per-method state.
* ``order=prefix`` — question-agnostic, a kvcli variant: the document prefix (document +
  template) is prefilled and compressed *before* the question, whose tokens then run on the
  compressed cache (the non-retrieval heads never see the dropped document tokens, not even for
  the first answer token). N is the prefix, the window its last ``L_h`` tokens; the question's
  tokens are appended after it in every head. Its payoff: the compressed cache is this method's
  prefix state in the disk store (:mod:`kvcli.store`), so a second question skips the document
  entirely and loads a smaller entry.

In both orders the two kinds of heads live in separate tensors (:class:`kvcli.caches.razor.RazorCache`):
the memory saving is real, and ``kept_mask`` reports exactly the prompt entries each layer / KV
head holds (the compensation token is no prompt entry).

kvcli choices, each visible: the probe uses K = 512 random tokens for models under 1B parameters
(1024 under 4B, else the paper's 2500; knob ``tokens``); S_0 defaults to the paper's 4000 scaled
to the model's context window (``window``), since 4000 exceeds most documents a small model reads.
Models with a sliding attention window, and ALiBi models (whose retrieval heads the paper finds
with a closed form, Theorem 1), are refused with a message.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..caches import KVCache, RazorCache
from ..errors import UsageError
from .base import Compressor, knob, require_full_layers

ORDERS = ("paper", "prefix")
PAPER_WINDOW = 4000  # S_0 of Table 2, for models with 32k-token windows (Qwen1.5-7B)
PAPER_CONTEXT = 32768


def default_window(max_context: int | None) -> int:
    """S_0 for a model: the paper's 4000 for windows of 32k tokens or more, else in proportion
    (SmolLM2's 8192 -> 1000), never below 256."""
    if not max_context or max_context >= PAPER_CONTEXT:
        return PAPER_WINDOW
    return max(256, round(PAPER_WINDOW * max_context / PAPER_CONTEXT))


@dataclass
class Razor(Compressor):
    """RazorAttention (Tang et al., 2024): retrieval heads (echo + induction heads found once per
    model) keep their full KV cache; the other heads keep 4 sink tokens, a recent window and one
    compensation token. order=paper compresses after a full-attention prefill of the whole prompt
    (Algorithm 1); order=prefix compresses the document before the question, so the compressed
    cache serves every later question from the disk store. arXiv:2407.15891."""

    name: ClassVar[str] = "razor"
    paper: ClassVar[str] = (
        "Tang et al. 2024, RazorAttention: Efficient KV Cache Compression Through Retrieval Heads, arXiv:2407.15891"
    )
    # every head protected (all are retrieval heads), so none is cut to sinks + window — window=1:
    # it is the protection that keeps everything, not a window covering the prompt
    keep_all: ClassVar[str] = "induction=1,window=1"
    short_document_spec: ClassVar[str] = "razor:window=16,sinks=4"
    title: ClassVar[str] = "RazorAttention"
    acts: ClassVar[str] = (
        "`order=paper` (Algorithm 1): after the full-attention prefill of the whole prompt, so the first answer token "
        "is full attention's; `order=prefix`: after the prefill of the document, before the question. Retrieval heads "
        "keep all, others sinks + the last max(S0, N/5) tokens of what was compressed + compensation token"
    )
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "`paper`: prefix KV (shared with full); `prefix`: the compressed cache — any question"
    table_knobs: ClassVar[tuple[str, ...] | None] = ("order", "induction", "echo", "sinks", "window", "ratio")

    order: str = knob(
        "paper",
        "paper: prefill the whole prompt with full attention, compress before decoding (Algorithm 1; first answer token = full attention's); prefix: compress the document before the question (question-agnostic, the compressed cache is stored for any question)",
    )
    induction: float = knob(0.14, "fraction of all query heads protected for their induction score (paper: top 14%)")
    echo: float = knob(0.01, "fraction of all query heads protected for their echo score (paper: top 1%)")
    sinks: int = knob(4, "sink tokens N_0 kept at the start by every non-retrieval head")
    window: int | None = knob(
        None,
        "S_0: non-retrieval heads keep the last max(S_0, N/C) tokens; auto = 4000 scaled to the model's context (32k -> 4000)",
    )
    ratio: float = knob(5.0, "C: compression ratio of the window, L_h = max(S_0, N/C) (paper: 5)")
    compensate: bool = knob(
        True, "merge the dropped tokens into one compensation token (equation 5); false = just drop them"
    )
    tokens: int | None = knob(
        None,
        "K random tokens of the head probe (repeated 4 times); auto = 512 under 1B parameters, 1024 under 4B, else 2500",
    )
    seed: int = knob(0, "seed of the head probe's random tokens")

    def __post_init__(self) -> None:
        self.order = str(self.order).strip().lower()
        if self.order not in ORDERS:
            raise UsageError(f"razor: order must be paper or prefix, got '{self.order}'")
        for name in ("induction", "echo"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise UsageError(f"razor: {name} is a fraction of the heads, between 0 and 1, got {value}")
        if self.sinks < 0:
            raise UsageError(f"razor: sinks must be at least 0, got {self.sinks}")
        if self.window is not None and self.window < 1:
            raise UsageError(f"razor: window must be at least 1, got {self.window}")
        if not self.ratio >= 1.0:
            raise UsageError(f"razor: ratio (C) must be at least 1, got {self.ratio}")
        if self.tokens is not None and self.tokens < 2:
            raise UsageError(f"razor: tokens must be at least 2, got {self.tokens}")
        self._profile = None
        self._protected: torch.Tensor | None = None
        self._fingerprint: str | None = None

    # --- model-dependent setup ------------------------------------------------------------------
    def configure(self, lm) -> None:
        """Resolve the automatic knobs and load (or compute once and store) the head profile."""
        from .razor_heads import check_rope_model, default_tokens

        check_rope_model(lm, "razor")
        require_full_layers(lm, "razor")
        if self.window is None:
            self.window = default_window(lm.max_context)
        if self.tokens is None:
            self.tokens = default_tokens(lm)
        self._ensure_profile(lm)

    def _ensure_profile(self, lm, engine=None) -> None:
        if self._protected is not None and self._fingerprint == lm.fingerprint:
            return
        from ..runtime.engine import Engine
        from .razor_heads import load_or_compute

        if self.window is None or self.tokens is None:
            self.configure(lm)
            return
        engine = engine if engine is not None and engine.lm is lm else Engine(lm)
        self._profile = load_or_compute(engine, self.tokens, self.seed, self.runtime.cache_dir)
        # a hybrid's sliding layers: every head keeps its KV under its window mask (full attention's)
        self._protected = self._profile.protected_kv_heads(self.induction, self.echo, lm.windows.full_layers)
        self._fingerprint = lm.fingerprint

    @property
    def protected(self) -> torch.Tensor:
        """(n_layers, n_kv_heads) bool: the KV heads that keep their full cache (after configure)."""
        if self._protected is None:
            raise RuntimeError("razor: configure(lm) first")
        return self._protected

    @property
    def profile(self):
        return self._profile

    def window_for(self, n: int) -> int:
        """L_h = max(S_0, N / C) for a prefix of ``n`` tokens."""
        return max(int(self.window), math.ceil(n / self.ratio))

    # --- the prefix state: full attention's KV (paper) or the compressed cache (prefix) -------------
    def prefix_state(self, lm) -> dict:
        if self.order == "paper":
            return super().prefix_state(lm)  # full attention's KV of every layer, shared with -c full
        self._ensure_profile(lm)
        protected = self._protected.to(torch.uint8).contiguous().numpy().tobytes()
        return {
            "kind": "razor",
            "induction": self.induction,
            "echo": self.echo,
            "sinks": self.sinks,
            "window": self.window,
            "ratio": self.ratio,
            "compensate": self.compensate,
            "profile": self._profile.identity(),
            "protected": hashlib.sha256(protected).hexdigest()[:16],
        }

    def build_prefix(self, engine, prefix_ids: torch.Tensor):
        """order=paper: full attention's KV of ``prefix_ids``. order=prefix: prefill ``prefix_ids``
        at positions 0..n-1 with full KV, then compress it (Algorithm 1 on the document alone)."""
        if self.order == "paper":
            return super().build_prefix(engine, prefix_ids)
        self._ensure_profile(engine.lm, engine)
        kv = engine.prefix_kv(prefix_ids)
        return self.compress_kv(kv, engine.lm.n_heads, order="prefix")

    # --- after the prefill of the whole prompt ----------------------------------------------------
    def compress(self, engine, cache):
        """order=paper: Algorithm 1 on the full KV of the whole prompt (document + question), after
        its full-attention prefill. order=prefix: the cache is already compressed (the question ran
        on it); only when there was no prefix state to compress (an empty prefix) is the whole
        prompt compressed here."""
        if isinstance(cache, RazorCache):
            return cache
        if not isinstance(cache, KVCache) or cache.kept is not None or cache.kept_positions is not None:
            raise UsageError("razor: compresses the whole KV of the prompt; use it without eviction methods before it")
        self._ensure_profile(engine.lm, engine)
        return self.compress_kv(cache, engine.lm.n_heads, order="paper")  # the whole prompt was compressed

    def compress_kv(self, kv, n_heads: int, order: str = "prefix") -> RazorCache:
        """Algorithm 1 on the full cache ``kv`` of N tokens: L_h = max(S_0, N / C)."""
        n = kv.n_tokens  # (a hybrid's layer 0 may be a sliding layer cut back to its window)
        cache = RazorCache.compress(
            kv, self.protected, n_heads, self.sinks, self.window_for(n), self.compensate, consume=True
        )
        cache.order = order
        return cache
