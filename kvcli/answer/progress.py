"""How far the prompt's read has got: :class:`prompt_progress`, the hooks that count the (token,
layer) pairs a pass runs and the disk store's watcher (another process's read, a resumed book)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ..store import KVStore, Watcher


class prompt_progress(Watcher):
    """While the prompt is read: ``on_progress(f)`` after each decoder layer a pass runs, ``f``
    the (token, layer) pairs run over ``n_tokens`` x layers (capped at 1). A method that reads
    fewer (a selector's second pass) ends below 1, one that reads more (Finch's chunks) waits at 1;
    a prefix from the disk store is not read: nothing more is said once it came (a hit). Counted
    by forward pre-hooks on the model's layers (the engine is unchanged), removed at the first
    answer token (``done``) or on leaving.

    With a disk ``store`` it is the store's :class:`kvcli.store.kvstore.Watcher` (``on_wait``: the
    wait for another process, ``on_resume``: a book read resuming) and tells the store how far
    this process's computation is (:meth:`kvcli.store.KVStore.progress`), for the processes
    waiting for it."""

    def __init__(
        self,
        engine,
        n_tokens: int,
        on_progress: Callable[[float], None] | None,
        store: KVStore | None = None,
        on_wait: Callable[[str | None], None] | None = None,
        on_resume: Callable[[float], None] | None = None,
        retrieves: bool = False,
    ) -> None:
        self.engine, self.on_progress, self.store = engine, on_progress, store
        # a method that retrieves (pages) says what it reads once it chose (:meth:`expect`): the
        # passes it runs to choose (pages:expand's passage) are not the reading, nothing is said of them
        self.choosing = retrieves
        self.on_wait, self.on_resume = on_wait, on_resume
        self.n_layers = max(1, engine.n_layers)
        self.total = max(1, n_tokens * self.n_layers)
        self.count = 0
        self.quiet = False  # the prefix came from the store: nothing is read
        self.handles: list = []
        self.watched = contextlib.ExitStack()

    def __enter__(self) -> prompt_progress:
        if self.on_progress is not None or self.store is not None:
            self.handles = [
                layer.register_forward_pre_hook(self._hook, with_kwargs=True) for layer in self.engine.layers
            ]
        if self.store is not None:
            self.watched.enter_context(self.store.watching(self))
        return self

    def _hook(self, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        self.count += int(hidden.shape[1]) if hidden is not None and hidden.dim() == 3 else 0
        if self.store is not None:
            self.store.progress(self.count // self.n_layers)
        if self.on_progress is not None and not self.quiet and not self.choosing:
            self.on_progress(min(1.0, self.count / self.total))

    def expect(self, n_tokens: int) -> None:
        """The prompt tokens that will be read, once a method that retrieves chose them (``pages``):
        the progress counts those, not the whole prompt's, nor the passes the method ran to choose
        them (``pages:expand``'s passage, written by the model first)."""
        self.total = max(1, n_tokens * self.n_layers)
        self.count, self.choosing = 0, False

    # --- what the store says (kvcli.store.kvstore.Watcher) -------------------------------------------
    def waiting(self, holder) -> None:
        if self.on_wait is not None:
            self.on_wait(f"waiting for {holder.describe() if holder is not None else 'another kvcli process'}")

    def waited(self) -> None:
        if self.on_wait is not None:
            self.on_wait(None)

    def loaded(self) -> None:
        self.quiet = True

    def resumed(self, done: int, total: int) -> None:
        self.count += done * self.n_layers
        if self.on_resume is not None:
            self.on_resume(min(1.0, self.count / self.total))

    def done(self, token: int | None = None) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __exit__(self, *exc) -> None:
        self.done()
        self.watched.close()
