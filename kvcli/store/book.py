"""A stored book in the disk store: an entry written while the document is read, not after.

:meth:`kvcli.store.KVStore.fetch` computes a state in memory, then writes it. A book (InfLLM's
memory of a whole document, :mod:`kvcli.caches.book`) is larger than the memory a bounded read
may hold, so its entry is written as it is read: :func:`fetch_book` sizes it first (the layout is
fixed by the document's length), refuses it when it alone is over the store's cap or the disk's
free space (then the book is read into memory and not stored, with one line saying so), and
otherwise has the read write into a temporary file of the store, under the key's lock, which
becomes the entry by ``os.replace`` once the CRC-32 and the header are written. A read that fails
or is interrupted removes its temporary file (a killed one leaves it to the store's reclaim, like
any dead writer's): no partial entry is ever visible. A hit opens the entry in place
(:meth:`kvcli.caches.book.BookCache.open_entry`: CRC checked by reading it back, blocks read as
needed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from typing import Callable

from .. import notices
from ..files import file_mode
from .capacity import CAP_ENV, human
from .entries import META_KEY, header
from .keys import StoreKey
from .kvstore import Fetched, KVStore, Loaded

DISK_MARGIN = 256 << 20  # free disk space left to everything else


def no_room(store: KVStore, size: int) -> str | None:
    """Why an entry of ``size`` bytes cannot be stored (None: it can)."""
    if store.refuses(size):
        return f"over the cache cap ({human(store.max_bytes)}; --cache-max or {CAP_ENV})"
    where = store.root if store.root.exists() else store.root.parent
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(where).free
        if size > free - DISK_MARGIN:
            return f"more than the free disk space ({human(max(0, free))})"
    return None


def fetch_book(store: KVStore, key: StoreKey, read: Callable, size: int, meta: dict, what: str) -> tuple[object, Fetched]:
    """The book under ``key``: opened when stored, else ``read(path)`` into a new entry (or
    ``read(None)``: into memory, not stored). ``size``: the entry's bytes; ``what``: the book in
    words for the lines said to the user."""
    if not store.enabled:
        return _in_memory(read)
    t0 = time.perf_counter()
    hit = store.load(key)
    if hit is not None:
        return hit.cache, store.served(hit, t0)
    with store.lock(key.digest):
        hit = store.load(key)  # another process may have stored it meanwhile
        if hit is not None:
            return hit.cache, store.served(hit, t0)
        if not store.enabled:
            return _in_memory(read)
        why = no_room(store, size)
        if why is not None:
            notices.warn(f"storing {what} would take {human(size)}, {why}: answering without storing it "
                         "(every question reads the document again)", key=("book-no-room", key.digest))
            return _in_memory(read)
        path = store.path_of(key.digest)
        try:
            store.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=store.root)
            os.close(fd)
        except OSError as e:
            store.turn_off(e)
            return _in_memory(read)
        notices.warn(f"storing {what} in the disk store for later questions: {human(size)}", key=("book-store", key.digest))
        t1 = time.perf_counter()
        try:
            book = read(tmp)
            seconds = time.perf_counter() - t1
            storage = book.storage
            full_meta = header(key, meta, book.kind, book.facts(), storage.specs, storage.crc32(), seconds)
            storage.finish({META_KEY: json.dumps(full_meta, sort_keys=True)})
            os.chmod(tmp, file_mode())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        storage.path = str(path)
        entry_bytes = path.stat().st_size
        store.remember(key.digest, Loaded(book, full_meta, entry_bytes, path))
        store.make_room(path)  # the others that must go for it to fit under the cap
    return book, Fetched("miss", seconds, entry_bytes=entry_bytes, key=key.digest)


def _in_memory(read: Callable) -> tuple[object, Fetched]:
    t0 = time.perf_counter()
    book = read(None)
    return book, Fetched("off", time.perf_counter() - t0)
