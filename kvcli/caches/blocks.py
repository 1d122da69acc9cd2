"""The block cache of block-sparse retrieval attention (:mod:`kvcli.compressors.blocksparse`).

The KTransformers long-context framework (InfLLM, arXiv:2402.04617, generalised with Quest,
arXiv:2406.10774, and SnapKV's preselection) keeps the *whole* KV of the prompt and lets each
decoding step attend to part of it. The prompt of ``n`` tokens is split into

    Initial  [0, initial)                 — always attended (attention sinks)
    Context  [initial, ctx_end)           — ``n_blocks`` blocks of ``block_size`` tokens, retrieved
    Local    [ctx_end, n) + generated     — always attended; the Context is a whole number of
                                            blocks, the few tokens left over join Local

Storage, per layer (batch 1, after RoPE, GQA never expanded):

    keys[l], values[l]:   (1, n_kv, n_blocks * block_size, d)  — the Context, on the *storage*
                          device (CPU, pinned when possible, with ``--kv-offload cpu`` on CUDA)
    fkeys[l], fvalues[l]: (1, n_kv, initial + local + generated, d) — always attended, on the
                          compute device; decoding appends here
    reps[l]:              (n_kv, n_blocks, R, d) float32 representative keys, compute device
                          (Quest: R = 2, [max, min] element-wise; dynamic / infllm: the R keys
                          of the block with the highest per-token score)
    candidates[l]:        (H, P) preselected block indices (H = n_kv separate, 1 shared) or None

At a decode step (one query token) :meth:`BlockCache.update` returns a :class:`BlockLayer` view
(a :class:`~kvcli.runtime.attention.LayerView`) so :func:`kvcli.runtime.attention.kvcli_attention` hands it the attention: the layer
selects (or reuses) its blocks, gathers Initial + selected blocks + Local and runs SDPA on them.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..runtime import kernels
from ..runtime.attention import LayerView
from .base import CacheBase, cache_type
from .kv import KVCache
from .representatives import block_representatives, block_scores, partition

# --------------------------------------------------------------------------- prefill with offload


@cache_type
class ScoredKVCache(KVCache):
    """Full attention's KV of the question-agnostic prefix plus, per layer, the sums of InfLLM's
    representative score of its tokens (:func:`~kvcli.caches.representatives.infllm_accumulate`): blocksparse's prefix state with
    ``representative=infllm`` (the score needs the query of every document token, which a plain
    KV state no longer has).

        rep_sums[l]: (n_kv, n) float32 — the summed ``q_g · k_m`` of token m's successors g
        rows_scored: the query rows 0..rows_scored-1 that were added (the prefix's own tokens)
        local:       l_L, the successors each token listens to
    """

    # per-layer state of its own: a sliding layer keeps its entries (its mask still applies the window)
    cuts_windows: ClassVar[bool] = False
    graphable: ClassVar[bool] = False  # state of its own besides the keys and values
    rewindable: ClassVar[bool] = False

    kind: ClassVar[str] = "kv+infllm"

    def __init__(self) -> None:
        super().__init__()
        self.rep_sums: list[torch.Tensor] = []
        self.rows_scored = 0
        self.local = 0

    @classmethod
    def of(cls, kv: KVCache, rep_sums: list[torch.Tensor], rows_scored: int, local: int) -> ScoredKVCache:
        out = cls()
        out.keys, out.values, out.positions = list(kv.keys), list(kv.values), kv.positions
        out.rep_sums = [r[:, : kv.get_seq_length(0)].to("cpu") for r in rep_sums]
        out.rows_scored, out.local = int(rows_scored), int(local)
        return out

    def nbytes(self) -> int:
        return super().nbytes() + sum(r.numel() * r.element_size() for r in self.rep_sums)

    def copy(self) -> ScoredKVCache:
        other = ScoredKVCache.of(self, self.rep_sums, self.rows_scored, self.local)
        other.kept = None if self.kept is None else list(self.kept)
        return other

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, facts = super().to_tensors()
        for i, r in enumerate(self.rep_sums):
            tensors[f"rep.{i}"] = r.detach().to("cpu", torch.float32).contiguous()
        return tensors, {**facts, "rows_scored": self.rows_scored, "local": self.local}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], facts: dict, device="cpu") -> ScoredKVCache:
        reps = {name: t for name, t in tensors.items() if name.startswith("rep.")}
        rest = {name: t for name, t in tensors.items() if not name.startswith("rep.")}
        cache = super().from_tensors(rest, facts, device)
        n_layers, n_tokens = int(facts["n_layers"]), int(facts["n_tokens"])
        if set(reps) != {f"rep.{i}" for i in range(n_layers)}:
            raise ValueError("unexpected representative-score tensors")
        for i in range(n_layers):
            r = reps[f"rep.{i}"]
            if r.dim() != 2 or r.shape != (cache.keys[i].shape[1], n_tokens) or r.dtype != torch.float32:
                raise ValueError(f"rep.{i} has shape {tuple(r.shape)}")
            cache.rep_sums.append(r)
        cache.rows_scored, cache.local = int(facts["rows_scored"]), int(facts["local"])
        if not 0 <= cache.rows_scored <= n_tokens or cache.local < 1:
            raise ValueError("inconsistent representative-score facts")
        return cache


class OffloadKVCache(KVCache):
    """A :class:`KVCache` whose layers live in host memory while the model runs on a GPU, but for
    the one layer being prefilled (the article's chunked prefill, "loading only one layer of
    KVCache into GPU memory at a time"): :meth:`kvcli.runtime.engine.Engine.prefill_by_layer` calls
    :meth:`onload` before a layer's chunks (a prefix's entries go up once) and :meth:`offload`
    after them (the layer goes down once, into pinned memory); in between the layer grows on the
    GPU like any KV."""

    # per-layer state of its own: a sliding layer keeps its entries (its mask still applies the window)
    cuts_windows: ClassVar[bool] = False
    graphable: ClassVar[bool] = False  # state of its own besides the keys and values
    rewindable: ClassVar[bool] = False

    def onload(self, layer: int, device) -> None:
        if layer < len(self.keys):
            self.keys[layer] = self.keys[layer].to(device, non_blocking=True)
            self.values[layer] = self.values[layer].to(device, non_blocking=True)

    def offload(self, layer: int) -> None:
        self.keys[layer], self.values[layer] = _to_storage(self.keys[layer]), _to_storage(self.values[layer])

    def copy(self) -> OffloadKVCache:
        other = OffloadKVCache()
        other.keys, other.values, other.positions, other.kept = list(self.keys), list(self.values), self.positions, None
        return other


# --------------------------------------------------------------------------- the block cache


class BlockLayer(LayerView):
    """What :meth:`BlockCache.update` returns (as key and value) for one layer at a decode step."""

    cache: BlockCache

    def attend(
        self, module, query: torch.Tensor, scaling: float, sliding_window: int | None, kernel: str
    ) -> torch.Tensor:
        """query (1, n_heads, 1, head_dim) -> output (1, 1, n_heads, head_dim). A hybrid's sliding
        layer (Gemma 2 / 3) retrieves nothing: it attends to its window, as full attention does
        (once cut back to its window, :meth:`BlockCache.drop_front`, it holds no blocks)."""
        cache, layer = self.cache, self.layer_idx
        if sliding_window is not None and (sliding_window < cache.get_seq_length(layer) or layer in cache.dropped):
            key, value = cache.full(layer, query.device)
            key, value = key[:, :, -sliding_window:], value[:, :, -sliding_window:]
            cache._count(layer, [key.shape[2] / cache.get_seq_length(layer)] * key.shape[1])
        else:
            key, value = cache.gather(layer, query)
        # one query row: no mask, any kernel is exact (kernels.attend: Gemma 2's soft-capping too)
        return kernels.attend(
            "eager" if kernel == "eager" else "sdpa", module, query, key.to(query.dtype), value.to(query.dtype), scaling
        )


class BlockCache(CacheBase):
    """The whole KV of the prompt, organised for block retrieval (see the module docstring).

    Never written to the disk store: the prefix state of blocksparse is full attention's KV, and
    the blocks, representatives and preselection are rebuilt from it for each question."""

    kind: ClassVar[str] = "blocks"
    cuts_windows: ClassVar[bool] = True  # a sliding layer: its last entries, no blocks (drop_front)
    tensor_lists: ClassVar[tuple[str, ...]] = ("keys", "values", "fkeys", "fvalues", "reps")

    def __init__(
        self,
        *,
        initial: int,
        block_size: int,
        n_blocks: int,
        representative: str,
        topk: int,
        head_select: str = "shared",
        dense_layers: int = 0,
        layer_step: int = 1,
        token_step: int = 1,
        offload: bool = False,
    ) -> None:
        self.initial, self.block_size, self.n_blocks = int(initial), int(block_size), int(n_blocks)
        self.representative, self.topk, self.head_select = representative, int(topk), head_select
        self.dense_layers, self.layer_step, self.token_step = int(dense_layers), int(layer_step), int(token_step)
        self.offload = bool(offload)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.fkeys: list[torch.Tensor] = []
        self.fvalues: list[torch.Tensor] = []
        self.reps: list[torch.Tensor] = []
        self.candidates: list[torch.Tensor | None] = []
        self.positions: torch.Tensor | None = None
        self.n_prompt = 0
        # decoding state and counters
        self.step = -1  # index of the current decode step (layer 0 of a one-token pass starts one)
        self.history: dict[int, torch.Tensor] = {}  # selection group -> (H, k) block indices
        self.selections = 0  # selections computed (a query scored the blocks)
        self.reuses = 0  # selections reused from an earlier layer / token (layer_step, token_step)
        self.frac_sum = 0.0  # sum over (step, layer, KV head) of attended keys / keys in cache
        self.frac_count = 0
        self.layer_frac: list[list[float]] = []  # per layer: [sum, count]
        self.trace: list | None = None  # tests: set to [] to record (step, layer, query, blocks, computed)
        # a hybrid's sliding layers cut back to their window (drop_front) count their dropped
        # entries in ``dropped`` (CacheBase); such a layer holds no blocks, only its last entries (in ``fkeys``)

    # --- building it ----------------------------------------------------------------------------
    @classmethod
    def from_kv(
        cls,
        kv: KVCache,
        *,
        local: int,
        votes: list[torch.Tensor] | None = None,
        candidates: list[torch.Tensor | None] | None = None,
        representative_num: int = 1,
        compute_device=None,
        consume: bool = False,
        **config,
    ) -> BlockCache:
        """Split a full prompt cache ``kv`` (every layer, the same tokens) into Initial / Context
        blocks / Local, with representatives per block. ``local``: the Local window (the tokens
        left over by the blocks are added to it); ``votes[l]`` (n_kv, n) accumulated attention of
        each prompt token (dynamic / infllm representatives); ``candidates[l]`` the preselected blocks.
        ``consume``: the caller drops ``kv`` afterwards: each layer is released from it as soon as it
        is laid out (the source and the layout are never held whole together); ``kv`` is unusable after."""
        n = kv.n_tokens
        block_size = int(config["block_size"])
        initial, n_blocks, ctx_end = partition(n, config.pop("initial"), local, block_size)
        cache = cls(initial=initial, n_blocks=n_blocks, **config)
        cache.positions = kv.positions
        cache.n_prompt = n
        storage = torch.device("cpu") if cache.offload else None
        dropped = {layer: d for layer, d in kv.dropped.items() if d}
        cache.dropped = dropped
        for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
            if k.shape[2] != n - dropped.get(layer, 0):
                raise ValueError("every layer of the cache must hold the same tokens")
            device = compute_device if compute_device is not None else k.device
            if layer in dropped:  # a hybrid's sliding layer cut back to its window (a prefix state,
                # Engine.prefix_kv): no blocks, its entries always attended, as drop_front leaves one
                n_kv, d = k.shape[1], k.shape[3]
                cache.keys.append(k[:, :, :0])
                cache.values.append(v[:, :, :0])
                cache.fkeys.append(k.to(device))
                cache.fvalues.append(v.to(device))
                num = 2 if cache.representative == "quest" else representative_num
                cache.reps.append(torch.zeros(n_kv, 0, num, d, dtype=torch.float32, device=device))
                cache.candidates.append(None)
                cache.layer_frac.append([0.0, 0])
                if consume:
                    kv.keys[layer] = kv.values[layer] = None
                continue
            ck, cv = k[:, :, initial:ctx_end], v[:, :, initial:ctx_end]
            if storage is not None and ck.device.type != "cpu":  # views of host memory stay as they are (no copy)
                ck, cv = _to_storage(ck), _to_storage(cv)
            cache.keys.append(ck.contiguous() if storage is None else ck)
            cache.values.append(cv.contiguous() if storage is None else cv)
            cache.fkeys.append(torch.cat([k[:, :, :initial], k[:, :, ctx_end:]], dim=2).to(device))
            cache.fvalues.append(torch.cat([v[:, :, :initial], v[:, :, ctx_end:]], dim=2).to(device))
            n_kv, d = k.shape[1], k.shape[3]
            blocks = k[0, :, initial:ctx_end].to(device).reshape(n_kv, n_blocks, block_size, d)
            layer_votes = None
            if votes is not None and votes[layer] is not None:
                layer_votes = votes[layer][:, initial:ctx_end].reshape(n_kv, n_blocks, block_size)
            num = 2 if cache.representative == "quest" else representative_num
            cache.reps.append(block_representatives(blocks, cache.representative, num, layer_votes))
            cand = None if candidates is None else candidates[layer]
            cache.candidates.append(None if cand is None else cand.to(device))
            cache.layer_frac.append([0.0, 0])
            if consume:
                del k, v, ck, cv, blocks
                kv.keys[layer] = kv.values[layer] = None
        return cache

    # --- the transformers contract ----------------------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append new tokens (1, n_kv, new, d) to the always-attended part of ``layer_idx``. One
        token (a decode step): return the layer's :class:`BlockLayer`, which attends sparsely;
        several: return the whole KV (full causal attention over everything)."""
        if not 0 <= layer_idx < self.n_layers:
            raise IndexError(f"layer {layer_idx} is not in this cache ({self.n_layers} layers)")
        dev = self.fkeys[layer_idx].device
        self.fkeys[layer_idx] = torch.cat([self.fkeys[layer_idx], key.to(dev)], dim=-2)
        self.fvalues[layer_idx] = torch.cat([self.fvalues[layer_idx], value.to(dev)], dim=-2)
        if key.shape[-2] == 1:
            if layer_idx == 0:
                self.step += 1
            view = BlockLayer(self, layer_idx)
            return view, view
        k, v = self.full(layer_idx, key.device)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= self.n_layers:
            return 0
        return self.keys[layer_idx].shape[-2] + self.fkeys[layer_idx].shape[-2]

    # --- attention over the selected blocks ---------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def ctx_len(self) -> int:
        return self.n_blocks * self.block_size

    def full(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole KV of ``layer`` in token order (1, n_kv, seq, d) on ``device``."""
        i = self.initial
        fk, fv = self.fkeys[layer].to(device), self.fvalues[layer].to(device)
        k = torch.cat([fk[:, :, :i], self.keys[layer].to(device, non_blocking=True), fk[:, :, i:]], dim=2)
        v = torch.cat([fv[:, :, :i], self.values[layer].to(device, non_blocking=True), fv[:, :, i:]], dim=2)
        return k, v

    def selection_group(self, layer: int) -> int:
        """Layers that share a selection (``layer_step``): the first sparse layer of each group selects."""
        return (layer - self.dense_layers) // self.layer_step

    def select(self, layer: int, query: torch.Tensor) -> torch.Tensor | None:
        """The blocks ``layer`` attends at this step: (H, k) sorted block indices (H = n_kv when
        heads select separately, else 1), or None for every block. Computed when the step is a
        multiple of ``token_step`` and the layer the first of its ``layer_step`` group; otherwise
        the group's last selection is reused (the article's ``history_kvcache_after_retrieval``)."""
        group = self.selection_group(layer)
        compute = (
            self.step % self.token_step == 0 and (layer - self.dense_layers) % self.layer_step == 0
        ) or group not in self.history
        if not compute:
            self.reuses += 1
            top = self.history[group]
        else:
            self.selections += 1
            top = self._select(layer, query)
            self.history[group] = top
        if self.trace is not None:
            self.trace.append(
                {
                    "step": self.step,
                    "layer": layer,
                    "query": query[0, :, -1].detach().cpu(),
                    "blocks": None if top is None else top.cpu(),
                    "computed": compute,
                }
            )
        return top

    def _select(self, layer: int, query: torch.Tensor) -> torch.Tensor | None:
        # always scored, even when topk covers every block available (then the top-k is all of them)
        cand = self.candidates[layer]
        reps = self.reps[layer]
        scores = block_scores(query[0, :, -1].to(reps.device), reps, self.representative, self.head_select == "shared")
        if cand is None:
            top = torch.topk(scores, min(self.topk, self.n_blocks), dim=-1).indices
        else:
            if cand.shape[0] != scores.shape[0]:
                cand = cand.expand(scores.shape[0], -1)
            k = min(self.topk, cand.shape[-1])
            top = cand.gather(1, torch.topk(scores.gather(1, cand), k, dim=-1).indices)
        return torch.sort(top, dim=-1).values

    def gather(self, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Initial + selected blocks + Local (and generated tokens) of ``layer``, in token order,
        on the query's device: (1, n_kv, L, d) each. Layers below ``dense_layers`` take everything."""
        device = query.device
        n_kv = self.fkeys[layer].shape[1]
        total = self.get_seq_length(layer)
        top = None if layer < self.dense_layers or self.n_blocks == 0 else self.select(layer, query)
        if top is None:
            k, v = self.full(layer, device)
            self._count(layer, [1.0] * n_kv)
            return k, v
        bs = self.block_size
        store = self.keys[layer].device
        tok = (top.to(store)[..., None] * bs + torch.arange(bs, device=store)).flatten(-2)  # (H, k*bs)
        src_k, src_v = self.keys[layer], self.values[layer]
        # offloaded: gathered straight into the layer's pinned staging buffers, so the uploads
        # below are asynchronous (reused every step: the step's token read orders them)
        ck, cv = self._staging(layer, (1, src_k.shape[1], tok.shape[-1], src_k.shape[-1]), src_k.dtype)
        if top.shape[0] == 1:
            ck = torch.index_select(src_k, 2, tok[0], **({} if ck is None else {"out": ck}))
            cv = torch.index_select(src_v, 2, tok[0], **({} if cv is None else {"out": cv}))
        else:
            idx = tok[None, :, :, None].expand(1, -1, -1, src_k.shape[-1])
            ck = torch.gather(src_k, 2, idx, **({} if ck is None else {"out": ck}))
            cv = torch.gather(src_v, 2, idx, **({} if cv is None else {"out": cv}))
        i = self.initial
        fk, fv = self.fkeys[layer], self.fvalues[layer]
        k = torch.cat([fk[:, :, :i].to(device), ck.to(device, non_blocking=True), fk[:, :, i:].to(device)], dim=2)
        v = torch.cat([fv[:, :, :i].to(device), cv.to(device, non_blocking=True), fv[:, :, i:].to(device)], dim=2)
        self._count(layer, [k.shape[2] / total] * n_kv)
        return k, v

    def _staging(self, layer: int, shape, dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Offloaded: the layer's (key, value) host staging buffers of ``shape`` (made once, pinned
        where CUDA is); otherwise (None, None)."""
        if not self.offload or self.keys[layer].device.type != "cpu":
            return None, None
        stages = self.__dict__.setdefault("_stages", {})
        held = stages.get(layer)
        if held is None or held[0].shape != torch.Size(shape) or held[0].dtype != dtype:
            held = stages[layer] = (_host_empty(shape, dtype), _host_empty(shape, dtype))
        return held

    def _count(self, layer: int, fracs: list[float]) -> None:
        self.frac_sum += sum(fracs)
        self.frac_count += len(fracs)
        self.layer_frac[layer][0] += sum(fracs)
        self.layer_frac[layer][1] += len(fracs)

    def drop_front(self, layer: int, n: int) -> None:
        """Drop the ``n`` oldest entries of ``layer``, a hybrid's sliding layer (Gemma 2 / 3) whose
        window has passed them (:meth:`~kvcli.caches.base.CacheBase.trim_windows`). The layer then holds
        no blocks (a sliding layer never retrieves): its remaining entries, in token order, are its
        always-attended part (``fkeys``, on the compute device: a window is small), and
        ``full(layer)`` is just them."""
        k, v = self.full(layer, self.fkeys[layer].device)
        self.fkeys[layer], self.fvalues[layer] = k[:, :, n:].clone(), v[:, :, n:].clone()
        self.keys[layer], self.values[layer] = self.keys[layer][:, :, :0], self.values[layer][:, :, :0]
        self.reps[layer] = self.reps[layer][:, :0]
        self.candidates[layer] = None
        self.dropped = {**self.dropped, layer: self.dropped.get(layer, 0) + n}

    # --- kvcli's own use --------------------------------------------------------------------------
    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        """Every layer and KV head holds every prompt position, but a sliding layer cut back to its
        window (:meth:`drop_front`): its last entries."""
        n_kv = self.fkeys[0].shape[1] if self.fkeys else 0
        mask = torch.zeros(self.n_layers, n_kv, n_prompt, dtype=torch.bool)
        if self.positions is not None:
            for layer in range(self.n_layers):
                pos = self.positions[self.dropped.get(layer, 0) :]
                mask[layer, :, pos[pos < n_prompt]] = True
        return mask

    def stats(self) -> dict:
        """JSON-able counters: the share of the KV attended per decode step (mean over steps,
        layers and KV heads), the partition, selections computed / reused, preselection."""
        cand = [c for c in self.candidates if c is not None]
        return {
            "kv_attended_frac": self.frac_sum / self.frac_count if self.frac_count else None,
            "kv_attended_frac_by_layer": [s / c if c else None for s, c in self.layer_frac],
            "decode_steps": self.step + 1,
            "blocks": self.n_blocks,
            "block_size": self.block_size,
            "initial_tokens": self.initial,
            "context_tokens": self.ctx_len,
            "local_tokens": self.n_prompt - self.initial - self.ctx_len,
            "topk": self.topk,
            "representative": self.representative,
            "head_select": self.head_select,
            "selections": self.selections,
            "selections_reused": self.reuses,
            "preselected_blocks": (sum(c.shape[-1] for c in cand) / len(cand)) if cand else None,
            "kv_offload": "cpu" if self.offload else "none",
            "kv_bytes": self.nbytes(),
        }

    def copy(self) -> BlockCache:
        """A shallow copy: new lists and counters, same tensors (``update`` never writes in place)."""
        other = BlockCache.__new__(BlockCache)
        other.__dict__.update(self.__dict__)
        other.__dict__.pop("_stages", None)  # staging buffers: one writer each
        for name in ("keys", "values", "fkeys", "fvalues", "reps", "candidates"):
            setattr(other, name, list(getattr(self, name)))
        other.history = dict(self.history)
        other.dropped = dict(self.dropped)
        other.layer_frac = [list(x) for x in self.layer_frac]
        other.trace = None if self.trace is None else list(self.trace)
        return other


def _host_empty(shape, dtype) -> torch.Tensor:
    """An empty CPU tensor, pinned when CUDA is there (asynchronous copies to the GPU; a
    ``non_blocking`` upload from pageable memory is a synchronous one)."""
    if torch.cuda.is_available():
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:  # pinning can fail (limits); unpinned memory still works
            pass
    return torch.empty(shape, dtype=dtype)


def _to_storage(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t``, pinned when CUDA is there: copied straight into it (one copy)."""
    t = t.detach()
    return _host_empty(t.shape, t.dtype).copy_(t)
