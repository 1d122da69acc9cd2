"""Per-key locks across processes: an exclusive ``flock`` on ``kv/locks/<key>.lock``.

A process computing an entry holds its key's lock; the others wait for it and then load the entry
instead of all computing it. The temporary file of an entry is only written while its key's lock
is held, and the kernel releases the lock of a killed process: a temporary file whose lock can be
taken has no writer (:func:`kvcli.store.housekeeping.reclaim`). On a shared filesystem the lock
holds across hosts where ``flock`` does (NFS, CephFS, Lustre with ``-o flock``); where ``flock``
fails (``ENOLCK``, ``EOPNOTSUPP``) :func:`take_lock` raises :class:`LocksUnsupported` and the store
runs without locks (:meth:`kvcli.store.KVStore.lock`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

try:  # POSIX advisory locks; elsewhere concurrent runs may compute an entry twice (still safe)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

# what flock raises on a filesystem without (working) locks: some NFS mounts, FUSE, SMB
_NO_LOCK_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


class LocksUnsupported(OSError):
    """The filesystem of the lock file does not support ``flock``."""


def locking() -> bool:
    """Whether this platform has ``flock`` at all (POSIX)."""
    return fcntl is not None


def take_lock(path: Path, blocking: bool = True):
    """An open handle holding the exclusive ``flock`` of the lock file ``path`` (created if absent);
    None when ``blocking`` is False and another process holds it. Raises OSError.

    Lock files are removed by :func:`kvcli.store.housekeeping.reclaim`, only while it holds them. A
    process that opened the file just before it was removed would lock a file no longer at ``path``:
    the inode is checked after locking, and the lock taken again on the file now there. Raises
    :class:`LocksUnsupported` where the filesystem has no ``flock``."""
    while True:
        handle = open(path, "a+b")
        if fcntl is None:
            return handle
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.close()
            return None
        except OSError as e:
            handle.close()
            if e.errno in _NO_LOCK_ERRNOS:
                raise LocksUnsupported(e.errno, e.strerror) from e
            raise
        except BaseException:
            handle.close()
            raise
        try:
            here, ours = os.stat(path), os.fstat(handle.fileno())
            if (here.st_ino, here.st_dev) == (ours.st_ino, ours.st_dev):
                return handle
        except FileNotFoundError:
            pass
        handle.close()  # removed (and maybe re-created) meanwhile: lock the file that is there now
