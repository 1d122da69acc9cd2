"""The cache contract every kvcli cache layout shares (the layouts: one file each in this package).

transformers' attention layers only ever call ``past_key_values.update(key, value, layer_idx)``;
a kvcli cache is that contract with nothing hidden. The plain layout (:mod:`.kv`) holds one key
and one value tensor per layer,

    keys[l], values[l]: (batch=1, n_kv_heads, seq_len_l, head_dim)   — after RoPE, never GQA-expanded

plus the original token position of every cached entry (``positions``) so that methods which drop
entries still know where each kept token came from. A layout whose attention is not "softmax over
this layer's keys" (RazorAttention's head groups, block retrieval, padded ragged heads) returns a
:class:`~kvcli.runtime.attention.LayerView` from ``update`` instead of the key tensor; :func:`kvcli.runtime.attention.kvcli_attention`
dispatches on that type and the view attends itself with the kernels of :mod:`kvcli.runtime.kernels`.

A cache is also what the disk store (:mod:`kvcli.store`) saves: ``to_tensors()`` gives named
tensors for a safetensors file plus JSON-able facts, ``from_tensors()`` rebuilds and checks it.
Every layout registers under its ``kind`` in :data:`CACHE_TYPES` (:func:`cache_type`); importing
:mod:`kvcli.caches` imports every layout, so the store can always load any entry back.

The rule: a method's policy goes in ``kvcli/compressors/<name>.py``; a new cache layout, only if
it needs one, in ``kvcli/caches/<name>.py`` (imported by ``kvcli/caches/__init__.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import ClassVar

import torch

from ..runtime.buffers import finite_room, has_room, made_finite, widened
from ..runtime.measure import long_lived

CACHE_TYPES: dict[str, type] = {}


def _shares_more(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view into a larger storage: Phi-3's fused ``qkv_proj`` hands its values as
    a slice of the whole q|k|v projection, which the cache would otherwise keep alive for every
    layer (+12 GiB at 32k tokens on Phi-3.5-mini, simulated)."""
    return t.untyped_storage().nbytes() > _nbytes(t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
    # whether the layout cuts a sliding layer back to its window (:meth:`drop_front`); one that does
    # not keeps every entry, and its masks still apply the window
    cuts_windows: ClassVar[bool] = False
    # layer -> entries cut from the front of a sliding layer (its oldest, which its window no longer
    # reaches), in the layouts that count them by entry; replaced, never changed in place
    dropped: Mapping[int, int] = MappingProxyType({})
    # whether the layout has ``truncate(n_tokens)``, which cuts it back to its first n tokens (a prefix
    # state a query window reaches into: the prompt's last tokens then run again on top of it)
    truncatable: ClassVar[bool] = False
    # whether the layout has ``rewind(n)``, which takes back the last n rows appended to every layer
    # and goes on writing its buffers in place (a decoding pass's drafts the model did not take,
    # :mod:`kvcli.runtime.lookup`)
    rewindable: ClassVar[bool] = False
    rewound: int = 0  # rows ``rewind`` took back so far (what an observer of the steps counted may drop)
    # how the disk store reads an entry of the layout back (:func:`kvcli.store.entries.read_entry`):
    # False, its tensors loaded, checked against the entry's header and rebuilt (:meth:`from_tensors`);
    # True, its file opened in place and read as needed (:meth:`open_entry`, which checks it)
    opens_in_place: ClassVar[bool] = False
    # whether a decoding step of full attention over the layout may run as a captured CUDA graph
    # (:mod:`kvcli.runtime.graphs`; the plain layout: ``make_room``, ``grow``)
    graphable: ClassVar[bool] = False

    @classmethod
    def open_entry(cls, path, meta: dict):
        """The cache the disk-store entry at ``path`` (header JSON ``meta``) holds, opened in place:
        the layouts with :attr:`opens_in_place`. ValueError when anything differs."""
        raise NotImplementedError(f"{cls.__name__}'s entries are loaded, not opened in place")

    def for_device(self, device, room: int = 0):
        """This cache for one question on ``device``, an accelerator (the store keeps its memo on
        the host): by default a copy of its tensors there; ``room``: entries per layer a layout that
        reserves them leaves for the question and the answer (:meth:`kvcli.caches.kv.KVCache.upload`)."""
        return type(self).from_tensors(*self.to_tensors(), device=device)

    @property
    def kv_bits(self) -> int:
        """Bits each number of the KV is held in (``--kv-bits``): 16, the model's own dtype, unless
        the layout quantizes (:class:`~kvcli.caches.qkv.QuantKVCache`, a book's quantized storage)."""
        return 16

    def seq_len(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def drop_front(self, layer: int, n: int) -> None:
        """Drop the ``n`` oldest entries of ``layer``, a sliding layer whose window has passed them
        (:meth:`trim_windows`; the layouts with :attr:`cuts_windows`)."""
        raise NotImplementedError(f"{type(self).__name__} keeps a sliding layer's entries")

    def trim_windows(self, windows, *, slack: int = 0, room: int = 0, layers: Iterable[int] | None = None) -> None:
        """Cut each sliding layer (of ``layers``; default: all) back to what its window still
        reaches: ``windows`` (:class:`kvcli.runtime.windows.Windows`, the model's) says how many of its
        oldest entries go (:meth:`~kvcli.runtime.windows.Windows.excess`, with ``slack`` and ``room``), the
        layout drops them (:meth:`drop_front`). A layout that does not cut (:attr:`cuts_windows`)
        keeps them."""
        if not self.cuts_windows:
            return
        for i in windows.sliding_layers if layers is None else layers:
            if i < self.n_layers:
                n = windows.excess(i, self.get_seq_length(i), slack, room)
                if n:
                    self.drop_front(i, n)

    def stats(self) -> dict:
        """The layout's own counters, JSON-able (``--json`` method_stats; LazyLLM: the share of
        prompt tokens computed, blocksparse: the share of the KV attended per step); none by default."""
        return {}

    def nbytes(self) -> int:
        """Bytes of tensor data actually held."""
        return sum(_nbytes(t) for name in self.tensor_lists for t in getattr(self, name))

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

    def read_mask(self, n_prompt: int) -> torch.Tensor | None:
        """What the question and its answer read of what the cache holds, as :meth:`kept_mask`,
        where a layout attends less than it holds (a stored book's retrieved blocks); None: all
        it holds is read."""
        return None

    def held_positions(self, layer: int) -> torch.Tensor:
        """The position of each of ``layer``'s prompt rows, in row order: (n_kv_heads, rows) long
        (:mod:`kvcli.cite.attribution` maps a decoding step's attention to the prompt with it; the rows
        after them are decoded tokens). Layouts whose views attend themselves report weights with
        :meth:`~kvcli.runtime.attention.LayerView.read_weights` instead."""
        raise NotImplementedError(f"{type(self).__name__} does not report where its rows come from")


SPARE_SLOTS = 64  # room a layer's buffer leaves for later appends: at least this many slots ...
SPARE_SHARE = 32  # ... or 1/32 of its entries


def written_by(owner) -> dict:
    """(list names, layer) -> (entries, data pointers) of the buffers ``owner`` itself wrote last."""
    return owner.__dict__.setdefault("_written", {})


def _moved(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A new buffer for ``t`` (1, heads, m, d) with room for ``rows`` >= m rows and some to spare
    (1/32 of them, at least 64 slots), holding ``t``'s rows first: its first ``rows`` rows (the
    rows past m zeroed and the storage marked, :func:`~kvcli.runtime.buffers.made_finite`); the
    caller writes rows m.. itself."""
    m = t.shape[-2]
    cap = rows + max(SPARE_SLOTS, rows // SPARE_SHARE)
    with long_lived(t.device, _nbytes(t) // max(m, 1) * cap, always=True):
        buf = t.new_empty((*t.shape[:-2], cap, t.shape[-1]))
    buf[..., :m, :].copy_(t)
    return made_finite(buf, m)[..., :rows, :]


def append_rows(owner, names: tuple[str, ...], layer: int, news: tuple[torch.Tensor, ...]) -> None:
    """Append ``news`` (1, heads, new, d) — one tensor per list of ``owner`` named in ``names`` —
    to ``layer`` of those lists, in place: each list's entry is a view of the first entries of a
    buffer with room to spare (1/32 of the entries, at least 64 slots), widened over its storage,
    so an append copies its own rows, not the layer (``torch.cat`` would copy all of it, every
    decoding step). A new buffer (with room) when ``owner`` did not write the layer's current
    entries itself, or a buffer is full: a buffer has one writer, the cache that made it, and it
    writes only past every entry it ever held, so a view handed out (a copy of the cache shares
    the views; a layer cut back or replaced) is never overwritten. Nothing but the layer's view
    holds a buffer, so a layer replaced by an eviction frees it at once."""
    olds = [getattr(owner, name)[layer] for name in names]
    m, new = olds[0].shape[-2], news[0].shape[-2]
    if _wrote(owner, names, layer, olds) and all(has_room(t, m + new) for t in olds):
        bufs = [widened(t, m + new) for t in olds]
    else:
        bufs = [_moved(t, m + new) for t in olds]
    for buf, rows in zip(bufs, news):
        buf[..., m:, :].copy_(rows)
    _hold(owner, names, layer, bufs)


def _wrote(owner, names: tuple[str, ...], layer: int, olds: list[torch.Tensor]) -> bool:
    """Whether ``owner`` itself wrote ``layer``'s current entries ``olds`` (its buffers: it may append in place)."""
    return written_by(owner).get((names, layer)) == (olds[0].shape[-2], *(t.data_ptr() for t in olds))


def _hold(owner, names: tuple[str, ...], layer: int, bufs: list[torch.Tensor]) -> None:
    """``bufs`` become ``layer`` of the lists named in ``names``, written by ``owner`` (:func:`written_by`)."""
    for name, buf in zip(names, bufs):
        getattr(owner, name)[layer] = buf
    written_by(owner)[(names, layer)] = (bufs[0].shape[-2], *(buf.data_ptr() for buf in bufs))


def make_room(owner, names: tuple[str, ...], layer: int, rows: int) -> None:
    """Give ``layer`` of the lists of ``owner`` named in ``names`` ``rows`` finite rows past its
    entries in buffers of its own (:func:`~kvcli.runtime.buffers.finite_room`), moving it to new
    ones where they are not (as :func:`append_rows` would): what a decoding step captured as a CUDA
    graph (:mod:`kvcli.runtime.graphs`) writes in place and reads past the entries, weighed by zero."""
    olds = [getattr(owner, name)[layer] for name in names]
    m = olds[0].shape[-2]
    if not (_wrote(owner, names, layer, olds) and all(finite_room(t, m + rows) for t in olds)):
        _hold(owner, names, layer, [_moved(t, m + rows)[..., :m, :] for t in olds])


def grow_rows(owner, names: tuple[str, ...], layer: int, rows: int) -> None:
    """Count ``rows`` more entries in ``layer`` of the lists named in ``names``: rows written past
    its entries in place (after :func:`make_room`), the views widened over their buffers."""
    olds = [getattr(owner, name)[layer] for name in names]
    m = olds[0].shape[-2]
    if not all(has_room(t, m + rows) for t in olds):
        raise ValueError(f"layer {layer} has no room for {rows} more rows")
    _hold(owner, names, layer, [widened(t, m + rows) for t in olds])


def drop_rows(owner, names: tuple[str, ...], layer: int, n: int) -> None:
    """Drop the first ``n`` rows of ``layer`` of the lists of ``owner`` named in ``names`` (a
    sliding layer cut back to its window). The rest stays a view of its buffer, which the next
    append moves (decoding: a few rows past a window); when that would keep a buffer more than twice
    its size alive (a prompt's whole KV cut back to a window), the rest is copied into a buffer of
    its own with room to spare, written by ``owner`` (later appends land in place), and the large
    one is freed at once."""
    rests = [getattr(owner, name)[layer][..., n:, :] for name in names]
    if rests[0].untyped_storage().nbytes() > 2 * max(_nbytes(rests[0]), 1):
        rests = [_moved(t, t.shape[-2]) for t in rests]
        written_by(owner)[(names, layer)] = (rests[0].shape[-2], *(t.data_ptr() for t in rests))
    for name, t in zip(names, rests):
        getattr(owner, name)[layer] = t


def truncate_rows(owner, names: tuple[str, ...], n_tokens: int, layer: int | None = None) -> None:
    """Keep, in every layer (or ``layer`` only) of the lists of ``owner`` named in ``names``, only
    the rows of the first ``n_tokens`` tokens, and with every layer their positions; a sliding
    layer cut back to its window holds ``owner.dropped[layer]`` fewer (the plain layouts' ``truncate``)."""
    dropped = owner.dropped
    for i in range(owner.n_layers) if layer is None else (layer,):
        d = dropped.get(i, 0)
        for name in names:
            getattr(owner, name)[i] = getattr(owner, name)[i][:, :, : max(0, n_tokens - d)]
        if d > n_tokens:
            owner.dropped = {**dropped, i: n_tokens}
            dropped = owner.dropped
    if layer is None and owner.positions is not None:
        owner.positions = owner.positions[:n_tokens]


def rewind_rows(owner, names: tuple[str, ...], n: int) -> None:
    """Take back the last ``n`` rows of every layer of the lists of ``owner`` named in ``names``, and
    their positions: rows ``owner`` appended itself a moment ago, which nothing else holds (a
    decoding pass's rejected drafts). Unlike :func:`truncate_rows`, ``owner`` stays the writer of
    its buffers, so the next append lands in place, over the rows taken back (no copy of the layer);
    the caller vouches that no view of those rows outlives this call."""
    if n <= 0:
        return
    for i in range(owner.n_layers):
        olds = [getattr(owner, name)[i] for name in names]
        rows = olds[0].shape[-2]
        if n > rows:
            raise ValueError(f"layer {i} holds {rows} rows, not the {n} to take back")
        wrote = _wrote(owner, names, i, olds)
        for name, t in zip(names, olds):
            getattr(owner, name)[i] = t[..., : rows - n, :]
        if wrote:
            written_by(owner)[(names, i)] = (rows - n, *(t.data_ptr() for t in olds))
    owner.positions = owner.positions[: owner.positions.numel() - n]
    owner.rewound += n


def dropped_facts(dropped: Mapping[int, int]) -> dict:
    """``dropped`` as an entry's facts store it: {"dropped": {"layer": entries}} where any, else {}."""
    out = {str(layer): n for layer, n in sorted(dropped.items()) if n}
    return {"dropped": out} if out else {}


def read_dropped(facts: dict, n_layers: int, n_tokens: int) -> dict[int, int]:
    """The ``dropped`` of an entry's facts (:func:`dropped_facts`); ValueError outside the cache."""
    dropped = {int(layer): int(n) for layer, n in facts.get("dropped", {}).items()}
    if any(not 0 <= layer < n_layers or not 0 < n <= n_tokens for layer, n in dropped.items()):
        raise ValueError("dropped entries outside the cache")
    return dropped


class LayerKV(CacheBase):
    """Per-layer key and value tensors, appended as the layers run — the transformers contract
    shared by :class:`KVCache` and caches that keep different tokens per layer (LazyLLM):

        keys[l], values[l]: (1, n_kv_heads, seq_len_l, head_dim)

    Appending to a layer writes in place (:func:`append_rows`): a decoding step copies its own row,
    not the whole layer; a copy of the cache, a layer cut back (``truncate``) or replaced
    (eviction) gets a new buffer on its next append, so a view handed out is never overwritten.
    """

    tensor_lists: ClassVar[tuple[str, ...]] = ("keys", "values")
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # slots a new layer's buffer is made with (:meth:`reserve`); None: the first append's own size
    capacity: int | None = None

    def reserve(self, capacity: int | None) -> None:
        """Give each layer begun from now on a buffer of ``capacity`` entries (None: as many as its
        first append brings), so a prompt appended chunk by chunk, then the question and the answer,
        all land in place: no layer is copied to a larger buffer (a copy holds the layer twice, and
        leaves 1/32 of room behind) while the KV grows to that length."""
        self.capacity = capacity

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append ``key``/``value`` (batch, n_kv_heads, new, head_dim) to layer ``layer_idx`` (a
        new layer only right after the last). Returns that layer's whole key and value tensors."""
        # while a prompt is read on CPU the kept KV gets its own mappings (kvcli.runtime.measure.reading_prompt)
        if layer_idx == len(self.keys) and self.capacity is not None and self.capacity > key.shape[-2]:
            self._begin_reserved(key, value)
        elif layer_idx == len(self.keys):
            with long_lived(key.device, _nbytes(key)) as mapped:
                self.keys.append(key.clone() if mapped or _shares_more(key) else key)
                self.values.append(value.clone() if mapped or _shares_more(value) else value)
        elif layer_idx < len(self.keys):
            self._append(layer_idx, key, value)
        else:
            raise IndexError(f"layer {layer_idx} updated before layer {len(self.keys)}")
        return self.keys[layer_idx], self.values[layer_idx]

    def _begin_reserved(self, key: torch.Tensor, value: torch.Tensor, device=None) -> None:
        """A new layer in a buffer of :attr:`capacity` entries on ``device`` (default: the key's),
        holding ``key``/``value`` first."""
        new = key.shape[-2]
        device = key.device if device is None else torch.device(device)
        full = (*key.shape[:-2], self.capacity, key.shape[-1])
        with long_lived(device, _nbytes(key) // max(new, 1) * self.capacity):
            kbuf = torch.empty(full, dtype=key.dtype, device=device)
            vbuf = torch.empty(full, dtype=value.dtype, device=device)
        kbuf[..., :new, :].copy_(key)
        vbuf[..., :new, :].copy_(value)
        made_finite(kbuf, new)
        made_finite(vbuf, new)
        kbuf, vbuf = kbuf[..., :new, :], vbuf[..., :new, :]
        self.keys.append(kbuf)
        self.values.append(vbuf)
        written_by(self)[(("keys", "values"), len(self.keys) - 1)] = (new, kbuf.data_ptr(), vbuf.data_ptr())

    def _append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        append_rows(self, ("keys", "values"), layer, (key, value))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[-2] if layer_idx < len(self.keys) else 0

    @property
    def n_layers(self) -> int:
        return len(self.keys)
