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
  without ``output_attentions``, so the fast kernels stay usable.

Shapes at this boundary (after RoPE, after the cache update):
    query: (batch, n_heads, q_len, head_dim)
    key, value: (batch, n_kv_heads, kv_len, head_dim)      — GQA is never expanded in the cache
    returns: (batch, q_len, n_heads, head_dim)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

KERNELS = ("sdpa", "eager", "flash")

# observer(query, key) is called with the tensors documented above, before attention is computed.
Observer = Callable[[torch.Tensor, torch.Tensor], None]


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
    "kvcli_attention", default=AttentionContext()
)


@contextlib.contextmanager
def attention_context(ctx: AttentionContext):
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def causal_mask(q_len: int, kv_len: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """Boolean (q_len, kv_len) mask, True where attending is allowed; None when plain causal SDPA fits.

    Query i sits at key index ``kv_len - q_len + i``; it sees every key up to and including itself,
    and with a sliding window only the last ``sliding_window`` of them.
    """
    if sliding_window is None or sliding_window >= kv_len:
        if q_len == 1 or q_len == kv_len:
            return None  # q_len == 1 sees everything; square means the standard causal triangle
    offset = kv_len - q_len
    rows = torch.arange(q_len, device=device)[:, None] + offset
    cols = torch.arange(kv_len, device=device)[None, :]
    allowed = cols <= rows
    if sliding_window is not None:
        allowed &= cols > rows - sliding_window
    return allowed


def last_query_scores(query: torch.Tensor, key: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """Scores of the last query row against every key, summed over all query heads.

    query: (batch, n_heads, q_len, head_dim); key: (batch, n_kv_heads, kv_len, head_dim).
    Returns (batch, kv_len): sum over heads j of q_n^(j) · K^(j)ᵀ (scaled by ``scaling`` when given),
    with each query head reading the KV head of its GQA group — the cache is never expanded.
    """
    b, n_heads, _, d = query.shape
    n_kv = key.shape[1]
    q_last = query[:, :, -1, :].reshape(b, n_kv, n_heads // n_kv, d).to(torch.float32)
    # (b, n_kv, group, d) x (b, n_kv, d, kv_len) -> (b, n_kv, group, kv_len)
    scores = torch.matmul(q_last, key.to(torch.float32).transpose(-1, -2))
    scores = scores.sum(dim=(1, 2))
    return scores * scaling if scaling is not None else scores


def _sdpa(query, key, value, mask, scaling):
    q_len = query.shape[2]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=mask is None and q_len > 1,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous()


def _eager(query, key, value, mask, scaling):
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    q_len, kv_len = query.shape[2], key.shape[2]
    if mask is None and q_len > 1:
        mask = causal_mask(q_len, kv_len, None, query.device)
        if mask is None:
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
    if mask is not None:
        weights = weights.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def _flash(module, query, key, value, scaling, sliding_window):
    from transformers.integrations.flash_attention import flash_attention_forward

    out, _ = flash_attention_forward(
        module, query, key, value, None, scaling=scaling, sliding_window=sliding_window, is_causal=True
    )
    return out


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
    for fn in ctx.observers.get(module.layer_idx, ()):
        fn(query, key)
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    # --- caches that own attention (RazorAttention's grouped heads, block-sparse retrieval) -------
    # The cache's update returned a per-layer view (``kvcli_grouped``) instead of key/value tensors;
    # it attends itself — per head group, or over the blocks it selects — and returns
    # (batch, q_len, n_heads, head_dim). Observers above receive that view as ``key``.
    if getattr(key, "kvcli_grouped", False):
        return key.attend(module, query, scaling, sliding_window, ctx.kernel), None
    # ---------------------------------------------------------------------------------------------
    if ctx.mask is not None:
        mask = ctx.mask.to(query.device)
        if ctx.kernel == "eager":
            return _eager(query, key, value, mask, scaling), None
        return _sdpa(query, key, value, mask, scaling), None
    if ctx.kernel == "flash":
        return _flash(module, query, key, value, scaling, sliding_window), None
    mask = causal_mask(query.shape[2], key.shape[2], sliding_window, query.device)
    if ctx.kernel == "eager":
        return _eager(query, key, value, mask, scaling), None
    return _sdpa(query, key, value, mask, scaling), None


def install(model) -> None:
    """Make ``model`` run :func:`kvcli_attention` in every attention layer."""
    from transformers import AttentionInterface

    AttentionInterface.register("kvcli", kvcli_attention)
    model.config._attn_implementation = "kvcli"
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = "kvcli"
