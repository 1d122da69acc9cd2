"""PyramidKV: SnapKV's selection with budgets that shrink with depth (Cai et al., 2024,
arXiv:2406.02069).

"PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling": attention
spreads over the whole prompt in the lower layers and concentrates on a few tokens higher up, so
lower layers get more of the cache. Section 3 (budget allocation), with ``m`` layers and an
average of ``a = budget - window`` selected entries per layer (the window is kept in every layer):

* top layer: ``a / beta`` (``beta`` = 20 in the paper's code);
* bottom layer: ``2a - a / beta``, so the mean stays ``a``;
* layers in between: arithmetic decrease from bottom to top.

When the bottom layer would ask for more than the prompt holds, it keeps everything and the top
is raised to keep the same total. The total over layers is exactly ``m * budget`` — the same as
SnapKV at the same budget (rounding goes to the largest remainders). Selection within a layer is
SnapKV's (observation window, pooled votes, per KV head top-k; see :mod:`.snapkv`), with the
same GQA, positions and disk-store behaviour; layers keep different numbers of entries (the
attention mask is built per layer from its own lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import UsageError
from .base import knob
from .snapkv import SnapKV


def pyramid_budgets(n_layers: int, n: int, budget: int, window: int, beta: float) -> list[int]:
    """Entries kept per layer (bottom first) for a prompt of ``n`` tokens; sums to n_layers * budget."""
    window = min(window, n)
    avg = budget - window  # selected entries per layer, on average
    room = n - window  # what one layer can select at most
    if n_layers == 1 or avg <= 0:
        return [budget] * n_layers
    top = avg / beta
    bottom = 2 * avg - top
    if bottom > room:
        bottom, top = room, 2 * avg - room
    step = (bottom - top) / (n_layers - 1)
    exact = [bottom - i * step for i in range(n_layers)]
    counts = [int(x) for x in exact]
    short = n_layers * avg - sum(counts)
    for i in sorted(range(n_layers), key=lambda i: counts[i] - exact[i])[:short]:
        counts[i] += 1
    return [c + window for c in counts]


@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., 2024): SnapKV's selection with per-layer budgets decreasing
    arithmetically with depth (same total). arXiv:2406.02069."""

    name: ClassVar[str] = "pyramidkv"
    paper: ClassVar[str] = (
        "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling, arXiv:2406.02069"
    )
    keep_all: ClassVar[str] = "budget={n}"  # a budget of the whole prompt: every layer of the pyramid holds it all
    short_document_spec: ClassVar[str] = "pyramidkv:budget=0.25,window=8"
    title: ClassVar[str] = "PyramidKV"
    acts: ClassVar[str] = "SnapKV scores, budgets decreasing with depth (same total)"
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "as SnapKV"
    table_knobs: ClassVar[tuple[str, ...] | None] = ("budget", "beta")

    beta: float = knob(20.0, "the top layer selects (budget - window) / beta entries; larger = steeper pyramid")

    def check_knobs(self) -> None:
        super().check_knobs()
        if not self.beta >= 1:
            raise UsageError(f"{self.name}: beta must be at least 1, got {self.beta}")

    def layer_budgets(self, lm, n: int, k: int) -> list[int]:
        """The pyramid over the layers that attend to the whole context (all of them but a hybrid's
        sliding layers, which keep their window and are not evicted): its top is the last full layer."""
        full = lm.windows.full_layers
        budgets = [n] * lm.n_layers
        for layer, b in zip(full, pyramid_budgets(len(full), n, k, self.window, self.beta)):
            budgets[layer] = b
        return budgets
