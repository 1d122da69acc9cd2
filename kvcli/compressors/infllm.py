"""InfLLM: read a document of any length once, store its KV, answer every question from it.

Xiao et al. 2024, "InfLLM: Training-Free Long-Context Extrapolation for LLMs with an Efficient
Context Memory" (arXiv:2402.04617), as the KTransformers long-context article
(``papers/ktransformers-long-context.md``) frames it: "compute once, use many".

1. Reading (the question-agnostic prefix: the document and the template before it): the prompt
   runs in chunks of ``chunk`` tokens (InfLLM's ``exc_block_size``); each chunk's queries attend
   to Initial (the first ``initial`` tokens), the ``topk`` Memory blocks of ``block_size`` tokens
   that score highest against the chunk's queries, and Local (every token after the last Memory
   block: the ``local_window`` before the chunk, up to ``block_size`` more, and the chunk, causal).
   Positions as InfLLM assigns them (:mod:`kvcli.caches.book`): Local tokens by their order
   in Local, every Initial and Memory token at distance ``local_window`` from every query. So the
   attention span, the positions and the memory a chunk needs are bounded whatever the length.
2. A block joins Memory once ``local_window`` tokens follow it; its representatives are its
   ``repr_topk`` tokens with the highest representative score (InfLLM's equation 1, the mean
   q·k of a token's ``local_window`` successors), scored during this same read.
3. The KV of every token (keys before RoPE, values; ``kv_dtype``, 16 bits by default, or 8 or 4
   with ``--kv-bits``: :class:`~kvcli.caches.bookfile.QuantRows`) and the
   blocks' representatives go to the disk store as they leave Local (:mod:`kvcli.caches.bookfile`):
   the entry depends on the document only, so every later question reuses it; a read that stops
   keeps what it read and the next one resumes it (:mod:`kvcli.store.book`).
4. A question: its tokens run on top of the stored book as one more chunk (its queries retrieve
   the blocks); each decoding step retrieves its own blocks (InfLLM; ``retrieval=question``
   keeps the question's choice for the whole answer, as the KTransformers article does after
   finding per-token re-selection unstable). With ``filter_layer`` (the ``cpu`` preset's, where
   the model has a measured one: :data:`FILTER_LAYERS`) a probe pass of the question up to that
   layer chooses ``answer_topk`` blocks once, by that layer's attention over every stored key
   (GemFilter's filter layer, the KTransformers article's preselection), for every layer and
   step; ``answer_positions=ordered`` then lays Initial, those blocks and Local out in document
   order within the model's window (:meth:`kvcli.caches.book.BookCache._attend_memory`).

Settings (docs/books.md has the table): ``preset`` fills the knobs not given. ``paper``: InfLLM's
released configuration for 8K-window models (Llama-3-8B-Instruct: ``n_init=128, n_local=4096,
block_size=128, topk=16, repr_topk=4, exc_block_size=512``), each decoding step retrieving,
``local_window`` and ``topk`` scaled down to a smaller window (half of it for Local, a quarter for
Memory). ``cpu``: the span measured on a 2-core CPU (``local_window=1024, topk=8``, the question's
blocks for the whole answer): ~2,300 keys per query instead of ~6,900, so a 100-page book reads
within minutes; the question's blocks chosen by the model's filter layer, in document order
(InfLLM's representatives found the answer's block about as often as chance: docs/books.md). ``auto`` (the default): ``cpu`` on the CPU, ``paper`` on an accelerator. The
article's own runs (128K-1M contexts) use ``local_windows_len=4096``, ``block_size=128``,
``second_block_count=96``. kvcli departs from InfLLM in three documented ways: representatives
are chosen per KV head (InfLLM: per query head; kvcli sums each GQA group, never expanding the
cache), the representative score is the paper's equation 1 (its code sums softmax weights), and
Local runs from the last Memory block (InfLLM's code slides it token by token): a query's Local
is ``local_window`` to ``local_window + block_size + chunk`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..caches import quant
from ..caches.book import BookCache
from ..caches.bookfile import HEADER_ROOM, Destination, InMemory, nbytes_of, tensor_specs
from ..caches.representatives import partition
from ..errors import UsageError
from ..runtime import accelerator
from .base import Compressor, knob

INFLLM_WINDOW = 8192  # the training window of InfLLM's Llama-3 configuration
# knobs a preset fills when not given: local_window (at most half the window), topk (blocks, at
# most a quarter of the window), retrieval
PRESETS = {
    "paper": {
        "local_window": 4096,
        "topk": 16,
        "retrieval": "step",
        "filter": False,
    },  # InfLLM's n_local, topk; per-step retrieval
    # measured on a 2-core CPU (docs/books.md); the question's blocks chosen once by the model's
    # filter layer (FILTER_LAYERS) where one is measured
    "cpu": {"local_window": 1024, "topk": 8, "retrieval": "question", "filter": True},
}
# The layer whose question attention over the stored keys finds a needle's block (GemFilter's
# criterion for its filter layer: "the first layer that accurately identifies the needle's
# position"), measured per model on passkey needles in Paul Graham's essays (12k tokens, depths
# 0.2-0.8), never on the books benchmark: docs/books.md, "Which blocks a question reads".
FILTER_LAYERS = {"smollm2-135m-instruct": 17}
KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "model": None}
RETRIEVALS = ("step", "question")
ANSWER_POSITIONS = ("same", "ordered")
ANSWER_SCORES = ("representatives", "tokens", "attention")


@dataclass
class InfLLM(Compressor):
    """InfLLM (Xiao et al. 2024, arXiv:2402.04617): the whole document read once in chunks with a
    bounded attention span (Initial + retrieved Memory blocks + Local), its KV stored question-free;
    each question retrieves the blocks its queries score highest."""

    name: ClassVar[str] = "infllm"
    paper: ClassVar[str] = (
        "Xiao et al. 2024, InfLLM: Training-Free Long-Context Extrapolation for LLMs with an Efficient Context Memory (arXiv:2402.04617)"
    )
    holds_whole_kv: ClassVar[bool] = False
    writes_prefix: ClassVar[bool] = True  # the book, read into its store entry (stored_bytes, read)
    # --kv-bits auto: the book is stored in 8 bits (0.535x the disk; RULER and the books benchmark
    # score as at 16 bits: docs/kv-bits.md)
    auto_kv_bits: ClassVar[int] = 8
    # a Local window as long as the prompt: no block ever leaves it, every query attends to every
    # token before it at its own position — full attention (and the KV stored in the model's dtype)
    keep_all: ClassVar[str] = "local_window={n},kv_dtype=model"
    short_document_spec: ClassVar[str] = "infllm:block_size=8,initial=8,local_window=16,topk=2,chunk=16,repr_topk=2"
    # hybrids (Gemma 2 / 3): their sliding layers would need a window of their own
    hybrid_refusal: ClassVar[str] = (
        "kvcli's InfLLM reads every layer through its block memory and is not built for such hybrids yet "
        "(use -c full or finch)"
    )
    holds_every_token: ClassVar[bool] = True  # its book keeps all; each step attends a few blocks
    title: ClassVar[str] = "InfLLM"
    acts: ClassVar[str] = (
        "owns the prefill, the prefix state and every decoding step: reads the document once in passes of `chunk` "
        "tokens, each attending to Initial + the `topk` Memory blocks its queries retrieve + Local (InfLLM's positions: "
        "Local by its own order, Initial/Memory at distance `local_window`); blocks join Memory once `local_window` "
        "tokens follow them, represented by their `repr_topk` top tokens (equation 1); a question is one more pass, "
        "each decoding step retrieves again ([books.md](books.md))"
    )
    positions: ClassVar[str] = "Local: its own order; Initial/Memory: one fixed distance"
    disk_cache: ClassVar[str] = (
        "the whole document's KV (16-bit, keys before RoPE) + block representatives, written while it is read — any "
        "question"
    )
    table_knobs: ClassVar[tuple[str, ...] | None] = (
        "block_size",
        "initial",
        "local_window",
        "topk",
        "repr_topk",
        "chunk",
        "kv_dtype",
        "retrieval",
    )

    preset: str = knob(
        "auto",
        "auto (cpu on the CPU, paper on an accelerator), cpu (local_window=1024, topk=8, retrieval=question) or paper (InfLLM's 4096, 16, step); fills the knobs not given",
    )
    block_size: int = knob(128, "tokens per Memory block (InfLLM: 128)")
    initial: int = knob(128, "Initial tokens, always attended (InfLLM: n_init 128)")
    local_window: int | None = knob(
        None,
        "Local window in tokens (InfLLM: n_local 4096); auto = the preset's (cpu 1024, paper 4096), at most half the model's window",
    )
    topk: int | None = knob(
        None,
        "Memory blocks each chunk / step retrieves (InfLLM: 16); auto = the preset's (cpu 8, paper 16), at most a quarter of the window",
    )
    answer_topk: int | None = knob(
        None, "Memory blocks a question (and a decoding step) retrieves; auto = topk (InfLLM: the same)"
    )
    repr_topk: int = knob(4, "representative tokens per block (InfLLM: repr_topk 4)")
    chunk: int = knob(512, "tokens read per pass (InfLLM: exc_block_size 512)")
    kv_dtype: str = knob("float16", "stored KV precision: float16, bfloat16 or model (the model's dtype)")
    retrieval: str | None = knob(
        None,
        "answering: step (each decoding step retrieves, InfLLM) or question (the question's blocks for the whole answer, KTransformers); auto = the preset's (cpu question, paper step)",
    )
    answer_scores: str = knob(
        "representatives",
        "how the question scores a block: representatives (InfLLM's equation 2), tokens (its best token against the question's summed queries) or attention (the question's attention over every stored key, KTransformers' preselection); tokens and attention read every stored key",
    )
    filter_layer: int | None = knob(
        None,
        "answering: a probe pass of the question selects answer_topk blocks once, by the attention of this layer's queries over every stored key (GemFilter's filter layer), and every layer attends to them; -1 = each layer retrieves its own (InfLLM); auto = the preset's (cpu: the model's measured filter layer, else -1; paper: -1)",
    )
    answer_positions: str | None = knob(
        None,
        "answering: same (InfLLM: every Initial and Memory token at distance local_window) or ordered (Initial, the retrieved blocks in document order and Local at consecutive positions, within the model's window); auto = ordered with a filter layer (one set of blocks, as GemFilter re-positions its selection), else same",
    )

    def __post_init__(self) -> None:
        choices = {
            "preset": ("auto", *PRESETS),
            "kv_dtype": tuple(KV_DTYPES),
            "retrieval": RETRIEVALS,
            "answer_scores": ANSWER_SCORES,
            "answer_positions": ANSWER_POSITIONS,
        }
        for name, allowed in choices.items():  # None: auto, filled by configure()
            value = getattr(self, name)
            if value is not None:
                value = str(value).strip().lower()
                setattr(self, name, value)
                if value not in allowed:
                    raise UsageError(f"infllm: {name} must be one of {', '.join(allowed)}, got '{value}'")
        for name, low in (
            ("block_size", 1),
            ("initial", 0),
            ("local_window", 1),
            ("topk", 1),
            ("answer_topk", 1),
            ("repr_topk", 1),
            ("chunk", 1),
        ):
            value = getattr(self, name)
            if value is not None and value < low:
                raise UsageError(f"infllm: {name} must be at least {low}, got {value}")

    def configure(self, lm) -> None:
        self.refuse_hybrids(lm)
        window = lm.max_context or INFLLM_WINDOW
        preset = PRESETS[self.resolved_preset(lm)]
        if self.local_window is None:
            self.local_window = max(16, min(preset["local_window"], window // 2))
        if self.topk is None:
            self.topk = max(1, min(preset["topk"], window // (4 * self.block_size)))
        if self.retrieval is None:
            self.retrieval = preset["retrieval"]
        if self.answer_topk is None:
            self.answer_topk = self.topk
        if self.filter_layer is None:
            self.filter_layer = FILTER_LAYERS.get(lm.name, -1) if preset["filter"] else -1
        if self.answer_positions is None:
            self.answer_positions = "ordered" if self.filter_layer >= 0 else "same"
        if not -1 <= self.filter_layer < lm.n_layers:
            raise UsageError(
                f"infllm: filter_layer must be a layer index from 0 to {lm.n_layers - 1} (or -1: none), got {self.filter_layer}"
            )
        if self.repr_topk > self.block_size:
            raise UsageError(f"infllm: repr_topk={self.repr_topk} exceeds block_size={self.block_size}")

    def resolved_preset(self, lm) -> str:
        if self.preset != "auto":
            return self.preset
        return "paper" if accelerator.on_accelerator(lm.device) else "cpu"

    # --- what is stored -----------------------------------------------------------------------------
    def storage_dtype(self, lm) -> torch.dtype:
        """The dtype of the keys and values stored (16 bits), or of the rows read back (8 or 4 bits)."""
        return KV_DTYPES[self.kv_dtype] or next(lm.model.parameters()).dtype

    def storage_precision(self, lm) -> str:
        """The stored keys' and values' precision in words: ``float16`` (16 bits: the dtype), ``8-bit``."""
        bits = self.runtime.kv_bits
        return str(self.storage_dtype(lm)).removeprefix("torch.") if bits == 16 else f"{bits}-bit"

    def prefix_state(self, lm) -> dict:
        self.configure(lm)
        state = {
            "kind": "book",
            "layers": lm.n_layers,
            "block_size": self.block_size,
            "initial": self.initial,
            "local_window": self.local_window,
            "topk": self.topk,
            "repr_topk": self.repr_topk,
            "chunk": self.chunk,
            "kv_dtype": str(self.storage_dtype(lm)).removeprefix("torch."),
            **quant.state(self.runtime.kv_bits),  # the bits and their codec, at 16 too (every key names its format)
        }
        return state

    def specs(self, lm, n: int) -> dict:
        _, n_blocks, _ = partition(n, self.initial, self.local_window, self.block_size)
        dtype, bits = self.storage_dtype(lm), self.runtime.kv_bits
        return tensor_specs(lm.n_layers, lm.n_kv_heads, n, lm.head_dim, n_blocks, dtype, bits)

    def stored_bytes(self, lm, n: int) -> int:
        """Bytes of the stored book's file for an ``n``-token prefix (known before reading it)."""
        self.configure(lm)
        return 8 + HEADER_ROOM + nbytes_of(self.specs(lm, n))

    def span(self) -> str:
        return f"{self.initial} initial + {self.topk} retrieved blocks of {self.block_size} + a {self.local_window:,}-token local window"

    def window_needed(self, lm, n_prompt: int, n_suffix: int, max_new_tokens: int) -> int:
        """The largest distance a query sees: Local (before the question) plus the question and
        the answer; Initial and Memory sit at ``local_window``. Documents within the window: all."""
        self.configure(lm)
        if not lm.max_context or n_prompt + max_new_tokens <= lm.max_context:
            return n_prompt + max_new_tokens
        reading = self.local_window + self.block_size + self.chunk
        answering = self.local_window + self.block_size + n_suffix + max_new_tokens
        if self.answer_positions == "ordered":  # Initial and the retrieved blocks before Local
            answering += self.initial + self.answer_topk * self.block_size
        return max(reading, answering)

    def reading_note(self, lm, n_prompt: int) -> str:
        """What the over-window warning says without a disk store (with one, the store says once
        that it stores the book: :func:`kvcli.store.fetch_book`)."""
        how = (
            f"the {self.answer_topk} its layer-{self.filter_layer} attention selects, in document order"
            if self.filter_layer >= 0
            else f"the {self.answer_topk} its queries score highest"
        )
        return f"infllm reads it in {self.chunk}-token chunks into blocks, of which a question reads {how}"

    # --- reading -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def read(self, engine, ids: torch.Tensor, into: Destination | None = None) -> BookCache:
        """Read ``ids`` (the prefix) into a book: in memory (``into`` None), or where ``into`` puts
        it (:mod:`kvcli.caches.bookfile`): a new file, or the disk store's partial entry, which a
        read that stops keeps and the next one resumes (:mod:`kvcli.store.book`)."""
        lm = engine.lm
        self.configure(lm)
        n = ids.numel()
        into = InMemory() if into is None else into
        dtype = self.storage_dtype(lm)

        def new(storage) -> BookCache:
            return BookCache(
                storage,
                n,
                lm.n_layers,
                lm.n_kv_heads,
                lm.head_dim,
                initial=self.initial,
                block_size=self.block_size,
                local=self.local_window,
                topk=self.topk,
                repr_topk=self.repr_topk,
                retrieval=self.retrieval,
                dtype=dtype,
            ).bind(engine)

        carried = BookCache.carried_bytes(lm.n_layers, lm.n_kv_heads, lm.head_dim, dtype, self.runtime.kv_bits)
        room = BookCache.point_bytes(
            n, lm.n_layers, lm.n_kv_heads, self.initial, self.local_window, self.block_size, carried
        )
        book = into.start(self.specs(lm, n), room, new)
        try:
            book.reading = True
            for s in range(book.n_tokens, n, self.chunk):  # a resumed book: from where its read stopped
                part = ids[s : s + self.chunk]
                engine.forward(part, book.next_positions(part.numel()), book)
                book.end_chunk()
                into.reached(book)
            book.finish_read()
        except BaseException:
            into.interrupted()
            book.storage.close()
            raise
        return book

    def build_prefix(self, engine, prefix_ids: torch.Tensor):
        return self.read(engine, prefix_ids)

    # --- a question -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, engine, ids: torch.Tensor, prefix=None, protected: int = 0):
        """The question's tokens (everything after the prefix) on top of the stored book."""
        self.configure(engine.lm)
        n = ids.numel()
        if prefix is not None and prefix.n_tokens > 0:
            book, start = prefix.take(), prefix.n_tokens
        else:
            book, start = self.read(engine, ids[:0]), 0
        book = book.bind(engine)
        book.retrieval, book.answer_topk, book.answer_positions = (
            self.retrieval,
            self.answer_topk,
            self.answer_positions,
        )
        book.answer_scores = self.answer_scores
        if start >= n:
            raise UsageError("infllm: the prompt has no tokens after the document to answer from")
        if self.filter_layer >= 0:  # a probe pass selects one set of blocks for every layer
            probe = book.copy()
            probe.filter_layer = self.filter_layer
            engine.forward(ids[start:], probe.next_positions(n - start), probe, layers=range(self.filter_layer + 1))
            book.shared = probe.shared
        # one pass, as one more chunk: its queries together retrieve the blocks (equation 2)
        hidden = engine.forward(ids[start:], book.next_positions(n - start), book)
        return book, engine.logits(hidden[:, -1:])[-1], n

    @torch.inference_mode()
    def decode_step(self, engine, token: int, position: int, cache) -> torch.Tensor:
        if not isinstance(cache, BookCache):
            raise UsageError(f"infllm: decodes on its book, not a {type(cache).__name__}")
        cache.steps += 1
        return engine.step(token, position - cache.origin, cache)
