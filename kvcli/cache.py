"""The in-memory KV cache kvcli's engine runs on.

transformers' attention layers only ever call ``past_key_values.update(key, value, layer_idx)``;
this class is that contract with nothing hidden: one key and one value tensor per layer,

    keys[l], values[l]: (batch=1, n_kv_heads, seq_len_l, head_dim)   — after RoPE, never GQA-expanded

plus the original token position of every cached entry (``positions``, shared by all layers) so
that methods which drop entries still know where each kept token came from. Layers are appended
lazily, so a cache may hold only the first ``r`` layers (GemFilter's filter pass).

A cache is also what the disk store (:mod:`kvcli.store`) saves: ``to_tensors()`` gives named
tensors for a safetensors file plus JSON-able facts, ``from_tensors()`` rebuilds and checks it.
Other cache classes (compressed layouts) register under their own ``kind`` in :data:`CACHE_TYPES`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

CACHE_TYPES: dict[str, type] = {}


def cache_type(cls):
    """Register a cache class under its ``kind`` so the store can load it back."""
    CACHE_TYPES[cls.kind] = cls
    return cls


class CacheBase:
    """What every kvcli cache shares: the positions of the tokens it has seen, and byte counts.

    Subclasses hold their tensors in per-layer lists named by :attr:`tensor_lists` and implement the
    transformers ``update``/``get_seq_length`` contract, ``copy`` and ``to_tensors``/``from_tensors``.
    """

    kind: ClassVar[str] = ""
    tensor_lists: ClassVar[tuple[str, ...]] = ()
    positions: torch.Tensor | None

    def seq_len(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def nbytes(self) -> int:
        """Bytes of tensor data actually held."""
        return sum(t.numel() * t.element_size() for name in self.tensor_lists for t in getattr(self, name))

    def record_positions(self, positions: torch.Tensor) -> None:
        """Note the original positions of tokens just appended to every layer."""
        positions = positions.detach().to("cpu", torch.long)
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions])

    @property
    def n_tokens(self) -> int:
        """Number of prompt tokens the cache has seen (its positions)."""
        return 0 if self.positions is None else self.positions.numel()

    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        """What each layer and KV head holds of the prompt: (n_layers, n_kv_heads, n_prompt) bool,
        True where the KV of the token at original position p (0 <= p < n_prompt) is in the cache.

        This is what ``kvcli inspect`` summarises per layer and head. Positions are those the
        tokens had in the sequence the cache was built from (after a selector such as GemFilter,
        indices into its kept tokens). Default: every layer holds every recorded position.
        """
        raise NotImplementedError(f"{type(self).__name__} does not report what it kept")


class LayerKV(CacheBase):
    """Per-layer key and value tensors, appended as the layers run — the transformers contract
    shared by :class:`KVCache` and caches that keep different tokens per layer (LazyLLM):

        keys[l], values[l]: (1, n_kv_heads, seq_len_l, head_dim)
    """

    tensor_lists: ClassVar[tuple[str, ...]] = ("keys", "values")
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append ``key``/``value`` (batch, n_kv_heads, new, head_dim) to layer ``layer_idx`` (a
        new layer only right after the last). Returns that layer's whole key and value tensors."""
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        elif layer_idx < len(self.keys):
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value], dim=-2)
        else:
            raise IndexError(f"layer {layer_idx} updated before layer {len(self.keys)}")
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[-2] if layer_idx < len(self.keys) else 0

    @property
    def n_layers(self) -> int:
        return len(self.keys)


@cache_type
class KVCache(LayerKV):
    kind: ClassVar[str] = "kv"

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # (seq_len,) original positions of the entries of layer 0 (all layers share them unless a
        # compressor keeps different tokens per layer, in which case it tracks its own).
        self.positions: torch.Tensor | None = None
        # --- eviction (kvcli.compressors.scoring: snapkv, h2o, streamingllm, pyramidkv) ----------
        # None until an eviction method drops entries; then, per layer, the (n_kv_heads, kept_l)
        # original positions of the prompt entries each KV head kept (decoded tokens are appended
        # after them). ``positions`` keeps every prompt position seen, so ``positions[-1] + 1`` is
        # still the next position. An evicted cache is never written to the disk store.
        self.kept: list[torch.Tensor] | None = None

    # --- kvcli's own use ------------------------------------------------------------------------
    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        """(n_layers, n_kv_heads, n_prompt) bool; see :meth:`CacheBase.kept_mask`. Sources, in
        order: ``kept`` (eviction, per head), ``kept_positions`` + ``suffix_positions`` (Finch: per
        layer, the document slots, then the question's), ``positions``."""
        n_kv = self.keys[0].shape[1] if self.keys else 0
        mask = torch.zeros(self.n_layers, n_kv, n_prompt, dtype=torch.bool)
        for layer in range(self.n_layers):
            if self.kept is not None:
                pos = self.kept[layer]  # (n_kv, kept_l)
            elif getattr(self, "kept_positions", None) is not None:
                pos = torch.cat([self.kept_positions[layer], self.suffix_positions]).view(1, -1).expand(n_kv, -1)
            else:
                pos = self.positions.view(1, -1).expand(n_kv, -1)
            pos = pos.to("cpu", torch.long)
            inside = pos < n_prompt
            rows = torch.arange(n_kv).view(-1, 1).expand_as(pos)
            mask[layer][rows[inside], pos[inside]] = True
        return mask

    # --- the disk store's contract ---------------------------------------------------------------
    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Named contiguous CPU tensors (``k.<layer>``, ``v.<layer>``, ``positions``) and facts."""
        tensors = {"positions": self.positions.contiguous()}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            tensors[f"k.{i}"] = k.detach().to("cpu").contiguous()
            tensors[f"v.{i}"] = v.detach().to("cpu").contiguous()
        return tensors, {"n_layers": self.n_layers, "n_tokens": self.n_tokens}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], facts: dict, device="cpu") -> "KVCache":
        """Inverse of :meth:`to_tensors`; ValueError when the tensors do not form such a cache."""
        n_layers, n_tokens = int(facts["n_layers"]), int(facts["n_tokens"])
        expected = {"positions", *(f"{t}.{i}" for i in range(n_layers) for t in "kv")}
        if set(tensors) != expected:
            raise ValueError("unexpected tensor names")
        cache = cls()
        cache.positions = tensors["positions"].to(torch.long)
        if cache.positions.shape != (n_tokens,):
            raise ValueError("positions do not match the token count")
        shape = None
        for i in range(n_layers):
            k, v = tensors[f"k.{i}"], tensors[f"v.{i}"]
            if k.dim() != 4 or k.shape[0] != 1 or k.shape[2] != n_tokens or k.shape != v.shape:
                raise ValueError(f"layer {i} has shape {tuple(k.shape)}")
            if shape is not None and (k.shape, k.dtype) != shape:
                raise ValueError(f"layer {i} differs from layer 0")
            shape = (k.shape, k.dtype)
            cache.keys.append(k.to(device))
            cache.values.append(v.to(device))
        return cache

    def truncate(self, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` entries of every layer (and their positions)."""
        self.keys = [k[:, :, :n_tokens] for k in self.keys]
        self.values = [v[:, :, :n_tokens] for v in self.values]
        if self.positions is not None:
            self.positions = self.positions[:n_tokens]

    def copy(self) -> "KVCache":
        """A shallow copy: new lists, same tensors (``update`` never writes in place)."""
        other = KVCache()
        other.keys = list(self.keys)
        other.values = list(self.values)
        other.positions = self.positions
        other.kept = None if self.kept is None else list(self.kept)  # eviction (see __init__)
        return other


# ===================================================================================== RazorAttention
# The grouped cache of RazorAttention (kvcli.compressors.razor; Tang et al. 2024, arXiv:2407.15891).
# Each layer's KV heads are split into two groups stored in separate tensors — never a mask over a
# full cache — and :func:`kvcli.attention.kvcli_attention` hands a layer's attention to
# :meth:`RazorLayer.attend` (the ``kvcli_grouped`` dispatch) which attends per group and puts the
# head outputs back in head order.


class RazorLayer:
    """What :meth:`RazorCache.update` returns (as both key and value) for one layer.

    Attention per group, GQA kept (query head h reads KV head h // group; the cache is never
    expanded):

    * protected ("retrieval") KV heads: every token, plain causal attention;
    * the other KV heads: ``[compensation token?, sinks, recent window, new tokens]``; the
      compensation token (mean key and mean value of the N_d dropped tokens, after RoPE) enters the
      softmax with weight N_d — a ``log(N_d)`` additive bias on its logit — which is equation 5 of
      the paper: ``(N_d e^{q k̂} v̂ + Σ_kept e^{q k_n} v_n) / (N_d e^{q k̂} + Σ_kept e^{q k_n})``.
    """

    kvcli_grouped = True  # the attention dispatch looks for this

    def __init__(self, cache: "RazorCache", layer_idx: int) -> None:
        self.cache = cache
        self.layer_idx = layer_idx

    @property
    def protected_keys(self) -> torch.Tensor:
        return self.cache.pk[self.layer_idx]

    @property
    def protected_values(self) -> torch.Tensor:
        return self.cache.pv[self.layer_idx]

    @property
    def compressed_keys(self) -> torch.Tensor:
        return self.cache.ck[self.layer_idx]

    @property
    def compressed_values(self) -> torch.Tensor:
        return self.cache.cv[self.layer_idx]

    def attend(self, module, query: torch.Tensor, scaling: float, sliding_window: int | None, kernel: str) -> torch.Tensor:
        """query (1, n_heads, q_len, head_dim) -> output (1, q_len, n_heads, head_dim)."""
        from . import attention as A

        cache, layer = self.cache, self.layer_idx
        n_heads, q_len = query.shape[1], query.shape[2]
        q_prot, q_comp = cache.query_heads(layer, n_heads, query.device)
        out = query.new_empty(query.shape[0], q_len, n_heads, query.shape[-1])
        if q_prot.numel():
            q = query.index_select(1, q_prot)
            k, v = cache.pk[layer], cache.pv[layer]
            if kernel == "flash":
                o = A._flash(module, q, k, v, scaling, sliding_window)
            else:
                mask = A.causal_mask(q_len, k.shape[2], sliding_window, query.device)
                o = (A._eager if kernel == "eager" else A._sdpa)(q, k, v, mask, scaling)
            out.index_copy_(2, q_prot, o)
        if q_comp.numel():
            q = query.index_select(1, q_comp)
            k, v = cache.ck[layer], cache.cv[layer]
            bias = cache.compressed_bias(q_len, k.shape[2], query.dtype, query.device)
            out.index_copy_(2, q_comp, compensated_attention(q, k, v, bias, scaling, eager=kernel == "eager"))
        return out


def compensated_attention(query, key, value, bias: torch.Tensor, scaling: float, eager: bool = False) -> torch.Tensor:
    """Attention with an additive float ``bias`` (q_len, kv_len) on the logits (-inf: masked).

    query (1, h, q, d), key/value (1, h_kv, kv, d) with h a multiple of h_kv -> (1, q, h, d).
    """
    import torch.nn.functional as F

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
    tensor_lists: ClassVar[tuple[str, ...]] = ("pk", "pv", "ck", "cv")

    def __init__(self, protected: torch.Tensor, n_heads: int, n_dropped: int = 0, compensated: bool = False,
                 sinks: int = 0, window: int = 0) -> None:
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
    def compress(cls, kv: KVCache, protected: torch.Tensor, n_heads: int, sinks: int, window: int,
                 compensate: bool = True) -> "RazorCache":
        """Algorithm 1 of the paper on a full cache ``kv`` of N tokens (every layer): protected KV
        heads keep everything; the others keep the first ``sinks`` and the last ``window`` tokens,
        and (``compensate``) one token whose key and value are the means of the dropped ones."""
        n = kv.get_seq_length(0)
        if protected.shape != (kv.n_layers, kv.keys[0].shape[1]):
            raise ValueError(f"protected mask {tuple(protected.shape)} does not match the cache")
        sinks = min(max(sinks, 0), n)
        window = min(max(window, 0), n - sinks)
        n_dropped = n - sinks - window
        cache = cls(protected, n_heads, n_dropped, compensate and n_dropped > 0, sinks, window)
        cache.positions = kv.positions
        for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
            if k.shape[2] != n:
                raise ValueError("every layer of the cache must hold the same tokens")
            p_idx, c_idx = cache.kv_heads(layer, k.device)
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
        import math

        from .attention import causal_mask

        allowed = causal_mask(q_len, kv_len, None, device)
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
        self.pk[layer_idx] = torch.cat([self.pk[layer_idx], key.index_select(1, p_idx)], dim=-2)
        self.pv[layer_idx] = torch.cat([self.pv[layer_idx], value.index_select(1, p_idx)], dim=-2)
        self.ck[layer_idx] = torch.cat([self.ck[layer_idx], key.index_select(1, c_idx)], dim=-2)
        self.cv[layer_idx] = torch.cat([self.cv[layer_idx], value.index_select(1, c_idx)], dim=-2)
        view = RazorLayer(self, layer_idx)
        return view, view

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
        for layer in range(self.n_layers):
            for head in range(n_kv):
                pos = seen if self.protected[layer, head] else kept
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

    def copy(self) -> "RazorCache":
        """A shallow copy: new lists, same tensors (``update`` never writes in place)."""
        other = RazorCache(self.protected, self.n_heads, self.n_dropped, self.compensated, self.sinks, self.window)
        other.pk, other.pv, other.ck, other.cv = list(self.pk), list(self.pv), list(self.ck), list(self.cv)
        other.positions = self.positions
        other.order = self.order
        other._index = self._index  # read-only lookups, safe to share
        return other

    # --- the disk store's contract -----------------------------------------------------------------
    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``positions``, ``protected`` (uint8), ``pk.<l>``, ``pv.<l>``, ``ck.<l>``, ``cv.<l>`` and facts."""
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
    def from_tensors(cls, tensors: dict[str, torch.Tensor], facts: dict, device="cpu") -> "RazorCache":
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
        if protected.dim() != 2 or protected.shape[0] != n_layers or protected.dtype != torch.uint8 or bool((protected > 1).any()):
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
            shapes = {"pk": (1, n_p, n_tokens), "pv": (1, n_p, n_tokens), "ck": (1, n_kv - n_p, kept), "cv": (1, n_kv - n_p, kept)}
            for name, want in shapes.items():
                t = tensors[f"{name}.{i}"]
                if t.dim() != 4 or tuple(t.shape[:3]) != want:
                    raise ValueError(f"{name}.{i} has shape {tuple(t.shape)}, expected {want} + (head_dim,)")
                if ref is not None and (t.shape[3], t.dtype) != ref:
                    raise ValueError(f"{name}.{i} differs in head_dim or dtype")
                ref = (t.shape[3], t.dtype)
                getattr(cache, name).append(t.to(device))
        return cache


# ===================================================================================== ragged heads
# KV heads of one layer holding different numbers of entries: head-adaptive budgets (AdaKV, KVzip,
# ExpectedAttention's adaptive mode; kvcli.compressors.adakv / kvzip / expected_attention). Each
# layer is one (1, n_kv_heads, slots, head_dim) tensor as in KVCache; a head holding fewer entries
# than the layer's widest head is padded, and :class:`RaggedLayer` masks the padding out of the
# softmax exactly (a -inf logit, never a small weight).


class RaggedLayer:
    """What :meth:`RaggedCache.update` returns (as both key and value) for a layer with padding.

    Attention over the layer's slots with the causal mask of the new queries (they are the last
    ``q_len`` slots, as everywhere in kvcli) AND each KV head's padding masked out; GQA kept (query
    head h reads KV head h // group, the cache is never expanded: only the boolean mask is per
    query head). SDPA (also for ``--attn flash``: flash-attn takes no arbitrary mask) or eager.
    """

    kvcli_grouped = True  # the attention dispatch looks for this

    def __init__(self, cache: "RaggedCache", layer_idx: int) -> None:
        self.cache = cache
        self.layer_idx = layer_idx

    def attend(self, module, query: torch.Tensor, scaling: float, sliding_window: int | None, kernel: str) -> torch.Tensor:
        """query (1, n_heads, q_len, head_dim) -> output (1, q_len, n_heads, head_dim)."""
        from . import attention as A

        k, v = self.cache.keys[self.layer_idx], self.cache.values[self.layer_idx]
        n_heads, q_len, kv_len = query.shape[1], query.shape[2], k.shape[2]
        allowed = A.causal_mask(q_len, kv_len, sliding_window, query.device)
        if allowed is None:
            allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        valid = self.cache.valid_slots(self.layer_idx, query.device)  # (n_kv, kv_len)
        mask = allowed[None] & valid[:, None, :]  # (n_kv, q_len, kv_len)
        mask = mask.repeat_interleave(n_heads // k.shape[1], dim=0)[None]  # (1, n_heads, q_len, kv_len)
        if kernel == "eager":
            return A._eager(query, k, v, mask, scaling)
        return A._sdpa(query, k, v, mask, scaling)


@cache_type
class RaggedCache(LayerKV):
    """Per-layer KV whose heads hold different numbers of the prompt's entries.

        keys[l], values[l]: (1, n_kv_heads, slots_l + new, head_dim)  — after RoPE, never GQA-expanded
        lengths[l]: (n_kv_heads,) int64 — head h holds its ``lengths[l][h]`` kept prompt entries in
                    slots 0..lengths-1 (original order); slots lengths..slots_l-1 are padding (zeros,
                    never attended); ``slots_l`` = the layer's largest count
        kept[l]:    (n_kv_heads, slots_l) int64 original positions of those entries, -1 on padding

    Tokens appended after the compression (the question, the answer) go to slots_l onwards, in
    every head. ``positions`` are the original positions of every token seen (as for KVCache), the
    first ``n_compressed`` of them before the compression. A layer without padding attends with the
    plain kernels; one with padding returns a :class:`RaggedLayer` view that masks it.

    There is no ``truncate`` (a compressed prefix cannot be cut back for a query window), and no
    eviction method accepts it as input (:func:`kvcli.compressors.scoring.require_kv_cache`).
    """

    kind: ClassVar[str] = "ragged"

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None
        self.n_compressed = 0
        self._valid: dict = {}

    # --- building it ------------------------------------------------------------------------------
    @classmethod
    def from_selection(cls, cache: "KVCache", keep: list[torch.Tensor]) -> "RaggedCache":
        """Keep, in each layer l of ``cache`` (a KVCache right after a prefill: prompt entries
        only), the entries where ``keep[l]`` (n_kv_heads, seq_len_l) bool is True, head by head."""
        if len(keep) != cache.n_layers:
            raise ValueError(f"{len(keep)} selections for {cache.n_layers} layers")
        out = cls()
        out.positions = cache.positions
        out.n_compressed = cache.n_tokens
        for layer, mask in enumerate(keep):
            k, v = cache.keys[layer], cache.values[layer]
            n_kv, seq = k.shape[1], k.shape[2]
            if tuple(mask.shape) != (n_kv, seq):
                raise ValueError(f"layer {layer}: selection {tuple(mask.shape)} for {(n_kv, seq)} entries")
            if cache.kept is not None:
                positions = cache.kept[layer]
            else:
                positions = torch.arange(seq).expand(n_kv, seq)
            mask = mask.to("cpu", torch.bool)
            lengths = mask.sum(dim=-1)
            slots = int(lengths.max()) if n_kv else 0
            # selected entries first, in their original order (stable sort of "not selected")
            order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices[:, :slots]
            valid = torch.arange(slots)[None, :] < lengths[:, None]
            idx = order.to(k.device)[None, :, :, None].expand(-1, -1, -1, k.shape[-1])
            fill = valid.to(k.device)[None, :, :, None]
            out.keys.append(torch.where(fill, k.gather(2, idx), 0).contiguous())
            out.values.append(torch.where(fill, v.gather(2, idx), 0).contiguous())
            out.kept.append(torch.where(valid, positions.gather(1, order), -1))
            out.lengths.append(lengths.to(torch.long))
        return out

    # --- the transformers contract -----------------------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append new tokens (every head) to ``layer_idx``; a view that masks the padding if it has any."""
        if not 0 <= layer_idx < len(self.keys):
            raise IndexError(f"layer {layer_idx} is not in this cache ({len(self.keys)} layers)")
        k, v = super().update(key, value, layer_idx)
        if self.padded(layer_idx):
            view = RaggedLayer(self, layer_idx)
            return view, view
        return k, v

    def padded(self, layer: int) -> bool:
        lengths = self.lengths[layer]
        return bool((lengths < self.kept[layer].shape[1]).any())

    def valid_slots(self, layer: int, device) -> torch.Tensor:
        """(n_kv_heads, seq_len) bool: False on padding."""
        n = self.keys[layer].shape[2]
        key = (layer, n, str(device))
        if key not in self._valid:
            slots = self.kept[layer].shape[1]
            head = torch.arange(slots)[None, :] < self.lengths[layer][:, None]
            new = torch.ones(head.shape[0], n - slots, dtype=torch.bool)
            self._valid = {key: torch.cat([head, new], dim=1).to(device)}  # one entry: the current length
        return self._valid[key]

    # --- kvcli's own use ---------------------------------------------------------------------------
    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        """(n_layers, n_kv_heads, n_prompt) bool (:meth:`CacheBase.kept_mask`): each head's kept
        prompt entries, plus every token appended after the compression."""
        n_kv = self.kept[0].shape[0] if self.kept else 0
        after = self.positions[self.n_compressed :]
        after = after[after < n_prompt]
        mask = torch.zeros(self.n_layers, n_kv, n_prompt, dtype=torch.bool)
        for layer, pos in enumerate(self.kept):
            inside = (pos >= 0) & (pos < n_prompt)
            rows = torch.arange(n_kv).view(-1, 1).expand_as(pos)
            mask[layer][rows[inside], pos[inside]] = True
            mask[layer][:, after] = True
        return mask

    def stats(self) -> dict:
        """Entries held vs slots allocated (padding is memory too)."""
        new = [k.shape[2] - kept.shape[1] for k, kept in zip(self.keys, self.kept)]
        entries = sum(int(l.sum()) + n * l.numel() for l, n in zip(self.lengths, new))
        slots = sum(k.shape[1] * k.shape[2] for k in self.keys)
        heads = [l.float() for l in self.lengths]
        return {
            "kv_entries": entries,
            "kv_slots": slots,
            "padding_frac": round(1 - entries / slots, 4) if slots else 0.0,
            "head_entries_min": int(min(int(l.min()) for l in self.lengths)) if heads else 0,
            "head_entries_max": int(max(int(l.max()) for l in self.lengths)) if heads else 0,
        }

    def copy(self) -> "RaggedCache":
        """A shallow copy: new lists, same tensors (``update`` never writes in place)."""
        other = RaggedCache()
        other.keys, other.values = list(self.keys), list(self.values)
        other.lengths, other.kept = list(self.lengths), list(self.kept)
        other.positions = self.positions
        other.n_compressed = self.n_compressed
        return other

    # --- the disk store's contract -----------------------------------------------------------------
    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``positions``, ``k.<l>``, ``v.<l>``, ``kept.<l>``, ``lengths.<l>`` and facts."""
        tensors = {"positions": self.positions.contiguous()}
        for i in range(self.n_layers):
            tensors[f"k.{i}"] = self.keys[i].detach().to("cpu").contiguous()
            tensors[f"v.{i}"] = self.values[i].detach().to("cpu").contiguous()
            tensors[f"kept.{i}"] = self.kept[i].contiguous()
            tensors[f"lengths.{i}"] = self.lengths[i].contiguous()
        return tensors, {"n_layers": self.n_layers, "n_tokens": self.n_tokens, "n_compressed": self.n_compressed}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], facts: dict, device="cpu") -> "RaggedCache":
        """Inverse of :meth:`to_tensors`; ValueError when the tensors do not form such a cache."""
        try:
            n_layers, n_tokens, n_compressed = int(facts["n_layers"]), int(facts["n_tokens"]), int(facts["n_compressed"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"ragged cache facts are incomplete: {e}") from None
        expected = {"positions", *(f"{t}.{i}" for i in range(n_layers) for t in ("k", "v", "kept", "lengths"))}
        if set(tensors) != expected:
            raise ValueError("unexpected tensor names")
        cache = cls()
        cache.positions = tensors["positions"].to(torch.long)
        if cache.positions.shape != (n_tokens,) or not 0 <= n_compressed <= n_tokens:
            raise ValueError("positions do not match the token count")
        ref = None
        for i in range(n_layers):
            k, v, kept, lengths = (tensors[f"{t}.{i}"] for t in ("k", "v", "kept", "lengths"))
            if kept.dim() != 2 or kept.dtype != torch.long or lengths.dtype != torch.long or lengths.shape != kept.shape[:1]:
                raise ValueError(f"layer {i}: kept {tuple(kept.shape)} / lengths {tuple(lengths.shape)}")
            n_kv, slots = kept.shape
            want = (1, n_kv, slots + n_tokens - n_compressed)
            if k.dim() != 4 or tuple(k.shape[:3]) != want or k.shape != v.shape:
                raise ValueError(f"layer {i} has shape {tuple(k.shape)}, expected {want} + (head_dim,)")
            if ref is not None and (k.shape[1], k.shape[3], k.dtype) != ref:
                raise ValueError(f"layer {i} differs from layer 0")
            ref = (k.shape[1], k.shape[3], k.dtype)
            valid = torch.arange(slots)[None, :] < lengths[:, None]
            if bool((lengths < 0).any() or (lengths > slots).any()) or (slots and int(lengths.max()) != slots):
                raise ValueError(f"layer {i}: head lengths do not match the slots")
            if bool((kept[~valid] != -1).any() or (kept[valid] < 0).any() or (kept[valid] >= max(n_compressed, 1)).any()):
                raise ValueError(f"layer {i}: kept positions out of range")
            cache.keys.append(k.to(device))
            cache.values.append(v.to(device))
            cache.kept.append(kept)
            cache.lengths.append(lengths)
        cache.n_compressed = n_compressed
        return cache
