"""The library behind the CLI: open a model once, ask questions about documents.

from kvcli.api import AskOptions, Session, parse_pipeline, read_document
session = Session.open(AskOptions())                  # embedded SmolLM2 by default
doc = read_document("book.pdf")
result = session.ask(doc, "Who wrote it?", parse_pipeline("auto"))
print(result.answer, result.ttft_s, result.selection.spans(result.prompt, doc))
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import notices
from .answer.pipeline import SEPARATOR, Pipeline, Result, check_window, run
from .answer.prompt import build_prompt, load_template, stop_token_ids
from .answer.stopping import AnswerGuard
from .answer.streaming import AnswerStream
from .caches import quant
from .caches.quant import DEFAULT_KV_BITS
from .cite.attribution import citing_heads
from .cite.sources import LEXICAL_WEIGHT, Sources, sources_from_tokens
from .compressors.base import Runtime
from .compressors.selection import Selection, read_record
from .documents import Document, load_document
from .errors import UsageError
from .model import LoadedModel, default_cache_dir, load_model
from .model.facts import spelled
from .runtime.engine import Engine
from .runtime.threads import ThreadPolicy
from .store import KVStore, Watcher, resolve_cap


@dataclass
class AskOptions:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "auto"
    quant: str = "auto"
    attn: str = "sdpa"
    dtype: str = "auto"
    max_new_tokens: int = 64
    template: str = "qa"
    cache_dir: Path | None = None  # converted models and the disk KV store (default: default_cache_dir())
    use_cache: bool = True  # False: never read or write the disk KV store
    cache_max: str | None = (
        None  # the store's cap, e.g. "2G" or "none" (None: $KVCLI_CACHE_MAX, else kvcli.store.capacity's default)
    )
    kv_offload: str = "none"  # "cpu": methods that keep the whole KV (blocksparse) hold it in CPU memory
    # bits the KV is held and stored in: 16, 8, 4, or auto (each method's Compressor.auto_kv_bits; kvcli.caches.quant)
    kv_bits: int | str = DEFAULT_KV_BITS
    low_memory: bool = False  # CPU: freed prompt activations go back to the OS at once (less peak memory, +15-20% TTFT; kvcli.runtime.measure.reading_prompt)
    answer_guard: bool = True  # end answers at an invented next question or a repeated sentence (kvcli.answer.stopping)
    threads: str | None = (
        None  # CPU threads: "auto" or a count (None: $KVCLI_THREADS, else auto; kvcli.runtime.threads)
    )
    sources: bool = (
        True  # cite the document's pages the answer comes from (kvcli.cite.sources); False: nothing read for it
    )


def parse_pipeline(spec: str) -> Pipeline:
    return Pipeline.parse(spec)


def read_document(path) -> Document:
    return load_document(path)


@dataclass
class Session:
    """A loaded model ready to answer; load once, ask many times."""

    lm: LoadedModel
    engine: Engine
    options: AskOptions
    template: str
    store: KVStore | None = None
    threads: ThreadPolicy | None = None  # each question's threads, phase by phase (None: left as they are)

    @classmethod
    def open(cls, options: AskOptions) -> Session:
        template = load_template(options.template)
        try:
            options.kv_bits = quant.check_bits(options.kv_bits)
        except ValueError as e:
            raise UsageError(str(e)) from None
        threads = ThreadPolicy.from_option(options.threads)  # auto measures the free cores from here on
        lm = load_model(
            options.model,
            device=options.device,
            quant=options.quant,
            attn=options.attn,
            dtype=options.dtype,
            cache_dir=options.cache_dir,
        )
        store = None
        if options.use_cache:
            cache_dir = options.cache_dir if options.cache_dir is not None else default_cache_dir()
            store = KVStore.open(cache_dir, max_bytes=resolve_cap(options.cache_max, cache_dir))
        return cls(lm=lm, engine=Engine(lm), options=options, template=template, store=store, threads=threads)

    def ask(
        self,
        document: Document,
        question: str,
        pipeline: Pipeline,
        on_token=None,
        *,
        max_new_tokens: int | None = None,
        force_tokens: bool = False,
        use_store: bool = True,
        answer_prefix: str = "",
        on_text: Callable[[str], None] | None = None,
        on_prompt: Callable[[str, int], None] | None = None,
        on_progress: Callable[[float], None] | None = None,
        on_wait: Callable[[str | None], None] | None = None,
        on_resume: Callable[[float], None] | None = None,
        on_embed: Callable[[int, int], None] | None = None,
        sources: bool | None = None,
    ) -> Result:
        """Answer ``question`` about ``document`` with ``pipeline``.

        ``max_new_tokens``: default the session's; ``force_tokens``: ignore the stop tokens and
        generate exactly that many (benchmarks of decoding speed); ``use_store=False``: neither
        read nor write the disk store for this question (cold runs); ``answer_prefix``: text the
        answer starts with, after the generation prompt (benchmarks such as RULER).

        While it runs: ``on_prompt(method, n_tokens)`` once the method is chosen (its name, e.g.
        "full attention", and the prompt's length; for a method that retrieves, ``pages``, once it
        chose what to read, and the tokens it reads), before the prompt is read; ``on_progress(f)``
        while the prompt is read, ``f`` in [0, 1] (:func:`prompt_progress`; none once the document's
        KV came from the disk store); ``on_wait(text)`` while another kvcli process computes the
        same document's KV and this one waits for it ("another kvcli process (pid 4242) reading
        book.pdf: 12,288/88,244 tokens (14%)"), ``on_wait(None)`` when the wait ends;
        ``on_resume(f)`` when a book read resumes where an interrupted one stopped, ``f`` of the
        prompt read already; ``on_embed(done, total)`` while a method that retrieves (``pages``)
        embeds the document's passages, the first time it reads that document (``done`` of
        ``total`` windows; none once their vectors are kept in the cache folder);
        ``on_text(piece)`` with the answer as it is decoded, the pieces adding up to
        ``Result.answer`` (:class:`kvcli.answer.streaming.AnswerStream`). ``sources``: read the
        answer's attention while it is decoded and cite the document's sentences it read most
        (``Result.sources``, :mod:`kvcli.cite.sources`); False: nothing is read or cited; None: the
        session's option."""
        max_new_tokens = self.options.max_new_tokens if max_new_tokens is None else max_new_tokens
        sources = self.options.sources if sources is None else sources
        prompt = build_prompt(
            self.lm.tokenizer, document.text, question, self.template, answer_prefix, document.page_starts
        )
        pipeline = pipeline.resolve(prompt, self.lm, max_new_tokens)
        if self.options.kv_offload != "none" and not any(s.holds_whole_kv for s in pipeline.stages):
            notices.warn(
                f"--kv-offload {self.options.kv_offload} has no effect on {pipeline.spec().split(':')[0]}: only blocksparse holds its KV that way",
                key="kv-offload-unused",
            )
        source = document.source if document.source == "-" else os.path.abspath(document.source)
        runtime = Runtime(
            cache_dir=self.options.cache_dir,
            kv_offload=self.options.kv_offload,
            kv_bits=pipeline.kv_bits(self.options.kv_bits),
            document=source,
            document_sha256=document.sha256,
            on_embed=on_embed,
            on_stored=None if self.store is None else self._made,
        )
        pipeline.configure(self.lm, runtime)
        check_window(
            prompt,
            self.lm,
            max_new_tokens,
            pipeline,
            stored=use_store and self.store is not None and self.store.enabled,
        )
        retrieves = pipeline.retrieves()  # pages: the tokens read are known once it chose them
        if on_prompt is not None and not retrieves:
            on_prompt(method_label(pipeline), prompt.n_tokens)
        stop = set() if force_tokens else stop_token_ids(self.lm.tokenizer, self.lm.model.generation_config)
        guard = (
            AnswerGuard(self.lm.tokenizer, self.template) if self.options.answer_guard and not force_tokens else None
        )
        stream = None if on_text is None else AnswerStream(self.lm.tokenizer, guard, on_text)
        threads_used = {} if self.threads is None else self.threads.start_run()
        store = self.store if use_store else None
        with prompt_progress(self.engine, prompt.n_tokens, on_progress, store, on_wait, on_resume) as reading:
            callbacks = [reading.done] if reading.handles else []
            callbacks += [f for f in (None if stream is None else stream.on_token, on_token) if f is not None]

            def selected(selection: Selection) -> None:  # a retrieving method: count what it reads
                reading.expect(selection.n_kept)
                if on_prompt is not None:
                    on_prompt(method_label(pipeline), selection.n_kept)

            result = run(
                self.engine,
                prompt,
                pipeline,
                max_new_tokens=max_new_tokens,
                stop_ids=stop,
                on_token=(lambda token: [f(token) for f in callbacks]) if callbacks else None,
                store=store,
                guard=guard,
                low_memory=self.options.low_memory,
                threads=self.threads,
                cite=citing_heads(self.lm) if sources else None,
                on_selected=selected if retrieves else None,
                meta={
                    "document": source,
                    "document_sha256": document.sha256,
                    "model_name": self.lm.name,
                    "method": pipeline.spec(),
                    "template": self.options.template,
                },
            )
        result.document = document
        if stream is not None:
            stream.close(result.answer)
        if sources:
            result.sources = cite(document, result, question, by_passage=pipeline.reads_passages())
        result.extra["compressor"] = pipeline.spec()  # resolved (``-c auto`` -> the method it chose)
        result.extra["policy"] = pipeline.chosen_by
        result.extra["threads"] = threads_used  # phase -> the CPU threads it ran on, in order
        return result

    def _made(self, path: Path) -> None:
        """A method wrote ``path`` into the cache folder (the page vectors): the store makes room
        for it under its cap, as for its own entries (least recently used first)."""
        if self.store is not None and self.store.enabled:
            self.store.make_room(path)


def spec_label(spec: str, given: Pipeline | None = None) -> str:
    """A resolved spec (``Result.extra["compressor"]``, every knob spelled out) as a status line
    shows it: each stage's name and only the knobs the user set in ``given`` (the pipeline as
    parsed; ``-c auto`` sets none): "infllm:answer_topk=50", not InfLLM's 230 characters. The whole
    spec is in ``--json``."""
    explicit = {s.name: s.explicit_knobs for s in (given.stages if given is not None else ())}
    parts = []
    for stage in spec.split(SEPARATOR):
        name, _, knobs = stage.partition(":")
        mine = [kv for kv in knobs.split(",") if kv and kv.partition("=")[0] in explicit.get(name, ())]
        parts.append(name + (":" + ",".join(mine) if mine else ""))
    return SEPARATOR.join(parts)


def cite(document: Document, result: Result, question: str = "", by_passage: bool = False) -> Sources:
    """The answer's sources from what its decoding steps read (``result.extra["citing"]``, taken
    out), ranked with the question's BM25 by :data:`kvcli.cite.sources.LEXICAL_WEIGHT`; the time they
    added (reading and ranking) in ``result.extra["sources_s"]``. ``by_passage``: the method read
    whole passages chosen by their retrieval score (``pages``: ``result.selection.scores``): one source
    per passage, ordered by the answer's evidence over them (:func:`kvcli.cite.sources.sources_from_tokens`)."""
    t0 = time.perf_counter()
    citing = result.extra.pop("citing")
    if citing["unsupported"]:
        found = Sources((), clear=False, reason=f"no sources: {citing['unsupported']}", signal="attention")
    else:
        found = sources_from_tokens(
            document,
            result.prompt,
            citing["scores"].numpy(),
            question=question,
            lexical=LEXICAL_WEIGHT,
            passage_scores=result.selection.scores.numpy() if by_passage else None,
            answer=result.answer,
            signal=("passages by bm25, " if by_passage else "") + ("attention+bm25" if LEXICAL_WEIGHT else "attention"),
        )
    result.extra["sources_s"] = citing["seconds"] + time.perf_counter() - t0
    return found


def method_label(pipeline: Pipeline) -> str:
    """What a person calls the method(s) of a resolved pipeline: "full attention", "finch",
    "gemfilter + snapkv" (the knobs: ``pipeline.spec()``)."""
    return " + ".join("full attention" if s.name == "full" else s.name for s in pipeline.stages)


class prompt_progress(Watcher):
    """While the prompt is read: ``on_progress(f)`` after each decoder layer a pass runs, ``f``
    the (token, layer) pairs run over ``n_tokens`` x layers (capped at 1). A method that reads
    fewer (a selector's second pass) ends below 1, one that reads more (Finch's chunks) waits at 1;
    a prefix from the disk store is not read: nothing more is said once it came (a hit). Counted
    by forward pre-hooks on the model's layers (the engine is unchanged), removed at the first
    answer token (``done``) or on leaving.

    With a disk ``store`` it is the store's :class:`kvcli.store.kvstore.Watcher` (``on_wait``: the
    wait for another process, ``on_resume``: a book read resuming) and tells the store how far
    this process's computation is (:meth:`kvcli.store.KVStore.progress`), for the processes
    waiting for it."""

    def __init__(
        self,
        engine,
        n_tokens: int,
        on_progress: Callable[[float], None] | None,
        store: KVStore | None = None,
        on_wait: Callable[[str | None], None] | None = None,
        on_resume: Callable[[float], None] | None = None,
    ) -> None:
        self.engine, self.on_progress, self.store = engine, on_progress, store
        self.on_wait, self.on_resume = on_wait, on_resume
        self.n_layers = max(1, engine.n_layers)
        self.total = max(1, n_tokens * self.n_layers)
        self.count = 0
        self.quiet = False  # the prefix came from the store: nothing is read
        self.handles: list = []
        self.watched = contextlib.ExitStack()

    def __enter__(self) -> prompt_progress:
        if self.on_progress is not None or self.store is not None:
            self.handles = [
                layer.register_forward_pre_hook(self._hook, with_kwargs=True) for layer in self.engine.layers
            ]
        if self.store is not None:
            self.watched.enter_context(self.store.watching(self))
        return self

    def _hook(self, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        self.count += int(hidden.shape[1]) if hidden is not None and hidden.dim() == 3 else 0
        if self.store is not None:
            self.store.progress(self.count // self.n_layers)
        if self.on_progress is not None and not self.quiet:
            self.on_progress(min(1.0, self.count / self.total))

    def expect(self, n_tokens: int) -> None:
        """The prompt tokens that will be read, once a method that retrieves chose them (``pages``):
        the progress counts those, not the whole prompt's."""
        self.total = max(1, n_tokens * self.n_layers)

    # --- what the store says (kvcli.store.kvstore.Watcher) -------------------------------------------
    def waiting(self, holder) -> None:
        if self.on_wait is not None:
            self.on_wait(f"waiting for {holder.describe() if holder is not None else 'another kvcli process'}")

    def waited(self) -> None:
        if self.on_wait is not None:
            self.on_wait(None)

    def loaded(self) -> None:
        self.quiet = True

    def resumed(self, done: int, total: int) -> None:
        self.count += done * self.n_layers
        if self.on_resume is not None:
            self.on_resume(min(1.0, self.count / self.total))

    def done(self, token: int | None = None) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __exit__(self, *exc) -> None:
        self.done()
        self.watched.close()


def result_record(
    result: Result, session: Session, pipeline: Pipeline, document: Document, include_spans: bool = False
) -> dict:
    """The JSON object of ``kvcli ask --json``."""
    record = {
        "answer": result.answer,
        "compressor": result.extra.get("compressor", pipeline.spec()),
        "policy": result.extra.get("policy"),  # "auto" when the default policy chose the method
        "model": session.lm.name,
        "document": document.source,
        "n_pages": document.n_pages,
        "n_context_tokens": result.prompt.n_tokens,
        "n_document_tokens": result.prompt.n_document_tokens,
        # the KV actually held: mean over layers and KV heads of prompt entries in the cache
        "n_kept_tokens": round(result.n_kept_tokens, 2),
        # none for a method that retrieves (pages): what it read is in ``read``, and full attention
        # over the whole document, what a ratio compares with, may not fit the window
        "compression_ratio": None if result.selection.read is not None else round(result.compression_ratio, 4),
        "n_selected_tokens": result.selection.n_kept,  # prompt tokens the model read (a selector's k)
        **compute_fractions(result.extra.get("method_stats") or {}),
        "ttft_s": round(result.ttft_s, 4),
        "total_s": round(result.total_s, 4),
        "decode_tokens_per_s": None if result.decode_tokens_per_s is None else round(result.decode_tokens_per_s, 2),
        "peak_mem_mb": round(result.peak_mem_mb, 1),
        "threads": result.extra.get("threads"),  # phase -> its CPU threads, e.g. {"prefill": [2], "decode": [1]}
        **(
            {}
            if result.extra.get("peak_mem_reserved_mb") is None
            else {"peak_mem_reserved_mb": round(result.extra["peak_mem_reserved_mb"], 1)}
        ),  # CUDA
        "kv_cache_bytes": result.extra.get("kv_cache_bytes"),
        "kv_bits": result.extra.get("kv_bits"),  # bits the KV was held in (--kv-bits; 16 where a method keeps 16)
        "n_answer_tokens": len(result.answer_ids),
        "device": str(session.engine.device),
        "attn": session.lm.attn,
        "quant": spelled(session.lm.quant),  # as --quant spells it: none, 8, 4
        "cache": result.extra["cache"]["status"],
        "cache_saved_s": result.extra["cache"]["saved_s"],
        "cache_entry_bytes": result.extra["cache"]["entry_bytes"],
        "method_stats": result.extra.get("method_stats", {}),  # the method's own counters (cache.stats())
        # where the answer comes from, best first (null: --no-sources), and why there is none or no clear one
        "sources": None if result.sources is None else result.sources.to_json(),
        "sources_note": None if result.sources is None else result.sources.reason,
        "sources_s": None if result.sources is None else round(result.extra["sources_s"], 4),
        # a method that retrieves (pages): each passage read, with what ranked it as a source
        "sources_evidence": None if result.sources is None else result.sources.extra.get("evidence"),
        # a method that ranks passages (pages) and found none matching the question: that, and what it read instead
        "no_match": result.selection.note,
        # a method that retrieves (pages): the passages read whole and skimmed, their tokens, of the document's
        "read": read_record(result.selection.read, result.prompt, document),
        "warnings": notices.drain(),  # said while loading or answering, since the last record
    }
    # each kept span (a stored book: the spans read, :func:`shown_selection`), and whether a source cites it
    if include_spans:
        cited = [] if result.sources is None else result.sources.items
        record["selected_spans"] = [
            {**s.to_json(), "cited": any(c.start < s.end and s.start < c.end for c in cited)}
            for s in shown_selection(result)[0].spans(result.prompt, document)
        ]
    return record


def compute_fractions(stats: dict) -> dict:
    """What a method saves besides the KV it holds, from its own counters: ``prompt_computed_frac``
    (LazyLLM: share of (prompt token, layer) pairs computed), ``kv_attended_frac`` (block-sparse
    retrieval: share of the KV each decoding step attended) and ``kv_read_frac`` (InfLLM's book:
    share of the KV the question and its whole answer read, :func:`read_mask`); None for methods
    that do none of these."""
    return {
        "prompt_computed_frac": stats.get("prompt_tokens_computed_frac"),
        "kv_attended_frac": stats.get("kv_attended_frac"),
        "kv_read_frac": None if stats.get("kv_read_frac") is None else round(stats["kv_read_frac"], 4),
    }


def read_mask(result: Result) -> torch.Tensor | None:
    """What each layer and KV head *read* of the prompt while answering, where the cache reads
    less than it holds (InfLLM's book: Initial, the retrieved blocks, Local), in prompt indices:
    (n_layers, n_kv_heads, n_prompt) bool; None where it read all it held (``Result.kept_mask``)."""
    inner = None if result.cache is None else result.cache.read_mask(result.selection.n_kept)
    if inner is None:
        return None
    mask = torch.zeros(*inner.shape[:2], result.prompt.n_tokens, dtype=torch.bool)
    mask[:, :, result.selection.kept] = inner
    return mask


def shown_selection(result: Result) -> tuple[Selection, float, str]:
    """What ``--show-selected`` shows of an answer: (the tokens, how many per layer and KV head,
    "kept" or "read"). The tokens the model kept (a selector's choice; everything without one) —
    or, where the cache reads less than it holds (:func:`read_mask`), those the question and its
    answer read, scored by the share of (layer, KV head) pairs that read each."""
    read = read_mask(result)
    if read is None:
        return result.selection, float(result.selection.n_kept), "kept"
    tokens = torch.nonzero(read.any(dim=0).any(dim=0)).flatten()
    return Selection(tokens, read.float().mean(dim=(0, 1))), float(read.sum()) / (read.shape[0] * read.shape[1]), "read"


# --------------------------------------------------------------------------- kvcli cache


def open_store(cache_dir: Path | None = None) -> KVStore:
    return KVStore.open(cache_dir if cache_dir is not None else default_cache_dir())


def entries_for_documents(store: KVStore, paths) -> list:
    """Store entries made from the documents at ``paths``: same absolute path, or same text
    (sha256 of the extracted text, when the file can still be read — it may have moved)."""
    wanted_paths, wanted_shas = set(), set()
    for p in paths:
        wanted_paths.add(os.path.abspath(p))
        try:
            wanted_shas.add(load_document(p).sha256)
        except Exception:  # gone or unreadable: match by path only
            pass
    return [
        e
        for e in store.entries()
        if e.meta and (e.meta.get("document") in wanted_paths or e.meta.get("document_sha256") in wanted_shas)
    ]
