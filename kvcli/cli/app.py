"""The root ``kvcli`` Typer app the command modules register on."""

from __future__ import annotations

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # click's plain help (every sub-command, bench's included): paragraphs re-flowed to the
    # terminal, example blocks after a \b line kept as written, no Typer type placeholders
    rich_markup_mode=None,
    help="Ask questions about long documents with a local LLM, compressing the prompt and its KV cache.",
)
