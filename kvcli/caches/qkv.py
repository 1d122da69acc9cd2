"""The plain layout in 8 or 4 bits (``--kv-bits``): what :class:`~kvcli.caches.kv.KVCache` holds,
each row quantized with its scales (:mod:`kvcli.caches.quant`) as it is appended.

Per layer, six tensors, all (1, n_kv_heads, rows, ·) — the keys' and the values' :class:`Packed`
codes, scales and zeros::

    kc[l], ks[l], kz[l], vc[l], vs[l], vz[l]

so every row operation of the plain layout (append in place, cut a sliding layer's front, cut
back to a prefix) applies to the six alike, exactly, and the bytes held are the quantized ones.

A pass of many queries (a prompt chunk, a question) gets the layer dequantized for its attention —
one layer at a time, a transient, never the whole cache — and every kernel and observer runs on
it as on a plain cache. A decoding step (up to :data:`~kvcli.runtime.kernels.GROUPED_ROWS`
queries) gets a :class:`QuantLayer` view instead, which attends from the codes themselves
(:func:`kvcli.caches.quant.attend`).

What a method keeps is the plain layout's: ``kept`` (eviction, per head), ``kept_positions`` +
``suffix_positions`` (Finch), ``dropped`` (a hybrid's sliding layers) — :meth:`of` quantizes a
compressed plain cache for decoding, :meth:`dense` gives one back to a method that needs tensors.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..runtime import kernels
from ..runtime.attention import LayerView
from ..runtime.buffers import made_finite
from ..runtime.measure import long_lived
from . import quant
from .base import (
    CacheBase,
    append_rows,
    cache_type,
    drop_rows,
    dropped_facts,
    make_room,
    read_dropped,
    truncate_rows,
    written_by,
)
from .kv import KVCache, held_positions, kept_mask

NAMES = ("kc", "ks", "kz", "vc", "vs", "vz")
_FIELDS = ("kept", "kept_positions", "suffix_positions")  # what a method kept, as in KVCache


class QuantLayer(LayerView):
    """What :meth:`QuantKVCache.update` returns (as key and value) for a decoding step: attention
    read from the layer's codes (:func:`kvcli.caches.quant.attend`), causal, with the layer's
    sliding window and Gemma 2's soft cap."""

    cache: QuantKVCache

    def attend(
        self, module, query: torch.Tensor, scaling: float, sliding_window: int | None, kernel: str
    ) -> torch.Tensor:
        k, v = self.cache.packed(self.layer_idx)
        q_len, kv_len = query.shape[2], k.rows
        mask = kernels.causal_mask(q_len, kv_len, sliding_window, query.device)
        if mask is None and q_len > 1:  # square: the standard causal triangle
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        softcap = getattr(module, "kvcli_softcap", None)
        return quant.attend(query, k, v, self.cache.head_dim, scaling, mask, softcap)

    def read_weights(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoding step's weights over the layer's rows (:meth:`LayerView.read_weights`)."""
        positions = self.cache.held_positions(self.layer_idx)
        weights = quant.read_weights(query, self.cache.packed(self.layer_idx)[0])
        return positions, weights[..., : positions.shape[1]]


@cache_type
class QuantKVCache(CacheBase):
    kind: ClassVar[str] = "qkv"
    tensor_lists: ClassVar[tuple[str, ...]] = NAMES
    cuts_windows: ClassVar[bool] = True
    truncatable: ClassVar[bool] = True

    def __init__(self, bits: int, dtype: torch.dtype = torch.bfloat16) -> None:
        if bits not in (8, 4):
            raise ValueError(f"a quantized cache holds 8 or 4 bits, not {bits}")
        self.bits = bits
        self.dtype = dtype  # what a pass of many queries gets the layer back in (the model's)
        self.head_dim = 0
        for name in NAMES:
            setattr(self, name, [])
        self.positions: torch.Tensor | None = None
        self.kept: list[torch.Tensor] | None = None
        self.kept_positions: list[torch.Tensor] | None = None
        self.suffix_positions: torch.Tensor | None = None
        self.capacity: int | None = None

    @property
    def kv_bits(self) -> int:
        return self.bits

    @property
    def n_layers(self) -> int:
        return len(self.kc)

    @property
    def n_kv(self) -> int:
        return self.kc[0].shape[1] if self.kc else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kc[layer_idx].shape[-2] if layer_idx < len(self.kc) else 0

    def packed(self, layer: int) -> tuple[quant.Packed, quant.Packed]:
        return quant.Packed(self.kc[layer], self.ks[layer], self.kz[layer]), quant.Packed(
            self.vc[layer], self.vs[layer], self.vz[layer]
        )

    def dense_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values dequantized (1, n_kv, rows, d) in :attr:`dtype`: a transient."""
        k, v = self.packed(layer)
        return quant.dequantize(k, self.head_dim, self.dtype), quant.dequantize(v, self.head_dim, self.dtype)

    # --- the transformers contract ----------------------------------------------------------------
    def reserve(self, capacity: int | None) -> None:
        """Give each layer begun from now on buffers of ``capacity`` rows (as :meth:`LayerKV.reserve`)."""
        self.capacity = capacity

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Quantize ``key``/``value`` (1, n_kv, new, d) and append them to layer ``layer_idx``.
        Returns the whole layer dequantized for a pass of many queries, else a :class:`QuantLayer`."""
        if not self.head_dim:
            self.head_dim, self.dtype = key.shape[-1], key.dtype
        rows = (*quant.quantize(key, self.bits), *quant.quantize(value, self.bits))
        if layer_idx == len(self.kc):
            self._begin(rows)
        elif layer_idx < len(self.kc):
            append_rows(self, NAMES, layer_idx, rows)
        else:
            raise IndexError(f"layer {layer_idx} updated before layer {len(self.kc)}")
        if key.shape[-2] > kernels.GROUPED_ROWS:
            return self.dense_layer(layer_idx)
        view = QuantLayer(self, layer_idx)
        return view, view

    def _begin(self, rows: tuple[torch.Tensor, ...]) -> None:
        new = rows[0].shape[-2]
        layer = len(self.kc)
        if self.capacity is None or self.capacity <= new:
            for name, t in zip(NAMES, rows):
                getattr(self, name).append(t)
            return
        nbytes = sum(t.numel() * t.element_size() for t in rows) // max(new, 1) * self.capacity
        with long_lived(rows[0].device, nbytes):
            bufs = [t.new_empty((*t.shape[:-2], self.capacity, t.shape[-1])) for t in rows]
        for name, buf, t in zip(NAMES, bufs, rows):
            buf[..., :new, :].copy_(t)
            getattr(self, name).append(made_finite(buf, new)[..., :new, :])
        written_by(self)[(NAMES, layer)] = (new, *(getattr(self, n)[layer].data_ptr() for n in NAMES))

    # --- what it holds -----------------------------------------------------------------------------
    def held_positions(self, layer: int) -> torch.Tensor:
        """(n_kv, rows) the position of each row of ``layer`` (as :meth:`KVCache.held_positions`)."""
        return held_positions(self, layer, self.n_kv)

    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        return kept_mask(self, n_prompt, self.n_kv)

    # --- from and to the plain layout -------------------------------------------------------------
    @classmethod
    def of(cls, cache: KVCache, bits: int) -> QuantKVCache:
        """``cache`` (a plain cache, compressed or not) in ``bits`` bits, layer by layer: each 16-bit
        layer is released from ``cache`` as soon as it is quantized (``cache`` is the caller's to drop)."""
        out = cls(bits, cache.keys[0].dtype if cache.keys else torch.bfloat16)
        out.positions, out.dropped = cache.positions, dict(cache.dropped)
        for name in _FIELDS:
            setattr(out, name, getattr(cache, name))
        for layer in range(cache.n_layers):
            k, v = cache.keys[layer], cache.values[layer]
            out.head_dim = k.shape[-1]
            for name, t in zip(NAMES, (*quant.quantize(k, bits), *quant.quantize(v, bits))):
                getattr(out, name).append(t)
            cache.keys[layer] = cache.values[layer] = k.new_empty(*k.shape[:-2], 0, k.shape[-1])  # its buffer freed
        return out

    def dense(self, room: int = 0) -> KVCache:
        """This cache as a plain 16-bit one, layer by layer (each quantized layer released as soon
        as it is converted: this cache is unusable after); ``room``: entries more each layer's
        buffer holds, so that decoding appends its answer in place (a layer moved to a larger
        buffer would be held twice, and the heap keeps what it frees)."""
        out = KVCache()
        out.positions, out.dropped = self.positions, dict(self.dropped)
        for name in _FIELDS:
            setattr(out, name, getattr(self, name))
        for layer in range(self.n_layers):
            k, v = self.dense_layer(layer)
            out.keys.append(k)
            out.values.append(v)
            if room > 0:
                make_room(out, ("keys", "values"), layer, room)
            for name in NAMES:  # a new empty tensor: a view would keep the layer's buffer alive
                t = getattr(self, name)[layer]
                getattr(self, name)[layer] = t.new_empty(*t.shape[:-2], 0, t.shape[-1])
        return out

    # --- the disk store's contract -----------------------------------------------------------------
    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Named contiguous CPU tensors (``kc.<layer>`` ... ``vz.<layer>``, ``positions``) and facts."""
        tensors = {"positions": self.positions.contiguous()}
        for name in NAMES:
            for i, t in enumerate(getattr(self, name)):
                tensors[f"{name}.{i}"] = t.detach().to("cpu").contiguous()
        facts = {
            "n_layers": self.n_layers,
            "n_tokens": self.n_tokens,
            "bits": self.bits,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            **dropped_facts(self.dropped),
        }
        return tensors, facts

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], facts: dict, device="cpu") -> QuantKVCache:
        """Inverse of :meth:`to_tensors`; ValueError when the tensors do not form such a cache."""
        n_layers, n_tokens = int(facts["n_layers"]), int(facts["n_tokens"])
        bits, d = int(facts["bits"]), int(facts["head_dim"])
        dtype = getattr(torch, str(facts["dtype"]), None)
        if not isinstance(dtype, torch.dtype) or bits not in (8, 4) or d < 1:
            raise ValueError("bad quantization facts")
        if set(tensors) != {"positions", *(f"{n}.{i}" for i in range(n_layers) for n in NAMES)}:
            raise ValueError("unexpected tensor names")
        cache = cls(bits, dtype)
        cache.head_dim = d
        cache.positions = tensors["positions"].to(torch.long)
        if cache.positions.shape != (n_tokens,):
            raise ValueError("positions do not match the token count")
        cache.dropped = dropped = read_dropped(facts, n_layers, n_tokens)
        width, ng = quant.code_width(d, bits), d // quant.group_size(d)
        for i in range(n_layers):
            ts = [tensors[f"{n}.{i}"] for n in NAMES]
            rows = n_tokens - dropped.get(i, 0)
            n_kv = ts[0].shape[1] if ts[0].dim() == 4 else -1
            want = [(1, n_kv, rows, w) for w in (width, ng, ng) * 2]
            if [tuple(t.shape) for t in ts] != want or n_kv < 1:
                raise ValueError(f"layer {i} has shapes {[tuple(t.shape) for t in ts]}")
            if [t.dtype for t in ts] != [torch.uint8, quant.SCALE_DTYPE, quant.SCALE_DTYPE] * 2:
                raise ValueError(f"layer {i} has dtypes {[t.dtype for t in ts]}")
            for name, t in zip(NAMES, ts):
                getattr(cache, name).append(t.to(device))
        return cache

    # --- cutting it back ---------------------------------------------------------------------------
    def truncate(self, n_tokens: int, layer: int | None = None) -> None:
        """Keep only the rows of the first ``n_tokens`` tokens (as :meth:`KVCache.truncate`)."""
        truncate_rows(self, NAMES, n_tokens, layer)

    def drop_front(self, layer: int, n: int) -> None:
        """Drop the ``n`` oldest rows of ``layer`` (a sliding layer's, as :meth:`KVCache.drop_front`)."""
        drop_rows(self, NAMES, layer, n)
        self.dropped = {**self.dropped, layer: self.dropped.get(layer, 0) + n}

    def copy(self) -> QuantKVCache:
        """A shallow copy: new lists, the same tensors (appends never write over a view handed out)."""
        other = QuantKVCache(self.bits, self.dtype)
        other.head_dim = self.head_dim
        for name in NAMES:
            setattr(other, name, list(getattr(self, name)))
        other.positions, other.dropped = self.positions, dict(self.dropped)
        for name in _FIELDS:
            value = getattr(self, name)
            setattr(other, name, list(value) if isinstance(value, list) else value)
        return other
