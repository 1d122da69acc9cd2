"""LazyLLM: dynamic token pruning for the prefill and every decoding step (Fu et al., 2024,
arXiv:2407.14057).

"LazyLLM: Dynamic Token Pruning for Efficient Long Context LLM Inference", section 3.2. What kvcli
implements, for a schedule of pruning layers ``L_1 < L_2 < ... < L_m`` (0-based, each in
``1..n_layers-1``) with keep ratios ``k_1 >= k_2 >= ... >= k_m`` in (0, 1]:

**One generation step** (the prefill is step 0, each decoding step one more) runs the sequence
of ``T`` tokens so far (positions ``0..T-1``, the last one — the last prompt token, or the token
just generated — is the *query token*). Every layer ``l`` uses a token set ``S_l`` of that step:

* ``S_0 = ... = S_{L_1 - 1}`` = every token;
* at a pruning layer ``L_j``: the importance of token ``i`` is equation 1, the query token's
  softmax attention at layer ``L_j - 1`` averaged over the heads,
  ``s_i = 1/H sum_h softmax_i(q_T^h · K^h / sqrt(d))`` over the keys of ``S_{L_j - 1}`` — computed
  from the post-RoPE query and keys an observer receives (GQA: each query head reads its group's
  KV head, the cache is never expanded; no attention matrix is materialised, so SDPA stays the
  kernel). ``S_{L_j}`` = the ``ceil(k_j · T)`` best of ``S_{L_j - 1}`` (the "k-th percentile";
  the query token is always kept, it must reach the LM head); ``S_l = S_{L_j}`` up to ``L_{j+1}``.
  The sets are nested: a token pruned at ``L_j`` takes no part in any later layer of this step.
* in layer ``l``, each token of ``S_l`` attends to the tokens of ``S_l`` at original positions
  ``<=`` its own (tokens are skipped, never re-numbered: RoPE uses the original positions).

**What is computed** in layer ``l`` of a step: the tokens of ``S_l`` that have no KV there yet. A
token's KV always covers a prefix of the layers, ``0 .. f-1`` (its *frontier* ``f``, a pruning
layer or ``n_layers``): in the prefill every token starts at layer 0 and is carried until it is
pruned; the query token of a decoding step runs through every layer; a prompt token selected
again at ``L_j`` with frontier ``f = L_j`` (pruned there by an earlier step) is *revived*: its
input hidden state to ``L_j`` is taken from the **Aux Cache** of layer ``L_j`` (no earlier layer
runs again) and it is carried through the following layers as long as it stays selected; where it
drops out again (``L_{j'}``), its hidden state goes into the Aux Cache of ``L_{j'}``. So each
(token, layer) is computed at most once over the whole generation (``LazyCache.computed`` counts
it), and the worst case — every token selected everywhere — is full attention's work.

With every ``k_j = 1`` nothing is pruned and the result is full attention's.

Cache layout (:class:`LazyCache`), per layer ``l`` its own token set:

    keys[l], values[l]: (1, n_kv_heads, m_l, head_dim)   after RoPE, in the order computed
    slot_pos[l]:        (m_l,) int64                      original position of each slot
    frontier:           (T,) int64                        per token: layers 0..frontier-1 hold its KV
    aux[L]:             ((k,) int64 positions, (1, k, hidden))  hidden states entering pruning
                        layer L of the k tokens whose frontier is L (the Aux Cache)
    computed:           (n_layers, T) int32               times each (layer, token) was computed

A revived token's KV slot is appended at the end of its layer's tensors, so whenever the slots
are not "all of ``S_l``, then the new tokens in position order" the layer runs with an explicit
(q_len, kv_len) mask built from ``slot_pos`` (membership in ``S_l``, position ``<=`` the query's,
and within a layer's sliding window, if any, counted in positions, not slots).

Disk store: the layers before the first pruning layer ``L_1`` see every token with plain causal
attention, so they are question-agnostic; the prefix state is the KV of layers ``0..L_1-1`` of
the prefix tokens plus their hidden states entering ``L_1`` (held as the Aux Cache of ``L_1``,
``prefix_state`` = ``{"kind": "lazyllm", "layers": L_1}``; the keep ratios and later layers act
after the question is read). The question's tokens then run on top of it, and at ``L_1`` the
selected prefix tokens continue from their stored hidden states: same arithmetic as one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import attention
from ..cache import LayerKV, cache_type
from ..errors import UsageError
from .base import Compressor, knob, register

DEFAULT_FRACTIONS = "1/4, 1/2, 3/4"
DEFAULT_KEEP_RANGE = (0.7, 0.3)  # the first and last keep ratio of the default schedule


def default_layers(n_layers: int, count: int = 3) -> list[int]:
    """``count`` pruning layers at (i+1)/(count+1) of the depth, in 1..n_layers-1, deduplicated."""
    out: list[int] = []
    for i in range(count):
        layer = max(1, min(n_layers - 1, round((i + 1) * n_layers / (count + 1))))
        if layer not in out:
            out.append(layer)
    return out


def default_keep(count: int) -> list[float]:
    """``count`` keep ratios evenly from 0.7 down to 0.3 (a single one: 0.5)."""
    hi, lo = DEFAULT_KEEP_RANGE
    if count == 1:
        return [round((hi + lo) / 2, 4)]
    return [round(hi - (hi - lo) * i / (count - 1), 4) for i in range(count)]


def n_keep(keep: float, total: int) -> int:
    """``ceil(keep · total)`` (at least 1), robust to float noise (0.3 · 10 is 3, not 4)."""
    return max(1, math.ceil(keep * total - 1e-9))


def last_token_attention(query: torch.Tensor, key: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """Equation 1 for the last query row: (kv_len,) float32, the softmax attention of the last
    query over the ``visible`` keys ((kv_len,) bool, None: all), averaged over every query head.

    query: (1, n_heads, q_len, d); key: (1, n_kv, kv_len, d). Each query head reads the KV head
    of its GQA group; the key tensor is never expanded.
    """
    _, n_heads, _, d = query.shape
    n_kv = key.shape[1]
    q_last = query[0, :, -1, :].reshape(n_kv, n_heads // n_kv, d).to(torch.float32)
    logits = torch.matmul(q_last, key[0].to(torch.float32).transpose(-1, -2)) / math.sqrt(d)  # (n_kv, group, kv)
    if visible is not None:
        logits = logits.masked_fill(~visible.to(logits.device), float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=(0, 1))


# ======================================================================================= the cache


@cache_type
class LazyCache(LayerKV):
    """LazyLLM's cache: per layer the KV of the tokens computed there, plus the Aux Cache (see the
    module docstring for the layout)."""

    kind: ClassVar[str] = "lazyllm"

    def __init__(self, n_model_layers: int) -> None:
        self.n_model_layers = int(n_model_layers)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slot_pos: list[torch.Tensor] = []
        self.frontier = torch.zeros(0, dtype=torch.long)
        self.computed = torch.zeros(self.n_model_layers, 0, dtype=torch.int32)
        self.aux: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.positions: torch.Tensor | None = None
        # --- facts for stats() -------------------------------------------------------------------
        self.schedule: list[tuple[int, float]] = []
        self.n_prompt = 0
        self.prefill_tokens: list[int] = []  # per layer: prompt tokens computed by the prefill
        self.revivals = 0  # (token, layer) pairs taken from the Aux Cache by decoding steps
        self.revived = torch.zeros(0, dtype=torch.bool)  # per token: revived at least once
        self.decode_steps = 0
        # set to a list to record, per step, [(pruning layer, S_layer (T,) bool), ...] (tests, debugging)
        self.trace: list | None = None

    # --- bookkeeping used by run_tokens (update, inherited, appends KV; run_tokens records the
    # slots' positions) ------------------------------------------------------------------------
    def slots(self, layer: int) -> torch.Tensor:
        return self.slot_pos[layer] if layer < len(self.slot_pos) else torch.zeros(0, dtype=torch.long)

    def grow(self, total: int) -> None:
        """Make room in the per-token counters for tokens ``0..total-1``."""
        extra = total - self.frontier.numel()
        if extra > 0:
            self.frontier = torch.cat([self.frontier, torch.zeros(extra, dtype=torch.long)])
            self.computed = torch.cat([self.computed, torch.zeros(self.n_model_layers, extra, dtype=torch.int32)], dim=1)
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

    # --- kvcli's own use ---------------------------------------------------------------------------
    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        """(n_layers, n_kv_heads, n_prompt) bool: layer ``l`` holds the KV of the prompt tokens
        computed there (in the prefill or revived later); the same for every KV head."""
        n_kv = self.keys[0].shape[1] if self.keys else 0
        n = min(n_prompt, self.frontier.numel())
        mask = torch.zeros(self.n_model_layers, n_kv, n_prompt, dtype=torch.bool)
        layers = torch.arange(self.n_model_layers).view(-1, 1)
        mask[:, :, :n] = (self.frontier[:n].view(1, -1) > layers).unsqueeze(1)
        return mask

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
        per_layer_kv = [int((self.frontier[:n] > l).sum()) for l in range(layers)]
        return {
            "prompt_tokens": n,
            # sum over layers of prompt tokens computed in that layer (prefill + revivals) / (layers · n)
            "prompt_tokens_computed_frac": float(prompt_computed.sum()) / (layers * n) if n else 0.0,
            "prefill_tokens_computed_frac": sum(self.prefill_tokens) / (layers * n) if n else 0.0,
            "per_layer_prefill_tokens": list(self.prefill_tokens),
            "per_layer_kv_tokens": per_layer_kv,  # prompt tokens holding KV per layer now
            "revived": self.revivals,  # (token, pruning layer) pairs taken from the Aux Cache
            "revived_tokens": int(self.revived[:n].sum()),
            "aux_cache_tokens": self.aux_tokens(),
            "decode_steps": self.decode_steps,
            "max_computations_per_layer": int(self.computed.max()) if self.computed.numel() else 0,
            "schedule": {"layers": [l for l, _ in self.schedule], "keep": [k for _, k in self.schedule]},
        }

    def copy(self) -> "LazyCache":
        """A copy that shares the tensors (never written in place) and owns its counters."""
        other = LazyCache(self.n_model_layers)
        other.keys, other.values, other.slot_pos = list(self.keys), list(self.values), list(self.slot_pos)
        other.frontier, other.computed, other.revived = self.frontier.clone(), self.computed.clone(), self.revived.clone()
        other.aux = dict(self.aux)
        other.positions = self.positions
        other.schedule, other.n_prompt = list(self.schedule), self.n_prompt
        other.prefill_tokens, other.revivals, other.decode_steps = list(self.prefill_tokens), self.revivals, self.decode_steps
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
        return tensors, facts

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], facts: dict, device="cpu") -> "LazyCache":
        """Inverse of :meth:`to_tensors`; ValueError when the tensors do not form such a cache."""
        try:
            n_model, n_layers, n_tokens = int(facts["n_model_layers"]), int(facts["n_layers"]), int(facts["n_tokens"])
            aux_layers = [int(x) for x in facts["aux_layers"]]
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
            if s.numel() != int((cache.frontier > i).sum()):
                raise ValueError(f"layer {i} does not hold the tokens its frontier says")
            cache.keys.append(k.to(device))
            cache.values.append(v.to(device))
            cache.slot_pos.append(s)
        for layer in aux_layers:
            pos, hidden = tensors[f"aux_pos.{layer}"].to(torch.long), tensors[f"aux_hidden.{layer}"]
            if hidden.dim() != 3 or hidden.shape[1] != pos.numel() or bool((cache.frontier[pos] != layer).any()):
                raise ValueError(f"the Aux Cache of layer {layer} does not match the frontier")
            cache.aux[layer] = (pos, hidden.to(device))
        return cache


# ====================================================================================== one step


def _rows(hidden: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return hidden.index_select(1, idx.to(hidden.device))


def _sliding_window(attn) -> int | None:
    """The sliding window a layer's attention passes to the kernel (qwen2/3: per layer; mistral,
    phi3: the config's), None for none."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(getattr(attn, "config", None), "sliding_window", None)


def _layer_mask(slots: torch.Tensor, batch_pos: torch.Tensor, selected: torch.Tensor, window: int | None = None):
    """(key positions, mask) of a layer pass: keys = the layer's slots then the batch's; mask
    (q_len, kv_len) bool or None when plain causal attention is exact (every slot selected and
    before every batch token, the batch in position order, and no sliding window that could
    count slots instead of positions). ``window``: the layer's sliding window (None: none)."""
    key_pos = torch.cat([slots, batch_pos])
    visible = selected[key_pos]
    windowed = window is not None and window < int(key_pos.max()) + 1
    if not windowed and bool(visible.all()) and (slots.numel() == 0 or int(slots.max()) < int(batch_pos.min())):
        return key_pos, None
    mask = visible.view(1, -1) & (key_pos.view(1, -1) <= batch_pos.view(-1, 1))
    if windowed:
        mask &= key_pos.view(1, -1) > batch_pos.view(-1, 1) - window
    return key_pos, mask


@torch.inference_mode()
def run_tokens(
    engine,
    ids: torch.Tensor,
    cache: LazyCache,
    schedule: list[tuple[int, float]],
    *,
    until: int | None = None,
    decoding: bool = False,
) -> torch.Tensor | None:
    """One LazyLLM generation step (module docstring): the new tokens ``ids`` (q,) at positions
    ``cache.n_tokens ..`` on top of ``cache``; returns the query token's last hidden state
    (1, 1, hidden), before the final norm.

    ``until``: run layers ``0..until-1`` only, every token, and leave the new tokens' hidden states
    in the Aux Cache of ``until`` (the prefix state; no pruning layer may come before ``until``).
    ``decoding``: count Aux Cache reads as revivals.
    """
    n_layers = engine.n_layers
    start, q = cache.n_tokens, ids.numel()
    total = start + q
    cache.grow(total)
    keep_at = dict(schedule)
    stop = n_layers if until is None else until
    selected = torch.ones(total, dtype=torch.bool)  # S_0: every token
    batch_pos = torch.arange(start, total)
    hidden = engine.embed(ids)
    rope = engine.position_embeddings(hidden, batch_pos)
    found: dict[str, torch.Tensor] = {}
    step_trace: list = []
    if cache.trace is not None:
        cache.trace.append(step_trace)

    for layer in range(stop):
        if layer in keep_at:
            # --- pruning layer: S_layer = the best of S_{layer-1} by the query token's attention
            cand, scores = found.pop("cand"), found.pop("scores")
            k = n_keep(keep_at[layer], total)
            if k < cand.numel():
                scores = scores.cpu().clone()
                scores[cand == total - 1] = float("inf")  # the query token always goes on
                kept = cand[torch.topk(scores, k).indices]
                selected = torch.zeros(total, dtype=torch.bool)
                selected[kept] = True
            # tokens carried so far that drop out here: their hidden state -> Aux Cache of `layer`
            leave = ~selected[batch_pos]
            if bool(leave.any()):
                go, stay = torch.nonzero(leave).flatten(), torch.nonzero(~leave).flatten()
                cache.stash(layer, batch_pos[go], _rows(hidden, go))
                hidden, batch_pos = _rows(hidden, stay), batch_pos[stay]
            # selected tokens without KV here: their hidden state comes from the Aux Cache of `layer`
            pos_r, hidden_r = cache.take(layer, selected)
            if pos_r.numel():
                if bool((cache.frontier[pos_r] != layer).any()):
                    raise RuntimeError("lazyllm: Aux Cache entry out of step with the token's KV")
                if decoding:
                    cache.revivals += pos_r.numel()
                    cache.revived[pos_r] = True
                batch_pos = torch.cat([batch_pos, pos_r])
                hidden = torch.cat([hidden, hidden_r], dim=1)
                order = torch.argsort(batch_pos)
                batch_pos, hidden = batch_pos[order], _rows(hidden, order)
            missing = selected & (cache.frontier <= layer)
            missing[batch_pos] = False
            if bool(missing.any()):
                raise RuntimeError("lazyllm: a selected token has neither KV nor an Aux Cache entry")
            rope = engine.position_embeddings(hidden, batch_pos)
            step_trace.append((layer, selected.clone()))
        window = _sliding_window(engine.layers[layer].self_attn)
        key_pos, mask = _layer_mask(cache.slots(layer), batch_pos, selected, window)
        observers = None
        if layer + 1 in keep_at and layer + 1 < stop:
            visible = selected[key_pos]  # what the query token (the last row) sees: S_layer

            def score(query: torch.Tensor, key: torch.Tensor, visible=visible, key_pos=key_pos) -> None:
                probs = last_token_attention(query, key, visible)
                idx = torch.nonzero(visible).flatten()
                found["cand"], found["scores"] = key_pos[idx], probs[idx.to(probs.device)]

            observers = {layer: [score]}
        with attention.attention_context(engine.context(observers=observers, mask=mask)):
            hidden = engine.layer(layer, hidden, batch_pos, cache, rope)
        cache.note_computed(layer, batch_pos)

    if stop < n_layers:
        cache.stash(stop, batch_pos, hidden)
    cache.record_positions(torch.arange(start, total))
    return hidden[:, -1:] if until is None else None


# ===================================================================================== the method


def _parse_list(name: str, text: str, kind, example: str) -> list:
    try:
        return [kind(p.strip()) for p in text.split("/")]
    except ValueError:
        raise UsageError(f"lazyllm: {name} expects values separated by '/', e.g. {name}={example}, got '{text}'") from None


@register
@dataclass
class LazyLLM(Compressor):
    """LazyLLM (Fu et al., 2024): at a few pruning layers the last token's attention in the layer
    before keeps the most important tokens (fewer in later layers); pruned tokens stop being
    computed, and every decoding step selects again, reviving tokens from an Aux Cache of hidden
    states. arXiv:2407.14057."""

    name: ClassVar[str] = "lazyllm"
    paper: ClassVar[str] = "Fu et al. 2024, LazyLLM: Dynamic Token Pruning for Efficient Long Context LLM Inference, arXiv:2407.14057"
    keep_all: ClassVar[str] = "keep=1/1/1"  # no token is pruned at any of the (default) three pruning layers

    layers: str | None = knob(
        None,
        "pruning layers, '/'-separated, increasing, 0-based in 1..n_layers-1: layer L and later see only the tokens "
        f"kept by the last token's attention at layer L-1; auto = {DEFAULT_FRACTIONS} of the depth",
    )
    keep: str | None = knob(
        None,
        "share of all tokens kept at each pruning layer, '/'-separated, non-increasing, in (0, 1]; "
        "auto = evenly from 0.7 down to 0.3 (0.7/0.5/0.3)",
    )

    def __post_init__(self) -> None:
        if self.layers is not None:
            _parse_list("layers", self.layers, int, "8/16/24")
        if self.keep is not None:
            keep = _parse_list("keep", self.keep, float, "0.7/0.5/0.3")
            if any(not 0 < k <= 1 for k in keep):
                raise UsageError(f"lazyllm: keep ratios must be in (0, 1], got '{self.keep}'")
            if any(b > a for a, b in zip(keep, keep[1:])):
                raise UsageError(f"lazyllm: keep ratios must not increase from one pruning layer to the next, got '{self.keep}'")

    def configure(self, lm) -> None:
        n_layers = lm.n_layers
        keep = None if self.keep is None else _parse_list("keep", self.keep, float, "0.7/0.5/0.3")
        if self.layers is None:
            layers = default_layers(n_layers, 3 if keep is None else len(keep))
            if keep is not None and len(layers) != len(keep):
                raise UsageError(
                    f"lazyllm: {len(keep)} keep ratios need {len(keep)} pruning layers, but the model has only "
                    f"{n_layers} layers; give layers= explicitly"
                )
        else:
            layers = _parse_list("layers", self.layers, int, "8/16/24")
            if any(not 1 <= l < n_layers for l in layers):
                raise UsageError(f"lazyllm: pruning layers must be in 1..{n_layers - 1} for {lm.name} ({n_layers} layers), got '{self.layers}'")
            if any(b <= a for a, b in zip(layers, layers[1:])):
                raise UsageError(f"lazyllm: pruning layers must be increasing, got '{self.layers}'")
        if keep is None:
            keep = default_keep(len(layers))
        if len(keep) != len(layers):
            raise UsageError(f"lazyllm: {len(layers)} pruning layers but {len(keep)} keep ratios; give one ratio per layer")
        self.layers = "/".join(str(l) for l in layers)
        self.keep = "/".join(f"{k:g}" for k in keep)

    def schedule(self, lm=None) -> list[tuple[int, float]]:
        """[(pruning layer, keep ratio), ...]; resolves the defaults for ``lm`` if :meth:`configure`
        has not run yet."""
        if self.layers is None or self.keep is None:
            if lm is None:
                raise ValueError("lazyllm: the schedule needs the model (configure first)")
            self.configure(lm)
        layers = _parse_list("layers", self.layers, int, "8/16/24")
        keep = _parse_list("keep", self.keep, float, "0.7/0.5/0.3")
        return list(zip(layers, keep))

    def first_pruning_layer(self, lm) -> int:
        sched = self.schedule(lm)
        return sched[0][0] if sched else lm.n_layers

    # --- the disk store: layers before the first pruning layer are question-agnostic -------------
    def prefix_state(self, lm) -> dict:
        """The KV of layers 0..L_1-1 and the hidden states entering L_1 (module docstring)."""
        return {"kind": "lazyllm", "layers": self.first_pruning_layer(lm)}

    def build_prefix(self, engine, prefix_ids: torch.Tensor) -> LazyCache:
        cache = LazyCache(engine.n_layers)
        run_tokens(engine, prefix_ids, cache, [], until=self.first_pruning_layer(engine.lm))
        return cache

    # --- the two phases ----------------------------------------------------------------------------
    def prefill(self, engine, ids: torch.Tensor, prefix=None, protected: int = 0):
        """Step 0 on the prompt ``ids`` (on top of the prefix state when given). ``protected`` is
        not used: as in the paper, only the last token is sure to be kept."""
        schedule = self.schedule(engine.lm)
        if prefix is not None:
            cache = prefix.cache()
            ids = ids[prefix.n_tokens :]
        else:
            cache = LazyCache(engine.n_layers)
        hidden = run_tokens(engine, ids, cache, schedule)
        cache.schedule = schedule
        cache.n_prompt = cache.n_tokens
        cache.prefill_tokens = [int(c) for c in cache.computed[:, : cache.n_prompt].sum(dim=1)]
        return cache, engine.logits(hidden)[-1], cache.n_tokens

    def decode_step(self, engine, token: int, position: int, cache: LazyCache) -> torch.Tensor:
        """One decoding step: the selection runs again for the new token (dynamic pruning)."""
        if position != cache.n_tokens:
            raise ValueError(f"lazyllm: decoding step at position {position}, expected {cache.n_tokens}")
        hidden = run_tokens(engine, torch.tensor([token]), cache, self.schedule(engine.lm), decoding=True)
        cache.decode_steps += 1
        return engine.logits(hidden)[-1]
