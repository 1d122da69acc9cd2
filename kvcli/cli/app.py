"""The root ``kvcli`` Typer app the command modules register on, and ``kvcli --version``."""

from __future__ import annotations

import platform

import typer

from .vocabulary import environment_help

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # click's plain help (every sub-command, bench's included): paragraphs re-flowed to the
    # terminal, example blocks after a \b line kept as written, no Typer type placeholders
    rich_markup_mode=None,
    help="Ask questions about long documents with a local LLM, compressing the prompt and its KV cache.",
    epilog=environment_help(),
)


def version_line() -> str:
    """``kvcli 0.1.0 (torch 2.x, transformers 5.x, Python 3.x)``: the installed distribution's
    version and the two libraries an answer depends on most, read from package metadata (nothing
    is imported, so ``--version`` answers at once)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"kvcli {version('kvcli')} (torch {version('torch')}, transformers {version('transformers')}, Python {platform.python_version()})"


def _show_version(value: bool) -> None:
    if value:
        print(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Print kvcli's version and exit"
    ),
) -> None:
    """Ask questions about long documents with a local LLM, compressing the prompt and its KV cache."""
