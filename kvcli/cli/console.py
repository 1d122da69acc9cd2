"""Where the command line's output goes: answers and JSON to stdout (:data:`stdout`), progress,
warnings and errors to stderr (:func:`stderr`, :func:`route_warnings`), and how any error ends a
run: one line, ``kvcli: error: ...``, and an exit code (:func:`run`)."""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console

from .. import notices
from ..errors import KvcliError

stdout = Console(highlight=False, soft_wrap=True)


def write_answer(text: str) -> None:
    """The answer on stdout exactly as the JSON's ``answer`` holds it, then a newline: no markup,
    wrapping or control-code stripping between the model and a script capturing ``$(kvcli ask ...)``."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def route_warnings(quiet: bool) -> None:
    """Library warnings (kvcli.notices) as ``kvcli: warning: ...`` lines on stderr, and long
    one-time steps (the embedded model's conversion) as ``kvcli: ...`` lines, whether or not stderr
    is a terminal (a spinner shows only on one); none with --quiet."""
    from ..model import set_progress_sink

    notices.set_sink(None if quiet else lambda m: print(f"kvcli: warning: {m}", file=sys.stderr))
    set_progress_sink(None if quiet else lambda m: print(f"kvcli: {m}", file=sys.stderr, flush=True))


def stderr(quiet: bool) -> Console:
    """The progress console on stderr; silent with --quiet."""
    # soft_wrap: the stats line stays one line when stderr is a pipe or a narrow terminal
    return Console(stderr=True, quiet=quiet, highlight=False, soft_wrap=True)


def say_error(err: Console, line: str) -> None:
    """``kvcli: error: LINE`` on stderr, with --quiet too (it hides all but errors): through
    ``err`` where it may hold a live bar (printed above it), else plainly."""
    if err.quiet:
        print(f"kvcli: error: {line}", file=sys.stderr)
    else:
        err.print(f"kvcli: error: {line}", style="red", markup=False, highlight=False)


def batch_progress(err: Console):
    """A bar over a batch's items on ``err`` (a description, the bar, done/total, the time so
    far), left on no line once done; none with --quiet or where stderr is not a terminal (a bar in
    a pipe is noise, and leaves a blank line)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=err.quiet or not err.is_terminal,
    )


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
    param = getattr(e, "param", None)
    envvar = getattr(param, "envvar", None)
    if ctx is not None and isinstance(envvar, str) and _source(ctx, param) != "ENVIRONMENT":
        message = message.replace(f" (env var: '{envvar}')", "")  # the value came from the command line
    message = message.replace(": Value error, ", ": ", 1)  # a choice's error, as Typer's validation words it
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    print(f"kvcli: error: {' '.join(message.split())}{hint}", file=sys.stderr)


def _source(ctx, param) -> str | None:
    """Where click took ``param``'s value from: "COMMANDLINE", "ENVIRONMENT", "DEFAULT", ..."""
    source = ctx.get_parameter_source(param.name) if param.name else None
    return getattr(source, "name", None)


def run(app) -> None:
    """Run ``app`` as ``kvcli``, turning user errors into one line on stderr and an exit code."""
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
