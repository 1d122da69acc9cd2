"""The prefill/decode loop every method runs on.

kvcli drives a transformers ``*ForCausalLM`` layer by layer instead of calling its ``forward``:
that is what lets GemFilter stop after layer r, lets methods run any sub-sequence at any positions
on top of any cache, and keeps the logits of the long prompt from being materialised (only the last
row goes through the LM head). Attention runs through :mod:`kvcli.attention`.

Shapes:
    ids, positions: (q_len,) int64 — batch size is always 1
    hidden: (1, q_len, hidden_size)
    logits: (vocab,) float32 for the last position, or (q_len, vocab) from :meth:`Engine.logits`
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Callable, Iterable

import torch

from . import accelerator, attention, windows
from .attention import AttentionContext, Observer, StopForward
from .caches import KVCache


def _stop(query: torch.Tensor, key: torch.Tensor) -> None:
    """An observer that ends the pass in its layer once the layer's KV is cached (:class:`StopForward`)."""
    raise StopForward


# --- chunked prefill ----------------------------------------------------------------------------
# A layer's MLP is position-wise: run over the prompt ``chunk`` tokens at a time, its intermediates
# (gate, up, act: 3 x intermediate_size per token, ~10 GiB per layer at 128k tokens on an 8B model)
# are bounded by the chunk while attention still sees every query at once — so every observer
# (SnapKV's window, H2O's column sums over all queries) scores exactly what it scored unchunked.
ENV_PREFILL_CHUNK = "KVCLI_PREFILL_CHUNK"
ACCELERATOR_PREFILL_CHUNK = 8192  # the default off the CPU; on the CPU: off (answers and speed as they were) ...
# ... but for a sliding-window hybrid (Gemma 2 / 3), whose prompt reads faster in chunks on the CPU:
# Gemma 3 270M, 17,269 tokens, alone, two threads: 35.7-36.0 s to the first token in chunks of
# 2,048 against 41.3-41.7 s in one pass, the same peak (docs/hybrid.md, "Speed"); SmolLM2 (no
# windows) read 3.7k tokens 8-15% slower in chunks, so it stays one pass
HYBRID_CPU_PREFILL_CHUNK = 2048


def default_prefill_chunk(device: torch.device, hybrid: bool = False) -> int | None:
    """``$KVCLI_PREFILL_CHUNK`` (tokens; 0: off), else 8192 off the CPU, and on the CPU 2048 for a
    model with sliding-window layers (``hybrid``), off for the others."""
    env = os.environ.get(ENV_PREFILL_CHUNK, "").strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            from .errors import UsageError

            raise UsageError(f"{ENV_PREFILL_CHUNK} must be a whole number of tokens (0: off), not '{env}'") from None
        return value if value > 0 else None
    if accelerator.on_accelerator(device):
        return ACCELERATOR_PREFILL_CHUNK
    return HYBRID_CPU_PREFILL_CHUNK if hybrid else None


def _chunked_mlp(mlp: torch.nn.Module) -> None:
    """Make ``mlp`` run over its tokens ``mlp.kvcli_chunk`` at a time (None: all at once); once per module."""
    if getattr(mlp, "kvcli_chunk", False) is not False:
        return
    forward = mlp.forward
    mlp.kvcli_chunk = None

    def chunked(hidden: torch.Tensor, *args, **kwargs):
        chunk, n = mlp.kvcli_chunk, hidden.shape[-2]
        if chunk is None or n <= chunk:
            return forward(hidden, *args, **kwargs)
        out = None
        for s in range(0, n, chunk):
            part = forward(hidden[..., s : s + chunk, :], *args, **kwargs)
            if out is None:
                out = part.new_empty(*part.shape[:-2], n, part.shape[-1])
            out[..., s : s + part.shape[-2], :] = part
        return out

    mlp.forward = chunked


def slice_rope(rope, start: int, stop: int):
    """Positions ``start:stop`` of what :meth:`Engine.position_embeddings` returned."""
    if isinstance(rope, dict):
        return {t: slice_rope(r, start, stop) for t, r in rope.items()}
    cos, sin = rope
    return cos[:, start:stop], sin[:, start:stop]


class Engine:
    def __init__(self, lm) -> None:
        """``lm``: a :class:`kvcli.model.LoadedModel`."""
        self.lm = lm
        model = lm.model
        attention.install(model)
        base = model.get_decoder()
        self.embed_tokens = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.lm_head = model.get_output_embeddings()
        # --- hybrid sliding-window families (Gemma 2 / 3): per-layer RoPE and window, soft-capped logits
        cfg = lm._config
        # Gemma 3's rotary embedding takes the layer type (local / global RoPE base); its layers get
        # the (cos, sin) of their type. The embedding scale (sqrt(hidden)) is in Gemma's embed_tokens.
        self.layer_types = list(getattr(cfg, "layer_types", None) or []) or None
        self._rope_by_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        if self._rope_by_type and self.layer_types is None:
            raise ValueError(f"{type(self.rotary_emb).__name__} takes a layer type, but the config lists none")
        # the name a decoder layer takes its cache by: ``cache`` from transformers 5.24 on (where
        # ``past_key_values`` still works, with a FutureWarning on stderr), ``past_key_values`` before
        self._cache_kwarg = "cache" if "cache" in inspect.signature(self.layers[0].forward).parameters else "past_key_values"
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.windows = lm.windows  # each layer's sliding window (kvcli.windows)
        self.device = next(model.parameters()).device
        self.kernel = lm.attn
        for layer in self.layers:
            _chunked_mlp(layer.mlp)  # every supported family's decoder layer has an ``mlp``
        self._positions: torch.Tensor | None = None  # device_positions' table
        self.prefill_chunk = default_prefill_chunk(self.device, hybrid=self.windows.hybrid)

    @property
    def prefill_chunk(self) -> int | None:
        """Tokens a layer's MLP runs at once in a prefill (None: all): see :func:`default_prefill_chunk`."""
        return self.layers[0].mlp.kvcli_chunk if len(self.layers) else None

    @prefill_chunk.setter
    def prefill_chunk(self, chunk: int | None) -> None:
        if chunk is not None and chunk < 1:
            raise ValueError(f"prefill chunk must be at least 1 token, got {chunk}")
        for layer in self.layers:
            layer.mlp.kvcli_chunk = chunk

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    # --- building blocks ------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (q_len,) -> input hidden states (1, q_len, hidden)."""
        return self.embed_tokens(ids.to(self.device).view(1, -1))

    def position_embeddings(self, hidden: torch.Tensor, positions: torch.Tensor):
        """The model's RoPE (cos, sin) for ``positions`` (q_len,), as its layers take them; for a
        model whose layers differ (Gemma 3: local and global bases) a dict layer type -> (cos, sin),
        which :meth:`layer` resolves. Slice either with :func:`slice_rope`."""
        pos = positions.to(self.device).view(1, -1)
        if self._rope_by_type:
            return {t: self.rotary_emb(hidden, pos, t) for t in sorted(set(self.layer_types))}
        return self.rotary_emb(hidden, pos)

    def rotary(self, layer: int):
        """The rotary embedding of decoder layer ``layer`` as ``fn(x, position_ids) -> (cos, sin)``
        (what :mod:`kvcli.rope` takes): the model's own, or Gemma 3's for the layer's type."""
        if not self._rope_by_type:
            return self.rotary_emb
        kind = self.layer_types[layer]
        return lambda x, pos: self.rotary_emb(x, pos, kind)

    def rope_groups(self) -> dict[int, list[int]]:
        """Layers grouped by the rotary embedding they use: {first layer of the group: layers}."""
        if not self._rope_by_type:
            return {0: list(range(self.n_layers))}
        groups: dict[str, list[int]] = {}
        for i, t in enumerate(self.layer_types):
            groups.setdefault(t, []).append(i)
        return {g[0]: g for g in groups.values()}

    def layer(
        self,
        i: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache,
        rope=None,
    ) -> torch.Tensor:
        """Run decoder layer ``i`` on ``hidden`` (1, q_len, hidden) at ``positions`` (q_len,),
        appending its KV to ``cache``; returns (1, q_len, hidden). Call inside an
        :func:`kvcli.attention.attention_context` to set the kernel, observers or an explicit mask
        (methods that run different tokens in different layers, LazyLLM)."""
        pos = positions.to(self.device).view(1, -1)
        if rope is None:
            rope = self.position_embeddings(hidden, pos)
        if isinstance(rope, dict):
            rope = rope[self.layer_types[i]]
        out = self.layers[i](
            hidden,
            attention_mask=None,
            position_ids=pos,
            use_cache=cache is not None,
            position_embeddings=rope,
            **{self._cache_kwarg: cache},
        )
        return out[0] if isinstance(out, tuple) else out

    def context(self, observers: dict[int, list[Observer]] | None = None, mask=None) -> AttentionContext:
        """The attention context of a pass: this engine's kernel, plus observers / explicit mask."""
        return AttentionContext(kernel=self.kernel, observers=observers or {}, mask=mask)

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None,
        *,
        layers: Iterable[int] | None = None,
        observers: dict[int, list[Observer]] | None = None,
        after_layer: Callable[[int], None] | None = None,
        recorded: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Run ``ids`` at ``positions`` through ``layers`` (default: all), appending to ``cache``.

        Returns the hidden states after the last layer run, before the final norm: (1, q_len, hidden);
        None when an observer ended the pass early with :class:`StopForward`. ``after_layer(i)``
        is called as soon as layer i has run (compressors evict its KV there). ``ids`` and
        ``positions`` may be on the host or the model's device (moved once, not per layer);
        ``recorded``: the same positions on the host, for the cache's record, when ``positions``
        are on the device (a decoding step: no device -> host read).
        """
        hidden = self.embed(ids)
        pos = positions.to(self.device)
        rope = self.position_embeddings(hidden, pos)
        with attention.attention_context(self.context(observers)):
            try:
                for i in range(self.n_layers) if layers is None else layers:
                    hidden = self.layer(i, hidden, pos, cache, rope)
                    if after_layer is not None:
                        after_layer(i)
            except StopForward:
                hidden = None
        if cache is not None and (layers is None or 0 in layers):
            cache.record_positions(positions if recorded is None else recorded)
        return hidden

    def device_positions(self, start: int, stop: int) -> torch.Tensor:
        """``arange(start, stop)`` on the model's device, a view of one table made there (grown by
        doubling): a decoding step's position costs no host -> device copy."""
        table = self._positions
        if table is None or table.numel() < stop:
            table = torch.arange(max(stop, 2 * (0 if table is None else table.numel()), 4096), device=self.device)
            self._positions = table
        return table[start:stop]

    def prefix_kv(self, ids: torch.Tensor, n_layers: int | None = None,
                  observers: dict[int, list[Observer]] | None = None, window_room: int | None = None) -> KVCache:
        """The KV of layers 0..n_layers-1 (default: all) for ``ids`` (n,) at positions 0..n-1.

        ``window_room``: each sliding layer (Gemma 2 / 3) is cut back, as soon as it has run, to
        the last w - 1 + ``window_room`` entries (:meth:`~kvcli.caches.base.CacheBase.trim_windows`):
        all that a pass going on from the prefix, or from up to ``window_room`` tokens before its
        end, reads there (:meth:`~kvcli.windows.Windows.can_resume`). None: every layer keeps every
        entry (a caller that reads them all).

        Only the KV is wanted, so the pass stops inside the last of those layers as soon as its
        keys and values are cached (its attention output and MLP are never computed).
        ``observers`` (per layer) see the pass's queries and keys: all at once, or chunk by chunk
        (below) — a chunk's query rows are the last ``q_len`` of the ``kv_len`` keys, at
        positions ``kv_len - q_len .. kv_len - 1``.

        With a :attr:`prefill_chunk` shorter than ``ids`` (off the CPU by default) the prompt runs
        ``chunk`` tokens at a time through every layer, each chunk's queries attending to the
        chunks before it (lower-right causal): no one observes those queries, so nothing needs
        them all at once, and every activation — attention's too — is bounded by the chunk; the
        KV goes into buffers reserved at the prompt's length plus :meth:`reserving`'s room. The
        same arithmetic as :meth:`prefill_by_layer` (bit for bit); within rounding of one pass.
        """
        n_layers = self.n_layers if n_layers is None else n_layers
        if not 1 <= n_layers <= self.n_layers:
            raise ValueError(f"n_layers must be in 1..{self.n_layers}, got {n_layers}")
        cache = KVCache()
        observers = {layer: list(fns) for layer, fns in (observers or {}).items()}
        observers.setdefault(n_layers - 1, []).append(_stop)
        trim = None
        if window_room is not None and self.windows.hybrid:
            trim = lambda i: cache.trim_windows(self.windows, room=window_room, layers=(i,))  # noqa: E731
        n, chunk = ids.numel(), self.prefill_chunk
        if chunk is None or n <= chunk:
            self.forward(ids, torch.arange(n), cache, layers=range(n_layers), observers=observers, after_layer=trim)
        else:
            cache.reserve(n + self.kv_room)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                self.forward(ids[s:e], torch.arange(s, e), cache, layers=range(n_layers), observers=observers, after_layer=trim)
            cache.reserve(None)  # later layers (none here) and copies: as usual
        if trim is not None:  # the last layer, if the pass stopped inside it
            cache.trim_windows(self.windows, room=window_room)
        return cache

    # entries a prefix's KV buffers leave for what follows it (the question and the answer):
    # set for the duration of a run by :meth:`reserving`
    kv_room: int = 0

    @contextlib.contextmanager
    def reserving(self, room: int):
        """Within the block, a chunked :meth:`prefix_kv` reserves ``room`` more entries per layer
        (the rest of the prompt and the answer: they append in place)."""
        before, self.kv_room = self.kv_room, max(0, int(room))
        try:
            yield
        finally:
            self.kv_room = before

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: (1, q, hidden) -> (q, vocab) float32 (soft-capped where the family
        does it: Gemma 2's ``final_logit_softcapping``)."""
        logits = self.lm_head(self.norm(hidden))[0].float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    # --- the two phases -------------------------------------------------------------------------
    def prefill(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        observers: dict[int, list[Observer]] | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> tuple[KVCache, torch.Tensor]:
        """Run all layers over ``ids``; returns the cache and the logits of the last position (vocab,).
        ``after_layer``: as for :meth:`forward`."""
        cache = KVCache() if cache is None else cache
        if positions is None:
            start = 0 if cache.positions is None or not cache.positions.numel() else int(cache.positions[-1]) + 1
            positions = torch.arange(start, start + ids.numel())
        hidden = self.forward(ids, positions, cache, observers=observers, after_layer=after_layer)
        return cache, self.logits(hidden[:, -1:])[-1]

    @torch.inference_mode()
    def prefill_by_layer(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        chunk: int,
        observers: dict[int, list[Observer]] | None = None,
        before_layer: Callable[[int], None] | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> tuple[object, torch.Tensor]:
        """:meth:`prefill` of ``ids`` at ``positions`` on top of ``cache`` in chunks of ``chunk``
        tokens, run layer by layer: layer i over every chunk (each attending to the chunks before
        it), then layer i + 1 — the same arithmetic as running each chunk through every layer in
        turn (bit for bit), but only one layer's KV is being written at a time:
        ``before_layer(i)`` / ``after_layer(i)`` bracket it (``--kv-offload cpu`` keeps the layer
        on the GPU during its prefill and moves it to host memory once). The prompt's hidden states
        (n x hidden) are held between layers. Returns (cache, logits of the last position)."""
        n = ids.numel()
        hidden = self.embed(ids)
        pos = positions.to(self.device)
        rope = self.position_embeddings(hidden, pos)
        with attention.attention_context(self.context(observers)):
            for i in range(self.n_layers):
                if before_layer is not None:
                    before_layer(i)
                for s in range(0, n, chunk):
                    e = min(n, s + chunk)
                    hidden[:, s:e] = self.layer(i, hidden[:, s:e], pos[s:e], cache, slice_rope(rope, s, e))
                if after_layer is not None:
                    after_layer(i)
        cache.record_positions(positions)
        return cache, self.logits(hidden[:, -1:])[-1]

    @torch.inference_mode()
    def prefill_on_prefix(
        self,
        ids: torch.Tensor,
        n_prefix: int,
        start: int,
        cache: KVCache | None = None,
        observers: dict[int, list[Observer]] | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> tuple[KVCache, torch.Tensor]:
        """:meth:`prefix_kv` of ``ids[:n_prefix]``, cut back to ``start`` tokens, then :meth:`prefill`
        of ``ids[start:]`` on top of it with ``observers`` and ``after_layer`` — the same arithmetic,
        run one layer at a time over both parts: layer i of the prefix, then layer i of the rest,
        then ``after_layer(i)``. A compressor that evicts there never holds the whole prompt's
        uncompressed KV (the prefix pass would finish with all of it). Returns (cache, logits of the
        last position). ``cache``: an empty :class:`KVCache` to fill (default: a new one)."""
        n = ids.numel()
        if not 0 <= start <= n_prefix <= n:
            raise ValueError(f"need 0 <= start <= n_prefix <= len(ids), got {start}, {n_prefix}, {n}")
        cache = KVCache() if cache is None else cache
        pos_prefix, pos_rest = torch.arange(n_prefix), torch.arange(start, n)
        h_prefix, h_rest = self.embed(ids[:n_prefix]), self.embed(ids[start:])
        rope_prefix, rope_rest = self.position_embeddings(h_prefix, pos_prefix), self.position_embeddings(h_rest, pos_rest)
        # the prefix's last layer: only its KV is wanted (as in prefix_kv)
        prefix_ctx, rest_ctx = self.context({self.n_layers - 1: [_stop]}), self.context(observers)
        for i in range(self.n_layers):
            with attention.attention_context(prefix_ctx):
                try:
                    h_prefix = self.layer(i, h_prefix, pos_prefix, cache, rope_prefix)
                except StopForward:
                    h_prefix = None
            cache.truncate(start, layer=i)
            with attention.attention_context(rest_ctx):
                h_rest = self.layer(i, h_rest, pos_rest, cache, rope_rest)
            if after_layer is not None:
                after_layer(i)
        cache.record_positions(torch.arange(n))
        return cache, self.logits(h_rest[:, -1:])[-1]

    @torch.inference_mode()
    def step(self, token: int | torch.Tensor, position: int, cache) -> torch.Tensor:
        """One decoding step of full attention: the logits (vocab,) after ``token`` at ``position``.
        ``token``: an id, or a (1,) tensor on the model's device (the argmax of the last step's
        logits, never read back to the host here): then the step makes no host -> device copy and
        no synchronisation."""
        ids = torch.tensor([token]) if isinstance(token, int) else token.view(1)
        hidden = self.forward(ids, self.device_positions(position, position + 1), cache,
                              recorded=torch.tensor([position]))
        cache.trim_windows(self.windows, slack=windows.WINDOW_SLACK)
        return self.logits(hidden)[-1]

    @torch.inference_mode()
    def decode(
        self,
        first_logits: torch.Tensor,
        cache: KVCache,
        next_position: int,
        max_new_tokens: int,
        stop_ids: set[int],
        on_token: Callable[[int], None] | None = None,
        step: Callable[[int, int, object], torch.Tensor] | None = None,
        guard=None,
    ) -> list[int]:
        """Greedy decoding from ``first_logits``; returns the generated ids (without the stop token).

        ``step(token, position, cache) -> logits (vocab,)`` runs one decoding step (default
        :meth:`step`); methods that own decoding (``Compressor.decode_step``) pass theirs.
        ``guard``: a :class:`kvcli.stopping.AnswerGuard` that may end the answer earlier (an
        invented next question, a repeated sentence) and trims it at the token limit.
        """
        own = step is None
        out: list[int] = []
        logits = first_logits
        for i in range(max_new_tokens):
            chosen = torch.argmax(logits).view(1)
            token = int(chosen)  # the step's one synchronisation: the host needs the token
            if token in stop_ids:  # the guard may still drop a dangling end ("The answer is:")
                return out if guard is None else out[: guard.finish(out, at_limit=False)]
            out.append(token)
            if guard is not None:
                keep = guard.check(out)
                if keep is not None:
                    return out[:keep]
            if on_token is not None:
                on_token(token)
            if i + 1 == max_new_tokens:
                break
            # the default step takes the token where it already is (on the device); a method's own
            # step (decode_step) too when it says so (``step.device_token``), else the id
            if own:
                logits = self.step(chosen, next_position + i, cache)
            else:
                logits = step(chosen if getattr(step, "device_token", False) else token, next_position + i, cache)
        return out if guard is None else out[: guard.finish(out)]
