"""KV heads of one layer holding different numbers of entries: head-adaptive budgets (AdaKV,
KVzip, ExpectedAttention's adaptive mode; :mod:`kvcli.compressors.adakv` / ``kvzip`` /
``expected_attention``).

Each layer is one (1, n_kv_heads, slots, head_dim) tensor as in the plain layout; a head holding
fewer entries than the layer's widest head is padded, and :class:`RaggedLayer` masks the padding
out of the softmax exactly (a -inf logit, never a small weight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from ..runtime import kernels
from ..runtime.attention import LayerView
from .base import LayerKV, cache_type

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .kv import KVCache


class RaggedLayer(LayerView):
    """What :meth:`RaggedCache.update` returns (as both key and value) for a layer with padding.

    Attention over the layer's slots with the causal mask of the new queries (they are the last
    ``q_len`` slots, as everywhere in kvcli) AND each KV head's padding masked out; GQA kept (query
    head h reads KV head h // group, the cache is never expanded: only the boolean mask is per
    query head). SDPA (also for ``--attn flash``: flash-attn takes no arbitrary mask) or eager.
    """

    cache: RaggedCache

    def attend(
        self, module, query: torch.Tensor, scaling: float, sliding_window: int | None, kernel: str
    ) -> torch.Tensor:
        """query (1, n_heads, q_len, head_dim) -> output (1, q_len, n_heads, head_dim)."""
        k, v = self.cache.keys[self.layer_idx], self.cache.values[self.layer_idx]
        n_heads, q_len, kv_len = query.shape[1], query.shape[2], k.shape[2]
        allowed = kernels.causal_mask(q_len, kv_len, sliding_window, query.device)
        if allowed is None:
            allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        valid = self.cache.valid_slots(self.layer_idx, query.device)  # (n_kv, kv_len)
        mask = allowed[None] & valid[:, None, :]  # (n_kv, q_len, kv_len)
        mask = mask.repeat_interleave(n_heads // k.shape[1], dim=0)[None]  # (1, n_heads, q_len, kv_len)
        return kernels.attend(kernel, module, query, k, v, scaling, mask=mask)

    def read_weights(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoding step's weights over the layer's slots, each KV head's padding weighed zero
        (:meth:`LayerView.read_weights`): the positions of :meth:`RaggedCache.held_positions`."""
        k = self.cache.keys[self.layer_idx]
        positions = self.cache.held_positions(self.layer_idx)
        valid = self.cache.valid_slots(self.layer_idx, query.device)  # (n_kv, kv_len)
        n_heads, n_kv, d = query.shape[1], k.shape[1], query.shape[-1]
        q = query[0, :, -1].reshape(n_kv, n_heads // n_kv, d).to(torch.float32)
        logits = torch.matmul(q, k[0].to(torch.float32).transpose(-1, -2)) / d**0.5
        weights = torch.softmax(logits.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
        return positions, weights[..., : positions.shape[1]]


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

    A hybrid's sliding layer (Gemma 2 / 3) is cut back to its window (:meth:`drop_front`, called
    by :meth:`~kvcli.caches.base.CacheBase.trim_windows`): its first slots go, then, once no compressed
    slot is left, the oldest appended tokens (``after_dropped[l]`` of them).

    There is no ``truncate`` (a compressed prefix cannot be cut back for a query window), and no
    eviction method accepts it as input (:func:`kvcli.compressors.scoring.require_kv_cache`).
    """

    kind: ClassVar[str] = "ragged"
    cuts_windows: ClassVar[bool] = True  # its slots first, then the appended tokens (``after_dropped``)

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None
        self.n_compressed = 0
        self._valid: dict = {}
        # layer -> appended tokens (the question's, the answer's) dropped from its front (drop_front)
        self.after_dropped: dict[int, int] = {}

    # --- building it ------------------------------------------------------------------------------
    @classmethod
    def from_selection(cls, cache: KVCache, keep: list[torch.Tensor], consume: bool = False) -> RaggedCache:
        """Keep, in each layer l of ``cache`` (a KVCache right after a prefill: prompt entries
        only), the entries where ``keep[l]`` (n_kv_heads, seq_len_l) bool is True, head by head.

        ``consume``: the caller drops ``cache`` afterwards, so each layer's full key and value
        tensors are released from it as soon as that layer is converted (the whole uncompressed
        cache and the compressed one are never held together); ``cache`` is unusable after."""
        if len(keep) != cache.n_layers:
            raise ValueError(f"{len(keep)} selections for {cache.n_layers} layers")
        out = cls()
        out.positions = cache.positions
        out.n_compressed = cache.n_tokens
        for layer, mask in enumerate(keep):
            k, v = cache.keys[layer], cache.values[layer]
            n_kv, seq = k.shape[1], k.shape[2]
            # a hybrid's sliding layer cut back to its window (a prefix state: Engine.prefix_kv)
            # holds the last seq of d + seq entries; its selection may cover all of them
            d = cache.dropped.get(layer, 0)
            if d and tuple(mask.shape) == (n_kv, d + seq):
                if bool(mask[:, :d].any()):
                    raise ValueError(f"layer {layer}: the selection keeps entries its window dropped")
                mask = mask[:, d:]
            if tuple(mask.shape) != (n_kv, seq):
                raise ValueError(f"layer {layer}: selection {tuple(mask.shape)} for {(n_kv, seq)} entries")
            if cache.kept is not None:
                positions = cache.kept[layer][:, d:]  # (KVCache.kept lists the dropped entries too)
            else:
                positions = torch.arange(d, d + seq).expand(n_kv, seq)
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
            if consume:
                del k, v
                cache.keys[layer] = cache.values[layer] = None
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
        # the compressed slots' validity goes to the device once per layer; a decoding step only
        # appends valid columns there (no host -> device copy per step)
        key = (layer, str(device))
        if key not in self._valid:
            slots = self.kept[layer].shape[1]
            self._valid[key] = (torch.arange(slots)[None, :] < self.lengths[layer][:, None]).to(device)
        head = self._valid[key]
        return torch.cat([head, head.new_ones(head.shape[0], n - head.shape[1])], dim=1)

    def drop_front(self, layer: int, n: int) -> None:
        """Drop the ``n`` first slots of ``layer``: a sliding layer (Gemma 2 / 3) whose window has
        passed them (:meth:`~kvcli.caches.base.CacheBase.trim_windows`). Its compressed slots go first (in
        every head: the slots are in original order; a head left with none holds only padding
        there), then the oldest appended tokens. A sliding layer is never padded (every head keeps
        the same window), so its entries stay the latest tokens in order, as its window mask counts."""
        slots = self.kept[layer].shape[1]
        d = min(n, slots)
        self.keys[layer] = self.keys[layer][:, :, n:]
        self.values[layer] = self.values[layer][:, :, n:]
        self.kept[layer] = self.kept[layer][:, d:]
        self.lengths[layer] = (self.lengths[layer] - d).clamp(min=0)
        if n > d:
            self.after_dropped = {**self.after_dropped, layer: self.after_dropped.get(layer, 0) + n - d}
        self._valid = {key: v for key, v in self._valid.items() if key[0] != layer}

    # --- kvcli's own use ---------------------------------------------------------------------------
    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        """(n_layers, n_kv_heads, n_prompt) bool (:meth:`CacheBase.kept_mask`): each head's kept
        prompt entries, plus every token appended after the compression."""
        n_kv = self.kept[0].shape[0] if self.kept else 0
        mask = torch.zeros(self.n_layers, n_kv, n_prompt, dtype=torch.bool)
        for layer, pos in enumerate(self.kept):
            inside = (pos >= 0) & (pos < n_prompt)
            rows = torch.arange(n_kv).view(-1, 1).expand_as(pos)
            mask[layer][rows[inside], pos[inside]] = True
            after = self.positions[self.n_compressed + self.after_dropped.get(layer, 0) :]
            mask[layer][:, after[after < n_prompt]] = True
        return mask

    def held_positions(self, layer: int) -> torch.Tensor:
        """(n_kv, rows) each slot's position (:meth:`CacheBase.held_positions`): the head's kept
        entries (-1 on padding), then the tokens appended after the compression."""
        kept = self.kept[layer]
        after = self.positions[self.n_compressed + self.after_dropped.get(layer, 0) :]
        return torch.cat([kept, after.view(1, -1).expand(kept.shape[0], -1)], dim=1)

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

    def copy(self) -> RaggedCache:
        """A shallow copy: new lists, same tensors (``update`` never writes in place)."""
        other = RaggedCache()
        other.keys, other.values = list(self.keys), list(self.values)
        other.lengths, other.kept = list(self.lengths), list(self.kept)
        other.positions = self.positions
        other.n_compressed = self.n_compressed
        other.after_dropped = dict(self.after_dropped)
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
        facts = {"n_layers": self.n_layers, "n_tokens": self.n_tokens, "n_compressed": self.n_compressed}
        if self.after_dropped:
            facts["after_dropped"] = [self.after_dropped.get(i, 0) for i in range(self.n_layers)]
        return tensors, facts

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], facts: dict, device="cpu") -> RaggedCache:
        """Inverse of :meth:`to_tensors`; ValueError when the tensors do not form such a cache."""
        try:
            n_layers, n_tokens, n_compressed = (
                int(facts["n_layers"]),
                int(facts["n_tokens"]),
                int(facts["n_compressed"]),
            )
            after_dropped = [int(x) for x in facts.get("after_dropped", [0] * n_layers)]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"ragged cache facts are incomplete: {e}") from None
        expected = {"positions", *(f"{t}.{i}" for i in range(n_layers) for t in ("k", "v", "kept", "lengths"))}
        if set(tensors) != expected:
            raise ValueError("unexpected tensor names")
        cache = cls()
        cache.positions = tensors["positions"].to(torch.long)
        if cache.positions.shape != (n_tokens,) or not 0 <= n_compressed <= n_tokens:
            raise ValueError("positions do not match the token count")
        if len(after_dropped) != n_layers or any(not 0 <= a <= n_tokens - n_compressed for a in after_dropped):
            raise ValueError("dropped token counts do not match the layers")
        ref = None
        for i in range(n_layers):
            k, v, kept, lengths = (tensors[f"{t}.{i}"] for t in ("k", "v", "kept", "lengths"))
            if (
                kept.dim() != 2
                or kept.dtype != torch.long
                or lengths.dtype != torch.long
                or lengths.shape != kept.shape[:1]
            ):
                raise ValueError(f"layer {i}: kept {tuple(kept.shape)} / lengths {tuple(lengths.shape)}")
            n_kv, slots = kept.shape
            want = (1, n_kv, slots + n_tokens - n_compressed - after_dropped[i])
            if k.dim() != 4 or tuple(k.shape[:3]) != want or k.shape != v.shape:
                raise ValueError(f"layer {i} has shape {tuple(k.shape)}, expected {want} + (head_dim,)")
            if ref is not None and (k.shape[1], k.shape[3], k.dtype) != ref:
                raise ValueError(f"layer {i} differs from layer 0")
            ref = (k.shape[1], k.shape[3], k.dtype)
            valid = torch.arange(slots)[None, :] < lengths[:, None]
            if bool((lengths < 0).any() or (lengths > slots).any()) or (slots and int(lengths.max()) != slots):
                raise ValueError(f"layer {i}: head lengths do not match the slots")
            if bool(
                (kept[~valid] != -1).any() or (kept[valid] < 0).any() or (kept[valid] >= max(n_compressed, 1)).any()
            ):
                raise ValueError(f"layer {i}: kept positions out of range")
            cache.keys.append(k.to(device))
            cache.values.append(v.to(device))
            cache.kept.append(kept)
            cache.lengths.append(lengths)
        cache.n_compressed = n_compressed
        cache.after_dropped = {i: a for i, a in enumerate(after_dropped) if a}
        return cache
