"""User-facing errors.

Every error a user can cause (bad file, bad option, missing hardware) is a :class:`KvcliError`.
The CLI prints ``kvcli: error: <message>`` as one line on stderr and exits with ``exit_code``;
it never shows a traceback for these.
"""

from __future__ import annotations


class KvcliError(Exception):
    """An error caused by the user's input or environment, reported as one line."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # one line, always
        return " ".join(self.message.split())


class UsageError(KvcliError):
    """Bad command line: unknown compressor or knob, bad option value. Exit code 2."""

    exit_code = 2


class DocumentError(KvcliError):
    """A document that cannot be read: missing, unsupported type, encrypted, image-only, empty."""


class ModelError(KvcliError):
    """A model that cannot be loaded or run as asked (missing weights, no GPU, no bitsandbytes...)."""


def one_line(exc: BaseException) -> str:
    """An exception's message as one line: its first non-blank line, whitespace squashed (the
    type's name when the message is empty) — for wrapping library errors in a KvcliError."""
    for line in str(exc).splitlines():
        if line.strip():
            return " ".join(line.split())
    return type(exc).__name__
