"""Pipelines of compressors, and the one function that answers a question with them.

``-c "gemfilter:k=2048+snapkv:budget=512"`` parses into a :class:`Pipeline`: stages run in the order
of the hooks (every ``select_tokens`` first, in the order written, then the prefill). At most one
stage may own an exclusive phase (:data:`compressors.base.EXCLUSIVE_PHASES`).

The prompt is always run in two parts: its question-agnostic prefix (document + template,
``Prompt.prefix_len`` tokens), whose state the *reader* — the stage that reads the whole prompt
first — computes with ``build_prefix`` or loads from the disk store (:class:`kvcli.answer.prefix.Prefix`),
then the question's tokens on top of it. Cold, warm and ``--no-cache`` runs therefore do the same
arithmetic and give token-identical answers.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import notices
from ..caches import KVCache, QuantKVCache, quant
from ..cite.attribution import CitingHeads
from ..compressors import Compressor, owned_phases, parse_one
from ..compressors.base import Runtime
from ..compressors.full import FullAttention
from ..compressors.selection import Selection
from ..errors import DocumentError, UsageError
from ..runtime.attention import listening
from ..runtime.decode import DecodeStep
from ..runtime.lookup import PromptLookup
from ..runtime.measure import measure, reading_prompt
from ..runtime.threads import ThreadPolicy, in_phase
from ..runtime.windows import Windows
from ..store import KVStore
from .policy import NAME as AUTO
from .policy import AutoPolicy, reads
from .prefix import Prefix
from .prefix import report as prefix_report
from .prompt import Prompt

SEPARATOR = "+"


@dataclass
class Pipeline:
    stages: list[Compressor]
    # ``-c auto``: no stages until :meth:`resolve` picks them for a prompt (kvcli.answer.policy)
    policy: AutoPolicy | None = None
    chosen_by: str | None = None  # "auto" when the policy chose these stages

    @classmethod
    def parse(cls, spec: str) -> Pipeline:
        if spec.strip().lower() == AUTO:
            return cls([], policy=AutoPolicy())
        parts = [p for p in spec.split(SEPARATOR)]
        if not spec.strip() or any(not p.strip() for p in parts):
            raise UsageError(f"empty compressor in pipeline '{spec}'")
        pipeline = cls([parse_one(p) for p in parts])
        pipeline.check_collisions()
        return pipeline

    def check_collisions(self) -> None:
        from ..compressors.base import EXCLUSIVE_PHASES

        for phase in EXCLUSIVE_PHASES:
            owners = [s.name for s in self.stages if phase in owned_phases(type(s))]
            if len(owners) > 1:
                raise UsageError(
                    f"pipeline: {' and '.join(owners)} both own the {phase} phase; only one method per pipeline may"
                )
        prefill_owner = self.owner("prefill")
        foreign = [s.name for s in self.compressors() if s is not prefill_owner]
        if prefill_owner is not None and foreign:
            # compressors score with observers on kvcli's own prefill pass and expect its KVCache
            raise UsageError(
                f"pipeline: {prefill_owner.name} runs its own prefill, so {', '.join(foreign)} cannot compress "
                f"after it; use {prefill_owner.name} alone"
            )
        selectors = self.selectors()
        late = [s.name for s in selectors[1:] if s.reads_passages]
        if late:  # only the first selector sees the prompt itself, and so its passages
            raise UsageError(f"pipeline: {late[0]} ranks the document's passages, so it must come first")
        prefix_owner = self.owner("build_prefix")
        if selectors and prefix_owner is not None and prefix_owner is not prefill_owner:
            # the selector reads the prompt first: the other method's prefix state would never be built
            # (a method that also owns the prefill, LazyLLM, simply runs the selected tokens without it)
            raise UsageError(
                f"pipeline: {selectors[0].name} selects tokens before {prefix_owner.name} could compress the "
                f"prompt's KV; use {prefix_owner.name} alone"
            )

    def spec(self) -> str:
        if self.policy is not None and not self.stages:
            return AUTO
        return SEPARATOR.join(s.spec() for s in self.stages)

    def resolve(self, prompt: Prompt, lm, max_new_tokens: int) -> Pipeline:
        """The pipeline that answers ``prompt``: itself, or for ``auto`` the policy's choice."""
        if self.policy is None:
            return self
        policy = self.policy.on(lm)
        spec = policy.choose(
            prompt.n_tokens, lm.max_context, max_new_tokens, reads=lambda s: reads(s, lm, prompt, max_new_tokens)
        )
        within = not lm.max_context or prompt.n_tokens + max_new_tokens <= lm.max_context
        if policy.compress_from != self.policy.compress_from and spec != "full" and within:
            notices.warn(  # once a model: a batch's next documents say it no more
                f"the prompt is {prompt.n_tokens:,} tokens: on a CPU -c auto reads a prompt whole on {lm.name} "
                f"only up to {policy.compress_from - 1:,} (beyond, a first question takes many minutes), so {spec} "
                "reads the pages the question points to; -c full reads it all",
                key=("cpu-full-until", lm.name),
            )
        return Pipeline(Pipeline.parse(spec).stages, chosen_by=AUTO)

    def configure(self, lm, runtime: Runtime | None = None) -> None:
        """Hand every stage the run's settings, then let it resolve its knobs for ``lm``."""
        for s in self.stages:
            if runtime is not None:
                s.runtime = runtime
            s.configure(lm)

    def owner(self, phase: str) -> Compressor | None:
        return next((s for s in self.stages if phase in owned_phases(type(s))), None)

    def selectors(self) -> list[Compressor]:
        return [s for s in self.stages if "select_tokens" in owned_phases(type(s))]

    def reads_passages(self) -> bool:
        """Whether the first selector ranks the document's passages (``pages``): it is handed the
        prompt, and the answer's sources come one per passage it read (:func:`kvcli.answer.citing.cite`)."""
        selectors = self.selectors()
        return bool(selectors) and selectors[0].reads_passages

    def retrieves(self) -> bool:
        """Whether the first selector retrieves what it reads instead of compressing the prompt
        (``pages``): its Selection says what it read (``read``), and no compression ratio is
        reported against a full attention that may not fit the window."""
        selectors = self.selectors()
        return bool(selectors) and selectors[0].retrieves

    def compressors(self) -> list[Compressor]:
        return [s for s in self.stages if "compress" in owned_phases(type(s))]

    def plain(self) -> bool:
        """Whether full attention runs the prompt: no stage selects, reads, compresses or decodes
        it its own way (each stage is ``full``)."""
        return not any(owned_phases(type(s)) for s in self.stages)

    def small_kv(self, cache, bits: int, room: int = 0):
        """The cache decoding runs on, in ``bits`` bits (:meth:`decode_bits`): ``cache`` as it is when
        it holds them already (full attention's quantized prefix, a quantized book); at 16 a quantized
        plain KV turned back layer by layer (a book, which decodes its own way, stays as it is); a
        plain KV (full attention without a prefix, the eviction methods, Finch) quantized layer by
        layer; else ``cache`` in 16 bits, said once: a method that decodes its own way or a layout
        not quantized (:mod:`kvcli.caches.quant`). ``room``: the entries decoding may append (a
        KV turned back to 16 bits gets them in its buffers)."""
        decoder = self.owner("decode_step")
        if cache.kv_bits == bits:
            return cache
        if bits == 16:  # a quantized plain KV read in 16 bits for decoding (Pipeline.decode_bits)
            return cache.dense(room) if type(cache) is QuantKVCache and decoder is None else cache
        if type(cache) is KVCache and decoder is None:
            return QuantKVCache.of(cache, bits)
        method = self.spec().split(":")[0]
        why = (
            f"{decoder.name} runs its own decoding steps"
            if decoder is not None
            else f"its {cache.kind} layout is not quantized"
        )
        notices.warn(f"--kv-bits {bits}: {method} keeps its KV in 16 bits ({why})", key=("kv-bits", method))
        return cache

    def kv_bits(self, setting: int | str) -> int:
        """The bits the KV is held in for ``--kv-bits setting``: the setting, or for ``auto`` what
        the stages declare (:attr:`Compressor.auto_kv_bits`): 16 when one of them holds 16."""
        return max(s.auto_kv_bits for s in self.stages) if setting == quant.AUTO else int(setting)

    def decode_bits(self, setting: int | str, device) -> int:
        """The bits decoding reads the KV in: :meth:`kv_bits`, except under ``auto`` on a CPU, where
        an 8-bit KV (in memory while the prompt is read, and in the disk store) is turned back to
        16 bits once for the answer: a CPU decodes from 16 bits faster (PyTorch's fused or kvcli's
        grouped attention against :func:`kvcli.caches.quant.attend`'s products over the codes; the
        1.5B Qwen after 4,700 tokens, docs/kv-bits.md), and the 16-bit KV of what an answer reads is
        no more than the prompt's reading held."""
        bits = self.kv_bits(setting)
        return 16 if setting == quant.AUTO and torch.device(device).type == "cpu" else bits

    def reader(self) -> Compressor:
        """The stage that reads the whole prompt first, and so owns the prefix state: the first
        selector, else the owner of ``build_prefix``, else the prefill owner, else the first stage."""
        selectors = self.selectors()
        if selectors:
            return selectors[0]
        return self.owner("build_prefix") or self.owner("prefill") or self.stages[0]


@dataclass
class Result:
    answer: str
    answer_ids: list[int]
    prompt: Prompt
    selection: Selection  # prompt tokens the second pass read (all of them without a selector)
    ttft_s: float  # start -> logits of the first answer token (selection + prefill)
    total_s: float  # start -> last token
    peak_mem_mb: float
    decode_tokens_per_s: float | None
    extra: dict = field(default_factory=dict)
    # the cache after decoding (what the layers and heads held: ``cache.kept_mask``; inspect reads it)
    cache: object | None = field(default=None, repr=False)
    # each layer's sliding window, the model's (kvcli.runtime.windows; None: not known, counted as without windows)
    windows: Windows | None = None
    # where the answer comes from (kvcli.cite.sources.Sources), built by the caller that knows the
    # document (kvcli.api.Session.ask) from ``extra["citing"]``; None: not asked for
    sources: object | None = None
    # the document answered from (kvcli.documents.Document), set by the caller that has it (Session.ask):
    # where what was read lies (pages or lines) for a method that retrieves
    document: object | None = None
    # each answer token's log-probability as it was chosen (None: not asked for; ``run(logprobs=True)``)
    answer_logprobs: list[float] | None = None
    # whether the answer comes from the document (kvcli.answer.grounding.Grounding), set by Session.ask; None: not checked
    grounding: object | None = None

    def kept_mask(self) -> torch.Tensor | None:
        """What each layer and KV head held of the prompt, in prompt indices:
        (n_layers, n_kv_heads, n_prompt) bool; None when the cache does not report it.
        Tokens a selector dropped are False everywhere."""
        if self.cache is None:
            return None
        try:
            inner = self.cache.kept_mask(self.selection.n_kept)  # indices into the selected tokens
        except NotImplementedError:
            return None
        mask = torch.zeros(*inner.shape[:2], self.prompt.n_tokens, dtype=torch.bool)
        mask[:, :, self.selection.kept] = inner
        return mask

    @functools.cached_property
    def n_kept_tokens(self) -> float:
        """The prompt's KV entries the model actually held after compression: the mean over layers
        and KV heads of prompt tokens whose KV is in the cache (:meth:`kept_mask`), so per-head and
        per-layer evictions count what they evicted. A selector's dropped tokens count as dropped;
        a cache that does not report what it held counts the selection."""
        mask = self.kept_mask()
        if mask is None or not mask.numel():
            return float(self.selection.n_kept)
        return float(mask.sum()) / (mask.shape[0] * mask.shape[1])

    @property
    def compression_ratio(self) -> float:
        """What full attention holds of the prompt / what was held, per layer and KV head (1.0:
        nothing evicted). Without sliding windows that is prompt tokens / :attr:`n_kept_tokens`. On
        a hybrid model (Gemma 2 / 3) full attention's own sliding layers hold only their window
        (the last ``w - 1`` prompt tokens once decoding starts, fewer as the answer's tokens push
        them out: :meth:`~kvcli.runtime.windows.Windows.mean_held`, after as many decoding steps as this run
        took): both sides count them, so full attention is 1.0 there too and a method is credited
        only for what it evicted."""
        n = self.prompt.n_tokens
        if self.windows is None or not self.windows.hybrid:
            return n / max(self.n_kept_tokens, 1e-9)
        fed = 0 if self.cache is None else max(0, self.cache.n_tokens - self.selection.n_kept)
        return self.windows.mean_held(n, fed) / max(self.n_kept_tokens, 1e-9)


def default_prefill(engine, ids: torch.Tensor, prefix: Prefix | None, compressors: list[Compressor]):
    """Prefill ``ids`` (n,) on top of the prefix state (if any: :meth:`Prefix.extend`, which runs
    again the last tokens whose queries a compressor needs, ``query_window``) with the compressors'
    observers. Returns (cache, first_logits).

    Compressors that evict layer by layer (``compresses_by_layer``: the leading ones, so the order
    of a chain is kept) evict each layer as soon as the pass has run it (with full attention's KV
    as the prefix state, computed here, the prefix and the rest then run layer by layer together:
    the prompt's whole uncompressed KV is never held at once). A hybrid's sliding layer is cut back
    to its window as soon as the pass has run it (what the pipeline does to every layer before
    decoding): the prompt's KV is never held whole there either.
    """
    lm = engine.lm
    n = ids.numel()
    observers: dict[int, list] = {}
    for stage in compressors:
        for layer, fns in stage.prefill_observers(lm, n).items():
            observers.setdefault(layer, []).extend(fns)
    by_layer = []
    for stage in compressors:
        if not stage.compresses_by_layer():
            break
        by_layer.append(stage)

    def after_layer(cache, i: int) -> None:
        for stage in by_layer:
            stage.compress_layer(engine, cache, i)
        cache.trim_windows(engine.windows, layers=(i,))  # a hybrid's sliding layer: its window, once run

    if prefix is None:
        cache = KVCache()
        return engine.prefill(ids, cache=cache, observers=observers, after_layer=functools.partial(after_layer, cache))
    window = max((stage.query_window(lm) for stage in compressors), default=0)
    return prefix.extend(
        ids, query_window=window, observers=observers, after_layer=after_layer, by_layer=bool(by_layer)
    )


def check_window(
    prompt: Prompt, lm, max_new_tokens: int, pipeline: Pipeline | None = None, stored: bool = False
) -> None:
    """Refuse a prompt the model's window cannot hold. With a (configured) ``pipeline``, its reader
    says how many positions it needs (``Compressor.window_needed``): Finch reads longer documents,
    and says so before it starts (one warning with the token count: it takes a while). ``stored``:
    a disk store keeps what a book reader reads, and says so once, when it reads the document
    (:func:`kvcli.store.fetch_book`): no warning then (a later run is a cache hit)."""
    limit = lm.max_context
    # --- the question (and the template around it) alone over the window: no method reads it ---
    fixed = prompt.n_tokens - prompt.n_document_tokens + max_new_tokens
    if limit and fixed > limit and prompt.n_suffix <= max_new_tokens:  # the answer's room is the larger part
        raise DocumentError(
            f"--max-new-tokens {max_new_tokens:,} does not fit: with the prompt template and the question "
            f"({fixed - max_new_tokens:,} tokens) it is over the {limit:,}-token window of {lm.name} by "
            f"{fixed - limit:,} tokens before any of the document; lower --max-new-tokens"
        )
    if limit and fixed > limit:
        raise DocumentError(
            f"the question is too long: with the prompt template and {max_new_tokens} tokens to generate it "
            f"needs {fixed:,} positions ({prompt.n_suffix:,} of question), over the {limit:,}-token window of "
            f"{lm.name} by {fixed - limit:,} tokens before any of the document; shorten the question by at "
            f"least {fixed - limit:,} tokens"
        )
    over = limit and prompt.n_tokens + max_new_tokens > limit
    # --- Finch: the reader may read documents longer than the window chunk by chunk ---
    if limit and pipeline is not None:
        reader = pipeline.reader()
        needed = reader.window_needed(lm, prompt.n_tokens, prompt.n_after_document, max_new_tokens)
        if needed != prompt.n_tokens + max_new_tokens:
            if needed > limit:
                raise DocumentError(
                    f"{reader.name} needs {needed:,} positions at once for this {prompt.n_tokens:,}-token prompt plus "
                    f"{max_new_tokens} to generate, over the {limit:,}-token window of {lm.name}; "
                    "lower its target/chunk, --max-new-tokens, or the question's length"
                )
            if over and not (stored and reader.writes_prefix):
                how = reader.reading_note(lm, prompt.n_tokens)
                notices.warn(  # once per document and method: a batch's next questions say it no more
                    f"the prompt is {prompt.n_tokens:,} tokens ({prompt.n_document_tokens:,} of document), "
                    f"{prompt.n_tokens / limit:,.1f}x the {limit:,}-token window of {lm.name}: {how}",
                    key=("over-window", reader.name, lm.name, _document_digest(prompt)),
                )
            return
    # ---
    if over:
        raise DocumentError(
            f"the prompt is {prompt.n_tokens:,} tokens ({prompt.n_document_tokens:,} of document) plus "
            f"{max_new_tokens} to generate, over the {limit:,}-token window of {lm.name}; "
            "use -c auto, which reads the page the question points to (-c pages; -c infllm reads the whole "
            "book once, -c finch chunk by chunk), or shorten the document"
        )


def _document_digest(prompt) -> str:
    """A digest of the prompt's question-agnostic prefix (the document in its template)."""
    import hashlib

    ids = prompt.ids[: prompt.prefix_len].to(torch.int64).contiguous().numpy()
    return hashlib.sha256(ids.tobytes()).hexdigest()


@dataclass(frozen=True)
class Generation:
    """How the answer is generated: at most ``max_new_tokens`` greedy tokens, up to one of
    ``stop_ids`` or where ``guard`` ends it, each handed to ``on_token`` as it comes, its
    log-probability appended to ``logprobs`` (None: not computed)."""

    max_new_tokens: int
    stop_ids: set[int]
    on_token: Callable[[int], None] | None = None
    guard: object | None = None
    logprobs: list[torch.Tensor] | None = None
    lookup: int = 0  # tokens drafted a pass from the text read (kvcli.runtime.lookup); 0: none


@dataclass(frozen=True)
class _Reading:
    """What reading the prompt left for decoding: the tokens read, the cache and the first logits."""

    prefix: Prefix | None  # the reader's prefix state
    second_prefix: Prefix | None  # the one the kept tokens were prefilled on (None: from scratch)
    selection: Selection
    kept_ids: torch.Tensor
    cache: object
    logits: torch.Tensor
    next_position: int
    held_bits: int = 16  # the bits the prompt's KV was held (and stored) in; ``cache`` is decoding's


def run(
    engine,
    prompt: Prompt,
    pipeline: Pipeline,
    *,
    max_new_tokens: int,
    stop_ids: set[int],
    on_token: Callable[[int], None] | None = None,
    store: KVStore | None = None,
    meta: dict | None = None,
    guard=None,
    low_memory: bool = False,
    threads: ThreadPolicy | None = None,
    cite=None,
    on_selected: Callable[[Selection], None] | None = None,
    logprobs: bool = False,
    lookup: int = 0,
) -> Result:
    """Answer from ``prompt`` with ``pipeline``: select tokens, prefill, decode greedily.

    ``store``: the disk store for the prefix state (None: compute it every time); ``meta``: facts
    recorded with a new store entry (document, method); ``guard``: where the answer may end besides
    the stop tokens (:class:`kvcli.answer.stopping.AnswerGuard`); ``cite``: the citing heads
    (:class:`kvcli.cite.attribution.HeadWeights`) whose attention while decoding is kept for the
    answer's sources (``Result.extra["citing"]``), None: nothing is read; ``threads``: the CPU
    threads of the prompt's reading and of decoding (:mod:`kvcli.runtime.threads`; None: left as they are);
    ``on_selected(selection)``: once the selectors chose, before the chosen tokens are read;
    ``logprobs``: keep each answer token's log-probability (``Result.answer_logprobs``); ``lookup``:
    at most that many tokens drafted a pass from the tokens read and checked in one pass, where
    decoding allows it (:mod:`kvcli.runtime.lookup`; 0: a pass a token).
    """
    generation = Generation(max_new_tokens, stop_ids, on_token, guard, [] if logprobs else None, lookup)
    with measure(engine.device) as m, contextlib.ExitStack() as reading:
        # the prompt phase (selection, prefill, compression): the KV it keeps gets its own mappings
        reading.enter_context(reading_prompt(engine.device, low_memory))
        reading.enter_context(in_phase(threads, "prefill", engine))
        # a chunked prefix pass reserves the KV for the question and the answer behind it
        reading.enter_context(engine.reserving(prompt.n_tokens - prompt.prefix_len + max_new_tokens))
        start = time.perf_counter()
        read = _read_prompt(engine, prompt, pipeline, store, meta, on_selected)
        ttft = m.elapsed(since=start)  # once the device has finished the prompt (CUDA)
        reading.close()
        reader = None if cite is None else CitingHeads(cite, read.kept_ids.numel(), read.cache)
        drafts = PromptLookup(read.kept_ids, generation.lookup) if generation.lookup else None
        answer_ids = _decode(engine, pipeline, read, generation, threads, reader, drafts)
        total = m.elapsed(since=start)
    result = _result(engine, prompt, pipeline, read, answer_ids, m, ttft, total, reader, cite)
    if drafts is not None and drafts.passes:
        result.extra["lookup"] = drafts.stats()
    if generation.logprobs is not None:  # the guard may have cut the answer: its tokens' only
        kept = generation.logprobs[: len(answer_ids)]
        result.answer_logprobs = torch.stack(kept).tolist() if kept else []
    return result


def _read_prompt(engine, prompt: Prompt, pipeline: Pipeline, store, meta, on_selected) -> _Reading:
    """The prompt phase: the prefix state, the selectors' choice, the prefill of the kept tokens,
    the compressors, the sliding windows' cut and ``--kv-bits``."""
    runtime = pipeline.reader().runtime
    bits = runtime.kv_bits if runtime.decode_bits is None else runtime.decode_bits
    prefix = Prefix.of(engine, prompt, pipeline.reader(), store, meta or {}, quantized=pipeline.plain())
    selection = _select(engine, prompt, pipeline, prefix)
    if on_selected is not None:
        on_selected(selection)
    kept_ids = prompt.ids[selection.kept]
    second_prefix = _second_prefix(engine, prompt, pipeline, selection, prefix, store, meta)
    cache, logits, next_position = _prefill(engine, prompt, pipeline, kept_ids, second_prefix)
    small = pipeline.small_kv(cache, bits, engine.kv_room)  # --kv-bits: the KV decoding holds
    held = cache.kv_bits if bits == 16 else small.kv_bits  # 16 for decoding: turned back, or never quantized
    return _Reading(prefix, second_prefix, selection, kept_ids, small, logits, next_position, held)


def _select(engine, prompt: Prompt, pipeline: Pipeline, prefix: Prefix | None) -> Selection:
    """The prompt tokens the selectors keep, one selector after the other (all of them without one)."""
    selection = Selection(torch.arange(prompt.n_tokens))
    for i, stage in enumerate(pipeline.selectors()):
        # only the first selector sees the prompt itself; later ones see its selection
        sub = stage.select_tokens(
            engine,
            prompt.ids[selection.kept],
            protected=prompt.n_after_document,
            prefix=prefix if i == 0 else None,
            prompt=prompt if i == 0 else None,
        )
        # the first scores a selector gives are kept, even when it kept every token (pages on a
        # short document: its passages' scores still order the sources)
        scores = selection.scores
        if scores is None and sub.scores is not None:
            scores = torch.full((prompt.n_tokens,), float("nan"))
            scores[selection.kept] = sub.scores
        selection = Selection(
            selection.kept[sub.kept],
            scores,
            selection.note or sub.note,
            selection.read or sub.read,
            selection.ranked_by or sub.ranked_by,
            selection.expansion or sub.expansion,
        )
    return selection


def _second_prefix(engine, prompt: Prompt, pipeline: Pipeline, selection: Selection, prefix, store, meta):
    """The prefix state the kept tokens are prefilled on. After a selection the kept tokens are
    re-run from scratch (None): the prefix state no longer applies — unless the selectors kept
    everything (a short document), then the second pass is full attention and reuses full
    attention's prefix state."""
    if not pipeline.selectors():
        return prefix
    if selection.n_kept != prompt.n_tokens or pipeline.owner("prefill") is not None:
        return None
    full = FullAttention()
    full.runtime = pipeline.reader().runtime
    return Prefix.of(engine, prompt, full, store, meta or {}, quantized=not pipeline.compressors())


def _prefill(engine, prompt: Prompt, pipeline: Pipeline, kept_ids: torch.Tensor, prefix):
    """Prefill ``kept_ids`` on ``prefix`` (the prefill owner's way, else :func:`default_prefill`),
    compress, and cut the sliding layers back. Returns (cache, first_logits, next_position)."""
    owner = pipeline.owner("prefill")
    compressors = pipeline.compressors()
    if owner is not None:
        cache, logits, next_position = owner.prefill(engine, kept_ids, prefix=prefix, protected=prompt.n_after_document)
    else:
        cache, logits = default_prefill(engine, kept_ids, prefix, compressors)
        next_position = kept_ids.numel()
    for stage in compressors:
        cache = stage.compress(engine, cache)
    cache.trim_windows(engine.windows)  # sliding layers keep only what their window still reaches
    return cache, logits, next_position


def _decode(engine, pipeline: Pipeline, read: _Reading, generation: Generation, threads, reader, drafts) -> list[int]:
    """Decode greedily from the prompt's cache (the decode owner's step, if any; else ``drafts``
    checked where the cache allows), the citing heads' ``reader`` listening."""
    decoder = pipeline.owner("decode_step")
    step = None
    if decoder is not None:  # the method's own step, taking the token as it declares (device_token)
        step = DecodeStep(functools.partial(decoder.decode_step, engine), device_token=decoder.device_token)
    with in_phase(threads, "decode", engine), listening({} if reader is None else reader.observers()):
        return engine.decode(
            read.logits,
            read.cache,
            read.next_position,
            generation.max_new_tokens,
            generation.stop_ids,
            generation.on_token,
            step=step,
            guard=generation.guard,
            logprobs=generation.logprobs,
            drafts=drafts,
        )


def _result(engine, prompt, pipeline, read: _Reading, answer_ids, m, ttft, total, reader, cite) -> Result:
    decode_s = total - ttft
    cache = read.cache
    return Result(
        answer=engine.lm.tokenizer.decode(answer_ids, skip_special_tokens=True).strip(),
        answer_ids=answer_ids,
        prompt=prompt,
        selection=read.selection,
        ttft_s=ttft,
        total_s=total,
        peak_mem_mb=m.peak_mem_mb,
        decode_tokens_per_s=(len(answer_ids) - 1) / decode_s if len(answer_ids) > 1 and decode_s > 0 else None,
        cache=cache,
        windows=engine.windows,
        extra={
            "kv_cache_bytes": cache.nbytes(),
            "kv_bits": read.held_bits,
            "decode_kv_bits": cache.kv_bits,
            "peak_mem_reserved_mb": m.peak_mem_reserved_mb,  # CUDA only (None elsewhere)
            "cache": prefix_report(read.prefix, read.second_prefix),
            # a method's own counters, JSON-able (LazyLLM: share of prompt tokens computed;
            # blocksparse: share of the KV attended per step); caches expose them as ``stats()``
            "method_stats": cache.stats(),
            "citing": _citing(reader, cite, prompt, pipeline, read.selection),
        },
    )


def _citing(reader, cite, prompt: Prompt, pipeline: Pipeline, selection: Selection) -> dict | None:
    """What the citing heads read while decoding (``Result.extra["citing"]``); None: not asked for."""
    if reader is None:
        return None
    return {
        "scores": reader.prompt_scores(prompt.n_tokens, selection.kept if pipeline.selectors() else None),
        "unsupported": reader.unsupported,
        "seconds": reader.seconds,
        "steps": reader.steps,
        "heads": cite.source,
    }
