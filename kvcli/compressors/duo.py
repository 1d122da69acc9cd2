"""DuoAttention: retrieval heads keep the whole KV cache, streaming heads only sinks + recent
tokens (Xiao et al., 2024, arXiv:2410.10819).

"DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads": only a
fraction of the attention heads (*retrieval heads*) need every token; the others (*streaming
heads*) attend to a few attention sinks and the recent tokens. The paper finds the split by
optimising one gate per KV head on synthetic passkey data and ships the learned patterns for six
models (sink 128, recent 256). kvcli has no trained pattern for the model at hand, so it estimates
one as NVIDIA kvpress's ``duo_attention_on_the_fly`` does: per layer and head, the mean pre-RoPE
query and key over a calibration text; the mean query at the last of ``length`` positions attends
to the mean key placed at every position (RoPE applied), and the head's score is the area under
the cumulative attention curve — high when the attention reaches far back (retrieval), low when it
stays local (streaming). The ``streaming`` fraction of KV heads with the lowest scores (over the
whole model; mean over each GQA group) become streaming heads.

The profile is a property of the model, computed once and stored per model next to
RazorAttention's head profiles (``<cache dir>/heads/``, atomic safetensors writes, see
:mod:`kvcli.compressors.razor_heads` and :func:`kvcli.files.save_safetensors_atomic`). Calibration text: kvcli's
bundled passkey filler (:mod:`kvcli.texts`; kvpress samples BookSum, which kvcli does not
download), ``tokens`` of it.

After the prefill of the document (question-agnostic), retrieval KV heads keep every entry and
streaming heads the first ``sinks`` and the last ``recent`` entries: RazorAttention's grouped cache
(:class:`kvcli.caches.razor.RazorCache`, no compensation token) holds the two groups in separate tensors,
so the memory saving is real. The compressed cache is the prefix state in the disk store and
serves every later question. Kept tokens keep their original positions; GQA: the split is per KV
head, never expanded. The streaming window does not roll during decoding (new tokens stay), which
only matters for long answers. ``streaming=0`` (or a prefix within sinks + recent) keeps
everything (= full attention).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from .. import notices
from ..caches import RazorCache
from ..errors import UsageError
from ..runtime.attention import StopForward
from ..texts import filler_text
from .base import Compressor, knob, require_full_layers
from .scoring import prerope

FORMAT = 1
_META_KEY = "kvcli_duo"


def calibration_ids(lm, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of the bundled filler text (no special tokens)."""
    ids = lm.tokenizer(filler_text(), add_special_tokens=False)["input_ids"][:tokens]
    return torch.tensor(ids, dtype=torch.long)


def head_scores(mean_q: torch.Tensor, mean_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One layer's scores (n_kv,): mean pre-RoPE query (n_heads, d) at the last of L positions
    against the mean pre-RoPE key (n_kv, d) at every position ((cos, sin): (L, rot)); per query
    head the mean over positions of the cumulative softmax, then the mean over the GQA group."""
    from ..runtime.rope import apply_rotation

    n_heads, d = mean_q.shape
    n_kv = mean_k.shape[0]
    q = apply_rotation(mean_q, cos[-1:], sin[-1:]).view(n_kv, n_heads // n_kv, d)  # at position L-1
    k = apply_rotation(mean_k[:, None, :].expand(-1, cos.shape[0], -1), cos, sin)  # (n_kv, L, d)
    attn = torch.softmax(torch.einsum("kgd,kld->kgl", q, k) / math.sqrt(d), dim=-1)
    return attn.cumsum(dim=-1).mean(dim=-1).mean(dim=1)


def compute_scores(engine, tokens: int, length: int) -> torch.Tensor:
    """(n_layers, n_kv_heads) DuoAttention head scores of the engine's model (see the module doc)."""
    from ..runtime.rope import rope_cos_sin

    lm = engine.lm
    ids = calibration_ids(lm, tokens)
    n = ids.numel()
    like = torch.empty(0, device=engine.device)
    # each layer's own RoPE (Gemma 3: local / global bases), one table per group of layers
    tables = {}
    for first, layers in engine.rope_groups().items():
        rotary = engine.rotary(first)
        t = (*rope_cos_sin(rotary, torch.arange(n), like), *rope_cos_sin(rotary, torch.arange(length), like))
        tables.update({layer: t for layer in layers})
    scores = torch.zeros(lm.n_layers, lm.n_kv_heads)

    def observe(layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        cos, sin, l_cos, l_sin = tables[layer]
        mean_q = prerope(query[0], cos, sin).mean(dim=1)  # (n_heads, d)
        mean_k = prerope(key[0], cos, sin).mean(dim=1)  # (n_kv, d)
        scores[layer] = head_scores(mean_q, mean_k, l_cos, l_sin).cpu()
        if layer == lm.n_layers - 1:
            raise StopForward

    observers = {l: [lambda q, k, l=l: observe(l, q, k)] for l in range(lm.n_layers)}
    engine.forward(ids, torch.arange(n), None, observers=observers)
    return scores


@dataclass
class DuoProfile:
    """DuoAttention head scores of one model: (n_layers, n_kv_heads) float32 (higher: retrieval)."""

    fingerprint: str
    tokens: int
    length: int
    scores: torch.Tensor
    path: Path | None = None
    loaded: bool = False

    def identity(self) -> dict:
        digest = hashlib.sha256(self.scores.contiguous().numpy().tobytes()).hexdigest()[:16]
        return {"tokens": self.tokens, "length": self.length, "scores": digest}

    def streaming_heads(self, fraction: float, full_layers: list[int] | None = None) -> torch.Tensor:
        """(n_layers, n_kv) bool: the ``round(fraction × heads)`` lowest scores (stable ties).
        ``full_layers``: on a hybrid model (Gemma 2 / 3), the heads are chosen among those layers'
        only; a sliding layer's heads are never streaming heads (they keep their KV under their
        own window, as full attention does)."""
        rows = list(range(self.scores.shape[0])) if full_layers is None else list(full_layers)
        flat = self.scores[rows].flatten()
        count = round(fraction * flat.numel())
        mask = torch.zeros(flat.numel(), dtype=torch.bool)
        mask[torch.argsort(flat, stable=True)[:count]] = True
        out = torch.zeros(self.scores.shape, dtype=torch.bool)
        out[rows] = mask.view(len(rows), -1)
        return out

    def save(self, path: Path) -> None:
        from ..files import save_safetensors_atomic

        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "tokens": self.tokens,
            "length": self.length,
            "paper": "Xiao et al. 2024, DuoAttention, arXiv:2410.10819 (kvpress's on-the-fly estimate)",
        }
        save_safetensors_atomic(
            Path(path), {"scores": self.scores.contiguous()}, {_META_KEY: json.dumps(meta, sort_keys=True)}
        )
        self.path = Path(path)

    @classmethod
    def load(cls, path: Path, lm) -> DuoProfile:
        """ValueError when the file is damaged or belongs to another model."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get(_META_KEY, "null"))
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  (safe_open is not iterable)
        except Exception as e:  # safetensors raises its own errors for truncated files
            raise ValueError(f"unreadable DuoAttention profile: {e}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or set(tensors) != {"scores"}:
            raise ValueError("not a kvcli DuoAttention profile of this version")
        scores = tensors["scores"]
        if meta.get("fingerprint") != lm.fingerprint or tuple(scores.shape) != (lm.n_layers, lm.n_kv_heads):
            raise ValueError("DuoAttention profile belongs to another model")
        if scores.dtype != torch.float32 or not torch.isfinite(scores).all():
            raise ValueError("DuoAttention profile scores are damaged")
        return cls(lm.fingerprint, int(meta["tokens"]), int(meta["length"]), scores, Path(path), loaded=True)


def load_or_compute(engine, tokens: int, length: int, cache_dir: Path | None = None) -> DuoProfile:
    """The model's profile from ``<cache_dir>/heads/`` (kvcli.compressors.razor_heads' folder and naming), else
    computed and stored there; a damaged file is a warning and is recomputed."""
    from ..files import cache_folder
    from .razor_heads import profile_path

    lm = engine.lm
    cache_dir = cache_folder(cache_dir)
    # kvcli.compressors.razor_heads names profiles <fingerprint>-K<tokens>-s<seed>; "-duo-L<length>" keeps these apart
    path = profile_path(cache_dir, f"{lm.fingerprint}-duo-L{length}", tokens, 0)
    if path.is_file():
        try:
            return DuoProfile.load(path, lm)
        except (ValueError, KeyError, TypeError, OSError) as e:
            notices.warn(f"DuoAttention profile {path} is damaged ({e}); recomputing it")
    profile = DuoProfile(lm.fingerprint, tokens, length, compute_scores(engine, tokens, length))
    try:
        profile.save(path)
    except OSError as e:
        notices.warn(
            f"cannot store the DuoAttention profile in {path.parent} ({e.strerror or e}); it will be recomputed next time"
        )
    return profile


@dataclass
class DuoAttention(Compressor):
    """DuoAttention (Xiao et al., 2024): retrieval KV heads keep the whole cache, streaming heads
    the first sinks and the last recent tokens; heads estimated once per model (kvpress's
    on-the-fly scores). Question-agnostic: the compressed cache serves every later question.
    arXiv:2410.10819."""

    name: ClassVar[str] = "duo"
    paper: ClassVar[str] = (
        "Xiao et al. 2024, DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads, arXiv:2410.10819"
    )
    # no streaming heads: every KV head is a retrieval head and keeps the whole prefix — sinks=0 and
    # recent=0: it is the head split that keeps everything, not sinks + recent covering the prompt
    keep_all: ClassVar[str] = "streaming=0,sinks=0,recent=0"
    short_document_spec: ClassVar[str] = "duo:streaming=0.5,sinks=4,recent=16"
    title: ClassVar[str] = "DuoAttention"
    acts: ClassVar[str] = (
        "compresses the document prefix once: retrieval KV heads keep everything, the `streaming` share of KV heads "
        "with the lowest on-the-fly scores (kvpress's estimate from mean q/k, once per model, stored under `heads/`) "
        "keep sinks + recent (RazorAttention's grouped cache, no compensation)"
    )
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "the compressed prefix — any question"

    streaming: float = knob(0.5, "fraction of the KV heads (whole model) made streaming heads: the lowest scores")
    sinks: int = knob(128, "first tokens a streaming head keeps (the paper's patterns: 128)")
    recent: int = knob(256, "last tokens of the document a streaming head keeps (the paper's patterns: 256)")
    tokens: int | None = knob(None, "calibration tokens of the head estimate; auto = 2048, at most the model's window")
    length: int = knob(500, "positions of the head estimate (kvpress: 500)")

    def __post_init__(self) -> None:
        if not 0.0 <= self.streaming <= 1.0:
            raise UsageError(f"duo: streaming is a fraction of the KV heads, between 0 and 1, got {self.streaming}")
        for name in ("sinks", "recent"):
            if getattr(self, name) < 0:
                raise UsageError(f"duo: {name} must be at least 0, got {getattr(self, name)}")
        if self.tokens is not None and self.tokens < 2:
            raise UsageError(f"duo: tokens must be at least 2, got {self.tokens}")
        if self.length < 2:
            raise UsageError(f"duo: length must be at least 2, got {self.length}")
        self._profile: DuoProfile | None = None

    def configure(self, lm) -> None:
        from .razor_heads import check_rope_model

        check_rope_model(lm, "duo")
        require_full_layers(lm, "duo")
        if self.tokens is None:
            self.tokens = min(2048, lm.max_context or 2048)
        if lm.max_context and self.length > lm.max_context:
            raise UsageError(f"duo: length={self.length} exceeds the {lm.max_context:,}-token window of {lm.name}")
        self._profile = None

    def profile(self, engine) -> DuoProfile:
        lm = engine.lm
        if self.tokens is None:
            self.configure(lm)
        if self._profile is None or self._profile.fingerprint != lm.fingerprint:
            self._profile = load_or_compute(engine, self.tokens, self.length, self.runtime.cache_dir)
        return self._profile

    def retrieval_heads(self, engine) -> torch.Tensor:
        """(n_layers, n_kv_heads) bool: the KV heads that keep everything."""
        return ~self.profile(engine).streaming_heads(self.streaming, engine.windows.full_layers)

    def prefix_state(self, lm) -> dict:
        from ..runtime.engine import Engine

        engine = Engine(lm)
        retrieval = self.retrieval_heads(engine).to(torch.uint8).numpy().tobytes()
        return {
            "kind": "duo",
            "streaming": self.streaming,
            "sinks": self.sinks,
            "recent": self.recent,
            "profile": self.profile(engine).identity(),
            "retrieval": hashlib.sha256(retrieval).hexdigest()[:16],
        }

    @torch.inference_mode()
    def build_prefix(self, engine, prefix_ids: torch.Tensor) -> RazorCache:
        """Full KV of the prefix, then streaming heads cut to sinks + recent (no compensation)."""
        kv = engine.prefix_kv(prefix_ids)
        return RazorCache.compress(
            kv, self.retrieval_heads(engine), engine.lm.n_heads, self.sinks, self.recent, compensate=False, consume=True
        )
