"""Atomic file writes: the one way kvcli puts a file into a folder other processes read."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Create ``path`` by ``write(tmp)`` on a temporary file in the same folder (``.<name>.*.tmp``),
    then ``os.replace``: readers see the old file or the new one, never half of one. On failure the
    temporary file is removed and the error raised. The file is left world-readable (0644)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a shared cache should stay readable
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
