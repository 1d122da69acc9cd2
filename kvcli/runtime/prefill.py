"""Reading a prompt: the prefill passes every method runs on, and the prompt's chunking.

Each pass runs token ids through the engine's decoder layers (:class:`kvcli.runtime.engine.Engine`, which
wires the model: embeddings, layers, RoPE, logits) into a cache; the engine's methods of the same
names call them:

* :func:`prefix_kv` — the KV of the first layers for ids at positions 0..n-1, and nothing else (no
  attention output or MLP in the last layer run): a prefix state, a method's own reading;
* :func:`prefill` — every layer, on top of a cache; the logits of the last position;
* :func:`prefill_by_layer` — the same arithmetic, layer by layer over chunks of the prompt (only
  one layer's KV written at a time: ``--kv-offload cpu``);
* :func:`prefill_on_prefix` — a prefix's KV and the rest of the prompt, layer by layer together (a
  compressor that evicts each layer as the pass runs it never holds the whole uncompressed KV).

Chunking: a layer's MLP is position-wise, so it may run over the prompt ``chunk`` tokens at a time
(:func:`chunk_mlps`): its intermediates (gate, up, act: 3 x intermediate_size per token, ~10 GiB per
layer at 128k tokens on an 8B model) are bounded by the chunk while attention still sees every query
at once — every observer (SnapKV's window, H2O's column sums over all queries) scores exactly what
it scored unchunked. :func:`prefix_kv` with a chunk shorter than its ids runs them chunk by chunk
through every layer (attention too: no one observes those queries).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable

import torch

from . import accelerator, attention
from .attention import Observer, StopForward
from .chunking import ENV_PREFILL_CHUNK, requested_chunk  # noqa: F401  (named here as before)

ACCELERATOR_PREFILL_CHUNK = 8192  # the default off the CPU; on the CPU: off (answers and speed as they were) ...
# ... but for a sliding-window hybrid (Gemma 2 / 3), whose prompt reads faster in chunks on the CPU:
# Gemma 3 270M, 17,269 tokens, alone, two threads: 35.7-36.0 s to the first token in chunks of
# 2,048 against 41.3-41.7 s in one pass, the same peak (docs/hybrid.md, "Speed"); SmolLM2 (no
# windows) read 3.7k tokens 8-15% slower in chunks, so it stays one pass. An embedded model may name
# its own (``cpu_prefill_chunk`` in kvcli/model/models.json, measured: the 0.5B Qwen's 1,024)
HYBRID_CPU_PREFILL_CHUNK = 2048


def default_prefill_chunk(device: torch.device, hybrid: bool = False, cpu: int | None = None) -> int | None:
    """``$KVCLI_PREFILL_CHUNK`` (tokens; 0: off), else 8192 off the CPU, and on the CPU the model's
    own measured chunk (``cpu``: an embedded model's ``cpu_prefill_chunk``), else 2048 for a model
    with sliding-window layers (``hybrid``), off for the others."""
    value = requested_chunk()
    if value is not None:
        return value if value > 0 else None
    if accelerator.on_accelerator(device):
        return ACCELERATOR_PREFILL_CHUNK
    return cpu or (HYBRID_CPU_PREFILL_CHUNK if hybrid else None)


# --- the MLP chunk -------------------------------------------------------------------------------
# decoder layer MLP -> [its chunk] (None: all tokens at once); one per module, shared by every
# engine on the model, whose patched forward reads it
_CHUNKS: weakref.WeakKeyDictionary[torch.nn.Module, list] = weakref.WeakKeyDictionary()


def chunk_mlps(layers: Iterable[torch.nn.Module]) -> None:
    """Make each decoder layer's MLP run over its tokens :func:`mlp_chunk` at a time (every
    supported family's decoder layer has an ``mlp``); once per module."""
    for layer in layers:
        mlp = layer.mlp
        if mlp in _CHUNKS:
            continue
        cell = _CHUNKS[mlp] = [None]
        mlp.forward = _chunked(mlp.forward, cell)


def _chunked(forward: Callable, cell: list) -> Callable:
    def chunked(hidden: torch.Tensor, *args, **kwargs):
        chunk, n = cell[0], hidden.shape[-2]
        if chunk is None or n <= chunk:
            return forward(hidden, *args, **kwargs)
        out = None
        for s in range(0, n, chunk):
            part = forward(hidden[..., s : s + chunk, :], *args, **kwargs)
            if out is None:
                out = part.new_empty(*part.shape[:-2], n, part.shape[-1])
            out[..., s : s + part.shape[-2], :] = part
        return out

    return chunked


def mlp_chunk(layers) -> int | None:
    """Tokens the MLPs of ``layers`` (made by :func:`chunk_mlps`) run at once (None: all)."""
    return _CHUNKS[layers[0].mlp][0] if len(layers) else None


def set_mlp_chunk(layers, chunk: int | None) -> None:
    if chunk is not None and chunk < 1:
        raise ValueError(f"prefill chunk must be at least 1 token, got {chunk}")
    for layer in layers:
        _CHUNKS[layer.mlp][0] = chunk


def slice_rope(rope, start: int, stop: int):
    """Positions ``start:stop`` of what :meth:`Engine.position_embeddings` returned."""
    if isinstance(rope, dict):
        return {t: slice_rope(r, start, stop) for t, r in rope.items()}
    cos, sin = rope
    return cos[:, start:stop], sin[:, start:stop]


def _stop(query: torch.Tensor, key: torch.Tensor) -> None:
    """An observer that ends the pass in its layer once the layer's KV is cached (:class:`StopForward`)."""
    raise StopForward


# --- the passes ----------------------------------------------------------------------------------
def prefix_kv(
    engine,
    ids: torch.Tensor,
    n_layers: int | None = None,
    observers: dict[int, list[Observer]] | None = None,
    window_room: int | None = None,
    cache=None,
) -> object:
    """The KV of layers 0..n_layers-1 (default: all) for ``ids`` (n,) at positions 0..n-1, into
    ``cache`` (an empty plain layout: by default the engine's new one, a :class:`kvcli.caches.KVCache`, or its 8/4-bit
    :class:`~kvcli.caches.qkv.QuantKVCache`).

    ``window_room``: each sliding layer (Gemma 2 / 3) is cut back, as soon as it has run, to the last
    w - 1 + ``window_room`` entries (:meth:`~kvcli.caches.base.CacheBase.trim_windows`): all that a
    pass going on from the prefix, or from up to ``window_room`` tokens before its end, reads there
    (:meth:`~kvcli.runtime.windows.Windows.can_resume`). None: every layer keeps every entry (a caller that
    reads them all).

    Only the KV is wanted, so the pass stops inside the last of those layers as soon as its keys
    and values are cached (its attention output and MLP are never computed). ``observers`` (per
    layer) see the pass's queries and keys: all at once, or chunk by chunk (below) — a chunk's
    query rows are the last ``q_len`` of the ``kv_len`` keys, at positions ``kv_len - q_len ..
    kv_len - 1``.

    With a prefill chunk (:attr:`Engine.prefill_chunk`) shorter than ``ids`` (off the CPU by
    default) the prompt runs ``chunk`` tokens at a time through every layer, each chunk's queries
    attending to the chunks before it (lower-right causal): no one observes those queries, so
    nothing needs them all at once, and every activation — attention's too — is bounded by the
    chunk; the KV goes into buffers reserved at the prompt's length plus :func:`reserving`'s room.
    The same arithmetic as :func:`prefill_by_layer` (bit for bit); within rounding of one pass.
    """
    n_layers = engine.n_layers if n_layers is None else n_layers
    if not 1 <= n_layers <= engine.n_layers:
        raise ValueError(f"n_layers must be in 1..{engine.n_layers}, got {n_layers}")
    cache = engine.new_cache() if cache is None else cache
    observers = {layer: list(fns) for layer, fns in (observers or {}).items()}
    observers.setdefault(n_layers - 1, []).append(_stop)
    windows = engine.windows
    trim = None
    if window_room is not None and windows.hybrid:
        trim = lambda i: cache.trim_windows(windows, room=window_room, layers=(i,))  # noqa: E731
    n, chunk = ids.numel(), engine.prefill_chunk
    if chunk is None or n <= chunk:
        engine.forward(ids, torch.arange(n), cache, layers=range(n_layers), observers=observers, after_layer=trim)
    else:
        cache.reserve(n + engine.kv_room)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            engine.forward(
                ids[s:e], torch.arange(s, e), cache, layers=range(n_layers), observers=observers, after_layer=trim
            )
        cache.reserve(None)  # later layers (none here) and copies: as usual
    if trim is not None:  # the last layer, if the pass stopped inside it
        cache.trim_windows(windows, room=window_room)
    return cache


@contextlib.contextmanager
def reserving(engine, room: int):
    """Within the block, a chunked :func:`prefix_kv` on ``engine`` reserves ``room`` more entries
    per layer (the rest of the prompt and the answer: they append in place)."""
    before, engine.kv_room = engine.kv_room, max(0, int(room))
    try:
        yield
    finally:
        engine.kv_room = before


def prefill(
    engine,
    ids: torch.Tensor,
    positions: torch.Tensor | None = None,
    cache=None,
    observers: dict[int, list[Observer]] | None = None,
    after_layer: Callable[[int], None] | None = None,
) -> tuple[object, torch.Tensor]:
    """Run all layers over ``ids``; returns the cache and the logits of the last position (vocab,).
    ``positions``: default, those after the cache's last; ``after_layer``: as for :meth:`Engine.forward`."""
    cache = engine.new_cache() if cache is None else cache
    if positions is None:
        start = 0 if cache.positions is None or not cache.positions.numel() else int(cache.positions[-1]) + 1
        positions = torch.arange(start, start + ids.numel())
    hidden = engine.forward(ids, positions, cache, observers=observers, after_layer=after_layer)
    return cache, engine.logits(hidden[:, -1:])[-1]


@torch.inference_mode()
def prefill_by_layer(
    engine,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache,
    chunk: int,
    observers: dict[int, list[Observer]] | None = None,
    before_layer: Callable[[int], None] | None = None,
    after_layer: Callable[[int], None] | None = None,
) -> tuple[object, torch.Tensor]:
    """:func:`prefill` of ``ids`` at ``positions`` on top of ``cache`` in chunks of ``chunk``
    tokens, run layer by layer: layer i over every chunk (each attending to the chunks before
    it), then layer i + 1 — the same arithmetic as running each chunk through every layer in
    turn (bit for bit), but only one layer's KV is being written at a time:
    ``before_layer(i)`` / ``after_layer(i)`` bracket it (``--kv-offload cpu`` keeps the layer
    on the GPU during its prefill and moves it to host memory once). The prompt's hidden states
    (n x hidden) are held between layers. Returns (cache, logits of the last position)."""
    n = ids.numel()
    hidden = engine.embed(ids)
    pos = positions.to(engine.device)
    rope = engine.position_embeddings(hidden, pos)
    with attention.attention_context(engine.context(observers)):
        for i in range(engine.n_layers):
            if before_layer is not None:
                before_layer(i)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                hidden[:, s:e] = engine.layer(i, hidden[:, s:e], pos[s:e], cache, slice_rope(rope, s, e))
            if after_layer is not None:
                after_layer(i)
    cache.record_positions(positions)
    return cache, engine.logits(hidden[:, -1:])[-1]


@torch.inference_mode()
def prefill_on_prefix(
    engine,
    ids: torch.Tensor,
    n_prefix: int,
    start: int,
    cache=None,
    observers: dict[int, list[Observer]] | None = None,
    after_layer: Callable[[int], None] | None = None,
) -> tuple[object, torch.Tensor]:
    """:func:`prefix_kv` of ``ids[:n_prefix]``, cut back to ``start`` tokens, then :func:`prefill`
    of ``ids[start:]`` on top of it with ``observers`` and ``after_layer`` — the same arithmetic,
    run one layer at a time over both parts: layer i of the prefix, then layer i of the rest,
    then ``after_layer(i)``. A compressor that evicts there never holds the whole prompt's
    uncompressed KV (the prefix pass would finish with all of it). Returns (cache, logits of the
    last position). ``cache``: an empty :class:`kvcli.caches.KVCache` to fill (default: the engine's new one)."""
    n = ids.numel()
    if not 0 <= start <= n_prefix <= n:
        raise ValueError(f"need 0 <= start <= n_prefix <= len(ids), got {start}, {n_prefix}, {n}")
    cache = engine.new_cache() if cache is None else cache
    pos_prefix, pos_rest = torch.arange(n_prefix), torch.arange(start, n)
    h_prefix, h_rest = engine.embed(ids[:n_prefix]), engine.embed(ids[start:])
    rope_prefix = engine.position_embeddings(h_prefix, pos_prefix)
    rope_rest = engine.position_embeddings(h_rest, pos_rest)
    # the prefix's last layer: only its KV is wanted (as in prefix_kv)
    prefix_ctx, rest_ctx = engine.context({engine.n_layers - 1: [_stop]}), engine.context(observers)
    for i in range(engine.n_layers):
        with attention.attention_context(prefix_ctx):
            try:
                h_prefix = engine.layer(i, h_prefix, pos_prefix, cache, rope_prefix)
            except StopForward:
                h_prefix = None
        cache.truncate(start, layer=i)
        with attention.attention_context(rest_ctx):
            h_rest = engine.layer(i, h_rest, pos_rest, cache, rope_rest)
        if after_layer is not None:
            after_layer(i)
    cache.record_positions(torch.arange(n))
    return cache, engine.logits(h_rest[:, -1:])[-1]
