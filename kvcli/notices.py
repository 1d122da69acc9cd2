"""Warnings for the user: one line each, at most once per cause, sent wherever the caller wants.

The library never prints. Code that degrades gracefully (an unwritable cache directory, a damaged
cache entry) calls :func:`warn`; the CLI installs a sink that prints ``kvcli: warning: ...`` on
stderr (nothing with ``--quiet``), and every warning is also kept in :func:`collected` so JSON
output can report it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable

Sink = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"kvcli: warning: {message}", file=sys.stderr)


_sink: Sink = _stderr
_seen: set[Hashable] = set()
_collected: list[str] = []


def set_sink(sink: Sink | None) -> None:
    """Where warnings go (None: nowhere); the default prints them on stderr."""
    global _sink
    _sink = sink if sink is not None else (lambda message: None)


def warn(message: str, key: Hashable | None = None) -> None:
    """Tell the user ``message`` once per ``key`` (default: the message itself) in this process."""
    key = message if key is None else key
    if key in _seen:
        return
    _seen.add(key)
    _collected.append(message)
    _sink(message)


def collected() -> list[str]:
    return list(_collected)


def drain() -> list[str]:
    """The warnings since the last drain (for per-record reporting)."""
    out = list(_collected)
    _collected.clear()
    return out


def reset() -> None:
    """Forget what was said (tests)."""
    _seen.clear()
    _collected.clear()
