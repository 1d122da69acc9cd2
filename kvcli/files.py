"""Atomic file writes: the one way kvcli puts a file into a folder other processes read."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable


def umask() -> int:
    """The process's umask (read without changing it for good)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain ``open()`` would give a new file: 0666 less the umask (0644 with umask 022,
    0664 with 002 — a cache folder shared by a group stays writable by the group)."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode a plain ``mkdir`` would give a new folder: 0777 less the umask."""
    return 0o777 & ~umask()


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Create ``path`` by ``write(tmp)`` on a temporary file in the same folder (``.<name>.*.tmp``),
    then ``os.replace``: readers see the old file or the new one, never half of one. On failure the
    temporary file is removed and the error raised. The file gets the mode the umask gives new
    files (:func:`file_mode`), not mkstemp's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())  # mkstemp makes it 0600; a shared cache follows the umask
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
