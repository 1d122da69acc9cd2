"""The grouped cache of RazorAttention (:mod:`kvcli.compressors.razor`; Tang et al. 2024,
arXiv:2407.15891), also DuoAttention's (:mod:`kvcli.compressors.duo`, no compensation token).

Each layer's KV heads are split into two groups stored in separate tensors — never a mask over a
full cache — and :func:`kvcli.runtime.attention.kvcli_attention` hands a layer's attention to
:meth:`RazorLayer.attend` (a :class:`~kvcli.runtime.attention.LayerView`), which attends per group and
puts the head outputs back in head order.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from ..runtime import kernels
from ..runtime.attention import LayerView
from .base import CacheBase, append_rows, cache_type

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .kv import KVCache


class RazorLayer(LayerView):
    """What :meth:`RazorCache.update` returns (as both key and value) for one layer.

    Attention per group, GQA kept (query head h reads KV head h // group; the cache is never
    expanded):

    * protected ("retrieval") KV heads: every token, plain causal attention;
    * the other KV heads: ``[compensation token?, sinks, recent window, new tokens]``; the
      compensation token (mean key and mean value of the N_d dropped tokens, after RoPE) enters the
      softmax with weight N_d — a ``log(N_d)`` additive bias on its logit — which is equation 5 of
      the paper: ``(N_d e^{q k̂} v̂ + Σ_kept e^{q k_n} v_n) / (N_d e^{q k̂} + Σ_kept e^{q k_n})``.
    """

    cache: RazorCache

    def attend(
        self, module, query: torch.Tensor, scaling: float, sliding_window: int | None, kernel: str
    ) -> torch.Tensor:
        """query (1, n_heads, q_len, head_dim) -> output (1, q_len, n_heads, head_dim)."""
        cache, layer = self.cache, self.layer_idx
        n_heads, q_len = query.shape[1], query.shape[2]
        q_prot, q_comp = cache.query_heads(layer, n_heads, query.device)
        out = query.new_empty(query.shape[0], q_len, n_heads, query.shape[-1])
        if q_prot.numel():
            q = query.index_select(1, q_prot)
            k, v = cache.pk[layer], cache.pv[layer]
            o = kernels.attend(kernel, module, q, k, v, scaling, sliding_window)
            out.index_copy_(2, q_prot, o)
        if q_comp.numel():
            q = query.index_select(1, q_comp)
            k, v = cache.ck[layer], cache.cv[layer]
            bias = cache.compressed_bias(q_len, k.shape[2], query.dtype, query.device)
            out.index_copy_(2, q_comp, compensated_attention(q, k, v, bias, scaling, eager=kernel == "eager"))
        return out

    def read_weights(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoding step's weights per KV head over its group's rows (:meth:`LayerView.read_weights`):
        retrieval heads over every token; the others over [the compensation token (no position,
        its logit + log N_d), the sinks, the window, the tokens appended since]. The two groups'
        rows padded to one length (position -1, weight 0)."""
        cache, layer = self.cache, self.layer_idx
        d, n_kv = query.shape[-1], cache.protected.shape[1]
        g = query.shape[1] // n_kv
        q = query[0, :, -1].reshape(n_kv, g, d).to(torch.float32)
        seen, n = cache.positions, cache.n_compressed
        prot = cache.protected[layer]
        compensation = torch.full((int(cache.compensated),), -1)
        # then the sinks, the window and the tokens appended since (question, answer)
        compressed = torch.cat([compensation, seen[: cache.sinks], seen[n - cache.window : n], seen[n:]])
        groups = []
        for heads, keys, pos, bias in (
            (torch.nonzero(prot).flatten(), cache.pk[layer], seen[getattr(cache, "dropped", {}).get(layer, 0) :], 0.0),
            (
                torch.nonzero(~prot).flatten(),
                cache.ck[layer],
                compressed,
                math.log(cache.n_dropped) if cache.compensated else 0.0,
            ),
        ):
            if heads.numel():
                logits = torch.matmul(q[heads.to(q.device)], keys[0].to(torch.float32).transpose(-1, -2)) / math.sqrt(d)
                logits[..., 0] += bias  # the compensation token's weight N_d (0 elsewhere)
                groups.append((heads, pos, torch.softmax(logits, dim=-1)[..., : pos.numel()]))
        rows = max(pos.numel() for _, pos, _ in groups)
        positions = torch.full((n_kv, rows), -1, dtype=torch.long)
        weights = torch.zeros(n_kv, g, rows, device=q.device)  # where the step ran: no read back per step
        for heads, pos, w in groups:
            positions[heads, : pos.numel()] = pos
            weights[heads.to(q.device), :, : pos.numel()] = w
        return positions, weights


def compensated_attention(query, key, value, bias: torch.Tensor, scaling: float, eager: bool = False) -> torch.Tensor:
    """Attention with an additive float ``bias`` (q_len, kv_len) on the logits (-inf: masked).

    query (1, h, q, d), key/value (1, h_kv, kv, d) with h a multiple of h_kv -> (1, q, h, d).
    """
    if eager:
        groups = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        logits = torch.matmul(query, k.transpose(2, 3)).to(torch.float32) * scaling + bias.to(torch.float32)
        weights = torch.softmax(logits, dim=-1).to(query.dtype)
        return torch.matmul(weights, v).transpose(1, 2).contiguous()
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous()


@cache_type
class RazorCache(CacheBase):
    """RazorAttention's compressed cache: per layer, two groups of KV heads in separate tensors.

        pk[l], pv[l]: (1, n_protected_l, seq, head_dim)     — every token seen (retrieval heads)
        ck[l], cv[l]: (1, n_kv_heads - n_protected_l, kept + new, head_dim)
                      kept = [compensation token if any, the first ``sinks`` tokens, the last
                      ``window`` tokens of the compressed prefix]; ``update`` appends new tokens

    ``protected`` (n_layers, n_kv_heads) bool says which KV head is in which group (each group in
    head order). ``n_dropped`` tokens of the compressed sequence were merged into the compensation
    token (the same tokens in every compressed head: N, the sinks and the window do not depend on
    the head). ``positions`` are the original positions of every token seen, as for
    :class:`KVCache`. ``order`` says what was compressed (:mod:`kvcli.compressors.razor`):
    ``"paper"`` the whole prompt after its full-attention prefill, ``"prefix"`` the document
    prefix before the question ran on it; in both, the first ``sinks + n_dropped + window``
    positions are the compressed sequence and everything after it was appended whole.
    """

    kind: ClassVar[str] = "razor"
    cuts_windows: ClassVar[bool] = True  # a layer whose every KV head is protected (drop_front)
    tensor_lists: ClassVar[tuple[str, ...]] = ("pk", "pv", "ck", "cv")

    def __init__(
        self,
        protected: torch.Tensor,
        n_heads: int,
        n_dropped: int = 0,
        compensated: bool = False,
        sinks: int = 0,
        window: int = 0,
    ) -> None:
        self.protected = protected.detach().to("cpu", torch.bool)
        self.n_heads = int(n_heads)
        self.n_dropped = int(n_dropped)
        self.compensated = bool(compensated)  # ck[l][:, :, 0] is the compensation token
        self.sinks = int(sinks)
        self.window = int(window)
        self.order = "prefix"  # "paper": compressed after the whole prompt; "prefix": before the question
        self.pk: list[torch.Tensor] = []
        self.pv: list[torch.Tensor] = []
        self.ck: list[torch.Tensor] = []
        self.cv: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None
        self._index: dict = {}

    # --- building it ------------------------------------------------------------------------------
    @classmethod
    def compress(
        cls,
        kv: KVCache,
        protected: torch.Tensor,
        n_heads: int,
        sinks: int,
        window: int,
        compensate: bool = True,
        consume: bool = False,
    ) -> RazorCache:
        """Algorithm 1 of the paper on a full cache ``kv`` of N tokens (every layer): protected KV
        heads keep everything; the others keep the first ``sinks`` and the last ``window`` tokens,
        and (``compensate``) one token whose key and value are the means of the dropped ones.
        ``consume``: the caller drops ``kv`` afterwards: each layer is released from it as soon as
        it is split (``kv`` is unusable after)."""
        n = kv.n_tokens
        if protected.shape != (kv.n_layers, kv.keys[0].shape[1]):
            raise ValueError(f"protected mask {tuple(protected.shape)} does not match the cache")
        # a hybrid's sliding layer cut back to its window (a prefix state: prefill.prefix_kv) holds
        # its last entries; every head of it is protected, so it keeps them as they are
        dropped = {layer: d for layer, d in kv.dropped.items() if d}
        if any(not bool(protected[layer].all()) for layer in dropped):
            raise ValueError("a layer cut back to its window must have every KV head protected")
        sinks = min(max(sinks, 0), n)
        window = min(max(window, 0), n - sinks)
        n_dropped = n - sinks - window
        cache = cls(protected, n_heads, n_dropped, compensate and n_dropped > 0, sinks, window)
        cache.positions = kv.positions
        cache.dropped = dropped
        for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
            if k.shape[2] != n - dropped.get(layer, 0):
                raise ValueError("every layer of the cache must hold the same tokens")
            p_idx, c_idx = cache.kv_heads(layer, k.device)
            cache.query_heads(layer, n_heads, k.device)  # uploaded now: decoding makes no host -> device copy
            cache.pk.append(k.index_select(1, p_idx))
            cache.pv.append(v.index_select(1, p_idx))
            ck, cv = k.index_select(1, c_idx), v.index_select(1, c_idx)
            parts_k = [ck[:, :, :sinks], ck[:, :, n - window :]]
            parts_v = [cv[:, :, :sinks], cv[:, :, n - window :]]
            if cache.compensated:  # equation 4: means of the dropped keys and values (after RoPE)
                parts_k.insert(0, ck[:, :, sinks : n - window].to(torch.float32).mean(dim=2, keepdim=True).to(ck.dtype))
                parts_v.insert(0, cv[:, :, sinks : n - window].to(torch.float32).mean(dim=2, keepdim=True).to(cv.dtype))
            cache.ck.append(torch.cat(parts_k, dim=2).contiguous())
            cache.cv.append(torch.cat(parts_v, dim=2).contiguous())
            if consume:
                del k, v, ck, cv, parts_k, parts_v
                kv.keys[layer] = kv.values[layer] = None
        return cache

    def kv_heads(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(protected, compressed) KV head indices of ``layer``, each in head order."""
        key = ("kv", layer, str(device))
        if key not in self._index:
            mask = self.protected[layer]
            self._index[key] = (
                torch.nonzero(mask).flatten().to(device),
                torch.nonzero(~mask).flatten().to(device),
            )
        return self._index[key]

    def query_heads(self, layer: int, n_heads: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(protected, compressed) query head indices of ``layer``: the query heads of each KV head."""
        key = ("q", layer, n_heads, str(device))
        if key not in self._index:
            group = n_heads // self.protected.shape[1]
            mask = self.protected[layer].repeat_interleave(group)
            self._index[key] = (
                torch.nonzero(mask).flatten().to(device),
                torch.nonzero(~mask).flatten().to(device),
            )
        return self._index[key]

    def compressed_bias(self, q_len: int, kv_len: int, dtype, device) -> torch.Tensor:
        """Additive (q_len, kv_len) logit bias of the compressed group: causal -inf for the new
        tokens, ``log(N_d)`` on the compensation token (column 0), 0 elsewhere."""

        allowed = kernels.causal_mask(q_len, kv_len, None, device)
        bias = torch.zeros(q_len, kv_len, dtype=dtype, device=device)
        if allowed is not None:
            bias.masked_fill_(~allowed, float("-inf"))
        elif q_len > 1:  # square: plain causal triangle
            bias.masked_fill_(~torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(), float("-inf"))
        if self.compensated:
            bias[:, 0] += math.log(self.n_dropped)
        return bias

    # --- the transformers contract -----------------------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append new tokens (1, n_kv_heads, new, head_dim) to both groups of ``layer_idx``."""
        if not 0 <= layer_idx < len(self.pk):
            raise IndexError(f"layer {layer_idx} is not in this cache ({len(self.pk)} layers)")
        p_idx, c_idx = self.kv_heads(layer_idx, key.device)
        # in place, as LayerKV: a decoding step copies its own row, not the layer's groups
        append_rows(self, ("pk", "pv"), layer_idx, (key.index_select(1, p_idx), value.index_select(1, p_idx)))
        append_rows(self, ("ck", "cv"), layer_idx, (key.index_select(1, c_idx), value.index_select(1, c_idx)))
        view = RazorLayer(self, layer_idx)
        return view, view

    def drop_front(self, layer: int, n: int) -> None:
        """Drop the ``n`` oldest entries of ``layer`` where every KV head is protected: a hybrid's
        sliding layer (Gemma 2 / 3) whose window has passed them (:meth:`CacheBase.trim_windows`).
        A layer with compressed heads keeps its entries (its sinks and window are the method's).
        Only the pipeline's run trims; the prefix state the store keeps is never trimmed."""
        if self.ck[layer].shape[1] or n <= 0:
            return
        self.pk[layer] = self.pk[layer][:, :, n:]
        self.pv[layer] = self.pv[layer][:, :, n:]
        self.dropped = {**self.dropped, layer: self.dropped.get(layer, 0) + n}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by ``layer_idx`` (what the protected heads hold)."""
        return self.pk[layer_idx].shape[-2] if layer_idx < len(self.pk) else 0

    # --- kvcli's own use ---------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.pk)

    @property
    def n_compressed(self) -> int:
        """Tokens the compression saw (N): the whole prompt (order=paper) or the prefix (prefix)."""
        return self.sinks + self.n_dropped + self.window

    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        """(n_layers, n_kv_heads, n_prompt) bool (:meth:`CacheBase.kept_mask`): the prompt entries
        each layer / KV head holds in its KV. Retrieval heads hold every token; the others the
        sinks, the window and every token appended after compression (order=prefix: the
        question; both orders: decoded tokens, which are no prompt entries). The compensation
        token is a mean of dropped entries, not an entry: the dropped tokens are False."""
        n_kv = self.protected.shape[1]
        n = self.n_compressed
        seen = self.positions  # also the tokens appended after compression (question, answer)
        kept = torch.cat([seen[: self.sinks], seen[n - self.window :]])
        mask = torch.zeros(self.n_layers, n_kv, n_prompt, dtype=torch.bool)
        dropped = self.dropped
        for layer in range(self.n_layers):
            for head in range(n_kv):
                pos = seen[dropped.get(layer, 0) :] if self.protected[layer, head] else kept
                mask[layer, head, pos[pos < n_prompt]] = True
        return mask

    def stats(self) -> dict:
        """JSON-able counters (``--json`` method_stats): when and what was compressed, the head
        groups, and the KV bytes before (a full cache of the same tokens) and after."""
        kv = self.kv_bytes()
        return {
            "order": self.order,
            "compressed_tokens": self.n_compressed,
            "sinks": self.sinks,
            "window": self.window,
            "dropped_tokens": self.n_dropped,
            "compensation_token": self.compensated,
            "protected_kv_heads": int(self.protected.sum()),
            "kv_heads": int(self.protected.numel()),
            "kv_bytes": kv["after"],
            "kv_bytes_full": kv["before"],
            "kv_compression": kv["ratio"],
        }

    def full_nbytes(self) -> int:
        """Bytes a full :class:`KVCache` of the same tokens would hold (the "before")."""
        total = 0
        for pk, ck in zip(self.pk, self.ck):
            heads = pk.shape[1] + ck.shape[1]
            total += 2 * heads * pk.shape[2] * pk.shape[3] * pk.element_size()
        return total

    def kv_bytes(self) -> dict:
        """KV bytes before (full cache) and after (this cache), and their ratio."""
        before, after = self.full_nbytes(), self.nbytes()
        return {"before": before, "after": after, "ratio": before / after if after else float("inf")}

    def copy(self) -> RazorCache:
        """A shallow copy: new lists, same tensors (``update`` appends in place only into buffers
        the cache itself made: the copy makes its own on its first append)."""
        other = RazorCache(self.protected, self.n_heads, self.n_dropped, self.compensated, self.sinks, self.window)
        other.pk, other.pv, other.ck, other.cv = list(self.pk), list(self.pv), list(self.ck), list(self.cv)
        other.positions = self.positions
        other.order = self.order
        other._index = self._index  # read-only lookups, safe to share
        other.dropped = dict(self.dropped)
        return other

    # --- the disk store's contract -----------------------------------------------------------------
    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``positions``, ``protected`` (uint8), ``pk.<l>``, ``pv.<l>``, ``ck.<l>``, ``cv.<l>`` and facts."""
        if self.dropped:
            raise ValueError("a cache cut back to its sliding windows is a run's, not a prefix state to store")
        tensors = {"positions": self.positions.contiguous(), "protected": self.protected.to(torch.uint8).contiguous()}
        for i in range(self.n_layers):
            for name, t in (("pk", self.pk[i]), ("pv", self.pv[i]), ("ck", self.ck[i]), ("cv", self.cv[i])):
                tensors[f"{name}.{i}"] = t.detach().to("cpu").contiguous()
        facts = {
            "n_layers": self.n_layers,
            "n_tokens": self.n_tokens,
            "n_heads": self.n_heads,
            "n_dropped": self.n_dropped,
            "compensated": self.compensated,
            "sinks": self.sinks,
            "window": self.window,
            "order": self.order,
        }
        return tensors, facts

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], facts: dict, device="cpu") -> RazorCache:
        """Inverse of :meth:`to_tensors`; ValueError when the tensors do not form such a cache."""
        try:
            n_layers, n_tokens = int(facts["n_layers"]), int(facts["n_tokens"])
            n_heads, n_dropped = int(facts["n_heads"]), int(facts["n_dropped"])
            compensated = bool(facts["compensated"])
            sinks, window = int(facts["sinks"]), int(facts["window"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"razor cache facts are incomplete: {e}") from None
        expected = {"positions", "protected", *(f"{t}.{i}" for i in range(n_layers) for t in ("pk", "pv", "ck", "cv"))}
        if set(tensors) != expected:
            raise ValueError("unexpected tensor names")
        protected = tensors["protected"]
        if (
            protected.dim() != 2
            or protected.shape[0] != n_layers
            or protected.dtype != torch.uint8
            or bool((protected > 1).any())
        ):
            raise ValueError("the protected-head mask does not match the layers")
        n_kv = protected.shape[1]
        if n_kv < 1 or n_heads % n_kv or n_dropped < 0 or (compensated and n_dropped == 0):
            raise ValueError("inconsistent head counts or dropped tokens")
        cache = cls(protected.bool(), n_heads, n_dropped, compensated, sinks, window)
        cache.order = str(facts.get("order", "prefix"))
        cache.positions = tensors["positions"].to(torch.long)
        if cache.positions.shape != (n_tokens,):
            raise ValueError("positions do not match the token count")
        kept = n_tokens - n_dropped + int(compensated)
        ref = None
        for i in range(n_layers):
            n_p = int(protected[i].sum())
            shapes = {
                "pk": (1, n_p, n_tokens),
                "pv": (1, n_p, n_tokens),
                "ck": (1, n_kv - n_p, kept),
                "cv": (1, n_kv - n_p, kept),
            }
            for name, want in shapes.items():
                t = tensors[f"{name}.{i}"]
                if t.dim() != 4 or tuple(t.shape[:3]) != want:
                    raise ValueError(f"{name}.{i} has shape {tuple(t.shape)}, expected {want} + (head_dim,)")
                if ref is not None and (t.shape[3], t.dtype) != ref:
                    raise ValueError(f"{name}.{i} differs in head_dim or dtype")
                ref = (t.shape[3], t.dtype)
                getattr(cache, name).append(t.to(device))
            # the head tables go to the device with the tensors: decoding makes no host -> device copy
            cache.kv_heads(i, cache.pk[i].device)
            cache.query_heads(i, n_heads, cache.pk[i].device)
        return cache
