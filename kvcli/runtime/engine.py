"""The model's wiring: the decoder layers kvcli drives one by one, and the engine every method runs on.

kvcli drives a transformers ``*ForCausalLM`` layer by layer instead of calling its ``forward``:
that is what lets GemFilter stop after layer r, lets methods run any sub-sequence at any positions
on top of any cache, and keeps the logits of the long prompt from being materialised (only the last
row goes through the LM head). Attention runs through :mod:`kvcli.runtime.attention`.

:class:`Engine` holds the wiring — embeddings, the layers, RoPE per layer type (Gemma 3), the final
norm and LM head with Gemma 2's soft-capped logits — and :meth:`Engine.forward`, the one pass all
else is made of. The prompt's passes are :mod:`kvcli.runtime.prefill`'s, decoding is :mod:`kvcli.runtime.decode`'s,
each layer's sliding window :mod:`kvcli.runtime.windows`'s (``engine.windows``); the engine's methods of
those names (``prefix_kv``, ``prefill``, ``step``, ``decode``, ...) call them, so a method's code
reads ``engine.prefill(...)``.

Shapes:
    ids, positions: (q_len,) int64 — batch size is always 1
    hidden: (1, q_len, hidden_size)
    logits: (vocab,) float32 for the last position, or (q_len, vocab) from :meth:`Engine.logits`
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch

from . import attention, decode, graph_setting, prefill
from .attention import AttentionContext, Observer, StopForward
from .decode import DecodeStep


class Engine:
    """A loaded model, wired for kvcli to drive layer by layer (see the module docstring)."""

    # entries a prefix's KV buffers leave for what follows it (the question and the answer): set
    # for the duration of a run by :meth:`reserving`, read by a chunked :meth:`prefix_kv`
    kv_room: int = 0

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
        cfg = lm.text_config
        # Gemma 3's rotary embedding takes the layer type (local / global RoPE base); its layers get
        # the (cos, sin) of their type. The embedding scale (sqrt(hidden)) is in Gemma's embed_tokens.
        self.layer_types = list(getattr(cfg, "layer_types", None) or []) or None
        self._rope_by_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        if self._rope_by_type and self.layer_types is None:
            raise ValueError(f"{type(self.rotary_emb).__name__} takes a layer type, but the config lists none")
        # the name a decoder layer takes its cache by: ``cache`` from transformers 5.24 on (where
        # ``past_key_values`` still works, with a FutureWarning on stderr), ``past_key_values`` before
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.layers[0].forward).parameters else "past_key_values"
        )
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.windows = lm.windows  # each layer's sliding window (kvcli.runtime.windows)
        self.device = next(model.parameters()).device
        self.kernel = lm.attn
        self.new_cache = lm.new_cache  # the empty cache a pass fills when its caller gives none
        self._positions: torch.Tensor | None = None  # device_positions' table
        prefill.chunk_mlps(self.layers)
        self.prefill_chunk = prefill.default_prefill_chunk(
            self.device, hybrid=self.windows.hybrid, cpu=lm.cpu_prefill_chunk
        )
        graph_setting.graphs_allowed()  # a bad $KVCLI_CUDA_GRAPHS is said before the model runs (read again per answer)

    @property
    def prefill_chunk(self) -> int | None:
        """Tokens a layer's MLP runs at once in a prefill (None: all): see
        :func:`kvcli.runtime.prefill.default_prefill_chunk`; shared by every engine on the model."""
        return prefill.mlp_chunk(self.layers)

    @prefill_chunk.setter
    def prefill_chunk(self, chunk: int | None) -> None:
        prefill.set_mlp_chunk(self.layers, chunk)

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
        which :meth:`layer` resolves. Slice either with :func:`kvcli.runtime.prefill.slice_rope`."""
        pos = positions.to(self.device).view(1, -1)
        if self._rope_by_type:
            return {t: self.rotary_emb(hidden, pos, t) for t in sorted(set(self.layer_types))}
        return self.rotary_emb(hidden, pos)

    def rotary(self, layer: int):
        """The rotary embedding of decoder layer ``layer`` as ``fn(x, position_ids) -> (cos, sin)``
        (what :mod:`kvcli.runtime.rope` takes): the model's own, or Gemma 3's for the layer's type."""
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
        :func:`kvcli.runtime.attention.attention_context` to set the kernel, observers or an explicit mask
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
        cache,
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

    @torch.inference_mode()
    def rows(self, ids: torch.Tensor, position: int, cache) -> torch.Tensor:
        """One pass of full attention over ``ids`` (n,) at ``position`` on, their KV appended to
        ``cache``: the logits after each, (n, vocab). A decoding step's pass
        (:func:`kvcli.runtime.decode.step`), or a draft's (:meth:`kvcli.runtime.lookup.PromptLookup.check`)."""
        n = ids.numel()
        positions = self.device_positions(position, position + n)
        return self.logits(self.forward(ids, positions, cache, recorded=torch.arange(position, position + n)))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: (1, q, hidden) -> (q, vocab) float32 (soft-capped where the family
        does it: Gemma 2's ``final_logit_softcapping``)."""
        logits = self.lm_head(self.norm(hidden))[0].float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    # --- the prompt's passes (kvcli.runtime.prefill) and decoding (kvcli.runtime.decode) --------------------------
    def prefix_kv(
        self,
        ids: torch.Tensor,
        n_layers: int | None = None,
        observers: dict[int, list[Observer]] | None = None,
        window_room: int | None = None,
        cache=None,
    ) -> object:
        """:func:`kvcli.runtime.prefill.prefix_kv`: the KV of the first ``n_layers`` layers for ``ids``."""
        return prefill.prefix_kv(self, ids, n_layers, observers, window_room, cache)

    def reserving(self, room: int):
        """:func:`kvcli.runtime.prefill.reserving`: a chunked :meth:`prefix_kv` leaves ``room`` entries."""
        return prefill.reserving(self, room)

    def prefill(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache=None,
        observers: dict[int, list[Observer]] | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> tuple[object, torch.Tensor]:
        """:func:`kvcli.runtime.prefill.prefill`: every layer over ``ids``; (cache, last logits)."""
        return prefill.prefill(self, ids, positions, cache, observers, after_layer)

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
        """:func:`kvcli.runtime.prefill.prefill_by_layer`: the prefill, layer by layer over chunks."""
        return prefill.prefill_by_layer(self, ids, positions, cache, chunk, observers, before_layer, after_layer)

    def prefill_on_prefix(
        self,
        ids: torch.Tensor,
        n_prefix: int,
        start: int,
        cache=None,
        observers: dict[int, list[Observer]] | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> tuple[object, torch.Tensor]:
        """:func:`kvcli.runtime.prefill.prefill_on_prefix`: a prefix and the rest, layer by layer together."""
        return prefill.prefill_on_prefix(self, ids, n_prefix, start, cache, observers, after_layer)

    def step(self, token: int | torch.Tensor, position: int, cache) -> torch.Tensor:
        """:func:`kvcli.runtime.decode.step`: one decoding step of full attention; the logits (vocab,)."""
        return decode.step(self, token, position, cache)

    def decode(
        self,
        first_logits: torch.Tensor,
        cache,
        next_position: int,
        max_new_tokens: int,
        stop_ids: set[int],
        on_token: Callable[[int], None] | None = None,
        step: DecodeStep | None = None,
        guard=None,
        logprobs: list[torch.Tensor] | None = None,
        drafts=None,
    ) -> list[int]:
        """:func:`kvcli.runtime.decode.greedy`: greedy decoding from ``first_logits``; the answer's ids."""
        return decode.greedy(
            self, first_logits, cache, next_position, max_new_tokens, stop_ids, on_token, step, guard, logprobs, drafts
        )
