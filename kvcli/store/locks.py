"""Per-key locks across processes: an exclusive ``flock`` on ``kv/locks/<key>.lock``.

A process computing an entry holds its key's lock; the others wait for it and then load the entry
instead of all computing it. The temporary file of an entry is only written while its key's lock
is held, and the kernel releases the lock of a killed process: a temporary file whose lock can be
taken has no writer (:func:`kvcli.store.housekeeping.reclaim`). On a shared filesystem the lock
holds across hosts where ``flock`` does (NFS, CephFS, Lustre with ``-o flock``); where ``flock``
fails (``ENOLCK``, ``EOPNOTSUPP``) :func:`take_lock` raises :class:`LocksUnsupported` and the store
runs without locks (:meth:`kvcli.store.KVStore.lock`).

The process holding a key's lock says in its lock file what it computes and how far it is (a
:class:`Holder`, JSON: data, never code), so that a process waiting for it can tell its user
which document it waits for instead of staying silent.

A holder also beats (:class:`Heartbeat`): a thread touches its lock file every
:data:`HEARTBEAT_S` (and every progress it says rewrites it). The kernel releases the lock of a
process that dies, but not of one stopped (``kill -STOP``, a suspended laptop's job) or on an NFS
client that went away: a waiter that has itself seen the holder's lock file unchanged (its mtime,
size and content: :func:`beat_of`) for :func:`stale_after` seconds of its own monotonic clock
(:data:`STALE_AFTER_S`, or ``$KVCLI_LOCK_STALE_S``, never under :func:`stale_floor`: a few
heartbeats) stops waiting, says so in one line and computes the state itself
(:meth:`kvcli.store.KVStore.lock`). The file's mtime is never compared with the waiter's clock: a
host whose clock is off, or a waiter that just arrived, still waits the whole period. A holder
whose process runs but whose work hangs still beats: that one is waited for.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

try:  # POSIX advisory locks; elsewhere concurrent runs may compute an entry twice (still safe)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

HEARTBEAT_S = 5.0  # how often a lock's holder touches its lock file
STALE_AFTER_S = 120.0  # a lock file seen unchanged this long: its holder is stopped or gone (a waiter reads itself)
STALE_ENV = "KVCLI_LOCK_STALE_S"  # overrides STALE_AFTER_S (seconds; never under stale_floor())
STALE_FLOOR_BEATS = 4  # the least stale_after(): this many heartbeats

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
        handle = open(path, "a+b")  # noqa: SIM115  (the open file is the lock: the caller holds it)
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


@dataclass
class Holder:
    """What the process holding a key's lock computes, written in its lock file."""

    pid: int
    host: str
    document: str | None  # the document's path ("-": stdin)
    n_tokens: int | None  # the prefix's tokens
    done: int | None  # tokens of it computed so far (None: unknown)
    since: float  # time.time() when it took the lock

    @classmethod
    def me(cls, document: str | None, n_tokens: int | None) -> Holder:
        return cls(os.getpid(), socket.gethostname(), document, n_tokens, None, time.time())

    def describe(self) -> str:
        """ "another kvcli process (pid 4242) reading book.pdf: 12,288/88,244 tokens (14%)"."""
        who = f"pid {self.pid}" + ("" if self.host == socket.gethostname() else f" on {self.host}")
        what = "stdin" if self.document == "-" else Path(self.document).name if self.document else "a document"
        text = f"another kvcli process ({who}) reading {what}"
        if self.done and self.n_tokens:
            text += f": {self.done:,}/{self.n_tokens:,} tokens ({100 * self.done / self.n_tokens:.0f}%)"
        else:
            took = max(0, int(time.time() - self.since))
            text += f" (for {took // 60}m {took % 60:02d}s)"
        return text


def write_holder(handle, holder: Holder) -> None:
    """Say ``holder`` in the lock file held open by ``handle`` (a reader may catch it half-written
    and then knows nothing more: :func:`read_holder`)."""
    try:
        handle.truncate(0)
        handle.write(json.dumps(asdict(holder)).encode())
        handle.flush()
    except OSError:
        pass  # a read-only lock folder: waiting processes just know less


def read_holder(path: Path) -> Holder | None:
    """What the holder of the lock file ``path`` says; None when it says nothing readable."""
    try:
        with open(path, "rb") as f:
            return Holder(**json.loads(f.read(4096)))
    except (OSError, ValueError, TypeError):
        return None


def stale_floor() -> float:
    """The least :func:`stale_after`: :data:`STALE_FLOOR_BEATS` heartbeats (20 s), so that a
    holder that beats is never given up on between two beats."""
    return STALE_FLOOR_BEATS * HEARTBEAT_S


def stale_after() -> float:
    """Seconds a waiter sees a lock file unchanged before it gives up on the lock's holder:
    ``$KVCLI_LOCK_STALE_S`` when it is a positive number (raised to :func:`stale_floor`), else
    :data:`STALE_AFTER_S`."""
    try:
        value = float(os.environ.get(STALE_ENV, ""))
    except ValueError:
        return STALE_AFTER_S
    return max(value, stale_floor()) if value > 0 else STALE_AFTER_S


def beat_of(path: Path) -> tuple | None:
    """What the lock file ``path`` looks like now (its inode, mtime, size and first bytes): a
    holder's heartbeat or progress changes it. Compared only with what the same waiter saw
    before (:class:`Staleness`), never with a clock. The file is opened, not only stat'ed: on NFS
    an open revalidates its attributes (close-to-open). None when it is gone."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            return (st.st_ino, st.st_dev, st.st_mtime_ns, st.st_size, f.read(4096))
    except OSError:
        return None


class Staleness:
    """A waiter's watch on the lock file ``path``: how long it has itself seen the file unchanged,
    on its own monotonic clock from its first look (:meth:`silent`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen = beat_of(path)
        self.since = time.monotonic()

    def silent(self) -> float:
        """Seconds this waiter has seen the lock file unchanged (0 when it just changed)."""
        now, beat = time.monotonic(), beat_of(self.path)
        if beat is None or beat != self.seen:
            self.seen, self.since = beat, now
        return now - self.since


class Heartbeat:
    """A thread touching the lock file ``path`` every :data:`HEARTBEAT_S` until :meth:`stop`: a
    stopped process stops beating with it."""

    def __init__(self, path: Path) -> None:
        import threading

        self.path = path
        self.every = HEARTBEAT_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcli-lock-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                os.utime(self.path)
            except OSError:
                pass  # removed (reclaimed after we let go) or read-only: nothing to say

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
