"""The library behind the CLI: open a model once (:class:`Session`), ask it questions about
documents (:meth:`Session.ask`), and the disk KV store's entries (``kvcli cache``).

from kvcli.api import AskOptions, QuestionOptions, Session, parse_pipeline, read_document
session = Session.open(AskOptions())                  # embedded SmolLM2 by default
doc = read_document("book.pdf")
result = session.ask(doc, "Who wrote it?", parse_pipeline("auto"))
print(result.answer, result.ttft_s, result.selection.spans(result.prompt, doc))
session.ask(doc, "Who is it for?", parse_pipeline("full"), QuestionOptions(on_text=lambda piece: print(piece, end=""), sources=False))
keep_document(doc)                                    # every page embedded ahead of later questions (kvcli cache add)

What an answer is shown with lives apart: its JSON record (:mod:`kvcli.report.record`), its
sources (:mod:`kvcli.answer.citing`), a method's label (:mod:`kvcli.answer.labels`) and the
prompt's progress (:mod:`kvcli.answer.progress`).

Importing this module imports no PyTorch (the model, the pipeline and the store are imported by the
functions that use them): a command whose help or checks need none of it answers at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import kv_bits, notices
from .answer.question import QuestionOptions
from .documents import Document, load_document
from .errors import UsageError
from .kv_bits import DEFAULT_KV_BITS
from .runtime.lookup import MAX_DRAFT
from .runtime.threads import ThreadPolicy

if TYPE_CHECKING:
    from .answer.pipeline import Pipeline, Result
    from .compressors.selection import Selection
    from .model import LoadedModel
    from .runtime.engine import Engine
    from .store import KVStore


@dataclass
class AskOptions:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "auto"
    quant: str = "auto"  # weights: "auto", "none", "8" or "4" bits (as --quant and --json spell it)
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
    # tokens drafted a pass from the text read, checked by one pass of the model (kvcli.runtime.lookup):
    # the same greedy answer in fewer passes; 0: a pass a token
    lookup: int = MAX_DRAFT
    threads: str | None = (
        None  # CPU threads: "auto" or a count (None: $KVCLI_THREADS, else auto; kvcli.runtime.threads)
    )
    sources: bool = (
        True  # cite the document's pages the answer comes from (kvcli.cite.sources); False: nothing read for it
    )
    # after the answer, whether it comes from the document (kvcli.answer.grounding), on a model whose
    # threshold was measured (the Qwen models): a note if it may not
    check: bool = True


def parse_pipeline(spec: str) -> Pipeline:
    from .answer.pipeline import Pipeline

    return Pipeline.parse(spec)


def read_document(path) -> Document:
    return load_document(path)


@dataclass(frozen=True)
class _Asked:
    """A question's settings, its own (:class:`QuestionOptions`) or else the session's."""

    options: QuestionOptions
    max_new_tokens: int
    sources: bool
    check: bool


def _source(document: Document) -> str:
    """The document's path as the store records it: absolute, or ``-`` for standard input."""
    return document.source if document.source == "-" else os.path.abspath(document.source)


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
        from .answer.prompt import load_template
        from .files import cache_folder
        from .model import load_model
        from .runtime.engine import Engine
        from .store import KVStore, resolve_cap

        template = load_template(options.template)
        try:
            options.kv_bits = kv_bits.check_bits(options.kv_bits)
        except ValueError as e:
            raise UsageError(str(e)) from None
        from .model.names import QUANT_SPELLINGS, quant_name

        weights = quant_name(options.quant)
        if weights is None:
            raise UsageError(f"--quant must be one of {', '.join(QUANT_SPELLINGS)}, not '{options.quant}'")
        threads = ThreadPolicy.from_option(options.threads)  # auto measures the free cores from here on
        lm = load_model(
            options.model,
            device=options.device,
            quant=weights,
            attn=options.attn,
            dtype=options.dtype,
            cache_dir=options.cache_dir,
        )
        store = None
        if options.use_cache:
            cache_dir = cache_folder(options.cache_dir)
            store = KVStore.open(cache_dir, max_bytes=resolve_cap(options.cache_max, cache_dir))
        return cls(lm=lm, engine=Engine(lm), options=options, template=template, store=store, threads=threads)

    def ask(
        self, document: Document, question: str, pipeline: Pipeline, options: QuestionOptions | None = None
    ) -> Result:
        """Answer ``question`` about ``document`` with ``pipeline``; ``options``: the question's
        settings and the callbacks that show it being answered (:class:`QuestionOptions`)."""
        from .answer.citing import cite
        from .answer.prompt import build_prompt

        o = QuestionOptions() if options is None else options
        asked = _Asked(
            o,
            max_new_tokens=self.options.max_new_tokens if o.max_new_tokens is None else o.max_new_tokens,
            sources=self.options.sources if o.sources is None else o.sources,
            # a model without a measured threshold, or an answer forced to a length or begun by a prefix
            # (benchmarks), is not checked
            check=(self.options.check if o.check is None else o.check)
            and self.lm.check_threshold is not None
            and not o.force_tokens
            and not o.answer_prefix,
        )
        prompt = build_prompt(
            self.lm.tokenizer, document.text, question, self.template, o.answer_prefix, document.page_starts
        )
        pipeline = self._prepare(document, prompt, pipeline, asked)
        by_passage = pipeline.reads_passages()  # the sources come one per passage it read
        threads_used = {} if self.threads is None else self.threads.start_run()
        result = self._answer(document, prompt, pipeline, asked)
        if o.on_answer is not None:
            o.on_answer(result.answer)
        if asked.check:
            self._check(result, question)
        if asked.sources:
            result.sources = cite(document, result, question, by_passage=by_passage)
        result.extra["compressor"] = pipeline.spec()  # resolved (``-c auto`` -> the method it chose)
        result.extra["policy"] = pipeline.chosen_by
        result.extra["threads"] = threads_used  # phase -> the CPU threads it ran on, in order
        return result

    def _prepare(self, document: Document, prompt, pipeline: Pipeline, asked: _Asked) -> Pipeline:
        """``pipeline`` resolved for ``prompt`` (``-c auto``), configured with the run's settings,
        and the prompt checked against the model's window."""
        from .answer.pipeline import check_window
        from .compressors.base import Runtime

        o = asked.options
        pipeline = pipeline.resolve(prompt, self.lm, asked.max_new_tokens)
        if self.options.kv_offload != "none" and not any(s.holds_whole_kv for s in pipeline.stages):
            notices.warn(
                f"--kv-offload {self.options.kv_offload} has no effect on {pipeline.spec().split(':')[0]}: only blocksparse holds its KV that way",
                key="kv-offload-unused",
            )
        runtime = Runtime(
            cache_dir=self.options.cache_dir,
            kv_offload=self.options.kv_offload,
            kv_bits=pipeline.kv_bits(self.options.kv_bits),
            decode_bits=pipeline.decode_bits(self.options.kv_bits, self.lm.device),
            document=_source(document),
            document_sha256=document.sha256,
            on_embed=o.on_embed,
            on_stored=None if self.store is None else self.made,
        )
        pipeline.configure(self.lm, runtime)
        stored = o.use_store and self.store is not None and self.store.enabled
        check_window(prompt, self.lm, asked.max_new_tokens, pipeline, stored=stored)
        return pipeline

    def _answer(self, document: Document, prompt, pipeline: Pipeline, asked: _Asked) -> Result:
        """Run ``pipeline`` on ``prompt``, showing the prompt's progress and the answer as it comes."""
        from .answer.labels import method_label
        from .answer.pipeline import run
        from .answer.progress import prompt_progress
        from .answer.streaming import AnswerStream
        from .cite.attribution import citing_heads

        o = asked.options
        # a method that retrieves (pages): the tokens read are known once it chose them
        label, retrieves = method_label(pipeline), pipeline.retrieves()
        if o.on_prompt is not None and not retrieves:
            o.on_prompt(label, prompt.n_tokens)
        stop, guard = self._stopping(o)
        stream = None if o.on_text is None else AnswerStream(self.lm.tokenizer, guard, o.on_text)
        store = self.store if o.use_store else None
        progress = prompt_progress(
            self.engine, prompt.n_tokens, o.on_progress, store, o.on_wait, o.on_resume, retrieves
        )
        with progress as reading:
            callbacks = [reading.done] if reading.handles else []
            callbacks += [f for f in (None if stream is None else stream.on_token, o.on_token) if f is not None]

            def selected(selection: Selection) -> None:  # a retrieving method: count what it reads
                reading.expect(selection.n_kept)
                if o.on_prompt is not None:
                    o.on_prompt(label, selection.n_kept)

            result = run(
                self.engine,
                prompt,
                pipeline,
                max_new_tokens=asked.max_new_tokens,
                stop_ids=stop,
                on_token=(lambda token: [f(token) for f in callbacks]) if callbacks else None,
                store=store,
                guard=guard,
                low_memory=self.options.low_memory,
                threads=self.threads,
                cite=citing_heads(self.lm) if asked.sources else None,
                on_selected=selected if retrieves else None,
                meta=self._meta(document, pipeline),
                logprobs=asked.check,
                lookup=self.options.lookup,
            )
        result.document = document
        if stream is not None:
            stream.close(result.answer)
        return result

    def _check(self, result: Result, question: str) -> None:
        """Whether ``result``'s answer comes from the document (``result.grounding``); a note if it may not."""
        from .answer.grounding import grounding

        result.grounding = grounding(
            self.engine,
            self.lm.tokenizer,
            question,
            result.answer_ids,
            result.answer_logprobs,
            self.lm.check_threshold,
            asked=self.lm.check_asked,
            cache=result.cache,
            n_kept=result.selection.n_kept,
        )
        note = None if result.grounding is None else result.grounding.note()
        if note is not None:
            notices.warn(note)

    def _stopping(self, o: QuestionOptions):
        """The answer's stop tokens and its guard (None: none), both off with ``force_tokens``."""
        from .answer.stopping import AnswerGuard
        from .templates import stop_token_ids

        stop = set() if o.force_tokens else stop_token_ids(self.lm.tokenizer, self.lm.model.generation_config)
        guard = (
            AnswerGuard(self.lm.tokenizer, self.template, o.answer_prefix)
            if self.options.answer_guard and not o.force_tokens
            else None
        )
        return stop, guard

    def _meta(self, document: Document, pipeline: Pipeline) -> dict:
        """The facts recorded with a new disk store entry."""
        return {
            "document": _source(document),
            "document_sha256": document.sha256,
            "model_name": self.lm.name,
            "method": pipeline.spec(),
            "template": self.options.template,
        }

    def keep_kv(self, document: Document, pipeline: Pipeline, options: QuestionOptions | None = None) -> KeptKV | None:
        """Ahead of a document's questions (``kvcli cache add --kv``): the state ``pipeline``'s
        reading of it starts every question from, the question-agnostic prefix (full attention's
        KV where ``-c auto`` reads the document whole), computed and written to the disk store now,
        or found there; a first question then starts from it as a later one does. A reading that
        keeps nothing ahead of a question (one that retrieves, ``pages``; Finch, which compresses
        with it) gives a :class:`KeptKV` of 0 tokens; None: the disk store is off. ``options``:
        ``on_prompt``, ``on_progress`` and ``on_wait`` as for :meth:`ask` (the rest unused)."""
        from .answer.labels import method_label
        from .answer.prefix import Prefix
        from .answer.progress import prompt_progress
        from .answer.prompt import build_prompt

        o = QuestionOptions() if options is None else options
        if self.store is None or not self.store.enabled:
            return None
        # the prefix ends before the question: a placeholder stands for any question (the method
        # is chosen for the prompt, whose length a real question changes by its own few tokens)
        prompt = build_prompt(self.lm.tokenizer, document.text, KEEP_QUESTION, self.template, "", document.page_starts)
        asked = _Asked(o, max_new_tokens=self.options.max_new_tokens, sources=False, check=False)
        pipeline = pipeline.resolve(prompt, self.lm, asked.max_new_tokens)
        if pipeline.retrieves():  # nothing ahead of a question: nor its window's warning
            return KeptKV(pipeline.spec(), 0, None, 0.0, retrieves=True)
        pipeline = self._prepare(document, prompt, pipeline, asked)
        meta = self._meta(document, pipeline)
        prefix = Prefix.of(self.engine, prompt, pipeline.reader(), self.store, meta, quantized=pipeline.plain())
        if prefix is None:
            return KeptKV(pipeline.spec(), 0, None, 0.0)
        if o.on_prompt is not None:
            o.on_prompt(method_label(pipeline), prefix.n_tokens)
        with prompt_progress(self.engine, prefix.n_tokens, o.on_progress, self.store, o.on_wait):
            _, fetched = prefix.fetch()
        return KeptKV(pipeline.spec(), prefix.n_tokens, fetched.status, fetched.seconds)

    def made(self, path: Path) -> None:
        """A method wrote ``path`` into the cache folder (the page vectors): the store makes room
        for it under its cap, as for its own entries (least recently used first)."""
        if self.store is not None and self.store.enabled:
            self.store.make_room(path)

    def embed_rest(self, result: Result, stop) -> Path | None:
        """Embed the rest of the document's passages for the ranking that chose ``result``'s reading
        (``pages``, ranked by a sentence-embedding model; any other reading: nothing), a few at a
        time in the order that ranking put them until all are embedded or ``stop`` (a
        :class:`threading.Event`) is set
        (:func:`kvcli.retrieval.vectors.fill`): what a chat does while its user types, so that a
        later question finds its candidates embedded. Returns the vectors' file if it was written
        (the caller then makes room for it under the cap, :meth:`made`, where it may say so)."""
        from .retrieval import embed

        name = embed.setting()
        if name is None or not (result.selection.ranked_by or "").startswith("bm25+") or not result.prompt.passages:
            return None
        passages = result.prompt.passages
        # the passages as this question ranked them (its candidates, then BM25's order): a follow-up
        # question shares words with it, so its candidates are likely among the next ones
        scores = result.selection.scores
        order = None
        if scores is not None and scores.numel() >= passages[-1].end:
            scores = scores.float().nan_to_num(float("-inf"))
            order = sorted(range(len(passages)), key=lambda i: (-float(scores[passages[i].start]), i))
        texts = [p.text for p in passages]
        path, wrote = _fill_vectors(
            embed.embedder(name), result.document, texts, self.options.cache_dir, stop, order=order
        )
        return path if wrote else None


@dataclass(frozen=True)
class Kept:
    """What :func:`keep_document` keeps of a document for its later questions."""

    document: Document
    passages: int  # the passages a ranking reads (pages, else page-sized runs)
    embedded: int  # of them, those whose vectors are in the cache now
    added: int  # of those, embedded by this call (the others were there already)
    model: str | None  # the sentence-embedding model's name; None: none is set, nothing embedded
    vectors: Path | None  # the vectors' file (None: no model)
    seconds: float


@dataclass(frozen=True)
class KeptKV:
    """What :meth:`Session.keep_kv` kept of a document: the method (resolved), the prefix's tokens
    (0: the method keeps nothing ahead of a question: Finch compresses with the question; one that
    retrieves reads what it points to), how the store had it ("hit": there already, "miss":
    computed and written now) and the seconds that took."""

    method: str
    tokens: int
    status: str | None
    seconds: float
    retrieves: bool = False  # kept nothing as the method reads what each question points to (pages)


KEEP_QUESTION = "?"  # the question :meth:`Session.keep_kv` builds its prompt with (the prefix ends before it)
KEEP_STEP = 8  # passages :func:`keep_document` embeds between two writes of the file (~3 s on two cores)


def keep_document(document: Document, cache_dir: Path | None = None, on_step=None, stop=None) -> Kept:
    """Ahead of a document's questions (``kvcli cache add``): every passage's vectors for the
    ``pages`` ranking (:mod:`kvcli.retrieval.vectors`), so that no question about it in any process
    embeds a page, only itself; the file written every :data:`KEEP_STEP` passages (an interrupted
    call keeps what it embedded) and counted under the store's cap. ``on_step(embedded, total)``:
    the passages embedded so far; ``stop``: a :class:`threading.Event` read between steps.
    Read with ``cache_dir`` (:func:`load_document`), a PDF's or an HTML page's text is kept too.
    A document that the default reads whole (within the model's window) keeps its KV on its first
    question instead: this does not read it with a model."""
    import threading
    import time

    from .retrieval import embed
    from .runtime.measure import keep_freed_memory

    keep_freed_memory()  # the embedding's batches reuse their buffers (as a model's load sets it)

    t0 = time.perf_counter()
    texts = [document.text[lo:hi] for lo, hi in document.passages()]
    name = embed.setting()
    if name is None or not texts:
        return Kept(document, len(texts), 0, 0, name, None, time.perf_counter() - t0)
    counts: list[tuple[int, int]] = []

    def step(done: int, total: int) -> None:
        counts.append((done, total))
        if on_step is not None:
            on_step(done, total)

    store = open_store(cache_dir)
    path, _ = _fill_vectors(
        embed.embedder(name),
        document,
        texts,
        cache_dir,
        stop or threading.Event(),
        step=KEEP_STEP,
        on_step=step,
        on_stored=store.make_room if store.enabled else None,
    )
    embedded = counts[-1][0] if counts else 0
    return Kept(document, len(texts), embedded, embedded - counts[0][0], name, path, time.perf_counter() - t0)


def _fill_vectors(model, document: Document, texts: list[str], cache_dir, stop, **how) -> tuple[Path, bool]:
    """The passages' vectors file in the cache folder, filled in (:func:`kvcli.retrieval.vectors.fill`,
    ``how`` its knobs), and whether this call wrote it."""
    from .files import cache_folder
    from .retrieval import vectors

    folder = cache_folder(cache_dir)
    about = {"document": _source(document), "document_sha256": document.sha256}
    wrote = vectors.fill(model, texts, folder, stop, document=about, **how)
    return vectors.path_for(folder, vectors.key(model.id, texts)), wrote


# --------------------------------------------------------------------------- kvcli cache


def open_store(cache_dir: Path | None = None) -> KVStore:
    from .files import cache_folder
    from .store import KVStore

    return KVStore.open(cache_folder(cache_dir))


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
