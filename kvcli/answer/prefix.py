"""The reusable document prefix: the question-agnostic start of a prompt, and a method's state of it.

A prompt is document first, question last (:mod:`kvcli.answer.prompt`), so what a method computes from its
first ``Prompt.prefix_len`` tokens — the document and the template around it — does not depend on
the question: the method's *prefix state* (``Compressor.prefix_state`` names what it depends on,
``build_prefix`` computes it: full attention's KV by default). The disk store keeps it, so a second
question about the document starts from it, and each question runs on top of it: cold, warm and
``--no-cache`` runs do the same arithmetic and give token-identical answers.

:class:`Prefix` owns that state for one run, end to end:

* :meth:`Prefix.of` — the prefix of a prompt for the stage that reads the prompt first (the
  pipeline's reader), or None when that method keeps no prefix state;
* the store, :meth:`Prefix.fetch` — the state from the disk store (a hit), else computed and
  written there (a miss; InfLLM's book is written into its entry while the document is read), or
  computed alone (no store: off); the first time the state is wanted, once;
* :meth:`Prefix.take` — the state for the run to extend: the state itself when nothing else holds
  it (no store, or the upload of the store's host copy to an accelerator), else :meth:`Prefix.copy`;
* :meth:`Prefix.extend` — the rest of the prompt run on top of the state (the pipeline's default
  prefill), cut back first when a compressor needs the queries of tokens inside the prefix; with
  full attention's KV that nothing else will hold, prefix and rest run layer by layer together.

What a method needs of its prefix is declared on its class: ``prefix_state`` / ``build_prefix`` /
``prefix_device`` (what, how, where), ``writes_prefix`` (a book written into its store entry while
it is read, InfLLM's: ``read`` / ``stored_bytes`` / ``storage_precision``, declared on
:class:`~kvcli.compressors.base.Compressor`), and on the state's cache class ``truncatable`` (whether it can be cut back).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from ..caches import KVCache, QuantKVCache
from ..compressors.base import Compressor, owned_phases
from ..errors import UsageError
from ..runtime import accelerator
from ..store import Fetched, KVStore, make_key
from .prompt import Prompt


def chunked_state(engine, ids: torch.Tensor, state: dict) -> dict:
    """``state`` as the store key hashes it: with the prefill chunk when the prefix pass runs chunk
    by chunk (off the CPU, a hybrid on the CPU, or ``KVCLI_PREFILL_CHUNK``): another chunk rounds
    differently. Unchunked (the CPU's default): ``state`` itself, so the keys of existing entries stay."""
    chunk = engine.prefill_chunk
    return state if chunk is None or ids.numel() <= chunk else {**state, "prefill_chunk": chunk}


class Prefix:
    """The question-agnostic start of a prompt and the reader's state of it, fetched the first time
    the run asks for it (see the module docstring)."""

    def __init__(
        self,
        engine,
        ids: torch.Tensor,
        reader: Compressor,
        state: dict,
        store: KVStore | None = None,
        meta: dict | None = None,
        quantized: bool = False,
    ) -> None:
        """``ids``: the prefix tokens (n,); ``state``: ``reader.prefix_state`` (what the state depends
        on); ``store``: the disk store (None: compute the state every time); ``meta``: facts recorded
        with a new store entry (document, method); ``quantized``: whoever extends the state takes an
        8/4-bit plain KV (:class:`~kvcli.caches.qkv.QuantKVCache`) as it is — full attention; every
        other method gets it back in 16 bits (:meth:`take`)."""
        lm = engine.lm
        self.engine, self.ids, self.reader, self.state = engine, ids, reader, state
        self.store, self.meta = store, meta or {}
        self.device = reader.prefix_device(engine)  # where the state is handed over (the host: an offloaded KV)
        # a disk store keeps the state: it is computed whole (to be written); on the CPU the store's
        # memo still holds it once taken (for the next question), so :meth:`take` hands out a copy
        self.stored = store is not None
        self.shared = self.stored and not accelerator.on_accelerator(self.device)
        # the state is full attention's KV of every layer, as the default build_prefix computes it
        self.full_kv = "build_prefix" not in owned_phases(type(reader)) and state == Compressor.prefix_state(reader, lm)
        self.fetched: Fetched | None = None  # how the state was obtained, once it was
        self._state = None
        self.quantized = quantized

    @classmethod
    def of(
        cls, engine, prompt: Prompt, reader: Compressor, store: KVStore | None, meta: dict, quantized: bool = False
    ) -> Prefix | None:
        """The prefix of ``prompt`` for ``reader``; None when the method keeps no prefix state (or the
        prompt has no prefix). ``quantized``: as for the constructor."""
        state = reader.prefix_state(engine.lm)
        if state is None or prompt.prefix_len == 0:
            return None
        return cls(engine, prompt.ids[: prompt.prefix_len], reader, state, store, meta, quantized)

    @property
    def n_tokens(self) -> int:
        return self.ids.numel()

    # --- the store ---------------------------------------------------------------------------------
    def fetch(self) -> tuple[object, Fetched]:
        """The state and how it was obtained: loaded from the disk store (hit), else computed with
        the reader's ``build_prefix`` and written there (miss), or computed alone (no store: off).
        A book (``writes_prefix``) is read straight into its new entry, whose size is known first."""
        engine, ids, reader = self.engine, self.ids, self.reader
        compute = functools.partial(reader.build_prefix, engine, ids)
        if self.store is None:
            t0 = time.perf_counter()
            state = compute()
            return state, Fetched("off", time.perf_counter() - t0)
        key = make_key(engine.lm, ids, chunked_state(engine, ids, self.state))
        if reader.writes_prefix:
            from ..store import fetch_book

            lm = engine.lm
            what = f"the document's KV ({ids.numel():,} tokens, {reader.storage_precision(lm)})"
            read = functools.partial(reader.read, engine, ids)
            return fetch_book(self.store, key, read, reader.stored_bytes(lm, ids.numel()), self.meta, what)
        return self.store.fetch(key, compute, self.meta, device=self.device, room=engine.kv_room)

    # --- handing the state over --------------------------------------------------------------------
    def take(self):
        """The state, the caller's to extend (appending the question's tokens never touches a stored
        one): the state itself, forgotten here (a later take fetches it again), when nothing else
        holds it; else :meth:`copy`. Handing it over keeps the prefix KV from being held twice while
        the question's tokens are appended (each layer's append into a new buffer frees the one it
        replaces) and while a compressor evicts."""
        if self.shared:
            return self._bits(self.copy())
        if self._state is None:
            self._state, self.fetched = self.fetch()
        state, self._state = self._state, None
        return self._bits(state)

    def _bits(self, state):
        """An 8/4-bit plain KV as the taker takes it: as it is (full attention), else in 16 bits (a
        method that evicts or reads the KV's tensors itself; the store's copy stays quantized)."""
        return state.dense() if isinstance(state, QuantKVCache) and not self.quantized else state

    def copy(self):
        """A copy of the state (fetched first, the first time), which stays here."""
        if self._state is None:
            self._state, self.fetched = self.fetch()
        return self._state.copy()

    # --- the rest of the prompt on top of it -------------------------------------------------------
    def extend(
        self,
        ids: torch.Tensor,
        *,
        query_window: int = 0,
        observers: dict | None = None,
        after_layer: Callable[[object, int], None] | None = None,
        by_layer: bool = False,
    ):
        """Run the prompt ``ids`` (n,), whose first :attr:`n_tokens` are this prefix, on top of the
        state; returns (cache, logits of the last position).

        The tokens after the prefix always run; when a compressor needs the queries of more of the
        last tokens (``query_window``) than that, the state is cut back and those tokens run again
        (same KV, so the answer does not change) — the whole prompt where a sliding layer of the
        state no longer holds what their windows reach (:meth:`~kvcli.runtime.windows.Windows.can_resume`).
        ``observers`` see the pass; ``after_layer(cache, i)`` runs as soon as layer i has run.
        ``by_layer``: compressors evict there; then, when the state is full attention's KV, not
        computed yet and held by nothing else (no store), prefix and rest run layer by layer together
        (:func:`kvcli.runtime.prefill.prefill_on_prefix`): the prompt's whole uncompressed KV is never held."""
        engine, n = self.engine, ids.numel()
        start = max(0, min(self.n_tokens, n - query_window))
        if by_layer and self.full_kv and not self.stored and self._state is None:
            t0 = time.perf_counter()
            cache = KVCache()
            out = engine.prefill_on_prefix(
                ids, self.n_tokens, start, cache, observers, after_layer=_bound(after_layer, cache)
            )
            self.fetched = Fetched("off", time.perf_counter() - t0)  # computed with the rest of the prompt
            return out
        cache = self.take()
        if start < self.n_tokens:
            if not cache.truncatable:
                raise UsageError(
                    f"the prefix state {self.state} cannot be cut back for a {query_window}-token query window"
                )
            if engine.windows.can_resume(cache, start):
                cache.truncate(start)
            else:
                # a sliding layer of the prefix kept its window and PREFIX_WINDOW_ROOM entries, fewer
                # than this query window goes back: the whole prompt runs
                cache, start = KVCache(), 0
        return engine.prefill(ids[start:], cache=cache, observers=observers, after_layer=_bound(after_layer, cache))


def _bound(after_layer: Callable[[object, int], None] | None, cache) -> Callable[[int], None] | None:
    return None if after_layer is None else functools.partial(after_layer, cache)


def report(*prefixes: Prefix | None) -> dict:
    """How the prefix state(s) of a run were obtained (``--json``'s ``cache``): the last one used, else off."""
    used = [p.fetched for p in prefixes if p is not None and p.fetched is not None]
    return (used[-1] if used else Fetched("off", 0.0)).to_json()
