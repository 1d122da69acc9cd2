"""A stored book in the disk store: an entry written while the document is read, not after.

:meth:`kvcli.store.KVStore.fetch` computes a state in memory, then writes it. A book (InfLLM's
memory of a whole document, :mod:`kvcli.caches.book`) is larger than the memory a bounded read
may hold, so its entry is written as it is read: :func:`fetch_book` sizes it first (the layout is
fixed by the document's length), refuses it when it alone is over the store's cap or the disk's
free space (then the book is read into memory and not stored, with one line saying so), and
otherwise has the read write, under the key's lock, into the key's *partial entry*
``<key>.partial.safetensors`` (:class:`PartialRead`), which becomes the entry by ``os.replace``
once the CRC-32 and the header are written.

A read that stops (Ctrl-C, an error, a kill) keeps its partial entry: every
:data:`CHECKPOINT_EVERY_S` — and at once when it is interrupted rather than killed — the read
keeps where it stands (the end of its last chunk) in the file's resume region
(:mod:`kvcli.caches.bookfile`: two slots, each with a CRC-32, written after the rows they need
and an fsync, so a torn file resumes from the last whole point or, with none, starts over). The
next read of the same key resumes from there: the blocks already read are not read again, and the
book is the one an uninterrupted read gives, bit for bit. A partial entry is never served as a
whole one (its name differs); ``kvcli cache ls`` shows how far it got, and ``cache prune``, ``rm``
and the cap remove it like any entry, except while its read runs.

A hit opens the entry in place (:meth:`~kvcli.caches.base.CacheBase.open_entry`: CRC checked by
reading it back, blocks read as needed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable

from .. import notices
from ..caches.bookfile import Destination, FileStorage, InMemory
from ..errors import one_line
from ..files import file_mode
from ..resume_points import region_bytes
from .capacity import CAP_ENV, human
from .entries import META_KEY, DamagedEntry, check_format, header
from .keys import FORMAT_VERSION, StoreKey, partial_path
from .kvstore import Fetched, KVStore, Loaded

DISK_MARGIN = 256 << 20  # free disk space left to everything else
CHECKPOINT_EVERY_S = 30.0  # how often a read keeps where it stands (a kill loses at most this much)


def no_room(store: KVStore, key: StoreKey, size: int) -> str | None:
    """Why the book of ``size`` bytes under ``key`` cannot be stored (None: it can). Its partial
    entry, if any, is this entry's own: it counts neither against the cap nor against the disk."""
    partial = partial_path(store.root, key.digest)
    if store.refuses(size, exclude=partial):
        return f"over the cache cap ({human(store.max_bytes)}; --cache-max or {CAP_ENV})"
    where = store.root if store.root.exists() else store.root.parent
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(where).free
        held = 0
        with contextlib.suppress(OSError):
            held = partial.stat().st_blocks * 512  # what it holds already of its size
        if size - held > free - DISK_MARGIN:
            return f"more than the free disk space ({human(max(0, free))})"
    return None


def fetch_book(
    store: KVStore, key: StoreKey, read: Callable, size: int, meta: dict, what: str
) -> tuple[object, Fetched]:
    """The book under ``key``: opened when stored, else ``read(destination)`` into a new entry (a
    :class:`PartialRead`, resumed when an earlier read stopped), or ``read(None)``: into memory,
    not stored. ``size``: the entry's bytes; ``what``: the book in words for the lines said to the
    user."""
    if not store.enabled:
        return _in_memory(read)
    t0 = time.perf_counter()
    hit = store.load(key)
    if hit is not None:
        return hit.cache, store.served(hit, t0)
    with store.lock(key, meta) as owned:
        hit = store.load(key)  # another process may have stored it meanwhile
        if hit is not None:
            return hit.cache, store.served(hit, t0)
        if not store.enabled or not owned:  # not owned: a stopped holder may still write its partial entry
            return _in_memory(read)
        if recover_finished(store, key):  # a read killed after its last write, before its rename
            hit = store.load(key)
            if hit is not None:
                return hit.cache, store.served(hit, t0)
        store.miss(key)
        why = no_room(store, key, size)
        if why is not None:
            notices.warn(
                f"storing {what} would take {human(size)}, {why}: answering without storing it "
                "(every question reads the document again)",
                key=("book-no-room", key.digest),
            )
            return _in_memory(read)
        try:
            store.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            store.turn_off(e)
            return _in_memory(read)
        into = PartialRead(store, key, meta, what, size)
        book = read(into)
        seconds = into.seconds()
        entry_bytes = into.finish(book, seconds)
    if entry_bytes is None:  # read, not kept (the store turned off, or the file was removed under it)
        return book, Fetched("off", seconds)
    return book, Fetched("miss", seconds, entry_bytes=entry_bytes, key=key.digest)


def recover_finished(store: KVStore, key: StoreKey) -> bool:
    """Make the partial entry of ``key`` the entry when its read had finished: killed at any point of
    :meth:`PartialRead.finish` after the final header was written (before or after the resume
    region was cut off, before the rename). The header is the final one (no ``partial`` mark, this
    key, this format), the region is cut off if it was not, and the bytes' CRC-32 must be the
    header's; then renamed into place. Returns whether it was; the book is not read again."""
    path = partial_path(store.root, key.digest)
    if not path.exists():
        return False
    try:
        storage, metadata = FileStorage.open(path, writable=True)
    except (OSError, ValueError):
        return False
    try:
        head = json.loads(metadata.get(META_KEY, "null"))
        if (
            not isinstance(head, dict)
            or head.get("partial")
            or (head.get("key"), head.get("fields"))
            != (
                key.digest,
                key.fields,
            )
        ):
            return False
        check_format(head)
        if storage.resume_size:  # killed between the final header and the cut
            os.ftruncate(storage.fd, storage.resume_at)
            os.fsync(storage.fd)
        if storage.crc32() != head.get("crc32"):
            return False
        os.fsync(storage.fd)
    except (OSError, ValueError, DamagedEntry):
        return False
    finally:
        storage.close()
    try:
        os.replace(path, store.path_of(key.digest))
    except OSError:
        return False
    notices.warn(f"the read of {head.get('document') or 'a document'} that ended unrenamed was kept (not read again)")
    return True


class PartialRead(Destination):
    """A book read into the store's partial entry of ``key``: resumed where an earlier read of the
    key stopped, kept (where it stands) when this one stops, the entry once it ends (:meth:`finish`)."""

    def __init__(self, store: KVStore, key: StoreKey, meta: dict, what: str, size: int) -> None:
        self.store, self.key, self.meta, self.what, self.size = store, key, meta, what, size
        self.path = partial_path(store.root, key.digest)
        self.book = None
        self.point = None  # where the read stood at the end of its last chunk
        self.kept = 0  # tokens of the last point kept in the file
        self.seq = 0  # the number of the next point kept
        self.t0 = time.perf_counter()
        self.earlier_s = 0.0  # seconds the stopped reads it resumes took
        self.last = time.monotonic()  # when a point was last kept

    # --- Destination --------------------------------------------------------------------------
    def start(self, specs: dict, room: int, new: Callable) -> object:
        book = self._resume(specs, room, new)
        if book is None:
            head = {
                **self.meta,
                "format": FORMAT_VERSION,
                "key": self.key.digest,
                "fields": self.key.fields,
                "cache_kind": "book",
                "partial": True,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            try:
                storage = FileStorage.create(self.path, specs, room, {META_KEY: json.dumps(head, sort_keys=True)})
                os.chmod(self.path, file_mode())  # not 0600: in a cache shared by a group, others resume it too
            except OSError as e:  # read-only, full disk: in memory, not stored
                self.store.turn_off(e)
                return InMemory().start(specs, room, new)
            notices.warn(
                f"storing {self.what} in the disk store for later questions: {human(self.size)}",
                key=("book-store", self.key.digest),
            )
            book = new(storage)
        self.book = book
        self.t0 = time.perf_counter()
        return book

    def _resume(self, specs: dict, room: int, new: Callable):
        """The book of the partial entry, where its read stopped; None when there is none to resume
        (none kept a point yet: started over; damaged: said, started over)."""
        if not self.path.exists():
            return None
        storage = None
        try:
            storage, metadata = FileStorage.open(self.path, writable=True)
            head = json.loads(metadata.get(META_KEY, "null"))
            mine = (self.key.digest, self.key.fields)
            if not isinstance(head, dict) or (head.get("key"), head.get("fields")) != mine:
                raise ValueError("it belongs to another key")
            if storage.specs != specs or storage.resume_size != region_bytes(room):
                raise ValueError("its layout differs")
            slot = storage.latest_slot()
            if slot is None:  # stopped before it kept a point: nothing to resume
                storage.close()
                return None
            book = new(storage)
            facts = book.resume(slot[1])
        except (ValueError, KeyError, TypeError, OSError) as e:
            if storage is not None:
                storage.close()
            notices.warn(
                f"the partial read of {self.what} in the disk store is damaged ({one_line(e)}); "
                "reading it from the start"
            )
            return None
        self.seq, self.kept, self.point = slot[0] + 1, book.n_tokens, None
        self.earlier_s = float(facts.get("seconds", 0.0))
        n = self.key.fields["n_tokens"]
        notices.warn(
            f"resuming the read of {self.what} at {book.n_tokens:,}/{n:,} tokens "
            f"({100 * book.n_tokens / max(1, n):.0f}%): an earlier read stopped there",
            key=("book-resume", self.key.digest),
        )
        self.store.watcher.resumed(book.n_tokens, n)
        return book

    def reached(self, book) -> None:
        if self.book is None:  # read in memory (its file could not be made)
            return
        self.point = book.read_point()
        self.store.progress(book.n_tokens)
        if time.monotonic() - self.last >= CHECKPOINT_EVERY_S:
            self._keep()

    def interrupted(self) -> None:
        """Keep the end of the last chunk read (best effort: the read is stopping anyway)."""
        if self.point is not None and self.point.tokens > self.kept:
            with contextlib.suppress(Exception):
                self._keep()

    def _keep(self) -> None:
        """Keep the last point: its rows into the file, fsync, then the point into a slot (fsync)."""
        point, storage = self.point, self.book.storage
        payload = self.book.save_point(point, {"seconds": round(self.seconds(), 4)})
        storage.sync()
        storage.write_slot(self.seq, payload)
        self.seq, self.kept, self.last = self.seq + 1, point.tokens, time.monotonic()

    # --- the end of the read ------------------------------------------------------------------
    def seconds(self) -> float:
        """Seconds the read took, the stopped reads it resumed included."""
        return self.earlier_s + time.perf_counter() - self.t0

    def finish(self, book, seconds: float) -> int | None:
        """Make the read book the entry: its header (the CRC-32 of its bytes, read back), the
        resume region cut off, renamed into place; the memo; room made under the cap. Returns the
        entry's size; None when it could not be kept (the book still answers)."""
        storage = book.storage
        if not isinstance(storage, FileStorage):  # its file could not be made: read in memory
            return None
        entry = self.store.path_of(self.key.digest)
        try:
            full = header(self.key, self.meta, book.kind, book.facts(), storage.specs, storage.crc32(), seconds)
            storage.finish({META_KEY: json.dumps(full, sort_keys=True)})
            os.replace(self.path, entry)
            entry_bytes = entry.stat().st_size
        except FileNotFoundError:  # removed under it (by hand: the store never removes a running read's)
            return None
        except OSError as e:  # full disk, read-only
            self.store.turn_off(e)
            return None
        storage.path = str(entry)
        self.store.remember(self.key.digest, Loaded(book, full, entry_bytes, entry))
        self.store.make_room(entry)  # the others that must go for it to fit under the cap
        return entry_bytes


def _in_memory(read: Callable) -> tuple[object, Fetched]:
    t0 = time.perf_counter()
    book = read(None)
    return book, Fetched("off", time.perf_counter() - t0)
