"""RazorAttention: retrieval heads keep everything, the other heads a window (Tang et al., 2024).

"RazorAttention: Efficient KV Cache Compression Through Retrieval Heads", arXiv:2407.15891.

1. Retrieval heads are found once per model with a data-free probe (§3.3, :mod:`kvcli.heads`):
   K random tokens repeated 4 times; per head the *echo* score (attention to the previous
   occurrence of the current token) and the *induction* score (attention to the token that
   followed it); the top 14% induction heads and top 1% echo heads are protected (Table 2). With
   GQA a KV head is protected when any of its query heads is (§4.1.1).
2. After prefill (Algorithm 1), protected KV heads keep their whole cache; every other KV head
   keeps the first ``sinks`` tokens (N_0 = 4) and the most recent ``L_h = max(S_0, N / C)``
   tokens, and the N_d dropped tokens become one *compensation token* whose key and value are the
   means of the dropped keys and values after RoPE (equation 4).
3. Non-retrieval heads attend with the compensation token weighted by N_d (equation 5), here a
   ``log(N_d)`` bias on its logit; retrieval heads attend normally.

The compression does not look at the question, so the compressed cache of a document serves
every later question: it is this method's prefix state in the disk store (:mod:`kvcli.store`),
and a second question runs only its own tokens on top of it. The two kinds of heads live in
separate tensors (:class:`kvcli.cache.RazorCache`); the memory saving is real.

kvcli choices, each visible: the probe uses K = 512 random tokens for models under 1B parameters
(1024 under 4B, else the paper's 2500; knob ``tokens``); S_0 defaults to the paper's 4000 scaled
to the model's context window (``window``), since 4000 exceeds most documents a small model reads.
Models with a sliding attention window, and ALiBi models (whose retrieval heads the paper finds
with a closed form, Theorem 1), are refused with a message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ..cache import RazorCache
from ..errors import UsageError
from .base import Compressor, knob, register

PAPER_WINDOW = 4000  # S_0 of Table 2, for models with 32k-token windows (Qwen1.5-7B)
PAPER_CONTEXT = 32768


def default_window(max_context: int | None) -> int:
    """S_0 for a model: the paper's 4000 for windows of 32k tokens or more, else in proportion
    (SmolLM2's 8192 -> 1000), never below 256."""
    if not max_context or max_context >= PAPER_CONTEXT:
        return PAPER_WINDOW
    return max(256, round(PAPER_WINDOW * max_context / PAPER_CONTEXT))


def sliding_windows(lm) -> set:
    """The attention windows of the layers of ``lm`` (None: full attention)."""
    base = lm.model.get_decoder()
    out = set()
    for layer in base.layers:
        attn = layer.self_attn
        out.add(attn.sliding_window if hasattr(attn, "sliding_window") else getattr(lm._config, "sliding_window", None))
    return out


@register
@dataclass
class Razor(Compressor):
    """RazorAttention (Tang et al., 2024): retrieval heads (echo + induction heads found once per
    model) keep their full KV cache; the other heads keep 4 sink tokens, a recent window and one
    compensation token. Question-agnostic: the compressed cache serves every later question.
    arXiv:2407.15891."""

    name: ClassVar[str] = "razor"
    paper: ClassVar[str] = "Tang et al. 2024, RazorAttention: Efficient KV Cache Compression Through Retrieval Heads, arXiv:2407.15891"

    induction: float = knob(0.14, "fraction of all query heads protected for their induction score (paper: top 14%)")
    echo: float = knob(0.01, "fraction of all query heads protected for their echo score (paper: top 1%)")
    sinks: int = knob(4, "sink tokens N_0 kept at the start by every non-retrieval head")
    window: int | None = knob(None, "S_0: non-retrieval heads keep the last max(S_0, N/C) tokens; auto = 4000 scaled to the model's context (32k -> 4000)")
    ratio: float = knob(5.0, "C: compression ratio of the window, L_h = max(S_0, N/C) (paper: 5)")
    compensate: bool = knob(True, "merge the dropped tokens into one compensation token (equation 5); false = just drop them")
    tokens: int | None = knob(None, "K random tokens of the head probe (repeated 4 times); auto = 512 under 1B parameters, 1024 under 4B, else 2500")
    seed: int = knob(0, "seed of the head probe's random tokens")

    # where head profiles are kept (not a knob; None = kvcli.models.default_cache_dir())
    cache_dir: Path | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
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
        from ..heads import check_rope_model, default_tokens

        check_rope_model(lm, "razor")
        windows = {w for w in sliding_windows(lm) if w is not None and (not lm.max_context or w < lm.max_context)}
        if windows:
            raise UsageError(
                f"razor: {lm.name} uses sliding-window attention ({min(windows)} tokens); RazorAttention "
                "needs full-attention layers (use -c full or gemfilter)"
            )
        if self.window is None:
            self.window = default_window(lm.max_context)
        if self.tokens is None:
            self.tokens = default_tokens(lm)
        self._ensure_profile(lm)

    def _ensure_profile(self, lm, engine=None) -> None:
        if self._protected is not None and self._fingerprint == lm.fingerprint:
            return
        from ..engine import Engine
        from ..heads import load_or_compute

        if self.window is None or self.tokens is None:
            self.configure(lm)
            return
        engine = engine if engine is not None and engine.lm is lm else Engine(lm)
        self._profile = load_or_compute(engine, self.tokens, self.seed, self.cache_dir)
        self._protected = self._profile.protected_kv_heads(self.induction, self.echo)
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

    # --- the prefix state: the compressed cache of the document ----------------------------------
    def prefix_state(self, lm) -> dict:
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

    def build_prefix(self, engine, prefix_ids: torch.Tensor) -> RazorCache:
        """Prefill ``prefix_ids`` at positions 0..n-1 with full KV, then compress (Algorithm 1)."""
        self._ensure_profile(engine.lm, engine)
        kv = engine.prefix_kv(prefix_ids)
        return self.compress_kv(kv, engine.lm.n_heads)

    def compress_kv(self, kv, n_heads: int) -> RazorCache:
        n = kv.get_seq_length(0)
        return RazorCache.compress(kv, self.protected, n_heads, self.sinks, self.window_for(n), self.compensate)
