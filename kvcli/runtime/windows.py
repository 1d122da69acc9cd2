"""Sliding windows: which layers attend only to their last w tokens, and what that means for the KV.

Gemma 2 / 3 interleave sliding-window layers with full-attention ones; Mistral v0.1 and Phi-3 slide
every layer over one window; Qwen 2 / 3 may slide some. transformers names each layer's kind in the
config's ``layer_types`` ("sliding_attention", "full_attention") where the family has them, and
gives the window in ``sliding_window``; without ``layer_types`` every layer takes the config's window
(the rule of transformers' ``cache_utils.get_layer_types_and_kwargs``). :class:`Windows` is that,
read once from the loaded model's config (``LoadedModel.windows``, which the engine holds as
``engine.windows``), and every engine, cache, scorer and the pipeline asks it:

* a layer's window (:meth:`Windows.window`: where it limits anything, shorter than the model's
  context), the full-attention layers (where compression acts), whether the model is a hybrid;
* what a sliding layer holds of n prompt tokens once they are read (its last w - 1: all the next
  token's window reaches; :meth:`Windows.holds`), and what full attention holds there after some
  decoding steps (:meth:`Windows.held_after`, :meth:`Windows.mean_held`);
* how many of a layer's entries its window has passed (:meth:`Windows.excess`): a cache cuts its
  own sliding layers back (:meth:`kvcli.caches.base.CacheBase.trim_windows`);
* whether a pass may go on from the first n tokens of a cache whose sliding layers were cut
  (:meth:`Windows.can_resume`).

A layer of window w lets the query at position p attend the keys at p - w + 1 .. p: the next token
needs only the layer's last w - 1 entries.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# A sliding layer's cache is cut back to its window once it holds this many entries more (decoding
# cuts every WINDOW_SLACK steps: a cut makes the next append copy the window into a new buffer)
WINDOW_SLACK = 64
# What a prefix state's sliding layers keep beyond their window w - 1 (``Engine.prefix_kv``'s
# ``window_room``): a question pass that goes back this many tokens into the prefix (a compressor's
# query window: SnapKV's 32 last prompt tokens) still finds every key its window reaches; one that
# goes back further runs the whole prompt again (:meth:`Windows.can_resume`)
PREFIX_WINDOW_ROOM = 256

# the layer types of transformers' configs whose attention slides over ``sliding_window``
SLIDING_TYPES = frozenset({"sliding_attention"})


@dataclasses.dataclass(frozen=True)
class Windows:
    """Each decoder layer's sliding window, and what follows from it (see the module docstring)."""

    # per layer: the window its attention masks with (None: none), as transformers applies it
    attention: tuple[int | None, ...]
    # the model's context (max_position_embeddings): a window as long as that limits nothing
    max_context: int | None = None
    # derived: per layer, the window where it is shorter than the context, else None; the layers
    # with such a window
    layers: tuple[int | None, ...] = dataclasses.field(init=False, repr=False)
    sliding_layers: tuple[int, ...] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        limit = self.max_context
        layers = tuple(w if w is not None and (not limit or w < limit) else None for w in self.attention)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "sliding_layers", tuple(i for i, w in enumerate(layers) if w is not None))

    @classmethod
    def of_config(cls, config, n_layers: int) -> Windows:
        """The windows a transformers text config gives its ``n_layers`` decoder layers."""
        window = getattr(config, "sliding_window", None)  # an optional field of the config
        types = getattr(config, "layer_types", None)  # listed by the families that mix layer kinds
        if types:
            attention = tuple(window if kind in SLIDING_TYPES else None for kind in types[:n_layers])
        else:
            attention = (window,) * n_layers
        return cls(attention, int(config.max_position_embeddings))

    @classmethod
    def none(cls, n_layers: int, max_context: int | None = None) -> Windows:
        """A model whose every layer attends to the whole context."""
        return cls((None,) * n_layers, max_context)

    # --- the facts ---------------------------------------------------------------------------------
    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window where it is shorter than the model's context, else None
        (the layer attends to the whole context)."""
        return self.layers[layer]

    def attention_window(self, layer: int) -> int | None:
        """The window layer ``layer``'s attention masks with (None: none), even one as long as the
        context: what a method that computes the layer's attention itself must apply too."""
        return self.attention[layer]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def full_layers(self) -> list[int]:
        """The layers that attend to the whole context: where compression acts on a hybrid model
        (Gemma 2 / 3: its sliding layers hold only their window anyway); every layer elsewhere."""
        return [i for i, w in enumerate(self.layers) if w is None]

    @property
    def hybrid(self) -> bool:
        """Whether some layers attend only to a sliding window (Gemma 2 / 3, Mistral-style windows)."""
        return bool(self.sliding_layers)

    @property
    def shortest(self) -> int | None:
        """The shortest window that limits a layer (None: none does)."""
        return min((w for w in self.layers if w is not None), default=None)

    # --- what a sliding layer holds ----------------------------------------------------------------
    def holds(self, layer: int, n: int, device=None) -> torch.Tensor | None:
        """What sliding layer ``layer`` holds of ``n`` prompt tokens once the prompt is read: its
        last ``w - 1`` (all the next token's window reaches), as an (n,) bool; None for a
        full-attention layer, where the compression methods act. Methods never score or evict a
        sliding layer: it keeps its window, as under full attention."""
        w = self.layers[layer]
        if w is None:
            return None
        import torch  # here: the model's facts read the windows without PyTorch (kvcli --help)

        mask = torch.zeros(n, dtype=torch.bool, device=device)
        mask[max(0, n - (w - 1)) :] = True
        return mask

    @staticmethod
    def held_after(n_prompt: int, window: int, fed: int) -> int:
        """Prompt entries full attention's sliding layer of ``window`` holds after ``fed`` decoding
        steps: its last ``w - 1`` once the prompt is read, then one more per step, cut back to
        ``w - 1`` once it holds more than ``w - 1 + WINDOW_SLACK`` (as decoding cuts it); the
        answer's tokens take the place of the oldest prompt ones."""
        held = min(n_prompt, window - 1)
        for _ in range(fed):
            held += 1
            if held > window - 1 + WINDOW_SLACK:
                held = window - 1
        return max(0, min(n_prompt, held - fed))

    def mean_held(self, n_prompt: int, fed: int) -> float:
        """Prompt entries full attention holds after ``fed`` decoding steps, mean over the layers:
        every prompt token in a full-attention layer, :meth:`held_after` in a sliding one."""
        held = [n_prompt if w is None else self.held_after(n_prompt, w, fed) for w in self.layers]
        return sum(held) / len(held)

    # --- cutting the sliding layers back -----------------------------------------------------------
    def excess(self, layer: int, n_held: int, slack: int = 0, room: int = 0) -> int:
        """How many of the ``n_held`` oldest entries of ``layer`` to drop: a layer of window w needs
        only its last w - 1 entries for the next token, and ``room`` more for a pass that goes back
        that many tokens (a prefix state: :data:`PREFIX_WINDOW_ROOM`). Cut once the layer holds
        more than w - 1 + ``room`` + ``slack`` (decoding cuts every ``slack`` steps, not every
        step); 0 for a full-attention layer."""
        w = self.layers[layer]
        if w is None or n_held <= w - 1 + room + slack:
            return 0
        return n_held - (w - 1 + room)

    def can_resume(self, cache, n_tokens: int) -> bool:
        """Whether a pass at positions ``n_tokens``, ``n_tokens + 1``, ... can go on from the first
        ``n_tokens`` tokens of ``cache`` (what its ``truncate`` keeps): every sliding layer cut back
        to its window (``cache.dropped``) still holds the last w - 1 of them."""
        dropped = cache.dropped
        return all(
            min(dropped.get(i, 0), n_tokens) <= max(0, n_tokens - (self.layers[i] - 1)) for i in self.sliding_layers
        )
