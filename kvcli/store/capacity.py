"""How big the disk KV store may grow: its cap, and which entries go when it is over.

The store (:mod:`kvcli.store`) keeps a new entry only when it fits under the cap, and then removes
the least recently used of the others until it does (:func:`room_for`); an entry that is not kept
removes nothing. The retrieval's page vectors (``<cache_dir>/vectors``) count as entries: their
bytes are under the same cap and they go by the same order. The cap (:func:`resolve_cap`) is
``--cache-max`` / ``$KVCLI_CACHE_MAX`` (a size such as ``2G``, or ``none``), by default the smaller
of

* 10 GiB (:data:`DEFAULT_CAP_BYTES`): the 8k-token prefix KV of ~56 documents for the embedded
  SmolLM2-135M (22.5 KiB per token, 180 MiB a document) or ~10 for an 8B model (128 KiB per token),
  more than a day's documents, and
* a quarter (:data:`DEFAULT_CAP_SHARE`) of the disk space the store may use (the free space where it
  lives plus what it holds already), so on a nearly full disk kvcli never takes the last of it.

A fixed size alone would fill a small disk; a share alone would let the cache take hundreds of GiB
of a big one for entries that are rarely reused.

The KV is stored in the dtype the model computes in: bfloat16 or float16 on a GPU; on the CPU
bfloat16 for a quantised model — the embedded one by default, whose 8-bit weights run with bfloat16
activations (:mod:`kvcli.model.cpu_quant`) — else float32 unless ``--dtype`` says otherwise.
Rounding a float32 model's KV to 16 bits on disk would make an answer from the store differ from
the cold one.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ..files import VECTORS_FOLDER
from .keys import SUFFIX, held_bytes

DEFAULT_CAP_BYTES = 10 << 30
DEFAULT_CAP_SHARE = 0.25
CAP_ENV = "KVCLI_CACHE_MAX"
NO_CAP = ("none", "off", "unlimited")


def human(n: int) -> str:
    """``n`` bytes in words: "1.6 GiB", "72.0 MiB", "512 B"."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def least_recently_used(items: list, max_bytes: int, size: Callable, last_use: Callable) -> list:
    """The items to remove, least recently used first, for the rest to fit in ``max_bytes``."""
    total = sum(size(i) for i in items)
    out = []
    for item in sorted(items, key=last_use):
        if total <= max_bytes:
            break
        out.append(item)
        total -= size(item)
    return out


def room_for(
    items: list, size: int, max_bytes: int, size_of: Callable, last_use: Callable, removable: Callable
) -> list | None:
    """The items to remove, least recently used first, for a new entry of ``size`` bytes to fit beside
    the rest in ``max_bytes``; None when it cannot, whatever goes (it alone, or with the items that
    cannot be removed, is over): then nothing is removed and the entry is not kept."""
    fixed = sum(size_of(i) for i in items if not removable(i))
    if size + fixed > max_bytes:
        return None
    return least_recently_used([i for i in items if removable(i)], max_bytes - size - fixed, size_of, last_use)


def resolve_cap(spec: str | int | None, root: Path) -> int | None:
    """The store's cap in bytes (None: no cap) from ``spec``: a size (``500M``, ``2G``, bytes), or
    ``none``/``off``/``unlimited``; unset: ``$KVCLI_CACHE_MAX``, else the default, the smaller of
    ``DEFAULT_CAP_BYTES`` and ``DEFAULT_CAP_SHARE`` of the free space where the store lives plus
    what the store holds, the page vectors included (:data:`DEFAULT_CAP_BYTES`)."""
    if spec is None:
        spec = os.environ.get(CAP_ENV) or None
    if isinstance(spec, int):
        return spec
    if spec is not None:
        if spec.strip().lower() in NO_CAP:
            return None
        return parse_size(spec)
    folder = Path(root).expanduser()
    while not folder.exists() and folder != folder.parent:  # not created yet: the disk it will be on
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return DEFAULT_CAP_BYTES
    held = 0
    base = Path(root).expanduser()
    for path in [*base.glob(f"kv/*{SUFFIX}"), *base.glob(f"{VECTORS_FOLDER}/*{SUFFIX}")]:
        try:
            held += held_bytes(path, path.stat())
        except OSError:  # removed meanwhile
            pass
    return min(DEFAULT_CAP_BYTES, int(DEFAULT_CAP_SHARE * (free + held)))


def parse_size(text: str, source: str = "size") -> int:
    """``'500M'`` -> bytes. Units K, M, G, T are binary (KiB, MiB...); a bare number is bytes. A
    :class:`UsageError` names ``source`` (the option or the variable the text came from)."""
    from ..errors import UsageError

    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(s[-1:], 1)
    number = s[:-1] if s[-1:] in units else s
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if not math.isfinite(value * scale):  # nan, inf, 1e400
        raise UsageError(f"{source} must look like 500M, 2G or 1048576, not '{text}'")
    if value < 0:
        raise UsageError(f"{source} must not be negative, got '{text}'")
    return int(value * scale)
