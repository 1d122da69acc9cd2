"""The in-memory KV cache kvcli's engine runs on.

transformers' attention layers only ever call ``past_key_values.update(key, value, layer_idx)``;
this class is that contract with nothing hidden: one key and one value tensor per layer,

    keys[l], values[l]: (batch=1, n_kv_heads, seq_len_l, head_dim)   — after RoPE, never GQA-expanded

plus the original token position of every cached entry (``positions``, shared by all layers) so
that methods which drop entries still know where each kept token came from. Layers are appended
lazily, so a cache may hold only the first ``r`` layers (GemFilter's filter pass).
"""

from __future__ import annotations

import torch


class KVCache:
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

    def copy(self) -> "KVCache":
        """A shallow copy: new lists, same tensors (``update`` never writes in place)."""
        other = KVCache()
        other.keys = list(self.keys)
        other.values = list(self.values)
        other.positions = self.positions
        return other
