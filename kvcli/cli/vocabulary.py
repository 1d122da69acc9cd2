"""kvcli's one vocabulary: the environment variables every command reads and the spellings of its
values, in one table the option declarations (:mod:`.options`), ``kvcli --help`` and so docs/cli.md
(:mod:`.reference`) are made from; and the old spellings still accepted for one release, each with
a one-line note on stderr (:func:`renamed`; none with ``--quiet``).

One spelling per idea: a precision is a number of bits (``--quant 8``, ``--kv-bits 8``; the library's
``AskOptions.quant`` and ``--json``'s ``quant`` spell it so too), a size cap
is ``--cache-max`` (``cache prune`` too), every answering command's method defaults to ``-c auto``.
"""

from __future__ import annotations

import sys

from .. import kv_bits as kv_quant
from ..model import int8_rows
from ..model.names import MODEL_ENV, QUANT_SPELLINGS
from ..runtime import threads as cpu_threads
from ..runtime.chunking import ENV_PREFILL_CHUNK
from ..runtime.graph_setting import ENV_CUDA_GRAPHS
from ..runtime.heap_setting import ENV_HEAP
from ..store.capacity import CAP_ENV
from ..store.locks import STALE_ENV

# name -> what it sets (the option it is the default of, or what it does); in --help's order
ENVIRONMENT: dict[str, str] = {
    MODEL_ENV: "--model",
    "KVCLI_COMPRESSOR": "--compressor / -c (ask, chat, inspect)",
    "KVCLI_MAX_NEW_TOKENS": "--max-new-tokens (ask, chat)",
    kv_quant.ENV_KV_BITS: "--kv-bits",
    cpu_threads.ENV: "--threads",
    "KVCLI_CACHE_DIR": "--cache-dir",
    CAP_ENV: "--cache-max (ask, chat, cache prune)",
    ENV_PREFILL_CHUNK: "tokens per prefill chunk (0: one pass)",
    int8_rows.ENV: "8-bit decoding: exact (default), 8bit or pytorch",
    ENV_CUDA_GRAPHS: "0: CUDA decodes step by step, no graph (default 1)",
    ENV_HEAP: "freed heap: keep (default, reused) or system",
    STALE_ENV: "seconds to wait for a stuck lock holder (120, min 20)",
    "KVCLI_EMBED_MODEL": "pages' embedding model: name, folder, package or none",
    "KVCLI_DEBUG": "1: a bug (exit 3) prints its Python stack too",
}

# --quant: weights in 4 or 8 bits, as --kv-bits names bits: a number; the library's names of each
QUANT_CHOICES = tuple(QUANT_SPELLINGS)
# old spelling -> the one to use, for one release (a note on stderr each time one is used)
OLD_SPELLINGS = {"--quant 8bit": "--quant 8", "--quant 4bit": "--quant 4", "--max-size": "--cache-max"}


def env(name: str) -> str:
    """``name``, checked against :data:`ENVIRONMENT` (an option's ``envvar=``: every one is listed)."""
    if name not in ENVIRONMENT:
        raise KeyError(f"{name} is not in kvcli.cli.vocabulary.ENVIRONMENT")
    return name


def environment_help() -> str:
    """The ``Environment:`` section of ``kvcli --help``."""
    width = max(map(len, ENVIRONMENT))
    rows = "\n".join(f"  {name.ljust(width)}  {what}" for name, what in ENVIRONMENT.items())
    return f"Environment:\n\n\b\n{rows}"


_PENDING: list[str] = []  # old spellings met while the command line was parsed, not said yet


def renamed(old: str, quiet: bool | None = None) -> None:
    """Say on stderr that ``old`` (a key of :data:`OLD_SPELLINGS`) is now spelled otherwise; nothing
    with ``quiet``. ``quiet`` None (an option's callback, before ``--quiet`` is known): said by
    :func:`say_renamed` once the command knows it."""
    if quiet is None:
        if old not in _PENDING:
            _PENDING.append(old)
    elif not quiet:
        print(
            f"kvcli: note: {old} is now {OLD_SPELLINGS[old]} (the old spelling goes in the next release)",
            file=sys.stderr,
        )


def say_renamed(quiet: bool) -> None:
    """Say the old spellings the command line used (:func:`renamed`), unless ``quiet``."""
    while _PENDING:
        renamed(_PENDING.pop(0), quiet)


def quant_value(value: str | None) -> str | None:
    """``--quant VALUE`` as kvcli spells it everywhere (``AskOptions.quant``, ``--json``): auto,
    none, 8 or 4; the old ``8bit`` / ``4bit`` accepted with a note (:func:`renamed`); None stays
    None (the command's default)."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("8bit", "4bit"):
        renamed(f"--quant {text}")
        text = text.removesuffix("bit")
    if text not in QUANT_SPELLINGS:
        from ..errors import UsageError

        raise UsageError(f"--quant must be one of {', '.join(QUANT_CHOICES)}, not '{value}'")
    return text
