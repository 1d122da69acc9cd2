"""The stored book: InfLLM's memory of a whole document (:mod:`kvcli.compressors.infllm`).

InfLLM (Xiao et al. 2024, arXiv:2402.04617) reads a sequence of any length in chunks; every query
attends to three parts of what came before it, and nothing else:

    Initial  tokens [0, initial)                      — always attended ("attention sinks")
    Memory   blocks of ``block_size`` tokens after    — the ``topk`` blocks whose representative
             Initial, each out of the local window       keys score highest against the chunk's
                                                         queries (InfLLM's equation 2)
    Local    every token after the last memory block  — at least ``local_window`` tokens, under
             (the local window), the chunk itself        ``local_window + block_size`` before the
                                                         chunk; causal within the chunk

Positions, as InfLLM assigns them: the Local tokens keep their order — the first Local token is
position 0, a query at local index ``i`` is position ``i`` — and every Initial and Memory token
sits at the *same* distance ``local_window`` from every query ("the same position for all tokens
beyond the local window"): their keys are kept before RoPE, and the query that scores them is
rotated to position ``local_window`` (InfLLM's ``apply_rotary_pos_emb_one_angle(q, n_local)``).
No relative distance ever exceeds ``local_window + block_size + chunk`` (reading) or
``local_window + block_size + question + answer`` (answering), whatever the document's length.

One softmax spans both kinds of positions: Local (the queries at their Local positions, causal)
and Initial + Memory (the queries rotated to ``local_window``, the keys before RoPE) are each
attended by PyTorch's fused kernel, which also gives each row's log-sum-exp, and the two results
are merged into the softmax over all the keys (:func:`kvcli.runtime.kernels.attention_lse`,
:func:`~kvcli.runtime.kernels.merge_lse`); the query heads of a GQA group are rows of their KV head,
the cache is never expanded.

A block leaves Local for Memory once ``local_window`` tokens follow it (checked after each
chunk); then its representatives are the ``repr_topk`` tokens with the highest representative
score, InfLLM's equation 1 ``r_m = 1/l_L sum_j q_{m+j} · k_m`` over its ``local_window``
successors' queries: a key's successors in a pass are consecutive queries, so its terms are
``k_m`` times a difference of prefix sums of the pass's queries (no logits). Only their sum is kept
(``repsum``): equation 2, ``sum_i sum_r q_i · r``, needs no more. The first block to leave also
moves Initial out of Local.

Everything a token ever needs is written to the storage (:mod:`kvcli.caches.bookfile`) when it
leaves Local: the keys before RoPE and the values in 16 bits (``kv_dtype``), or in 8 or 4
(``--kv-bits``: :class:`~kvcli.caches.bookfile.QuantRows`; Local stays in 16). After the document,
the tail still in Local is written too: the storage then holds the whole document, and a question
runs on top of it (:meth:`BookCache.copy`: Local grows with the question and the answer, and
every step retrieves its own blocks — or, ``retrieval=question``, the blocks the question chose).

What the book writes to its storage and reads back — the finished read, the store's entry, a read
that stops and resumes from the end of any chunk — is :mod:`kvcli.caches.book_storage`'s.
"""

from __future__ import annotations

import copy as _copy
import math
from typing import ClassVar

import torch

from ..runtime import kernels
from ..runtime.attention import LayerView
from ..runtime.kernels import attention_lse, merge_lse
from ..runtime.rope import rerotate_table, rope_cos_sin
from .base import CacheBase, cache_type
from .book_storage import StoredBook
from .bookfile import bits_of, kv_rows
from .representatives import partition


class BookLayer(LayerView):
    """What :meth:`BookCache.update` returns for one layer of a pass: it attends itself."""

    cache: BookCache

    def attend(
        self, module, query: torch.Tensor, scaling: float, sliding_window: int | None, kernel: str
    ) -> torch.Tensor:
        return self.cache.attend(self.layer_idx, module, query, scaling, kernel)

    def read_weights(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.cache.read_weights(self.layer_idx, query)


@cache_type
class BookCache(StoredBook, CacheBase):
    kind: ClassVar[str] = "book"
    tensor_lists: ClassVar[tuple[str, ...]] = ("tail_k", "tail_v")
    opens_in_place: ClassVar[bool] = True  # an entry is the book's storage: read as needed (:meth:`open_entry`)

    def __init__(
        self,
        storage,
        n_doc: int,
        n_layers: int,
        n_kv: int,
        head_dim: int,
        *,
        initial: int,
        block_size: int,
        local: int,
        topk: int,
        repr_topk: int,
        retrieval: str = "step",
        dtype: torch.dtype | None = None,
    ) -> None:
        self.storage = storage
        self.n_doc = int(n_doc)  # tokens of the document the storage is laid out for
        self.n_layers_, self.n_kv, self.d = n_layers, n_kv, head_dim
        self.initial, self.block_size, self.local, self.topk, self.repr_topk = (
            initial,
            block_size,
            local,
            topk,
            repr_topk,
        )
        self.retrieval = retrieval
        self.answer_topk = topk  # blocks a question / decoding step retrieves (the reading's topk unless set)
        self.answer_positions = "same"  # answering: "same" (InfLLM) or "ordered" (:meth:`_attend_memory`)
        self.answer_scores = (
            "representatives"  # the question's pass: "representatives" (InfLLM) or "tokens" (:meth:`choose`)
        )
        self.dtype = dtype or (storage.specs["k.0"][0] if n_layers else torch.float16)  # Local's, the rows read
        self.rows = kv_rows(storage, head_dim, self.dtype)  # the keys and values stored (8 or 4 bits: QuantRows)
        self.origin = 0  # absolute position of the first Local token
        self.n_blocks = 0  # blocks in Memory
        _, self.max_blocks, _ = partition(self.n_doc, initial, local, block_size)
        empty = torch.zeros(1, n_kv, 0, head_dim, dtype=self.dtype)
        self.tail_k = [empty] * n_layers
        self.tail_v = [empty] * n_layers
        self.tail_score = [torch.zeros(n_kv, 0)] * n_layers
        self.init_k = self.init_v = None  # per layer (1, n_kv, initial, d), once Initial left Local
        self.repsum = [torch.zeros(n_kv, self.max_blocks, head_dim) for _ in range(n_layers)]
        self.reading = False  # True while the document is read: score tokens, move blocks to Memory
        self.rotary = None  # the model's rotary embedding (:meth:`bind`)
        self._tables: dict[torch.device, tuple] = {}  # per device: (cos, sin) at positions 0.. (:meth:`rotate`)
        self._bias = None  # the causal mask of the pass in progress (:meth:`_causal_bias`)
        self.positions = None
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._chosen: dict[int, torch.Tensor] = {}  # retrieval=question: the blocks the question chose, per layer
        self.filter_layer: int | None = None  # a probe pass (:meth:`select_shared`): the layer that selects
        self.shared: torch.Tensor | None = None  # (n_kv, k) blocks every layer attends while answering
        self._rotated: dict[int, torch.Tensor] = {}  # answering: Local's keys at their positions, per layer
        self._cited_keys: dict[int, tuple] = {}  # answering: (blocks, Initial + their raw keys) a citing layer reads
        self.attended, self.steps = 0.0, 0  # share of the document's KV attended (decoding steps)
        self.trace: list | None = None  # a list: (pass start, layer, chosen blocks) of every retrieval
        self.reads: torch.Tensor | None = None  # answering: (n_layers, n_kv, max_blocks) retrievals of each block

    # --- the transformers contract ----------------------------------------------------------------
    def bind(self, engine) -> BookCache:
        if self.rotary is not engine.rotary_emb:
            self.rotary, self._tables = engine.rotary_emb, {}
        return self

    @property
    def n_layers(self) -> int:
        return self.n_layers_

    @property
    def kv_bits(self) -> int:
        return bits_of(self.storage.specs, self.d)

    @property
    def local_len(self) -> int:
        return self.tail_k[0].shape[2] if self.n_layers_ else 0

    def next_positions(self, n: int) -> torch.Tensor:
        """The positions of the next ``n`` tokens of a pass: their indices in Local."""
        return torch.arange(self.local_len, self.local_len + n)

    def record_positions(self, positions: torch.Tensor) -> None:
        """The tokens of a pass, at their absolute positions (the pass ran at Local positions)."""
        super().record_positions(torch.arange(self.n_tokens, self.n_tokens + positions.numel()))

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._pending[layer_idx] = (key, value)
        view = BookLayer(self, layer_idx)
        return view, view

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.origin + (self.tail_k[layer_idx].shape[2] if layer_idx < self.n_layers_ else 0)

    # --- attention ---------------------------------------------------------------------------------
    def attend(self, layer: int, module, query: torch.Tensor, scaling: float, kernel: str) -> torch.Tensor:
        """The pass's queries (1, n_heads, c, d), rotated at their Local positions, attend to
        Initial + retrieved Memory blocks (at distance ``local``) + Local (causal)."""
        key, value = self._pending.pop(layer)
        c, L = key.shape[2], self.tail_k[layer].shape[2]
        pos = torch.arange(L, L + c)
        raw = self.rotate(key, pos, torch.zeros(c, dtype=torch.long)).to(self.dtype)
        old = self._rotated.get(layer)
        if old is None or old.shape[2] != L or old.dtype != query.dtype:
            tail = self.tail_k[layer].to(query.device, query.dtype)  # rotated where the queries are
            old = self.rotate(tail, torch.zeros(L, dtype=torch.long), torch.arange(L))
        k_loc = torch.cat([old.to(query.device), key], dim=2)
        if not self.reading:  # answering: Local only grows, its keys keep their positions
            again = self.rotate(raw.to(query.dtype), torch.zeros(c, dtype=torch.long), pos)  # as the next pass would
            self._rotated[layer] = torch.cat([old.to(query.device), again.to(query.device)], dim=2)
        v_loc = torch.cat([self.tail_v[layer].to(device=query.device, dtype=value.dtype), value], dim=2)
        if self.reading:  # one pass of the document: equation 1's terms for every Local key
            self._score(layer, query, k_loc)
        if self.init_k is None:  # nothing has left Local yet: causal attention over it
            out = kernels.attend(kernel, module, query, k_loc, v_loc, scaling)
            if not self.reading and c == 1:
                self.attended += 1.0 / self.n_layers_
        else:
            out = self._attend_memory(layer, query, k_loc, v_loc, pos, scaling)
        self.tail_k[layer] = torch.cat([self.tail_k[layer], raw.to("cpu")], dim=2)
        self.tail_v[layer] = torch.cat([self.tail_v[layer], value.to("cpu", self.dtype)], dim=2)
        return out

    def _score(self, layer: int, query: torch.Tensor, k_loc: torch.Tensor) -> None:
        """Add a reading pass's terms of InfLLM's equation 1 to ``tail_score``: each Local key
        ``k_m`` gains ``q_i · k_m`` from every query ``i`` of the pass among its ``local``
        successors (``m < i <= m + local``; the query heads of its GQA group averaged). The
        successors of a key are a run of consecutive queries, so the sum is ``k_m`` times a
        difference of prefix sums of the pass's queries: (c + L) x d products, no logits."""
        _, n_heads, c, d = query.shape
        L = k_loc.shape[2] - c
        q = query[0].reshape(self.n_kv, n_heads // self.n_kv, c, d).to(torch.float64).mean(dim=1)  # (n_kv, c, d)
        prefix = torch.cat([q.new_zeros(self.n_kv, 1, d), q.cumsum(dim=1)], dim=1)  # prefix[:, r] = sum of rows < r
        m = torch.arange(L + c, device=q.device)
        lo = (m + 1).clamp(min=L) - L  # the first successor in this pass (row index)
        hi = torch.maximum((m + self.local).clamp(max=L + c - 1) - L + 1, lo)  # one past the last
        terms = ((prefix[:, hi] - prefix[:, lo]) * k_loc[0].to(torch.float64)).sum(dim=-1)
        score = torch.cat([self.tail_score[layer], torch.zeros(self.n_kv, c)], dim=1)
        self.tail_score[layer] = score + terms.to(torch.float32).cpu()

    def _attend_memory(self, layer: int, query, k_loc, v_loc, pos, scaling: float) -> torch.Tensor:
        """Initial + the retrieved Memory blocks (keys before RoPE, the queries rotated to
        ``local``) and Local (causal, at Local positions) in one softmax: each part's attention
        and log-sum-exp (fused, :func:`attention_lse`), merged. The query heads of a GQA group
        are rows of their KV head (never expanded)."""
        _, n_heads, c, d = query.shape
        g = n_heads // self.n_kv
        q_mem = self.rotate(query, pos, torch.full((c,), self.local, dtype=torch.long))
        blocks = self.choose(layer, q_mem, scaling)
        if not self.reading:
            self._count_reads(layer, blocks)
        k_mem, v_mem = self.gather(layer, blocks)
        k_mem = torch.cat([self.init_k[layer], k_mem], dim=2).to(query.device, query.dtype)
        v_mem = torch.cat([self.init_v[layer], v_mem], dim=2).to(query.device, query.dtype)
        n_mem, n_loc = k_mem.shape[2], k_loc.shape[2]
        if not self.reading and self.answer_positions == "ordered":
            # answering within the model's window: Initial, the retrieved blocks in document order
            # and Local at consecutive positions 0, 1, ... (the query at n_mem + its Local index)
            k_mem = self.rotate(k_mem, torch.zeros(n_mem, dtype=torch.long), torch.arange(n_mem))
            q_mem = self.rotate(query, pos, pos + n_mem)
        bias = None if c == 1 else self._causal_bias(c, n_loc, g, query)
        loc = attention_lse(query.reshape(1, self.n_kv, g * c, d), k_loc, v_loc.to(query.dtype), bias, scaling)
        mem = attention_lse(q_mem.reshape(1, self.n_kv, g * c, d), k_mem, v_mem, None, scaling)
        if not self.reading and c == 1:
            self.attended += (n_mem + n_loc) / max(1, self.get_seq_length(layer)) / self.n_layers_
        return merge_lse(loc, mem).reshape(1, n_heads, c, d).transpose(1, 2).contiguous()

    def _count_reads(self, layer: int, blocks: torch.Tensor) -> None:
        """One retrieval of ``blocks`` (n_kv, k) by ``layer`` while answering (the question's pass,
        a decoding step): counts per block, whatever the number of steps."""
        if self.reads is None:
            self.reads = torch.zeros(self.n_layers_, self.n_kv, self.max_blocks, dtype=torch.int32)
        if blocks.numel():
            self.reads[layer].scatter_add_(1, blocks.to(torch.long), torch.ones_like(blocks, dtype=torch.int32))

    def read_weights(self, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An answering step's softmax weights over what :meth:`_attend_memory` reads — Initial, the
        question's blocks (positioned as it positions them) and Local with the step's own key —
        and the absolute position of each row: (n_kv, rows) long, (n_kv, group, rows) float32
        (:meth:`kvcli.runtime.attention.LayerView.read_weights`). Called before the step attends, so it
        retrieves nothing itself: None where each step retrieves its own blocks
        (``retrieval=step``). Scaled by 1/sqrt(d)."""
        key, _ = self._pending[layer]
        _, n_heads, c, d = query.shape
        if self.reading or c != 1:
            return None
        g, L = n_heads // self.n_kv, self.tail_k[layer].shape[2]
        pos = torch.arange(L, L + 1)
        old = self._rotated.get(layer)
        if old is None or old.shape[2] != L or old.dtype != query.dtype:
            tail = self.tail_k[layer].to(query.device, query.dtype)  # rotated where the queries are
            old = self.rotate(tail, torch.zeros(L, dtype=torch.long), torch.arange(L))
        k_loc = torch.cat([old.to(query.device), key], dim=2)[0].to(torch.float32)  # (n_kv, L + 1, d)
        q = query[0, :, -1].reshape(self.n_kv, g, d).to(torch.float32)
        logits = [torch.matmul(q, k_loc.transpose(-1, -2))]
        positions = [(self.origin + torch.arange(L + 1)).expand(self.n_kv, -1)]
        if self.init_k is not None:
            blocks = self.shared if self.shared is not None else self._chosen.get(layer)
            if blocks is None or self.retrieval == "step" and self.shared is None:
                return None
            cached = self._cited_keys.get(layer)
            if cached is None or not torch.equal(cached[0], blocks):  # once per answer: the keys as read
                k_mem = torch.cat([self.init_k[layer], self.gather(layer, blocks)[0]], dim=2)
                k_mem = k_mem.to(query.device, query.dtype)
                if self.answer_positions == "ordered":
                    n_mem = k_mem.shape[2]
                    k_mem = self.rotate(k_mem, torch.zeros(n_mem, dtype=torch.long), torch.arange(n_mem))
                cached = self._cited_keys[layer] = (blocks.clone(), k_mem[0].to(torch.float32))
            k_mem = cached[1]  # (n_kv, n_mem, d) float32, rotated as _attend_memory rotates them
            n_mem = k_mem.shape[1]
            if self.answer_positions == "ordered":
                q_mem = self.rotate(query, pos, pos + n_mem)
            else:
                q_mem = self.rotate(query, pos, torch.full((1,), self.local, dtype=torch.long))
            q_mem = q_mem[0, :, -1].reshape(self.n_kv, g, d).to(torch.float32)
            logits.insert(0, torch.matmul(q_mem, k_mem.transpose(-1, -2)))
            offsets = torch.arange(self.block_size)
            held = [
                torch.cat([torch.arange(self.initial), *(self.initial + b * self.block_size + offsets for b in row)])
                for row in blocks.tolist()
            ]
            positions.insert(0, torch.stack(held))
        weights = torch.softmax(torch.cat(logits, dim=-1) / math.sqrt(d), dim=-1)
        return torch.cat(positions, dim=1), weights

    def _causal_bias(self, c: int, n_loc: int, g: int, like: torch.Tensor) -> torch.Tensor:
        """(g*c, n_loc) additive mask: query row i (any head of a group) sees Local keys up to
        its own position ``n_loc - c + i``. The same for every layer of a pass: built once."""
        key = (c, n_loc, g, like.dtype, like.device)
        if self._bias is None or self._bias[0] != key:
            allowed = torch.ones(c, n_loc, dtype=torch.bool, device=like.device).tril(n_loc - c)
            bias = torch.zeros(c, n_loc, dtype=like.dtype, device=like.device).masked_fill(~allowed, float("-inf"))
            self._bias = (key, bias.repeat(g, 1))
        return self._bias[1]

    def rotate(self, x: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Keys or queries (..., n, d) at positions ``old`` (n,) -> at ``new`` (n,), from a table of
        the model's rotary embedding over Local's positions: one per device (a pass on a GPU may
        rotate on the host too), each built once and grown only when a position is past its end."""
        if x.shape[-2] == 0:
            return x
        need = int(max(old.max(), new.max())) + 1
        table = self._tables.get(x.device)
        if table is None or table[0].shape[0] < need:
            size = max(need, 2 * table[0].shape[0] if table is not None else 0, self.local + self.block_size + 1)
            table = self._tables[x.device] = rope_cos_sin(self.rotary, torch.arange(size), x)
        return rerotate_table(x, old.to(x.device), new.to(x.device), *table)

    def choose(self, layer: int, q_mem: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """InfLLM's equation 2: block b scores ``sum_i sum_r q_i · r_b`` (i over the pass's queries,
        r over its representatives) per query head, summed over each KV head's GQA group; the
        ``topk`` best per KV head, in block order. (n_kv, min(topk, n_blocks)) long."""
        if not self.reading and self.shared is not None:  # one selection for every layer and step
            self._chosen.setdefault(layer, self.shared)
            return self.shared
        if not self.reading and self.retrieval == "question" and layer in self._chosen and q_mem.shape[2] == 1:
            return self._chosen[layer]
        if not self.reading and layer == self.filter_layer and q_mem.shape[2] > 1:
            return self._select_shared(layer, q_mem, scaling)
        nb = self.n_blocks
        k = min(self.topk if self.reading else self.answer_topk, nb)
        if k == 0:
            return torch.zeros(self.n_kv, 0, dtype=torch.long)
        q = q_mem[0].to(torch.float32).sum(dim=1)  # (n_heads, d): the sum over the pass's queries
        q = q.reshape(self.n_kv, -1, q.shape[-1]).sum(dim=1).cpu()  # per KV head (no GQA expansion)
        if not self.reading and self.answer_scores == "tokens" and q_mem.shape[2] > 1:
            scores = self._token_scores(layer, q, nb)
        elif not self.reading and self.answer_scores == "attention" and q_mem.shape[2] > 1:
            scores = self._attention_scores(layer, q_mem, nb, scaling)
        else:
            scores = torch.einsum("hd,hbd->hb", q, self.repsum[layer][:, :nb])
        chosen = torch.sort(torch.topk(scores, k, dim=-1).indices, dim=-1).values
        if self.trace is not None:
            self.trace.append((self.origin + self.tail_k[layer].shape[2], layer, chosen.tolist()))
        if not self.reading:
            self._chosen.setdefault(layer, chosen)
        return chosen

    def _token_scores(self, layer: int, q: torch.Tensor, nb: int) -> torch.Tensor:
        """The question's pass, ``answer_scores=tokens``: block b scores the best of its tokens,
        ``max_t sum_i q_i · k_t`` (keys before RoPE, read from the storage one KV head at a time):
        equation 2 with every token a representative, the max instead of the sum. (n_kv, nb)."""
        lo, bs = self.initial, self.block_size
        out = torch.empty(self.n_kv, nb)
        for h in range(self.n_kv):
            keys = self.rows.read(f"k.{layer}", h, lo, lo + nb * bs).to(torch.float32)
            out[h] = (keys @ q[h]).view(nb, bs).amax(dim=1)
        return out

    def _attention_scores(self, layer: int, q_mem: torch.Tensor, nb: int, scaling: float | None) -> torch.Tensor:
        """The question's pass, ``answer_scores=attention`` (the KTransformers article's
        preselection, SnapKV's vote): each query of the pass (rotated to ``local``, as for
        equation 2) attends over every Memory key of its KV head, read from the storage; block b
        scores the attention its tokens receive, summed over the queries and the group's heads.
        Rows in slices (never more than 32 x the Memory's length at once). (n_kv, nb)."""
        lo, bs = self.initial, self.block_size
        _, n_heads, c, d = q_mem.shape
        g = n_heads // self.n_kv
        scale = d**-0.5 if scaling is None else scaling
        out = torch.empty(self.n_kv, nb)
        for h in range(self.n_kv):
            keys = self.rows.read(f"k.{layer}", h, lo, lo + nb * bs).to(torch.float32)
            rows = q_mem[0, h * g : (h + 1) * g].reshape(g * c, d).to(torch.float32).cpu()
            votes = torch.zeros(nb * bs)
            for r in range(0, rows.shape[0], 32):
                votes += torch.softmax(rows[r : r + 32] @ keys.T * scale, dim=-1).sum(dim=0)
            out[h] = votes.view(nb, bs).sum(dim=1)
        return out

    def _select_shared(self, layer: int, q_mem: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """The probe pass at ``filter_layer``: the ``answer_topk`` blocks whose tokens get the most
        of the question's attention (:meth:`_attention_scores`) summed over every head of the
        layer — one index set, as GemFilter's — kept in ``shared`` for every KV head."""
        k = min(self.answer_topk, self.n_blocks)
        scores = self._attention_scores(layer, q_mem, self.n_blocks, scaling).sum(dim=0)
        chosen = torch.sort(torch.topk(scores, k).indices).values.expand(self.n_kv, k).contiguous()
        self.shared = chosen
        self._chosen.setdefault(layer, chosen)
        return chosen

    def question_blocks(self) -> dict[int, torch.Tensor]:
        """The blocks the question's pass retrieved: {layer: (n_kv, answer_topk) block indices}."""
        return dict(self._chosen)

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw keys and values of the chosen blocks from the storage: (1, n_kv, k*block_size, d),
        every head's blocks in one read of each (:meth:`~kvcli.caches.bookfile.MemoryStorage.read_blocks`)."""
        starts = self.initial + blocks * self.block_size
        k, v = (self.rows.read_blocks(f"{t}.{layer}", starts, self.block_size) for t in ("k", "v"))
        return k[None], v[None]

    # --- reading: Local -> Memory -------------------------------------------------------------------
    def end_chunk(self) -> None:
        """After a chunk ran through every layer: move each block followed by ``local`` tokens
        from Local to Memory (its KV to the storage, its representatives' sum to ``repsum``)."""
        end = self.origin + self.local_len
        first = self.initial if self.n_blocks == 0 else self.origin  # the next block's start
        moved = []
        while self.n_blocks + len(moved) < self.max_blocks and end - (first + self.block_size) >= self.local:
            moved.append(first)
            first += self.block_size
        if not moved:
            return
        cut = first - self.origin  # Local tokens leaving
        start = 0 if self.n_blocks == 0 else moved[0]  # the first time, Initial leaves with the blocks
        for layer in range(self.n_layers_):
            k, v, score = self.tail_k[layer], self.tail_v[layer], self.tail_score[layer]
            self.write_rows(layer, start, k[:, :, start - self.origin : cut], v[:, :, start - self.origin : cut])
            for i, a in enumerate(moved):
                lo = a - self.origin
                bk = k[0, :, lo : lo + self.block_size]
                top = torch.topk(
                    score[:, lo : lo + self.block_size], min(self.repr_topk, self.block_size), dim=-1
                ).indices
                reps = bk.gather(1, top[..., None].expand(-1, -1, self.d)).to(torch.float32)
                self.repsum[layer][:, self.n_blocks + i] = reps.sum(dim=1)
            self.tail_k[layer], self.tail_v[layer] = k[:, :, cut:].clone(), v[:, :, cut:].clone()
            self.tail_score[layer] = score[:, cut:].clone()
        if self.n_blocks == 0:
            self.init_k = [self.storage_rows("k", layer, 0, self.initial) for layer in range(self.n_layers_)]
            self.init_v = [self.storage_rows("v", layer, 0, self.initial) for layer in range(self.n_layers_)]
        self.n_blocks += len(moved)
        self.origin = first

    # --- the store ---------------------------------------------------------------------------------
    def copy(self) -> BookCache:
        """A question's copy: shares the storage, Memory and representatives (never written after
        the read); its own Local (appending makes new tensors) and choices."""
        out = _copy.copy(self)
        out.tail_k, out.tail_v, out.tail_score = list(self.tail_k), list(self.tail_v), list(self.tail_score)
        out._pending, out._chosen, out._rotated, out._cited_keys = {}, {}, {}, {}
        out._tables = dict(self._tables)  # the tables built so far, shared; its own growth
        out.filter_layer, out.shared = None, None
        out.attended, out.steps, out.reads = 0.0, 0, None
        return out

    def for_device(self, device, room: int = 0) -> BookCache:
        """The book itself: each pass moves what it reads to the pass's device (its storage stays
        where it is, on disk or in host memory)."""
        return self

    def to_tensors(self):
        raise NotImplementedError("a book is written to its storage as it is read (kvcli.caches.bookfile)")

    # --- reports -------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the KV kept: the whole stored book (on disk or in memory: it is all kept) plus
        the question's and the answer's Local entries."""
        extra = max(0, self.local_len - (self.n_doc - self.origin))
        per_token = sum(t[:, :, :1].numel() * t.element_size() for t in (*self.tail_k, *self.tail_v))
        return self.stored_bytes() + extra * per_token

    def stored_bytes(self) -> int:
        from .bookfile import nbytes_of

        return nbytes_of(self.storage.specs)

    def kept_mask(self, n_prompt: int) -> torch.Tensor:
        """Nothing is thrown away: every layer and KV head holds every prompt position (in memory
        or in the storage)."""
        mask = torch.zeros(self.n_layers_, self.n_kv, n_prompt, dtype=torch.bool)
        if self.positions is not None:
            mask[:, :, self.positions[self.positions < n_prompt]] = True
        return mask

    def read_mask(self, n_prompt: int) -> torch.Tensor | None:
        """What the question and its answer *read* of the prompt (the book holds all of it,
        :meth:`kept_mask`): (n_layers, n_kv_heads, n_prompt) bool, True for Initial, every Memory
        block a retrieval chose (the question's pass, each decoding step) and Local. None before
        anything was answered; all True while no block has left Local (it is all attended)."""
        if self.reads is None and self.init_k is not None:
            return None
        mask = torch.zeros(self.n_layers_, self.n_kv, n_prompt, dtype=torch.bool)
        if self.init_k is None:
            mask[:] = True
            return mask
        mask[:, :, : min(self.initial, n_prompt)] = True
        mask[:, :, min(self.origin, n_prompt) :] = True
        bs = self.block_size
        for layer, head, block in torch.nonzero(self.reads).tolist():
            lo = self.initial + block * bs
            mask[layer, head, lo : min(lo + bs, n_prompt)] = True
        return mask

    def block_reads(self) -> torch.Tensor | None:
        """(n_layers, n_kv, n_blocks) how many retrievals read each Memory block while answering
        (None: nothing answered yet); block ``b`` holds tokens ``initial + b * block_size`` on."""
        return None if self.reads is None else self.reads[:, :, : self.n_blocks].clone()

    def read_frac(self) -> float | None:
        """The share of the KV held (the book, the question's and the answer's tokens) that the
        question and its answer read, mean over layers and KV heads (:meth:`read_mask`)."""
        mask = self.read_mask(self.n_tokens)
        return None if mask is None or not self.n_tokens else float(mask.float().mean())

    def stats(self) -> dict:
        """JSON-able counters: the share of the KV each decoding step attended, the share the
        question and its answer read in all, the partition."""
        return {
            "kv_attended_frac": self.attended / self.steps if self.steps else None,
            "kv_read_frac": self.read_frac(),
            "decode_steps": self.steps,
            "memory_blocks": self.n_blocks,
            "block_size": self.block_size,
            "initial_tokens": self.initial if self.n_blocks else 0,
            "local_tokens": self.local_len,
            "stored_bytes": self.stored_bytes(),
        }
