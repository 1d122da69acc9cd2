"""What keeps the store folder clean: the files killed runs left, and removing entries.

Nothing is left behind: opening the store (and ``kvcli cache prune`` / ``rm --all``) removes the
temporary files of writers that died (their key's lock is free: a killed process holds no lock),
any other file that is not an entry once nobody has written to it for a while, and the lock files
nobody holds (:func:`reclaim`); ``kvcli cache info`` counts every byte of them (:func:`leftovers`).
A lock file is only removed by a process holding it, and a process that took the lock of a file
since removed takes it again (:func:`kvcli.store.locks.take_lock`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .entries import Entry
from .keys import SUFFIX, TEMP_NAME, digest_of, is_partial, lock_path
from .locks import LocksUnsupported, locking, take_lock

STALE_TEMP_S = 3600.0  # a temporary file not named after a key is removed after this long
IDLE_FOREIGN_S = 60.0  # ... and by ``kvcli cache prune`` / ``rm --all`` after this long unwritten


@dataclass
class Leftovers:
    """Files of the store that are not entries: temporary files (with their bytes) and lock files."""

    temp_files: int = 0
    temp_bytes: int = 0
    lock_files: int = 0


def remove(root: Path, entries: list[Entry]) -> int:
    """Delete ``entries`` of the store folder ``root``; returns the bytes freed. A partial entry
    goes only while this process holds its key's lock, which its read holds while it runs: a read
    that resumes it never loses its file under it."""
    freed = 0
    for e in entries:
        with contextlib.ExitStack() as held:
            if is_partial(e.path) and locking():
                try:
                    handle = take_lock(lock_path(root, digest_of(e.path)), blocking=False)
                except LocksUnsupported:
                    handle = contextlib.nullcontext()  # no locks on this filesystem: as any entry
                except OSError:
                    continue
                if handle is None:
                    continue  # its read runs: it stays
                held.enter_context(handle)
            with contextlib.suppress(FileNotFoundError):
                e.path.unlink()
                freed += e.size
    return freed


def reclaim(root: Path, explicit: bool = False) -> Leftovers:
    """Remove the temporary files of writers that died, any other file of the store's folder
    ``root`` that is not an entry, and the lock files nobody holds.

    An entry's temporary file is written only while its key's lock is held, and the kernel
    releases the lock of a killed process: a temporary file whose lock can be taken has no
    writer, whatever its age. Any other file directly under ``kv/`` that is not an entry (a
    ``.tmpXXXXXX`` the safetensors library left when kvcli wrote through it, a stray copy) has
    no lock to ask, so it goes by how long nobody wrote to it: an hour when a run opens the
    store, a minute for ``explicit`` (``kvcli cache prune`` / ``rm --all``); a file being
    written is never that idle. Lock files nobody holds are removed (while holding them).
    Files that cannot be removed (a read-only cache) are left. Returns what was removed."""
    out = Leftovers()
    if not root.is_dir():
        return out
    idle_limit = IDLE_FOREIGN_S if explicit else STALE_TEMP_S
    locks = set((root / "locks").glob("*.lock"))  # checking a temporary file may create its lock
    for path in _stray_files(root):
        try:
            size, mtime = (st := path.stat()).st_size, st.st_mtime
        except OSError:
            continue
        match = TEMP_NAME.match(path.name)
        idle = time.time() - mtime
        if match is None or not locking():  # not an entry's temporary file (or no locks here): by age
            if idle > (idle_limit if match is None else STALE_TEMP_S) and _unlink(path):
                out.temp_files, out.temp_bytes = out.temp_files + 1, out.temp_bytes + size
            continue
        try:
            handle = take_lock(lock_path(root, match.group(1)), blocking=False)
        except LocksUnsupported:  # no locks on this filesystem: by age
            if idle > STALE_TEMP_S and _unlink(path):
                out.temp_files, out.temp_bytes = out.temp_files + 1, out.temp_bytes + size
            continue
        except OSError:
            continue  # cannot tell whether its writer lives: leave it
        if handle is None:
            continue  # its writer holds the lock: a write in progress
        with handle:
            if _unlink(path):
                out.temp_files, out.temp_bytes = out.temp_files + 1, out.temp_bytes + size
    if locking():
        for path in (root / "locks").glob("*.lock"):
            try:
                handle = take_lock(path, blocking=False)
            except OSError:
                continue
            if handle is not None:
                with handle:
                    if _unlink(path) and path in locks:
                        out.lock_files += 1
    return out


def reclaim_by_age(folder: Path, explicit: bool = False) -> Leftovers:
    """Remove the files of ``folder`` (a side folder: ``<cache_dir>/vectors``, ``<cache_dir>/texts``) that are not
    entries once nobody has written to them for a while (an hour; a minute for ``explicit``): the
    temporary files of writers that died. Those writes take no lock (a vectors file is written
    whole in a moment, :func:`kvcli.files.atomic_write`), so age alone tells."""
    out = Leftovers()
    idle_limit = IDLE_FOREIGN_S if explicit else STALE_TEMP_S
    for path in _stray_files(folder):
        try:
            st = path.stat()
        except OSError:
            continue
        if time.time() - st.st_mtime > idle_limit and _unlink(path):
            out.temp_files, out.temp_bytes = out.temp_files + 1, out.temp_bytes + st.st_size
    return out


def leftovers(root: Path) -> Leftovers:
    """Every file of the store folder ``root`` that is not an entry: temporary files (writes in
    progress, or not yet reclaimed, whatever their name) with their bytes, and lock files."""
    out = Leftovers()
    if not root.is_dir():
        return out
    for path in _stray_files(root):
        with contextlib.suppress(OSError):
            out.temp_bytes += path.stat().st_size
            out.temp_files += 1
    out.lock_files = sum(1 for _ in (root / "locks").glob("*.lock"))
    return out


def added(*parts: Leftovers) -> Leftovers:
    return Leftovers(
        sum(p.temp_files for p in parts), sum(p.temp_bytes for p in parts), sum(p.lock_files for p in parts)
    )


def _stray_files(root: Path) -> Iterator[Path]:
    """The files directly under ``root`` (the store's ``kv/``, or a side folder) that are not entries."""
    with contextlib.suppress(OSError):
        for path in root.iterdir():
            if not path.name.endswith(SUFFIX) and path.is_file() and not path.is_symlink():
                yield path


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False
