"""The plain layout: one key and one value tensor per layer (full attention, and the eviction
methods, which keep per-head positions in ``kept``)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import (
    LayerKV,
    cache_type,
    drop_rows,
    dropped_facts,
    grow_rows,
    make_room,
    read_dropped,
    rewind_rows,
    truncate_rows,
)


@cache_type
class KVCache(LayerKV):
    kind: ClassVar[str] = "kv"
    cuts_windows: ClassVar[bool] = True  # a sliding layer keeps its last entries (``dropped`` counts the others)
    truncatable: ClassVar[bool] = True
    rewindable: ClassVar[bool] = True
    # a decoding step of full attention over it may run as a captured CUDA graph (kvcli.runtime.graphs),
    # which appends in place (:meth:`make_room`, :meth:`grow`): a layer's keys and values are all it attends
    graphable: ClassVar[bool] = True

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
        # --- Finch (kvcli.compressors.finch): per layer, the original positions of the document
        # slots it kept, then those of the question's slots that follow them (None: not Finch's)
        self.kept_positions: list[torch.Tensor] | None = None
        self.suffix_positions: torch.Tensor | None = None
        # a hybrid's sliding layers (Gemma 2 / 3) cut back to their window: ``dropped`` (CacheBase)

    # --- kvcli's own use ------------------------------------------------------------------------
    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        """(n_layers, n_kv_heads, n_prompt) bool; see :meth:`CacheBase.kept_mask` and :func:`kept_mask`."""
        return kept_mask(self, n_prompt, self.keys[0].shape[1] if self.keys else 0)

    def held_positions(self, layer: int) -> torch.Tensor:
        """(n_kv, rows) the position of each row of ``layer``: :func:`held_positions`."""
        return held_positions(self, layer, self.keys[0].shape[1] if self.keys else 0)

    # --- the disk store's contract ---------------------------------------------------------------
    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Named contiguous CPU tensors (``k.<layer>``, ``v.<layer>``, ``positions``) and facts
        (with ``dropped``, as {"layer": entries}, when sliding layers were cut back to a window)."""
        tensors = {"positions": self.positions.contiguous()}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            tensors[f"k.{i}"] = k.detach().to("cpu").contiguous()
            tensors[f"v.{i}"] = v.detach().to("cpu").contiguous()
        return tensors, {"n_layers": self.n_layers, "n_tokens": self.n_tokens, **dropped_facts(self.dropped)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], facts: dict, device="cpu") -> KVCache:
        """Inverse of :meth:`to_tensors`; ValueError when the tensors do not form such a cache."""
        n_layers, n_tokens = int(facts["n_layers"]), int(facts["n_tokens"])
        expected = {"positions", *(f"{t}.{i}" for i in range(n_layers) for t in "kv")}
        if set(tensors) != expected:
            raise ValueError("unexpected tensor names")
        cache = cls()
        cache.positions = tensors["positions"].to(torch.long)
        if cache.positions.shape != (n_tokens,):
            raise ValueError("positions do not match the token count")
        cache.dropped = dropped = read_dropped(facts, n_layers, n_tokens)
        shape = None
        for i in range(n_layers):
            k, v = tensors[f"k.{i}"], tensors[f"v.{i}"]
            if k.dim() != 4 or k.shape[0] != 1 or k.shape[2] != n_tokens - dropped.get(i, 0) or k.shape != v.shape:
                raise ValueError(f"layer {i} has shape {tuple(k.shape)}")
            if shape is not None and (k.shape[:2], k.shape[3], k.dtype) != shape:
                raise ValueError(f"layer {i} differs from layer 0")
            shape = (k.shape[:2], k.shape[3], k.dtype)
            cache.keys.append(k.to(device))
            cache.values.append(v.to(device))
        return cache

    def truncate(self, n_tokens: int, layer: int | None = None) -> None:
        """Keep only the entries of the first ``n_tokens`` tokens in every layer (and their
        positions); with ``layer``, of that layer only (a pass that runs the prompt layer by layer;
        the positions are the caller's). A sliding layer cut back to its window (``dropped``) holds
        fewer: whether what it still holds is enough for a pass that goes on from there is
        :meth:`kvcli.runtime.windows.Windows.can_resume`'s question."""
        truncate_rows(self, ("keys", "values"), n_tokens, layer)

    def rewind(self, n: int) -> None:
        """Take back the last ``n`` rows appended to every layer (:func:`~kvcli.caches.base.rewind_rows`)."""
        rewind_rows(self, ("keys", "values"), n)

    def upload(self, device, room: int = 0) -> KVCache:
        """A copy on ``device``, each layer in a buffer with ``room`` more entries: what follows the
        prefix (the question, the answer) appends in place, no layer is moved to a larger buffer
        (which would hold it twice, and leave 1/32 of room behind)."""
        out = KVCache()
        out.positions = self.positions
        out.dropped = dict(self.dropped)
        for _layer, (k, v) in enumerate(zip(self.keys, self.values)):
            out.reserve(k.shape[-2] + max(1, room))
            out._begin_reserved(k, v, device)
        out.reserve(None)
        return out

    def for_device(self, device, room: int = 0):
        """The plain KV, none of it evicted: :meth:`upload`, the question and the answer appending in
        place; otherwise (a subclass, evicted entries) its tensors rebuilt there."""
        if type(self) is KVCache and self.kept is None:
            return self.upload(device, room)
        return super().for_device(device, room)

    def make_room(self, rows: int) -> None:
        """Every layer with ``rows`` finite rows past its entries in buffers of its own
        (:func:`~kvcli.caches.base.make_room`): a captured decoding step's appends, in place."""
        for layer in range(self.n_layers):
            make_room(self, self.tensor_lists, layer, rows)

    def grow(self, rows: int, layers=None) -> None:
        """Count ``rows`` more entries in each layer (of ``layers``; default: all), rows a captured
        decoding step wrote past them in place (:func:`~kvcli.caches.base.grow_rows`); their
        positions are the caller's to record."""
        for layer in range(self.n_layers) if layers is None else layers:
            grow_rows(self, self.tensor_lists, layer, rows)

    def drop_front(self, layer: int, n: int) -> None:
        """Drop the ``n`` oldest entries of ``layer`` (a sliding-window layer whose window has
        passed them; :meth:`~kvcli.caches.base.CacheBase.trim_windows`). The positions stay: they are
        every token's, and the layer's entries are their last ones."""
        drop_rows(self, ("keys", "values"), layer, n)
        self.dropped = {**self.dropped, layer: self.dropped.get(layer, 0) + n}

    def copy(self) -> KVCache:
        """A shallow copy: new lists, same tensors (``update`` never writes in place)."""
        other = KVCache()
        other.keys = list(self.keys)
        other.values = list(self.values)
        other.positions = self.positions
        other.kept = None if self.kept is None else list(self.kept)  # eviction (see __init__)
        other.dropped = dict(self.dropped)
        return other


def held_positions(cache, layer: int, n_kv: int) -> torch.Tensor:
    """(n_kv, rows) the position of each row of ``layer`` of a plain cache (:class:`KVCache`, or
    the same in 8 or 4 bits: :class:`~kvcli.caches.qkv.QuantKVCache`; :meth:`CacheBase.held_positions`),
    from ``kept`` (eviction, per head), ``kept_positions`` + ``suffix_positions`` (Finch: per layer,
    the document slots, then the question's), else ``positions``; a sliding layer's first
    ``dropped`` entries are gone."""
    if cache.kept is not None:
        pos = cache.kept[layer]  # (n_kv, kept_l)
    elif cache.kept_positions is not None:
        pos = torch.cat([cache.kept_positions[layer], cache.suffix_positions]).view(1, -1).expand(n_kv, -1)
    else:
        pos = cache.positions.view(1, -1).expand(n_kv, -1)
    dropped = cache.dropped.get(layer, 0)  # the entries the window dropped: the first
    return pos.to("cpu", torch.long)[:, dropped:]


def kept_mask(cache, n_prompt: int, n_kv: int) -> torch.Tensor:
    """(n_layers, n_kv_heads, n_prompt) bool of a plain cache (:meth:`CacheBase.kept_mask`): where
    :func:`held_positions` puts a row."""
    mask = torch.zeros(cache.n_layers, n_kv, n_prompt, dtype=torch.bool)
    for layer in range(cache.n_layers):
        pos = held_positions(cache, layer, n_kv)
        inside = pos < n_prompt
        rows = torch.arange(n_kv).view(-1, 1).expand_as(pos)
        mask[layer][rows[inside], pos[inside]] = True
    return mask
