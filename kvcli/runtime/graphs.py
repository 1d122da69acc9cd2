"""A decoding step of full attention captured once as a CUDA graph and replayed for every token.

A step of an 8B model launches ~600 small kernels; launched one by one from Python each waits on the
host (measured on an H200: 32 tokens/s, where reading the weights once a step would allow ~300). A
graph launches them all at once. Its shapes and addresses are fixed when captured, so the step runs
over fixed buffers:

* the cache's layers get room for every token of the answer first (``cache.make_room``, the plain
  layout :class:`~kvcli.caches.kv.KVCache`), its rows past the entries finite;
* each layer writes its new key and value at a row index held on the device (``index_copy_``) and
  attends its whole buffer with a mask of the rows written so far
  (:func:`kvcli.runtime.kernels.padded`: the rest weighed by exactly zero);
* the token, its position and the step count live on the device: a replay copies the last argmax
  in and the logits out, no host -> device copy and no synchronisation;
* after the replays the cache counts the rows written (``cache.grow``) and records their positions,
  as :func:`kvcli.runtime.decode.step` would have.

Observers that listen to every step (:func:`kvcli.runtime.attention.listening`: the answer's
citations) get each layer's query, saved by the graph, and the layer's keys after the replay: what
they would have seen. Where the step cannot be captured (not a CUDA device, a layout that attends
itself, a model with sliding windows) or ``KVCLI_CUDA_GRAPHS=0``,
:meth:`kvcli.runtime.decode.DecodeStep.full_attention` hands the loop the plain step. The same code runs uncaptured (``capture=False``) on any device: the tests
check it against the plain step on the CPU, and on a GPU captured.
"""

from __future__ import annotations

import torch

from . import attention, kernels
from .buffers import widened
from .graph_setting import ENV_CUDA_GRAPHS, graphs_allowed

MIN_STEPS = 4  # fewer steps than this are not worth a capture (two steps' work)


def unavailable(engine, cache, steps: int) -> str | None:
    """Why a full-attention step over ``cache`` is not captured as a graph; None when it is."""
    if not graphs_allowed():
        return f"{ENV_CUDA_GRAPHS}=0"
    if engine.device.type != "cuda":
        return "not a CUDA device"
    if steps < MIN_STEPS:
        return f"fewer than {MIN_STEPS} steps"
    if not getattr(cache, "graphable", False):
        return f"{type(cache).__name__} attends its own way"
    if engine.windows.hybrid:
        return "sliding-window layers are cut back as they decode"
    return None


class _Rows(attention.LayerView):
    """A layer of :class:`_Buffers` as the attention function sees it: attends the layer's whole
    buffer with the mask of the rows written so far, and saves its query for the listeners."""

    def attend(self, module, query, scaling, sliding_window, kernel):
        bufs, layer = self.cache, self.layer_idx
        if layer in bufs.queries:
            if bufs.queries[layer].shape != query.shape:  # the first run, never a captured one
                bufs.queries[layer] = torch.empty_like(query)
            bufs.queries[layer].copy_(query)
        key, value = bufs.kv[layer]
        return kernels.padded(kernel, query, key, value, bufs.allowed[layer], scaling)


class _Buffers:
    """What the layers of a captured step append to (the transformers cache contract): each layer's
    key and value buffers at the cache's length plus ``steps`` rows, written at the device row index
    ``rows[layer]``."""

    def __init__(self, cache, steps: int, listened: set[int]) -> None:
        self.kv = []
        for k, v in zip(cache.keys, cache.values):
            n = k.shape[-2] + steps
            self.kv.append((widened(k, n), widened(v, n)))
        device = cache.keys[0].device
        self.held = torch.tensor([k.shape[-2] for k in cache.keys], device=device)  # entries before the answer
        self.spans = [torch.arange(k.shape[-2], device=device) for k, _ in self.kv]
        self.rows: list[torch.Tensor] = []
        self.allowed: list[torch.Tensor] = []
        self.queries = {i: torch.empty(0, device=device) for i in listened}  # sized by the first run

    def at_step(self, step: torch.Tensor) -> None:
        """The row each layer writes, and the rows it attends, at ``step`` (a (1,) device tensor)."""
        rows = self.held + step
        self.rows = [rows[i : i + 1] for i in range(len(self.kv))]
        self.allowed = [span <= row for span, row in zip(self.spans, self.rows)]

    def update(self, key, value, layer_idx: int, *args, **kwargs):
        k, v = self.kv[layer_idx]
        k.index_copy_(2, self.rows[layer_idx], key)
        v.index_copy_(2, self.rows[layer_idx], value)
        view = _Rows(self, layer_idx)
        return view, view

    def record_positions(self, positions) -> None:
        """The positions are the cache's to record, after the replays (:meth:`StaticStep.finish`)."""


class StaticStep:
    """Greedy decoding steps of full attention over ``cache`` from ``start``, at most ``steps`` of
    them, each the same fixed computation: captured once as a CUDA graph and replayed
    (``capture=True``), or run as it is (the same numbers; what the tests compare on the CPU)."""

    def __init__(self, engine, cache, start: int, steps: int, capture: bool) -> None:
        self.engine, self.cache, self.start, self.steps = engine, cache, start, steps
        self.listeners = {i: fns for i, fns in attention.listeners().items() if fns}
        cache.make_room(steps)
        self.bufs = _Buffers(cache, steps, set(self.listeners))
        device = engine.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.first = torch.full((1,), start, dtype=torch.long, device=device)
        self.done = 0  # steps run (rows written past the cache's entries)
        self.counted = 0  # of them, rows the listened layers count and positions the cache records
        self.finished = False
        self.logits = self._forward()  # a first run: sizes the saved queries, warms CUDA up
        self.step.zero_()
        self.graph = None
        if capture:
            self.graph, self.logits = _captured(self._forward)
            self.step.zero_()

    @torch.inference_mode()
    def _forward(self) -> torch.Tensor:
        """One step, every shape and address fixed: the logits (vocab,) after ``self.token``."""
        self.bufs.at_step(self.step)
        with attention.listening({}):
            hidden = self.engine.forward(self.token, self.first + self.step, self.bufs)
        logits = self.engine.logits(hidden)[-1]
        self.step.add_(1)
        return logits

    def run(self, token: torch.Tensor, position: int, cache) -> torch.Tensor:
        """The logits (vocab,) after ``token`` (a (1,) device tensor) at ``position``: the next step."""
        if self.finished or cache is not self.cache or position != self.start + self.done or self.done >= self.steps:
            raise ValueError(f"a captured step runs its own cache's next {self.steps - self.done} positions in order")
        self.token.copy_(token.view(1))
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self.logits = self._forward()
        self.done += 1
        if self.listeners:
            self._tell_listeners()
        return logits.clone()  # the next replay writes over the graph's output

    def _tell_listeners(self) -> None:
        """Hand each listened layer's observers its query and keys, as a plain step would."""
        self._count(layers=self.listeners)
        for i, fns in self.listeners.items():
            query = self.bufs.queries[i].clone()
            for fn in fns:
                fn(query, self.cache.keys[i])

    def finish(self) -> None:
        """The cache counts the rows the steps wrote and records their positions; no step after."""
        if self.finished:
            return
        self.finished = True
        self.cache.grow(self.done, layers=[i for i in range(self.cache.n_layers) if i not in self.listeners])
        self._count(layers=self.listeners)

    def _count(self, layers) -> None:
        """``layers`` count the rows written since the last count; their positions recorded."""
        if self.done > self.counted:
            self.cache.grow(self.done - self.counted, layers=layers)
            self.cache.record_positions(torch.arange(self.start + self.counted, self.start + self.done))
            self.counted = self.done


def _captured(forward) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``forward`` captured as a CUDA graph, after a run on a side stream (PyTorch's recipe), and
    the output the graph writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    return graph, out
