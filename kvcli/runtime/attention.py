"""The one attention function every kvcli model runs, and the hook point compressors use.

transformers looks attention kernels up by name (``config._attn_implementation``). kvcli registers
its own, ``"kvcli"``, which

* builds the causal (and sliding-window) mask itself from the query and key lengths — new queries
  are always the last ``q_len`` entries of the key sequence, whatever the cache kept before them,
  so the mask is right for compressed caches too;
* calls the kernel the user chose: PyTorch SDPA (default), eager (materialised softmax) or
  flash-attn (CUDA only);
* before attending, hands ``(query, key)`` of a layer to the observers registered in the active
  :class:`AttentionContext`. That is how compressors compute their scores from queries and keys
  without ``output_attentions``, so the fast kernels stay usable;
* lets an :class:`Attending` observer — one that needs the softmax weights of every query anyway
  (H2O) — compute the layer's attention itself from those weights, instead of the kernel, so the
  weights are computed once.

Shapes at this boundary (after RoPE, after the cache update):
    query: (batch, n_heads, q_len, head_dim)
    key, value: (batch, n_kv_heads, kv_len, head_dim)      — GQA is never expanded in the cache
    returns: (batch, q_len, n_heads, head_dim)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .kernels import KERNELS, attend, by_keys, causal_mask  # noqa: F401  (causal_mask: part of this module's API)


class LayerView:
    """What a cache's ``update`` returns, as both key and value, for a layer whose attention the
    cache owns (head groups, padded heads, retrieved blocks). The attention function dispatches on
    this type: it calls :meth:`attend` instead of running a kernel over key/value tensors, and
    observers (scorers) receive the view as ``key``."""

    def __init__(self, cache, layer_idx: int) -> None:
        self.cache = cache
        self.layer_idx = layer_idx

    def attend(
        self, module, query: torch.Tensor, scaling: float, sliding_window: int | None, kernel: str
    ) -> torch.Tensor:
        """query (1, n_heads, q_len, head_dim) -> output (1, q_len, n_heads, head_dim)."""
        raise NotImplementedError

    def read_weights(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What a decoding step's query (1, n_heads, 1, head_dim) attends: (positions (n_kv_heads,
        rows), weights (n_kv_heads, group, rows)), the softmax weights of each query head over the
        rows its KV head reads and the position each row holds (-1: not a prompt token); None
        where the layout does not say (its answers cite nothing, and say why)."""
        return None


# observer(query, key) is called with the tensors documented above, before attention is computed.
Observer = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class Attending:
    """An observer that can also compute the layer's attention: ``attend(query, key, value,
    scaling)`` observes *and* returns the output (batch, q_len, n_heads, head_dim), the causal
    attention of the new queries to every key, from the same softmax weights.

    :func:`kvcli_attention` calls ``attend`` instead of the kernel where the attention is plain
    causal over key and value tensors: no explicit mask (:attr:`AttentionContext.mask`), no
    sliding window shorter than the keys, not a cache that attends itself, batch 1. Elsewhere it
    calls ``observe(query, key)`` and runs the kernel as usual — so the observation must not
    depend on which of the two ran. Of several Attending observers of a layer, the first attends
    and the others observe. Called as a plain observer, it observes."""

    observe: Observer
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

    def __call__(self, query: torch.Tensor, key: torch.Tensor) -> None:
        self.observe(query, key)


class StopForward(Exception):
    """Raised by an observer that has what it needs: the engine ends the forward pass right there
    (the layer's KV is already in the cache; its attention output and MLP are never computed)."""


@dataclass
class AttentionContext:
    """What the attention function should do for the forward pass in progress."""

    kernel: str = "sdpa"
    observers: dict[int, list[Observer]] = field(default_factory=dict)
    # An explicit boolean (q_len, kv_len) mask, True where attending is allowed, for passes whose
    # queries are not the last q_len entries of the key sequence (LazyLLM computes revived tokens
    # late); None: the causal mask of :func:`causal_mask`. Applies to every layer of the pass.
    mask: torch.Tensor | None = None

    def observe(self, layer_idx: int, fn: Observer) -> None:
        self.observers.setdefault(layer_idx, []).append(fn)


_CONTEXT: contextvars.ContextVar[AttentionContext] = contextvars.ContextVar(
    "kvcli_attention",
    default=AttentionContext(),  # noqa: B039  (never mutated: a pass sets its own context)
)
# observers that see every pass run inside :func:`listening`, whatever context each pass sets
# (the answer's citations: every decoding step, the engine's or a method's own)
_LISTENING: contextvars.ContextVar[dict[int, list[Observer]]] = contextvars.ContextVar(
    "kvcli_listening",
    default={},  # noqa: B039  (never mutated: listening() sets its own dict)
)


@contextlib.contextmanager
def attention_context(ctx: AttentionContext):
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def listening(observers: dict[int, list[Observer]]):
    """Inside: ``observers`` (per layer, plain observers) see every pass's queries and keys, besides
    the observers of the pass's own :class:`AttentionContext`."""
    token = _LISTENING.set(observers)
    try:
        yield
    finally:
        _LISTENING.reset(token)


def listeners() -> dict[int, list[Observer]]:
    """The observers :func:`listening` set for every pass now (per layer; none outside it)."""
    return _LISTENING.get()


# whether the pass now running is decoding's check of a draft (kvcli.runtime.lookup): its queries
# are answer tokens, one decoding step each, not a prompt's or a method's recomputed tokens
_DRAFT: contextvars.ContextVar[bool] = contextvars.ContextVar("kvcli_draft_pass", default=False)


@contextlib.contextmanager
def draft_pass():
    """Inside: the pass checks a draft (:func:`in_draft_pass`)."""
    token = _DRAFT.set(True)
    try:
        yield
    finally:
        _DRAFT.reset(token)


def in_draft_pass() -> bool:
    """Whether the pass now running checks a draft: each of its queries is one decoding step's."""
    return _DRAFT.get()


def last_query_scores(query: torch.Tensor, key: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """Scores of the last query row against every key, summed over all query heads.

    query: (batch, n_heads, q_len, head_dim); key: (batch, n_kv_heads, kv_len, head_dim).
    Returns (batch, kv_len): sum over heads j of q_n^(j) · K^(j)ᵀ (scaled by ``scaling`` when given),
    with each query head reading the KV head of its GQA group — the cache is never expanded.
    """
    b, n_heads, _, d = query.shape
    n_kv = key.shape[1]
    q_last = query[:, :, -1, :].reshape(b, n_kv, n_heads // n_kv, d).to(torch.float32)
    # (b, n_kv, group, d) x (b, n_kv, d, kv_len) -> (b, n_kv, group, kv_len); keys upcast a chunk at a time
    scores = by_keys(key, lambda k: torch.matmul(q_last, k.transpose(-1, -2)))
    scores = scores.sum(dim=(1, 2))
    return scores * scaling if scaling is not None else scores


def kvcli_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    ctx = _CONTEXT.get()
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    out = None
    for fn in ctx.observers.get(module.layer_idx, ()):
        if (
            out is None
            and isinstance(fn, Attending)
            and _plain_causal(ctx, query, key, sliding_window)
            and getattr(module, "kvcli_softcap", None) is None
        ):
            out = fn.attend(query, key, value, scaling)
        else:
            fn(query, key)
    for fn in _LISTENING.get().get(module.layer_idx, ()):
        fn(query, key)
    if out is not None:
        return out, None
    # --- caches that own attention (RazorAttention's grouped heads, ragged heads, block retrieval) ---
    # The cache's update returned a per-layer view instead of key/value tensors; it attends itself
    # and returns (batch, q_len, n_heads, head_dim). Observers above receive that view as ``key``.
    if isinstance(key, LayerView):
        return key.attend(module, query, scaling, sliding_window, ctx.kernel), None
    return attend(
        ctx.kernel,
        module,
        query,
        key,
        value,
        scaling,
        sliding_window,
        mask=None if ctx.mask is None else ctx.mask.to(query.device),
    ), None


def _plain_causal(ctx: AttentionContext, query: torch.Tensor, key, sliding_window: int | None) -> bool:
    """Whether the layer's attention is the causal attention of the new queries to every key of
    a plain tensor (what an :class:`Attending` observer computes)."""
    return (
        isinstance(key, torch.Tensor)
        and ctx.mask is None
        and query.shape[0] == 1
        and (sliding_window is None or sliding_window >= key.shape[-2])
    )


def install(model) -> None:
    """Make ``model`` run :func:`kvcli_attention` in every attention layer."""
    from transformers import AttentionInterface

    AttentionInterface.register("kvcli", kvcli_attention)
    model.config._attn_implementation = "kvcli"
    # Gemma 2 soft-caps its attention scores (``softcap`` in the call, from the config): the kernels
    # read it off the module, so caches that attend themselves apply it too
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    softcap = (
        getattr(text, "attn_logit_softcapping", None)
        if str(getattr(text, "model_type", "")).startswith("gemma2")
        else None
    )
    for sub in model.modules():
        if hasattr(sub, "layer_idx") and hasattr(sub, "scaling"):  # an attention module
            sub.kvcli_softcap = softcap
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = "kvcli"
