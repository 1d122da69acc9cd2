"""The kvcli command line: thin Typer commands over the library.

Answers and JSON go to stdout; progress and errors go to stderr. A user error is one line,
``kvcli: error: ...``, and a non-zero exit code (2 for usage errors, 1 otherwise).
"""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from . import api, render
from .errors import KvcliError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Ask questions about long documents with a local LLM, compressing the prompt and its KV cache.",
)

stdout = Console(highlight=False, soft_wrap=True)


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Quant(str, Enum):
    none = "none"
    four = "4bit"
    eight = "8bit"


class Attn(str, Enum):
    sdpa = "sdpa"
    eager = "eager"
    flash = "flash"


def _stderr(quiet: bool) -> Console:
    # soft_wrap: the stats line stays one line when stderr is a pipe or a narrow terminal
    return Console(stderr=True, quiet=quiet, highlight=False, soft_wrap=True)


@app.command()
def ask(
    path: Path = typer.Argument(..., help="Document: .pdf, .txt, .md or .html", show_default=False),
    question: str = typer.Argument(..., help="The question to answer from the document", show_default=False),
    compressor: str = typer.Option(
        "gemfilter", "--compressor", "-c", help="Method spec, e.g. full or gemfilter:layer=16,k=256,kernel=5; see `kvcli compressors`"
    ),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="HF id or local path [default: embedded SmolLM2-135M-Instruct]"),
    device: Device = typer.Option(Device.auto, help="Where to run"),
    quant: Quant = typer.Option(Quant.none, help="Weight quantisation with bitsandbytes"),
    attn: Attn = typer.Option(Attn.sdpa, help="Attention kernel (flash needs CUDA and flash-attn)"),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Longest answer, in tokens"),
    template: str = typer.Option("qa", help="Prompt template name in prompts/ or a path"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text"),
    show_selected: bool = typer.Option(False, "--show-selected", help="After the answer, show the kept tokens in context with page numbers"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Nothing on stderr but errors"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", envvar="KVCLI_CACHE_DIR", help="Where converted models are kept"),
) -> None:
    """Answer QUESTION from the document at PATH."""
    err = _stderr(quiet)
    options = api.AskOptions(
        compressor=compressor,
        model=model,
        device=device.value,
        quant=quant.value,
        attn=attn.value,
        dtype=dtype,
        max_new_tokens=max_new_tokens,
        template=template,
        cache_dir=cache_dir,
    )
    pipeline = api.parse_pipeline(compressor)  # fail fast on a bad spec, before loading anything
    document = api.read_document(path)
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
        render.selected_spans(view, spans, document, result.n_kept_tokens, result.prompt.n_tokens)
    err.print(
        f"[dim]{pipeline.spec()} · kept {result.n_kept_tokens:,}/{result.prompt.n_tokens:,} tokens · "
        f"TTFT {result.ttft_s:.2f}s · total {result.total_s:.2f}s · peak {result.peak_mem_mb:,.0f} MiB[/dim]"
    )


@app.command()
def compressors() -> None:
    """List the compression methods with their knobs and defaults."""
    render.compressor_table(stdout)


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
        code = app(standalone_mode=False)
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
