"""LazyLLM's cache (:mod:`kvcli.compressors.lazyllm`, Fu et al. 2024, arXiv:2407.14057): per
layer the KV of the tokens computed there, plus the Aux Cache of hidden states.

    keys[l], values[l]: (1, n_kv_heads, m_l, head_dim)   after RoPE, in the order computed
    slot_pos[l]:        (m_l,) int64                      original position of each slot
    frontier:           (T,) int64                        per token: layers 0..frontier-1 hold its KV
    aux[L]:             ((k,) int64 positions, (1, k, hidden))  hidden states entering pruning
                        layer L of the k tokens whose frontier is L (the Aux Cache)
    computed:           (n_layers, T) int32               times each (layer, token) was computed
    selection[L]:       (T',) bool                        S_L of the last step that selected (knob
                        ``reselect``: the decoding steps between selections reuse it)

``keys[l]``/``values[l]`` grow in place, in a buffer with room to spare
(:class:`~kvcli.caches.base.LayerKV`): a decoding step appends its few rows without copying the
layer; ``copy()`` shares the views, and the copy gets its own buffer on its first append.

``gather``: set by :func:`kvcli.compressors.lazyllm.run_tokens` for one layer pass: the slots
(after this pass's append) that the layer's attention reads, in order; ``update`` then returns
just those rows (the step's token set ``S_l``), so the attention needs no membership mask.

A hybrid's sliding layer (Gemma 2 / 3) is cut back to its window (:meth:`LazyCache.drop_front`,
called by :meth:`~kvcli.caches.base.CacheBase.trim_windows`) as far as nothing can read the dropped slots
again: a token still in the Aux Cache may be revived into the layer and attend its own window
there, and the layer before a pruning layer is scored over all its slots. ``window_from[l]``: the
positions below it were dropped from layer ``l``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import LayerKV, cache_type


@cache_type
class LazyCache(LayerKV):
    """LazyLLM's cache: per layer the KV of the tokens computed there, plus the Aux Cache (see the
    module docstring for the layout)."""

    kind: ClassVar[str] = "lazyllm"
    cuts_windows: ClassVar[bool] = True  # as far as nothing can read the dropped slots (``window_from``)

    def __init__(self, n_model_layers: int) -> None:
        self.n_model_layers = int(n_model_layers)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slot_pos: list[torch.Tensor] = []
        self.frontier = torch.zeros(0, dtype=torch.long)
        self.computed = torch.zeros(self.n_model_layers, 0, dtype=torch.int32)
        self.aux: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gather: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        # --- facts for stats() -------------------------------------------------------------------
        self.schedule: list[tuple[int, float]] = []
        self.n_prompt = 0
        self.prefill_tokens: list[int] = []  # per layer: prompt tokens computed by the prefill
        self.revivals = 0  # (token, layer) pairs taken from the Aux Cache by decoding steps
        self.revived = torch.zeros(0, dtype=torch.bool)  # per token: revived at least once
        self.decode_steps = 0
        self.selecting_steps = 0  # decoding steps that selected again (all of them unless reselect != 1)
        self.reselect = 1
        # per pruning layer L: S_L (T,) bool of the last step that selected (reused by the steps between)
        self.selection: dict[int, torch.Tensor] = {}
        # set to a list to record, per step, [(pruning layer, S_layer (T,) bool), ...] (tests, debugging)
        self.trace: list | None = None
        # a hybrid's sliding layers cut back to their window (drop_front): layer -> the position
        # below which its slots were dropped
        self.window_from: dict[int, int] = {}

    # --- the transformers contract ---------------------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append ``key``/``value`` (1, n_kv_heads, new, head_dim) to layer ``layer_idx`` (in place,
        :class:`~kvcli.caches.base.LayerKV`); returns the layer's keys and values, or only the
        slots of :attr:`gather` when it is set."""
        k, v = super().update(key, value, layer_idx)
        if self.gather is not None:
            idx = self.gather.to(k.device)
            return k.index_select(-2, idx), v.index_select(-2, idx)
        return k, v

    # --- bookkeeping used by run_tokens (update, inherited, appends KV; run_tokens records the
    # slots' positions) ------------------------------------------------------------------------
    def slots(self, layer: int) -> torch.Tensor:
        return self.slot_pos[layer] if layer < len(self.slot_pos) else torch.zeros(0, dtype=torch.long)

    def grow(self, total: int) -> None:
        """Make room in the per-token counters for tokens ``0..total-1``."""
        extra = total - self.frontier.numel()
        if extra > 0:
            self.frontier = torch.cat([self.frontier, torch.zeros(extra, dtype=torch.long)])
            self.computed = torch.cat(
                [self.computed, torch.zeros(self.n_model_layers, extra, dtype=torch.int32)], dim=1
            )
            self.revived = torch.cat([self.revived, torch.zeros(extra, dtype=torch.bool)])

    def note_computed(self, layer: int, pos: torch.Tensor) -> None:
        """Tokens ``pos`` were just computed at ``layer`` (their KV appended in this order)."""
        if layer == len(self.slot_pos):
            self.slot_pos.append(pos.clone())
        else:
            self.slot_pos[layer] = torch.cat([self.slot_pos[layer], pos])
        self.frontier[pos] = layer + 1
        self.computed[layer].index_add_(0, pos, torch.ones(pos.numel(), dtype=torch.int32))

    def stash(self, layer: int, pos: torch.Tensor, hidden: torch.Tensor) -> None:
        """Put the hidden states (1, k, hidden) entering ``layer`` of tokens ``pos`` into the Aux Cache."""
        if pos.numel() == 0:
            return
        if layer in self.aux:
            old_pos, old_hidden = self.aux[layer]
            pos, hidden = torch.cat([old_pos, pos]), torch.cat([old_hidden, hidden], dim=1)
        self.aux[layer] = (pos, hidden)

    def take(self, layer: int, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Remove and return the Aux Cache entries of ``layer`` whose token is ``selected`` (T,) bool."""
        if layer not in self.aux:
            return torch.zeros(0, dtype=torch.long), None
        pos, hidden = self.aux[layer]
        pick = selected[pos]
        if not bool(pick.any()):
            return torch.zeros(0, dtype=torch.long), None
        if bool(pick.all()):
            del self.aux[layer]
        else:
            rest = torch.nonzero(~pick).flatten()
            self.aux[layer] = (pos[rest], hidden.index_select(1, rest.to(hidden.device)))
        idx = torch.nonzero(pick).flatten()
        return pos[idx], hidden.index_select(1, idx.to(hidden.device))

    # --- a hybrid's sliding layers: their window ----------------------------------------------------
    def reach(self, layer: int) -> int | None:
        """The lowest position a later computation in ``layer`` can have (its window reaches back
        from there), or None when every held slot may still be read: the layer before a pruning
        layer while selections go on (knob ``reselect`` not 0) scores the query token's attention
        over all its slots. Otherwise the next token's position, or, while selections go on, the
        lowest position of a token without KV here (frontier <= layer, in an Aux Cache), which a
        later step may revive into this layer."""
        selecting = self.reselect != 0 and bool(self.schedule)
        if selecting and any(l == layer + 1 for l, _ in self.schedule):
            return None
        total = self.frontier.numel()
        if selecting:
            pending = torch.nonzero(self.frontier <= layer).flatten()
            if pending.numel():
                return min(total, int(pending[0]))
        return total

    def drop_front(self, layer: int, n: int) -> None:
        """Cut ``layer``, a sliding layer, back to its window (:meth:`~kvcli.caches.base.CacheBase.trim_windows`
        asks for its ``n`` oldest entries, so that ``get_seq_length(layer) - n`` = w - 1 stay):
        drop the slots at positions below :meth:`reach` - (w - 1), which no computation can read
        again, and no other. Exact: what a query at or after :meth:`reach` attends is all held."""
        reach = self.reach(layer)
        if reach is None:
            return
        slots = self.slot_pos[layer]
        start = reach - (slots.numel() - n)
        keep = torch.nonzero(slots >= start).flatten()
        if keep.numel() == slots.numel():
            return
        idx = keep.to(self.keys[layer].device)
        self.keys[layer] = self.keys[layer].index_select(2, idx)
        self.values[layer] = self.values[layer].index_select(2, idx)
        self.slot_pos[layer] = slots[keep]
        self.window_from = {**self.window_from, layer: max(start, self.window_from.get(layer, 0))}

    # --- kvcli's own use ---------------------------------------------------------------------------
    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        """(n_layers, n_kv_heads, n_prompt) bool: layer ``l`` holds the KV of the prompt tokens
        computed there (in the prefill or revived later) that its window did not drop; the same
        for every KV head."""
        n_kv = self.keys[0].shape[1] if self.keys else 0
        mask = torch.zeros(self.n_model_layers, n_kv, n_prompt, dtype=torch.bool)
        for layer, pos in enumerate(self.slot_pos):
            mask[layer, :, pos[pos < n_prompt]] = True
        return mask

    def held_positions(self, layer: int) -> torch.Tensor:
        """(n_kv, slots) each slot's original position, the same for every KV head
        (:meth:`CacheBase.held_positions`)."""
        n_kv = self.keys[layer].shape[1]
        return self.slots(layer).view(1, -1).expand(n_kv, -1)

    def aux_tokens(self) -> int:
        return sum(int(p.numel()) for p, _ in self.aux.values())

    def nbytes(self) -> int:
        """KV bytes plus the Aux Cache's hidden states."""
        aux = sum(h.numel() * h.element_size() for _, h in self.aux.values())
        return super().nbytes() + aux

    def stats(self) -> dict:
        """The paper's "% of prompt tokens computed" and the counters behind it (JSON-able)."""
        n, layers = self.n_prompt, self.n_model_layers
        prompt_computed = self.computed[:, :n]
        per_layer_kv = [int((self.slots(l) < n).sum()) for l in range(layers)]
        return {
            "prompt_tokens": n,
            # sum over layers of prompt tokens computed in that layer (prefill + revivals) / (layers · n)
            "prompt_tokens_computed_frac": float(prompt_computed.sum()) / (layers * n) if n else 0.0,
            "prefill_tokens_computed_frac": sum(self.prefill_tokens) / (layers * n) if n else 0.0,
            "per_layer_prefill_tokens": list(self.prefill_tokens),
            "per_layer_kv_tokens": per_layer_kv,  # prompt tokens holding KV per layer now (sliding layers: their window)
            "revived": self.revivals,  # (token, pruning layer) pairs taken from the Aux Cache
            "revived_tokens": int(self.revived[:n].sum()),
            "aux_cache_tokens": self.aux_tokens(),
            "decode_steps": self.decode_steps,
            "selecting_decode_steps": self.selecting_steps,
            "max_computations_per_layer": int(self.computed.max()) if self.computed.numel() else 0,
            "schedule": {
                "layers": [l for l, _ in self.schedule],
                "keep": [k for _, k in self.schedule],
                "reselect": self.reselect,
            },
        }

    def copy(self) -> LazyCache:
        """A copy that shares the tensors (never written in place) and owns its counters."""
        other = LazyCache(self.n_model_layers)
        other.keys, other.values, other.slot_pos = list(self.keys), list(self.values), list(self.slot_pos)
        other.frontier, other.computed, other.revived = (
            self.frontier.clone(),
            self.computed.clone(),
            self.revived.clone(),
        )
        other.aux = dict(self.aux)
        other.positions = self.positions
        other.schedule, other.n_prompt = list(self.schedule), self.n_prompt
        other.prefill_tokens, other.revivals, other.decode_steps = (
            list(self.prefill_tokens),
            self.revivals,
            self.decode_steps,
        )
        other.selecting_steps, other.reselect, other.selection = (
            self.selecting_steps,
            self.reselect,
            dict(self.selection),
        )
        other.window_from = dict(self.window_from)
        return other

    # --- the disk store's contract (prefix states) -------------------------------------------------
    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``positions``, ``frontier``, ``computed``, per held layer ``k.<l>``, ``v.<l>``,
        ``slots.<l>``, per Aux Cache layer ``aux_pos.<L>``, ``aux_hidden.<L>``; and facts."""
        tensors = {
            "positions": self.positions.contiguous(),
            "frontier": self.frontier.contiguous(),
            "computed": self.computed.contiguous(),
        }
        for i in range(self.n_layers):
            tensors[f"k.{i}"] = self.keys[i].detach().to("cpu").contiguous()
            tensors[f"v.{i}"] = self.values[i].detach().to("cpu").contiguous()
            tensors[f"slots.{i}"] = self.slot_pos[i].contiguous()
        for layer, (pos, hidden) in self.aux.items():
            tensors[f"aux_pos.{layer}"] = pos.contiguous()
            tensors[f"aux_hidden.{layer}"] = hidden.detach().to("cpu").contiguous()
        facts = {
            "n_model_layers": self.n_model_layers,
            "n_layers": self.n_layers,
            "n_tokens": self.n_tokens,
            "aux_layers": sorted(self.aux),
        }
        if self.window_from:
            facts["window_from"] = {str(l): p for l, p in self.window_from.items()}
        return tensors, facts

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], facts: dict, device="cpu") -> LazyCache:
        """Inverse of :meth:`to_tensors`; ValueError when the tensors do not form such a cache."""
        try:
            n_model, n_layers, n_tokens = int(facts["n_model_layers"]), int(facts["n_layers"]), int(facts["n_tokens"])
            aux_layers = [int(x) for x in facts["aux_layers"]]
            window_from = {int(l): int(p) for l, p in facts.get("window_from", {}).items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"lazyllm cache facts are incomplete: {e}") from None
        expected = {"positions", "frontier", "computed"}
        expected |= {f"{t}.{i}" for i in range(n_layers) for t in ("k", "v", "slots")}
        expected |= {f"{t}.{layer}" for layer in aux_layers for t in ("aux_pos", "aux_hidden")}
        if set(tensors) != expected or not 0 < n_layers <= n_model:
            raise ValueError("unexpected tensor names")
        cache = cls(n_model)
        cache.positions = tensors["positions"].to(torch.long)
        cache.frontier = tensors["frontier"].to(torch.long)
        cache.computed = tensors["computed"].to(torch.int32)
        if cache.positions.shape != (n_tokens,) or cache.frontier.shape != (n_tokens,):
            raise ValueError("positions do not match the token count")
        if cache.computed.shape != (n_model, n_tokens) or bool((cache.frontier > n_model).any()):
            raise ValueError("counters do not match the layers")
        cache.revived = torch.zeros(n_tokens, dtype=torch.bool)
        for i in range(n_layers):
            k, v, s = tensors[f"k.{i}"], tensors[f"v.{i}"], tensors[f"slots.{i}"].to(torch.long)
            if k.dim() != 4 or k.shape != v.shape or s.shape != (k.shape[2],):
                raise ValueError(f"layer {i} has inconsistent shapes")
            held = (cache.frontier > i) & (torch.arange(n_tokens) >= window_from.get(i, 0))
            if (
                s.numel() != int(held.sum())
                or bool(((s < 0) | (s >= n_tokens)).any())
                or not bool(held[s.clamp(0, max(n_tokens - 1, 0))].all())
            ):
                raise ValueError(f"layer {i} does not hold the tokens its frontier says")
            cache.keys.append(k.to(device))
            cache.values.append(v.to(device))
            cache.slot_pos.append(s)
        for layer in aux_layers:
            pos, hidden = tensors[f"aux_pos.{layer}"].to(torch.long), tensors[f"aux_hidden.{layer}"]
            if hidden.dim() != 3 or hidden.shape[1] != pos.numel() or bool((cache.frontier[pos] != layer).any()):
                raise ValueError(f"the Aux Cache of layer {layer} does not match the frontier")
            cache.aux[layer] = (pos, hidden.to(device))
        cache.window_from = window_from
        return cache
