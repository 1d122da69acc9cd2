"""kvcli's one vocabulary: the environment variables every command reads and the spellings of its
values, in one table the option declarations (:mod:`.options`), ``kvcli --help`` and so docs/cli.md
(:mod:`.reference`) are made from; and the old spellings still accepted for one release, each with
a one-line note on stderr (:func:`renamed`).

One spelling per idea: a precision is a number of bits (``--quant 8``, ``--kv-bits 8``), a size cap
is ``--cache-max`` (``cache prune`` too), every answering command's method defaults to ``-c auto``.
"""

from __future__ import annotations

import sys

from .. import kv_bits as kv_quant
from ..model.facts import QUANT_SPELLINGS
from ..runtime import threads as cpu_threads
from ..runtime.chunking import ENV_PREFILL_CHUNK
from ..store.capacity import CAP_ENV
from ..store.locks import STALE_ENV

# name -> what it sets (the option it is the default of, or what it does); in --help's order
ENVIRONMENT: dict[str, str] = {
    "KVCLI_MODEL": "--model",
    "KVCLI_COMPRESSOR": "--compressor / -c (ask, chat, inspect)",
    "KVCLI_MAX_NEW_TOKENS": "--max-new-tokens (ask, chat)",
    kv_quant.ENV_KV_BITS: "--kv-bits",
    cpu_threads.ENV: "--threads",
    "KVCLI_CACHE_DIR": "--cache-dir",
    CAP_ENV: "--cache-max (ask, chat, cache prune)",
    ENV_PREFILL_CHUNK: "tokens per prefill chunk (0: one pass)",
    STALE_ENV: "seconds to wait for a stopped cache lock holder (120)",
    "KVCLI_EMBED_MODEL": "pages' embedding model: folder, package or none",
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


def renamed(old: str, quiet: bool = False) -> None:
    """Say once on stderr that ``old`` (a key of :data:`OLD_SPELLINGS`) is now spelled otherwise."""
    if not quiet:
        print(
            f"kvcli: note: {old} is now {OLD_SPELLINGS[old]} (the old spelling goes in the next release)",
            file=sys.stderr,
        )


def quant_value(value: str | None) -> str | None:
    """The library's name of ``--quant VALUE`` (``8`` -> ``8bit``); the old ``8bit`` / ``4bit``
    accepted with a note; None stays None (the command's default)."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("8bit", "4bit"):
        renamed(f"--quant {text}")
        text = text.removesuffix("bit")
    if text not in QUANT_SPELLINGS:
        from ..errors import UsageError

        raise UsageError(f"--quant must be one of {', '.join(QUANT_CHOICES)}, not '{value}'")
    return QUANT_SPELLINGS[text]
