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

Cache layout: :class:`kvcli.caches.lazy.LazyCache`, per layer ``l`` its own token set (``keys``,
``values``, ``slot_pos``), each token's ``frontier``, the Aux Cache ``aux`` and the ``computed`` counts.

A revived token's KV slot is appended at the end of its layer's tensors (in place, in a buffer
with room to spare), and a layer holds the KV of tokens that are not in this step's ``S_l``. A
layer pass therefore reads ``S_l`` one of two ways (:func:`_layer_pass`, planned once for the
layers between two pruning layers, which hold the same slots): several query rows (revivals) and
few members: only the members' rows are gathered, and a (q_len, kv_len) mask (position ``<=`` the
query's) is built only when held rows come after a query row; otherwise every slot is read and a
mask from ``slot_pos`` hides the others (membership in ``S_l``, position ``<=`` the query's). Both
are exact; a sliding window, if any, is counted in positions, not slots.

**Departure from the paper (knob ``reselect``, default 1 = the paper).** Every decoding step of
the paper selects again, so a step revives the tokens its new query wants and runs them through
the later layers: after ~128 tokens nearly every (token, layer) has been computed (0.97 at 4k),
and that work, done a few hundred rows at a time, costs more wall time than the prefill saved.
``reselect=N`` selects at every N-th decoding step only; the steps between reuse, at each pruning
layer, the last selection plus the tokens generated since (they hold KV everywhere), so they score
nothing and revive nothing, and their single row attends to that set. ``reselect=0`` keeps the
prefill's selection for good (the Aux Cache is never read again). Each (token, layer) is still
computed at most once, and ``keep=1`` is still full attention.

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

from ..caches.lazy import LazyCache
from ..errors import UsageError
from ..runtime import attention, windows
from ..runtime.kernels import by_keys
from .base import Compressor, knob

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
    logits = by_keys(key[0], lambda k: torch.matmul(q_last, k.transpose(-1, -2))) / math.sqrt(d)  # (n_kv, group, kv)
    if visible is not None:
        logits = logits.masked_fill(~visible.to(logits.device), float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=(0, 1))


# ====================================================================================== one step


def _rows(hidden: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return hidden.index_select(1, idx.to(hidden.device))


GATHER_BELOW = (
    0.8  # a pass with revived rows reads S_l's rows (a copy) when they are fewer than this share of the held slots
)


def _layer_pass(slots: torch.Tensor, batch_pos: torch.Tensor, selected: torch.Tensor, window: int | None = None):
    """What one layer pass attends to: (key positions, gather, mask, visible).

    The layer holds KV slots at positions ``slots`` and appends the batch's rows (positions
    ``batch_pos``, in position order) after them; the attention may read only the members of the
    step's set ``selected`` (S_l), at positions ``<=`` the query row's. Two ways to read them:

    * ``gather`` (slot indices, :attr:`LazyCache.gather`): only the held members of ``S_l``
      followed by the batch's new slots are read (a copy of those rows), so membership needs no
      mask. Worth it when several rows query a small share of the slots (revivals);
    * else (``gather`` None) every slot is read and non-members are masked out (``visible``).

    ``key positions``: the positions of the rows read, in order; ``visible``: (kv_len,) bool of the
    rows read that are in ``S_l`` (None: all); ``mask``: (q_len, kv_len) bool, or None when plain
    causal attention over the rows read is exact (all visible, every held row before every batch
    row, and no sliding window that could count rows instead of positions; ``window``: the
    layer's sliding window, None: none)."""
    n_held, q = slots.numel(), batch_pos.numel()
    members = selected[slots]
    n_members = int(members.sum())
    gather, visible = None, None
    if n_members == n_held:
        held_pos = slots
    elif q > 1 and n_members < GATHER_BELOW * n_held:
        idx = torch.nonzero(members).flatten()
        gather, held_pos = torch.cat([idx, torch.arange(n_held, n_held + q)]), slots[idx]
    else:
        held_pos, visible = slots, torch.cat([members, torch.ones(q, dtype=torch.bool)])
    key_pos = torch.cat([held_pos, batch_pos])
    windowed = window is not None and window < int(key_pos.max()) + 1
    if visible is None and not windowed and (held_pos.numel() == 0 or int(held_pos.max()) < int(batch_pos[0])):
        return key_pos, gather, None, None
    mask = key_pos.view(1, -1) <= batch_pos.view(-1, 1)
    if visible is not None:
        mask &= visible.view(1, -1)
    if windowed:
        mask &= key_pos.view(1, -1) > batch_pos.view(-1, 1) - window
    return key_pos, gather, mask, visible


@torch.inference_mode()
def run_tokens(
    engine,
    ids: torch.Tensor,
    cache: LazyCache,
    schedule: list[tuple[int, float]],
    *,
    until: int | None = None,
    decoding: bool = False,
    select: bool = True,
) -> torch.Tensor | None:
    """One LazyLLM generation step (module docstring): the new tokens ``ids`` (q,) at positions
    ``cache.n_tokens ..`` on top of ``cache``; returns the query token's last hidden state
    (1, 1, hidden), before the final norm.

    ``until``: run layers ``0..until-1`` only, every token, and leave the new tokens' hidden states
    in the Aux Cache of ``until`` (the prefix state; no pruning layer may come before ``until``).
    ``decoding``: count Aux Cache reads as revivals.
    ``select``: False (a decoding step between two selections, knob ``reselect``): no scoring;
    each pruning layer reuses the set of the last selecting step (``cache.selection``) plus the
    tokens generated since, which all hold KV there, so nothing is revived.
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
    plan = None  # (selected, batch_pos, window, slots, key positions, gather, mask, visible) of the last layer pass
    step_trace: list = []
    if cache.trace is not None:
        cache.trace.append(step_trace)

    for layer in range(stop):
        if layer in keep_at:
            # --- pruning layer: S_layer = the best of S_{layer-1} by the query token's attention
            if not select:
                last = cache.selection[layer]
                selected = torch.ones(total, dtype=torch.bool)  # the tokens generated since: all in
                selected[: last.numel()] = last
                cand = None
            else:
                cand, scores = found.pop("cand"), found.pop("scores")
                k = n_keep(keep_at[layer], total)
            if cand is not None and k < cand.numel():
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
            if select:
                cache.selection[layer] = selected
            step_trace.append((layer, selected.clone()))
        window = engine.windows.attention_window(layer)
        slots = cache.slots(layer)
        # the layers between two pruning layers hold the same slots: one pass plan serves them all
        if (
            plan is None
            or plan[0] is not selected
            or plan[1] is not batch_pos
            or plan[2] != window
            or not torch.equal(plan[3], slots)
        ):
            plan = (selected, batch_pos, window, slots, *_layer_pass(slots, batch_pos, selected, window))
        key_pos, gather, mask, visible = plan[4:]
        observers = None
        if select and layer + 1 in keep_at and layer + 1 < stop:

            def score(query: torch.Tensor, key: torch.Tensor, key_pos=key_pos, visible=visible) -> None:
                # the query token's attention over S_layer (the rows read, less the masked ones)
                probs = last_token_attention(query, key, visible)
                if visible is None:
                    found["cand"], found["scores"] = key_pos, probs
                else:
                    idx = torch.nonzero(visible).flatten()
                    found["cand"], found["scores"] = key_pos[idx], probs[idx.to(probs.device)]

            observers = {layer: [score]}
        cache.gather = gather
        try:
            with attention.attention_context(engine.context(observers=observers, mask=mask)):
                hidden = engine.layer(layer, hidden, batch_pos, cache, rope)
        finally:
            cache.gather = None
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
        raise UsageError(
            f"lazyllm: {name} expects values separated by '/', e.g. {name}={example}, got '{text}'"
        ) from None


@dataclass
class LazyLLM(Compressor):
    """LazyLLM (Fu et al., 2024): at a few pruning layers the last token's attention in the layer
    before keeps the most important tokens (fewer in later layers); pruned tokens stop being
    computed, and every decoding step selects again (``reselect``: every N-th step), reviving
    tokens from an Aux Cache of hidden states. arXiv:2407.14057."""

    name: ClassVar[str] = "lazyllm"
    paper: ClassVar[str] = (
        "Fu et al. 2024, LazyLLM: Dynamic Token Pruning for Efficient Long Context LLM Inference, arXiv:2407.14057"
    )
    keep_all: ClassVar[str] = "keep=1/1/1"  # no token is pruned at any of the (default) three pruning layers
    short_document_spec: ClassVar[str] = "lazyllm:keep=0.5/0.4/0.3"
    title: ClassVar[str] = "LazyLLM"
    acts: ClassVar[str] = (
        "owns the prefill and every decoding step: at each pruning layer the last token's attention at the layer before "
        "(from q·K, SDPA stays on) keeps the top share of the previous set; pruned tokens' hidden states go to the Aux "
        "Cache and may be revived by a later step, each (token, layer) computed at most once"
    )
    positions: ClassVar[str] = "original (skipped, never re-numbered)"
    disk_cache: ClassVar[str] = "KV of the layers before the first pruning layer + hidden states entering it"
    table_knobs: ClassVar[tuple[str, ...] | None] = ("layers", "keep")

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
    reselect: int = knob(
        1,
        "decoding steps per selection: 1 = select again at every step (the paper); N > 1 = at every N-th step, "
        "the steps between reuse the last selection plus the new tokens (no scoring, no revival); "
        "0 = keep the prefill's selection",
    )

    def __post_init__(self) -> None:
        if isinstance(self.reselect, bool) or not isinstance(self.reselect, int) or self.reselect < 0:
            raise UsageError(
                f"lazyllm: reselect expects a whole number of decoding steps >= 0 (1: every step), got '{self.reselect}'"
            )
        if self.layers is not None:
            _parse_list("layers", self.layers, int, "8/16/24")
        if self.keep is not None:
            keep = _parse_list("keep", self.keep, float, "0.7/0.5/0.3")
            if any(not 0 < k <= 1 for k in keep):
                raise UsageError(f"lazyllm: keep ratios must be in (0, 1], got '{self.keep}'")
            if any(b > a for a, b in zip(keep, keep[1:])):
                raise UsageError(
                    f"lazyllm: keep ratios must not increase from one pruning layer to the next, got '{self.keep}'"
                )

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
                raise UsageError(
                    f"lazyllm: pruning layers must be in 1..{n_layers - 1} for {lm.name} ({n_layers} layers), got '{self.layers}'"
                )
            if any(b <= a for a, b in zip(layers, layers[1:])):
                raise UsageError(f"lazyllm: pruning layers must be increasing, got '{self.layers}'")
        if keep is None:
            keep = default_keep(len(layers))
        if len(keep) != len(layers):
            raise UsageError(
                f"lazyllm: {len(layers)} pruning layers but {len(keep)} keep ratios; give one ratio per layer"
            )
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
            cache = prefix.take()
            ids = ids[prefix.n_tokens :]
        else:
            cache = LazyCache(engine.n_layers)
        hidden = run_tokens(engine, ids, cache, schedule)
        cache.schedule = schedule
        cache.reselect = self.reselect
        cache.n_prompt = cache.n_tokens
        cache.prefill_tokens = [int(c) for c in cache.computed[:, : cache.n_prompt].sum(dim=1)]
        return cache, engine.logits(hidden)[-1], cache.n_tokens

    def decode_step(self, engine, token: int, position: int, cache: LazyCache) -> torch.Tensor:
        """One decoding step: the selection runs again for the new token (dynamic pruning), at
        every ``reselect``-th step (knob; 1: every step, as the paper)."""
        if position != cache.n_tokens:
            raise ValueError(f"lazyllm: decoding step at position {position}, expected {cache.n_tokens}")
        step = cache.decode_steps + 1  # the prefill is step 0, a selecting step
        select = self.reselect == 1 or (self.reselect > 1 and step % self.reselect == 0)
        hidden = run_tokens(
            engine, torch.tensor([token]), cache, self.schedule(engine.lm), decoding=True, select=select
        )
        cache.decode_steps = step
        cache.selecting_steps += select
        cache.trim_windows(engine.windows, slack=windows.WINDOW_SLACK)  # a hybrid's sliding layers: their window
        return engine.logits(hidden)[-1]
