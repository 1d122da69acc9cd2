"""The kvcli command line: thin Typer commands over the library, one module per command
(:mod:`.ask`, :mod:`.chat`, :mod:`.methods` — ``compressors`` and ``heads`` —, :mod:`.inspect`, :mod:`.cache`,
:mod:`.bench`), the shared option declarations (:mod:`.options`) and the console (:mod:`.console`:
stdout/stderr, warnings, errors as one line).

Answers and JSON go to stdout; progress and errors go to stderr. A user error is one line,
``kvcli: error: ...``, and a non-zero exit code (2 for usage errors, 1 otherwise).
"""

from __future__ import annotations

# isort: off
from . import ask, chat, methods, inspect, cache, bench, bench_memory  # noqa: F401  (each registers its commands, in help order)

# isort: on
from .app import app
from .console import run


def main() -> None:
    """Entry point (``kvcli``)."""
    run(app)
