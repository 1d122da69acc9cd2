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


@cache_type
class KVCache:
    kind: ClassVar[str] = "kv"

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # (seq_len,) original positions of the entries of layer 0 (all layers share them unless a
        # compressor keeps different tokens per layer, in which case it tracks its own).
        self.positions: torch.Tensor | None = None

    # --- the transformers contract -------------------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append ``key``/``value`` (batch, n_kv_heads, new, head_dim) to layer ``layer_idx``.

        Returns the whole (cached + new) key and value tensors of that layer.
        """
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

    # --- kvcli's own use ------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.keys)

    def seq_len(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def record_positions(self, positions: torch.Tensor) -> None:
        """Note the original positions of tokens just appended to every layer."""
        positions = positions.detach().to("cpu", torch.long)
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions])

    @property
    def n_tokens(self) -> int:
        """Number of prompt tokens the cache has seen (its positions)."""
        return 0 if self.positions is None else self.positions.numel()

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
        return other
