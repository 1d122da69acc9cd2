"""``kvcli ask``: answer questions about documents — one answer as text, or a batch as JSON Lines
(here, or on a Ray cluster with ``--ray``)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import typer
from rich.console import Console

from .. import batch, executors
from ..documents import read_stdin
from ..errors import UsageError
from ..files import cache_folder
from ..report import terminal as render
from .app import app
from .console import batch_progress, route_warnings, say_error, stderr, stdout
from .live import Reading, answer, embedding_tip, stats_line
from .options import (
    AnswerGuardOpt,
    CacheDirOpt,
    CacheMaxOpt,
    CheckOpt,
    CompressorOpt,
    LookupOpt,
    ModelChoice,
    ModelOptions,
    NoCacheOpt,
    Offload,
    SourcesOpt,
    TemplateOpt,
    loads_a_model,
    max_new_tokens_option,
    sources_wanted,
    usage,
)

ASK_HELP = """Answer a question from documents.

Documents are .pdf, .txt, .md and .html files, folders (read recursively), glob patterns, or -
for text on stdin. One document and one question: the answer as text (--json: one JSON object).
More than one: JSON Lines, one object per (document, question) in input order; a document that
fails gives an error record and the batch goes on.

Exit code: 0 all answered, 1 some failed, 2 usage error, 3 internal error (a bug;
KVCLI_DEBUG=1 shows its traceback), 130 interrupted (Ctrl-C).

Examples:

\b
  kvcli ask book.pdf "Who is the narrator?"
  kvcli ask book.pdf "Who is the narrator?" -c full --json
  kvcli ask contracts/ "Who are the parties?"
  kvcli ask a.pdf b.md --questions questions.txt
  cat notes.txt | kvcli ask - "What changed?"
"""


@app.command(help=ASK_HELP, cls=usage("[OPTIONS] DOCUMENT... QUESTION", "[OPTIONS] DOCUMENT... --questions FILE"))
@loads_a_model
def ask(
    inputs: list[str] = typer.Argument(
        ...,
        metavar="DOCUMENT... QUESTION",
        help="Documents (files, folders, globs, - for stdin), then the question (none with --questions)",
        show_default=False,
    ),
    questions_file: str | None = typer.Option(
        None, "--questions", help='File of questions, one per line or JSON Lines with a "question" field (- for stdin)'
    ),
    compressor: str = CompressorOpt,
    load: ModelChoice = ModelOptions,
    max_new_tokens: int = max_new_tokens_option(),
    template: str = TemplateOpt,
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object instead of text (always, for batches: JSON Lines)"
    ),
    show_selected: bool = typer.Option(
        False,
        "--show-selected",
        help="After the answer, show the kept tokens in context with page numbers (in JSON: selected_spans)",
    ),
    fail_fast: bool = typer.Option(False, "--fail-fast", help="In a batch, stop at the first failure"),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Nothing on stderr but errors (and in a batch, nothing at all)"
    ),
    cache_dir: Path | None = CacheDirOpt,
    no_cache: bool = NoCacheOpt,
    cache_max: str | None = CacheMaxOpt,
    kv_offload: Offload = typer.Option(
        Offload.none,
        "--kv-offload",
        help="cpu: methods that keep the whole KV (blocksparse) hold it in CPU memory and move only the blocks they attend to the GPU",
    ),
    answer_guard: bool = AnswerGuardOpt,
    lookup: int = LookupOpt,
    sources: bool = SourcesOpt,
    check: bool = CheckOpt,
    low_memory: bool = typer.Option(
        False,
        "--low-memory",
        help="CPU: hand each freed prompt activation back to the OS at once: a lower memory peak (up to ~200 MiB less at 8k tokens on the embedded model), a slower first token (+15-30%)",
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray",
        help="Answer on a Ray cluster, one model per worker: auto (the running cluster), ray://HOST:PORT, or local (a Ray instance for this run); output as a batch's. Needs pip install 'kvcli[ray]'",
    ),
    workers: int | None = typer.Option(
        None,
        "--workers",
        min=1,
        help="With --ray: how many workers (default: one per GPU of the cluster when the model runs on CUDA, else one per N CPUs, N the threads each runs on: --threads, else a local run's count; at most one per document)",
    ),
) -> None:
    err = stderr(quiet)
    route_warnings(quiet)
    options = load.ask_options(
        max_new_tokens=max_new_tokens,
        template=template,
        cache_dir=cache_dir,
        use_cache=not no_cache,
        kv_offload=kv_offload.value,
        answer_guard=answer_guard,
        lookup=lookup,
        low_memory=low_memory,
        cache_max=cache_max,
        sources=sources is not False,
        check=check,
    )
    if workers is not None and ray_address is None:
        raise UsageError("--workers needs --ray (without it one process answers every document)")
    if ray_address is not None:
        if not ray_address.strip():
            raise UsageError("--ray: give an address (auto, ray://HOST:PORT) or local")
        executors.import_ray()  # missing: one line naming the extra, before anything else
    # --- what to ask of what: every usage error before the model loads
    if questions_file is not None:
        if batch.looks_like_question(inputs[-1]):
            raise UsageError(
                f"'{inputs[-1]}' is not a document, folder or matching pattern; a QUESTION and --questions "
                "exclude each other (add the question to the questions file)"
            )
        paths, questions = inputs, batch.read_questions(questions_file)
    elif len(inputs) < 2:
        raise UsageError(
            'give a document and a question, e.g. kvcli ask book.pdf "Who wrote it?", or --questions FILE '
            "(see 'kvcli ask --help')"
        )
    else:
        paths, questions = inputs[:-1], [batch.check_question(inputs[-1])]
    if paths.count(batch.STDIN) > 1 or (batch.STDIN in paths and questions_file == batch.STDIN):
        raise UsageError("stdin (-) can be read only once: as one document, or as the questions file")
    from .. import api  # the library (and PyTorch): not for --help

    pipeline = api.parse_pipeline(compressor)  # fail fast on a bad spec, before loading anything
    items = batch.expand_inputs(paths)
    single = len(paths) == 1 and len(items) == 1 and items[0].source == paths[0] and len(questions) == 1
    if single and ray_address is None:
        _ask_one(err, options, pipeline, items[0], questions[0], as_json, show_selected, sources)
    else:
        _ask_batch(err, options, pipeline, items, questions, show_selected, fail_fast, compressor, ray_address, workers)


def _ask_one(err, options, pipeline, item, question, as_json, show_selected, sources=None) -> None:
    """One document, one question: the answer as text (or one JSON object); errors end the run.
    On a terminal (not --json) the answer is printed as it is decoded, then its sources; in a pipe
    stdout is the answer alone (its sources with --sources)."""
    from .. import api
    from ..report.record import result_record, shown_selection

    document = batch.read_input(item, read_stdin, cache_folder(options.cache_dir))
    with err.status("loading model…", spinner="dots"):
        session = api.Session.open(options)
    stream = not as_json and stdout.is_terminal
    compute, shown = sources_wanted(sources, as_json, stdout.is_terminal)
    reading = Reading(err)
    # in a pipe the answer is written whole once final, before the check after it and its sources
    whole = not as_json and not stream
    result = answer(err, session, document, question, pipeline, stream, sources=compute, reading=reading, whole=whole)
    if as_json:
        record = result_record(result, session, pipeline, document, include_spans=show_selected)
        stdout.out(json.dumps(record, ensure_ascii=False))
        return
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if shown and result.sources is not None:
        for line in result.sources.lines():
            stdout.out(line)
    if show_selected:
        shown, n_shown, verb = shown_selection(result)  # a stored book: what the answer read
        # a wrapping console: on the soft-wrapping `stdout` rich cuts each row at the terminal
        # width (80 columns in a pipe), which hides the kept span behind its 60 characters of context
        view = Console(highlight=False)
        render.selected_spans(
            view, shown.spans(result.prompt, document), document, n_shown, result.prompt.n_tokens, verb=verb
        )
    err.print(stats_line(result, pipeline), style="dim", markup=False, highlight=False)
    tip = embedding_tip(reading.embedding_s, item.source) if err.is_terminal else None
    if tip is not None:
        err.print(tip, style="dim", markup=False, highlight=False)


def _ask_batch(
    err, options, pipeline, items, questions, show_selected, fail_fast, spec: str, ray_address=None, workers=None
) -> None:
    """Every (document, question) pair as a JSON line on stdout; exit 1 if any failed. Answered
    here (the model loaded once), or with --ray on the workers of a Ray cluster."""
    from .. import api
    from ..answer.labels import spec_label

    if ray_address is None:
        with err.status("loading model…", spinner="dots"):
            executor = executors.LocalExecutor(api.Session.open(options))
    else:
        warn = None if err.quiet else (lambda m: print(f"kvcli: warning: {m}", file=sys.stderr))
        executor = executors.RayExecutor(options, ray_address, workers, on_warning=warn)
    total = len(items) * len(questions)
    failed = done = 0
    methods: Counter = Counter()  # the methods that answered (-c auto picks one per document)
    said = batch.ErrorLines()  # a document's error once, however many questions it fails
    progress = batch_progress(err)
    with executor:
        if ray_address is not None:
            with err.status(f"starting Ray workers ({ray_address}) and loading the model…", spinner="dots"):
                executor.start(len(items))
        with progress:
            task = progress.add_task("answering", total=total)

            def on_start(source: str, question: str) -> None:
                progress.update(task, description=f"{Path(source).name}: {question[:40]}")

            for record in executors.run_batch(
                executor,
                items,
                questions,
                pipeline,
                include_spans=show_selected,
                fail_fast=fail_fast,
                on_start=on_start,
            ):
                stdout.out(json.dumps(record, ensure_ascii=False))
                sys.stdout.flush()
                done += 1
                if "error" in record:
                    failed += 1
                    line = said.line(record)
                    if line is not None:
                        say_error(progress.console, line)
                else:
                    methods[spec_label(record["compressor"], pipeline)] += 1  # the spec: every knob resolved
                progress.advance(task)
        where = executor.describe()
    stopped = f", {total - done:,} not asked (--fail-fast)" if done < total else ""
    where = f" · {where}" if where else ""
    err.print(
        f"{done - failed:,} answered, {failed:,} failed{stopped} · {batch_methods(methods, spec)}{where}",
        style="dim",
        markup=False,
        highlight=False,
    )
    if failed:
        raise typer.Exit(1)


def batch_methods(methods: Counter, spec: str) -> str:
    """The methods of a batch's summary: "infllm" when one answered everything, "infllm ×3, full
    ×1" when -c auto picked several (most answers first), the spec as given when none answered."""
    if len(methods) <= 1:
        return next(iter(methods), spec)
    return ", ".join(f"{label} ×{n:,}" for label, n in methods.most_common())
