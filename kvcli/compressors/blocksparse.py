"""Block-sparse retrieval attention: the KTransformers long-context framework (InfLLM + Quest + SnapKV).

"KVCache Long Context" (KTransformers, kvcache-ai, 2024; ``papers/ktransformers-long-context.md``)
generalises InfLLM (Xiao et al. 2024, arXiv:2402.04617) and Quest (Tang et al. 2024,
arXiv:2406.10774). Nothing is thrown away: the whole KV of the prompt is kept (in CPU memory with
``--kv-offload cpu`` while the model runs on a GPU) and every decoding step attends only to the
blocks most relevant to its query.

1. Prefill: chunked (``chunk`` tokens at a time, full attention over the cache so far), so the
   activations stay bounded; the result equals one pass.
2. The prompt's KV is split into Initial (``initial`` tokens, attention sinks), Context (blocks of
   ``block_size`` tokens) and Local (the last ``local_window`` tokens, plus what the whole blocks
   leave over, plus every generated token). Initial and Local are always attended.
3. Each block gets representative keys (``representative``, ``representative_num``): ``max`` /
   ``mean`` (element-wise over the block, or over ``representative_num`` equal pieces of it),
   ``quest`` (element-wise max and min; the block's score is Quest's upper bound
   ``sum_c max(q_c kmax_c, q_c kmin_c)`` >= q·k of every key in it), ``dynamic`` and ``infllm``
   (the ``representative_num`` tokens of the block with the highest per-token score, two
   readings of that score — below) and ``fixed`` (tokens at fixed intervals).
4. Optional preselection (``preselect``, ``preselect_blocks``): before decoding, SnapKV's vote of
   the last ``window`` prompt queries (attention summed over the window, mean over each GQA
   group, no pooling) preselects the blocks holding the most-voted tokens (block vote = its best
   token's); later selections are restricted to them ("if second_block_count >=
   preselect_block_count, use the preselected blocks").
5. Decoding: the current query scores the blocks — InfLLM's equation 2, ``sum_r q · r`` over the
   representatives (Quest: the upper bound), summed over the query heads of each KV head
   (``head_select=separate``: each KV head picks its own blocks) or of the whole layer
   (``shared``) — and attends to Initial + the ``topk`` best blocks + Local. The first
   ``dense_layers`` layers attend to everything; a selection is recomputed only every
   ``token_step`` tokens and every ``layer_step`` layers, and reused in between (the article's
   ``history_kvcache_after_retrieval``).

Two readings of the per-token score behind "representative tokens":

* ``dynamic`` — the KTransformers article's ("Dynamic: by calculating the cumulative attention
  score for each token using a specific method, each block selects the top-k tokens [...] similar
  to InfLLM but with some simplifications"), as its code does it (``operators/dynamic_attention.py``:
  at the end of the prefill, the softmax attention of the *last 128 prompt queries* summed per
  token): kvcli sums the attention of the last ``window`` prompt queries (softmax over the whole
  prompt, each query head on its GQA group's KV head, mean over the group). Those queries are
  the question's, so the representatives — and which blocks a decoding step can find — depend on
  the question, even with ``preselect=false``. The article explicitly did *not* implement
  InfLLM's own score ("InfLLM requires calculating a representative score for each token during
  the prefill stage [...] invasive modifications to the prefill [...] we ultimately decided not to
  integrate this method"), and its configurations use ``representative_type: DYNAMIC``: so
  ``dynamic`` is the default here, the framework as the article runs it.
* ``infllm`` — InfLLM's (Xiao et al. 2024, §3.2, equation 1): the representative score of token m
  is ``r_m = 1/l_L sum_{j=1..l_L} q_{m+j} · k_m``, the mean dot product with the queries of its
  ``l_L`` successors — how much the tokens of its local window listen to it, read off during the
  prefill, question-independent. kvcli takes ``l_L = local_window`` (InfLLM's local window is the
  one its queries attend to, as Local is here), averages the group's query heads per KV head
  (InfLLM picks per query head; kvcli's representatives are per KV head), and lets only the
  question-agnostic prefix vote: rows of the question never count, so the last document tokens
  have fewer than ``l_L`` voters (their mean is over those). It is computed from the queries and
  keys of every prefill chunk, 256 rows at a time against only the ``l_L`` keys each row reaches
  (:func:`kvcli.caches.representatives.infllm_accumulate`; no attention matrix, GQA never expanded). InfLLM's
  released code differs in detail: it sums the *softmax* weights of its own sparse attention
  (initial + retrieved + local) from the queries within ``n_local`` of a token, itself included;
  kvcli follows the paper's equation, which does not depend on how the prefill attends.
  Because the score needs the query of every document token, the prefix state of
  ``representative=infllm`` is full attention's KV *plus* the per-token score sums
  (:class:`kvcli.caches.blocks.ScoredKVCache`), not ``-c full``'s entry.

The article's named equivalences are presets (``preset=...`` fills the knobs the user did not set):

* ``preset=snapkv``: ``block_size=1``, ``preselect=true`` = SnapKV without pooling — ``initial=0``,
  ``local_window=window`` (SnapKV's observation window, 32), ``head_select=separate`` (SnapKV keeps
  tokens per KV head), ``preselect_blocks=1024-window`` (SnapKV's default budget of 1024 entries)
  and ``topk=preselect_blocks``, so decoding attends exactly to the preselected tokens + the window.
* ``preset=quest``: ``representative=quest``, ``preselect=false``, ``head_select=separate`` = Quest —
  plus Quest's page size ``block_size=16``, no Initial (``initial=0``), the last page always
  attended (``local_window=16``), and Quest's evaluation setup of dense first two layers
  (``dense_layers=2``).

Defaults: the article's where it gives them (``block_size=128``, ``representative=dynamic``,
``representative_num=1``, ``preselect=false``, ``head_select=shared``, ``dense_layers=0``,
``layer_step=1``, ``token_step=1``, ``chunk=4096``); ``initial=128`` is InfLLM's (the article gives
none); ``window=32`` is SnapKV's. The article attends a 4096-token Local window and 96 blocks of
128 tokens for 128K-token contexts; ``local_window`` and ``topk`` default to the same shares of the
model's context window (8K window: 256 tokens and 6 blocks of 128). ``preselect_blocks`` defaults
to ``2 * topk`` (a kvcli choice: the article gives no default).

Disk store: the prefix state is full attention's (the KV of every layer, shared with ``-c full``);
with ``representative=infllm`` that KV plus the representative-score sums of the prefix's tokens.
The tokens after the prefix (at least ``window`` when the queries are needed) run on top of it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import notices
from ..caches import KVCache, quant
from ..caches.blocks import BlockCache, OffloadKVCache, ScoredKVCache
from ..caches.representatives import HEAD_SELECT, REPRESENTATIVES, infllm_accumulate, infllm_scores, partition
from ..errors import UsageError
from ..runtime import accelerator
from .base import Compressor, knob, require_full_layers
from .scoring import group_mean, window_attention

ARTICLE_CONTEXT = 131072  # the article's 128K experiments
ARTICLE_LOCAL = 4096  # local_windows_len
ARTICLE_BLOCKS = 96  # second_block_count (x block_size 128)
ARTICLE_BLOCK_SIZE = 128
SNAPKV_BUDGET = 1024  # kvcli's (and SnapKV's LongBench) default budget
PRESETS = {
    "none": {},
    # "Setting block_size to 1 and preselect_block to True results in a version of SnapKV without pooling"
    "snapkv": {"block_size": 1, "preselect": True, "initial": 0, "head_select": "separate"},
    # "Setting representative_type to Quest, preselect_block to False, and head_select_mode to SEPARATE"
    "quest": {
        "representative": "quest",
        "preselect": False,
        "head_select": "separate",
        "block_size": 16,
        "initial": 0,
        "local_window": 16,
        "dense_layers": 2,
    },
}


def default_local(max_context: int | None) -> int:
    """The article's 4096-token Local window for 128K contexts, in proportion to the model's window."""
    if not max_context:
        return ARTICLE_LOCAL
    return max(16, round(ARTICLE_LOCAL * min(max_context, ARTICLE_CONTEXT) / ARTICLE_CONTEXT))


def default_topk(max_context: int | None, block_size: int) -> int:
    """The article's 96 blocks of 128 tokens for 128K contexts: the same share of the model's window."""
    tokens = (
        ARTICLE_BLOCKS * ARTICLE_BLOCK_SIZE * min(max_context or ARTICLE_CONTEXT, ARTICLE_CONTEXT) / ARTICLE_CONTEXT
    )
    return max(1, round(tokens / block_size))


@dataclass
class BlockSparse(Compressor):
    """Block-sparse retrieval attention (KTransformers long-context framework, generalising InfLLM
    arXiv:2402.04617 and Quest arXiv:2406.10774): the whole KV is kept; each decoding step attends
    to Initial + the top-k Context blocks (scored by representative keys) + Local."""

    name: ClassVar[str] = "blocksparse"
    holds_whole_kv: ClassVar[bool] = True
    paper: ClassVar[str] = (
        "KTransformers 2024, KVCache Long Context (framework of InfLLM, Xiao et al. 2024, arXiv:2402.04617, "
        "and Quest, Tang et al. 2024, arXiv:2406.10774)"
    )
    # the whole KV is always kept (nothing to drop); with no Initial or Local tokens and small blocks,
    # even a short prompt is all Context blocks, and topk >= the number of blocks (each holds >= 1 of
    # the n tokens) makes every decoding step score and attend to all of them: full attention
    keep_all: ClassVar[str] = "block_size=16,initial=0,local_window=0,topk={n}"
    short_document_spec: ClassVar[str] = "blocksparse:block_size=8,initial=8,local_window=16,topk=2"
    holds_every_token: ClassVar[bool] = True  # it keeps all and attends a few blocks per step
    title: ClassVar[str] = "block-sparse"
    acts: ClassVar[str] = (
        "owns the prefill (chunked), builds blocks + representatives (`dynamic`: the last prompt queries' attention, "
        "the article's; `infllm`: InfLLM's question-independent score), owns every decoding step: the query scores the "
        "Context blocks and attends to Initial + top-k blocks + Local; presets `snapkv`, `quest`"
    )
    positions: ClassVar[str] = "original (nothing dropped)"
    disk_cache: ClassVar[str] = "prefix KV (shared with full); `infllm`: + its token scores"
    table_knobs: ClassVar[tuple[str, ...] | None] = (
        "block_size",
        "initial",
        "local_window",
        "topk",
        "representative",
        "...",
    )

    preset: str = knob(
        "none",
        "none, snapkv (block_size 1 + preselect = SnapKV without pooling) or quest (quest representatives, separate heads); fills knobs not set",
    )
    block_size: int = knob(128, "tokens per Context block (article: 128)")
    initial: int = knob(128, "Initial tokens at the start, always attended (InfLLM: 128)")
    local_window: int | None = knob(
        None,
        "Local tokens at the end of the prompt, always attended; auto = the article's 4096 of 128K scaled to the model's window",
    )
    topk: int | None = knob(
        None,
        "Context blocks attended per step; auto = the article's 96 blocks of 128 tokens (of 128K) scaled to the model's window",
    )
    representative: str = knob(
        "dynamic",
        "representative keys of a block: max, mean, quest, dynamic (the article's: attention of the last window prompt queries, i.e. the question's), infllm (InfLLM's eq. 1: mean q·k from each token's local_window successors in the prefill, question-independent) or fixed",
    )
    representative_num: int = knob(1, "representatives per block (max/mean: pieces of the block; quest: always 2)")
    preselect: bool = knob(False, "SnapKV-style preselection of blocks by the question before decoding")
    preselect_blocks: int | None = knob(None, "blocks kept by the preselection; auto = 2 * topk")
    window: int = knob(32, "observation window: last prompt tokens whose queries vote (preselect, dynamic; SnapKV: 32)")
    dense_layers: int = knob(0, "first layers that attend to everything (article: 0; 2 in its best kvretrieval setup)")
    layer_step: int = knob(1, "select every this many layers; the layers in between reuse the selection")
    token_step: int = knob(1, "select every this many tokens; the tokens in between reuse the selection")
    head_select: str = knob("shared", "shared (all KV heads of a layer pick the same blocks) or separate (per KV head)")
    chunk: int = knob(4096, "prefill chunk in tokens (article: 4096)")

    _qtail: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    # infllm: per layer the (n_kv, n) sums of q·k from each token's successors; rows counted so far
    _rep_sums: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    _rows: tuple = dataclasses.field(default=(0, 0), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.preset = str(self.preset).strip().lower()
        if self.preset not in PRESETS:
            raise UsageError(f"blocksparse: preset must be one of {', '.join(PRESETS)}, got '{self.preset}'")
        self.representative = str(self.representative).strip().lower()
        if self.representative == "fix":
            self.representative = "fixed"
        if self.representative not in REPRESENTATIVES:
            raise UsageError(
                f"blocksparse: representative must be one of {', '.join(REPRESENTATIVES)}, got '{self.representative}'"
            )
        self.head_select = str(self.head_select).strip().lower()
        if self.head_select not in HEAD_SELECT:
            raise UsageError(f"blocksparse: head_select must be shared or separate, got '{self.head_select}'")
        for name, low in (
            ("block_size", 1),
            ("initial", 0),
            ("local_window", 0),
            ("topk", 1),
            ("representative_num", 1),
            ("preselect_blocks", 1),
            ("window", 1),
            ("dense_layers", 0),
            ("layer_step", 1),
            ("token_step", 1),
            ("chunk", 1),
        ):
            value = getattr(self, name)
            if value is not None and value < low:
                raise UsageError(f"blocksparse: {name} must be at least {low}, got {value}")

    # --- knobs: presets, automatic values, checks against the model -------------------------------
    def configure(self, lm) -> None:
        explicit = self.explicit_knobs
        for name, value in PRESETS[self.preset].items():
            if name not in explicit:
                setattr(self, name, value)
        if self.preset == "snapkv":
            if "local_window" not in explicit:
                self.local_window = self.window
            if "preselect_blocks" not in explicit:
                self.preselect_blocks = max(1, SNAPKV_BUDGET - self.window)
            if "topk" not in explicit:
                self.topk = self.preselect_blocks
        if self.local_window is None:
            self.local_window = default_local(lm.max_context)
        if self.topk is None:
            self.topk = default_topk(lm.max_context, self.block_size)
        if self.preselect_blocks is None:
            self.preselect_blocks = 2 * self.topk
        if self.representative == "quest" and "representative_num" in explicit and self.representative_num != 2:
            raise UsageError(
                f"blocksparse: quest representatives are always 2 (max and min), got representative_num={self.representative_num}"
            )
        if self.representative != "quest" and self.representative_num > self.block_size:
            raise UsageError(
                f"blocksparse: representative_num={self.representative_num} exceeds block_size={self.block_size}"
            )
        if self.representative == "infllm" and self.local_window < 1:
            raise UsageError(
                "blocksparse: infllm representatives are scored by each token's local_window successors; local_window must be at least 1"
            )
        require_full_layers(lm, "blocksparse")
        if self.dense_layers > lm.n_layers:
            raise UsageError(f"blocksparse: dense_layers={self.dense_layers} exceeds the model's {lm.n_layers} layers")

    def needs_queries(self) -> bool:
        """Whether the last ``window`` prompt queries are needed (preselection, dynamic representatives)."""
        return self.preselect or self.representative == "dynamic"

    def query_window(self, lm) -> int:
        return self.window if self.needs_queries() else 0

    def offloaded(self, engine) -> bool:
        """``--kv-offload cpu`` on an accelerator (CUDA, and the simulator's ``meta``); on the CPU
        a no-op, said once."""
        if self.runtime.kv_offload != "cpu":
            return False
        if accelerator.on_accelerator(engine.device):
            return True
        notices.warn(
            f"--kv-offload cpu has no effect: the model runs on the {engine.device.type}, where the whole KV already is",
            key="kv-offload-cpu",
        )
        return False

    def prefix_device(self, engine) -> torch.device:
        return torch.device("cpu") if self.offloaded(engine) else engine.device

    # --- the prefix state: full attention's KV (infllm: plus the representative-score sums) ------------
    def prefix_state(self, lm) -> dict:
        state = super().prefix_state(lm)
        if self.runtime.kv_offload == "cpu" and accelerator.on_accelerator(lm.device):
            # read offloaded in this method's chunks (build_prefix): not -c full's pass, bit for bit,
            # and in 16 bits
            state = {**quant.without_bits(state), "read": f"offloaded in chunks of {self.chunk}"}
        if self.representative != "infllm":
            return state  # without offload: shared with -c full
        self.configure(lm)
        state = quant.without_bits(state)  # its own build_prefix reads 16 bits
        return {**state, "kind": "kv+infllm", "local_window": self.local_window}

    def build_prefix(self, engine, prefix_ids: torch.Tensor):
        """Full attention's KV of ``prefix_ids`` (n,); with infllm representatives its chunked
        prefill also sums the representative scores the prefix's own queries give its tokens."""
        if self.representative != "infllm" and not self.offloaded(engine):
            return super().build_prefix(engine, prefix_ids)
        # --kv-offload cpu: the prefix too is read layer by layer, each layer offloaded once
        # (full attention's KV, in host memory: never the whole of it on the accelerator)
        cache, _, n = self.prefill(engine, prefix_ids)
        if self.representative != "infllm":
            self._rep_sums = {}
            return KVCache.copy(cache)
        sums = [self._rep_sums[layer] for layer in range(cache.n_layers)]
        self._rep_sums = {}
        return ScoredKVCache.of(cache, sums, rows_scored=n, local=self.local_window)

    # --- prefill: chunked, on top of the prefix state ------------------------------------------------
    @torch.inference_mode()
    def prefill(self, engine, ids: torch.Tensor, prefix=None, protected: int = 0):
        """Run ``ids`` in chunks of ``chunk`` tokens with full attention over the cache so far, on
        top of the prefix KV when there is one (cut back so the last ``window`` tokens run when
        their queries are needed). The last ``protected`` tokens (the question) never vote for
        infllm representatives. Returns (KVCache, first_logits, n)."""
        lm = engine.lm
        self.configure(lm)
        n = ids.numel()
        offload = self.offloaded(engine)
        need = min(n, max(1, self.query_window(lm)))
        cache = OffloadKVCache() if offload else KVCache()
        infllm = self.representative == "infllm"
        limit = max(0, n - int(protected))  # query rows that may vote for infllm representatives
        # the prefix state first: computing it (build_prefix) runs this method on the prefix alone
        pc = prefix.take() if prefix is not None and prefix.n_tokens > 0 else None
        self._rep_sums, scored = {}, 0
        start = 0
        if pc is not None:
            usable = not infllm or (isinstance(pc, ScoredKVCache) and pc.local == self.local_window)
            resume = max(0, min(prefix.n_tokens, n - need))
            # a hybrid's sliding layers kept their window and PREFIX_WINDOW_ROOM entries more: a
            # longer query window runs the whole prompt (Windows.can_resume)
            if usable and engine.windows.can_resume(pc, resume):
                start = resume
                if infllm:
                    scored = pc.rows_scored
                    self._rep_sums = {
                        layer: self._sums_from(r, n, engine.device) for layer, r in enumerate(pc.rep_sums)
                    }
                if start < pc.n_tokens:
                    pc.truncate(start)
                if offload:
                    cache.keys = [k.to("cpu") for k in pc.keys]
                    cache.values = [v.to("cpu") for v in pc.values]
                    cache.positions = pc.positions
                    cache.dropped = dict(pc.dropped)
                else:
                    cache = KVCache.copy(pc) if isinstance(pc, ScoredKVCache) else pc
        self._qtail = {}
        self._rows = (scored, max(scored, limit))
        observers: dict = {}
        if self.needs_queries():
            observers = {layer: [functools.partial(self._observe, layer)] for layer in range(lm.n_layers)}
        if infllm:
            for layer in range(lm.n_layers):
                self._rep_sums.setdefault(
                    layer, torch.zeros(lm.n_kv_heads, n, dtype=torch.float32, device=engine.device)
                )
                observers.setdefault(layer, []).append(functools.partial(self._observe_infllm, layer))
        if offload:  # layer by layer: each layer on the GPU during its chunks, offloaded once
            cache, logits = engine.prefill_by_layer(
                ids[start:],
                torch.arange(start, n),
                cache,
                self.chunk,
                observers,
                before_layer=lambda i: cache.onload(i, engine.device),
                after_layer=cache.offload,
            )
            return cache, logits, n
        logits = None
        for s in range(start, n, self.chunk):
            e = min(n, s + self.chunk)
            cache, logits = engine.prefill(ids[s:e], positions=torch.arange(s, e), cache=cache, observers=observers)
        return cache, logits, n

    @staticmethod
    def _sums_from(stored: torch.Tensor, n: int, device) -> torch.Tensor:
        out = torch.zeros(stored.shape[0], n, dtype=torch.float32, device=device)
        out[:, : stored.shape[1]] = stored.to(device)
        return out

    def _observe_infllm(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Add this pass's query rows (those not counted yet, before the question) to the sums."""
        lo, hi = self._rows
        infllm_accumulate(self._rep_sums[layer], query, key, self.local_window, lo, hi)

    def infllm_scores(self) -> list[torch.Tensor]:
        """InfLLM's representative score of every prompt token, per layer (n_kv, n) float32, from
        the last prefill (before :meth:`compress`); -inf for tokens no document query followed."""
        rows = self._rows[1]
        return [infllm_scores(self._rep_sums[layer], self.local_window, rows) for layer in range(len(self._rep_sums))]

    def _observe(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Keep the queries of the last ``window`` tokens run so far (across chunks)."""
        q = query[:, :, -self.window :]
        prev = self._qtail.get(layer)
        if prev is not None and q.shape[2] < self.window:
            q = torch.cat([prev, q], dim=2)[:, :, -self.window :]
        self._qtail[layer] = q.detach()

    # --- after prefill: blocks, representatives, preselection --------------------------------------
    @torch.inference_mode()
    def compress(self, engine, cache):
        lm = engine.lm
        self.configure(lm)
        if not isinstance(cache, KVCache) or cache.kept is not None:
            raise UsageError("blocksparse: needs the whole KV of the prompt; use it without eviction methods before it")
        n = cache.n_tokens
        initial, n_blocks, ctx_end = partition(n, self.initial, self.local_window, self.block_size)
        votes = None
        if self.needs_queries():
            if len(self._qtail) != cache.n_layers:
                raise UsageError(
                    "blocksparse: the prompt's last queries were not observed (another method ran the prefill); use blocksparse's own prefill"
                )
            votes = [
                self.token_votes(self._qtail[layer], cache.keys[layer].to(engine.device))
                for layer in range(cache.n_layers)
            ]
        self._qtail = {}
        scores = votes if self.representative == "dynamic" else None
        if self.representative == "infllm":
            if len(self._rep_sums) != cache.n_layers:
                raise UsageError(
                    "blocksparse: the prefill's queries were not observed (another method ran the prefill); use blocksparse's own prefill"
                )
            scores = self.infllm_scores()
            self._rep_sums = {}
        candidates = None
        if self.preselect and n_blocks > 0:
            candidates = [self.preselect_from(v[:, initial:ctx_end], n_blocks) for v in votes]
        return BlockCache.from_kv(
            cache,
            local=self.local_window,
            votes=scores,
            candidates=candidates,
            representative_num=self.representative_num,
            compute_device=engine.device,
            consume=True,  # the pipeline keeps only the block cache
            initial=self.initial,
            block_size=self.block_size,
            representative=self.representative,
            topk=self.topk,
            head_select=self.head_select,
            dense_layers=self.dense_layers,
            layer_step=self.layer_step,
            token_step=self.token_step,
            offload=self.offloaded(engine),
        )

    def token_votes(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """SnapKV's vote without pooling: attention of the last ``window`` queries to each key,
        summed over the window, mean over each GQA group -> (n_kv, n) float32."""
        probs = window_attention(query, key, self.window)  # (n_kv, g, w, n)
        return group_mean(probs.sum(dim=2))

    def preselect_from(self, ctx_votes: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """The ``preselect_blocks`` blocks holding the most-voted tokens (a block's vote is its best
        token's): (H, P) sorted block indices, H = n_kv (separate) or 1 (shared: votes averaged)."""
        block_votes = ctx_votes.reshape(ctx_votes.shape[0], n_blocks, self.block_size).amax(dim=-1)
        if self.head_select == "shared":
            block_votes = block_votes.mean(dim=0, keepdim=True)
        p = min(self.preselect_blocks, n_blocks)
        return torch.sort(torch.topk(block_votes, p, dim=-1).indices, dim=-1).values

    # --- decoding ----------------------------------------------------------------------------------
    device_token: ClassVar[bool] = True  # engine.step takes it where it is

    @torch.inference_mode()
    def decode_step(self, engine, token, position: int, cache) -> torch.Tensor:
        """One step: the block cache's layers attend to Initial + selected blocks + Local."""
        if not isinstance(cache, BlockCache):
            raise UsageError(f"blocksparse: decodes on its block cache, not a {type(cache).__name__}")
        return engine.step(token, position, cache)
