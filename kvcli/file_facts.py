"""Facts about large files computed once: a GGUF's sha256 and its matrices' storage types, the
identity of a sentence-embedding model's folder. Each is memoised in one JSON file of the cache
folder, ``gguf-sha256.json`` (named for its first fact), by the files' paths, sizes and mtimes: a
file replaced or touched is read again; a read-only or missing cache only costs computing the fact
again next time."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .files import atomic_write

SIDECAR = "gguf-sha256.json"


def _read(cache_dir: Path) -> dict:
    try:
        memo = json.loads((cache_dir / SIDECAR).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _remember(cache_dir: Path, key: str, entry: dict) -> None:
    memo = _read(cache_dir)  # read again: another process may have added its facts meanwhile
    memo[key] = entry
    with contextlib.suppress(OSError):
        atomic_write(
            cache_dir / SIDECAR,
            lambda tmp: Path(tmp).write_text(json.dumps(memo, indent=1, sort_keys=True), encoding="utf-8"),
        )


def file_fact(path: Path, cache_dir: Path, name: str, kind: type, compute: Callable[[Path], Any]) -> Any:
    """The fact ``name`` (a JSON value of type ``kind``) about the file at ``path``:
    ``compute(path)`` once, then memoised while the file keeps its size and mtime."""
    st = path.stat()
    key = str(path.resolve())
    entry = _read(cache_dir).get(key)
    if not (isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns):
        entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    elif isinstance(entry.get(name), kind):
        return entry[name]
    entry[name] = value = compute(path)
    _remember(cache_dir, key, entry)
    return value


def folder_fact(folder: Path, files: list[Path], cache_dir: Path, name: str, compute: Callable[[], str]) -> str:
    """The fact ``name`` (a string) about ``files`` of ``folder``: ``compute()`` once, then memoised
    while the folder holds the same files with the same sizes and mtimes. A folder's facts are kept
    together while they are about the same files (the same ``files`` for each)."""
    stats = {}
    for f in sorted(files):
        st = f.stat()
        stats[str(f.relative_to(folder))] = [st.st_size, st.st_mtime_ns]
    key = f"{folder.resolve()}/"
    entry = _read(cache_dir).get(key)
    if not (isinstance(entry, dict) and entry.get("files") == stats):
        entry = {"files": stats}
    elif isinstance(entry.get(name), str):
        return entry[name]
    entry[name] = value = compute()
    _remember(cache_dir, key, entry)
    return value
