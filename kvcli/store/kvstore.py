"""The disk store: prefix states kept between runs, so a second question costs a fraction of the first.

What is stored is a method's *prefix state* (:meth:`kvcli.compressors.base.Compressor.prefix_state`):
the KV of the question-agnostic start of the prompt (all layers for full attention, layers 0..r for
GemFilter, a compressed cache for question-agnostic methods). A new question runs only its own
tokens on top of it. :class:`KVStore` is the one object the pipeline, the book store and the CLI
use; the jobs behind it each have a module of this package:

* keys and the file names they give: :mod:`.keys`;
* an entry's bytes, written atomically and checked whole when read: :mod:`.entries`;
* per-key locks across processes (concurrent kvcli processes wait for the one computing an entry
  and then load it, instead of all computing it): :mod:`.locks`;
* the cap (least recently used entries go) and its default: :mod:`.capacity`;
* what killed runs left (temporary files, lock files): :mod:`.housekeeping`;
* a book written while it is read (InfLLM): :mod:`.book`.

The retrieval's page vectors (``<cache_dir>/vectors``, :mod:`kvcli.retrieval.vectors` writes them)
and documents' extracted texts (``<cache_dir>/texts``, :mod:`kvcli.documents.kept`) are part of the
cache too (its *side folders*): listed as entries of kind "vectors" and "text", counted against the
cap and removed by the same policy (least recently used first), by ``prune`` and by ``rm``.

Safety: anything wrong with an entry is a warning, the entry is dropped and the state recomputed —
never a crash or a wrong answer; a cache directory that cannot be created or written (read-only,
full disk) turns the store off for the rest of the run, with one warning. Where ``flock`` fails
(``ENOLCK``, ``EOPNOTSUPP``) the store runs without locks — one warning, and concurrent processes may
compute an entry twice and keep one (each write is atomic) — and temporary files are reclaimed by
age only; where it silently locks per host only, the same holds without the warning, and a writer
whose temporary file another host reclaimed just does not keep its entry.

The last entry read or written is kept in memory for the next question (the *memo*). While it
answers, a run learns from the store through a :class:`Watcher` (:meth:`KVStore.watching`): that
it waits for another process computing the same entry (and how far that one is), that its prefix
came from the store, that a book read resumes; and it tells the store how far its own computation
is (:meth:`KVStore.progress`), for the processes waiting for it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .. import notices
from ..errors import one_line
from ..files import TEXTS_FOLDER, VECTORS_FOLDER
from . import entries as entry_files
from . import housekeeping
from .capacity import CAP_ENV, human, least_recently_used, room_for
from .entries import DamagedEntry, Entry, OtherFormat
from .housekeeping import Leftovers
from .keys import SUFFIX, StoreKey, digest_of, entry_path, held_bytes, is_partial, lock_path, other_formats
from .locks import (
    STALE_ENV,
    Heartbeat,
    Holder,
    LocksUnsupported,
    Staleness,
    read_holder,
    stale_after,
    take_lock,
    write_holder,
)

_FORMAT_SAID = False  # a run says once that the store holds a state in another format (KVStore.miss)
WAIT_POLL_S = 0.5  # how often a process waiting for another's lock looks again
PROGRESS_EVERY_S = 1.0  # how often a lock's holder says how far it is


@dataclass
class Fetched:
    """What :meth:`KVStore.fetch` did: ``status`` is hit, miss or off."""

    status: str
    seconds: float  # time to load (hit) or compute (miss, off)
    saved_s: float | None = None  # hit: the entry's compute time minus the load time
    entry_bytes: int | None = None
    key: str | None = None

    def to_json(self) -> dict:
        return {
            "status": self.status,
            "seconds": round(self.seconds, 4),
            "saved_s": None if self.saved_s is None else round(self.saved_s, 4),
            "entry_bytes": self.entry_bytes,
            "key": self.key,
        }


@dataclass
class Loaded:
    """A valid entry read (or taken from the memo): the state on the device asked for, its header's
    JSON, its size and its file."""

    cache: object
    meta: dict
    size: int
    path: Path


class Watcher:
    """What the store tells the run that uses it (:meth:`KVStore.watching`; kvcli.api shows it).
    Each method does nothing here."""

    def waiting(self, holder: Holder | None) -> None:
        """Another process holds the lock of the entry this one needs (None: it says nothing of
        itself); said again every :data:`WAIT_POLL_S` while it lasts."""

    def waited(self) -> None:
        """The wait is over: this process holds the lock now."""

    def loaded(self) -> None:
        """The prefix came from the store (a hit): none of it is read."""

    def resumed(self, done: int, total: int) -> None:
        """A book read resumes with ``done`` of its ``total`` tokens read by an earlier run."""


_HOST = "cpu"


def _on_accelerator(device) -> bool:
    """:func:`kvcli.runtime.accelerator.on_accelerator`, imported when an entry is read or written
    (PyTorch with it): listing the store (`kvcli cache ls`) imports none."""
    from ..runtime.accelerator import on_accelerator

    return on_accelerator(device)


def _on(cache, device, room: int = 0):
    """The memo (the last entry read or written, kept for the next question) lives on the host: on
    an accelerator the question's copy of the prefix would otherwise hold its KV a second time
    there. Each fetch for an accelerator gets its own upload (nothing else holds it); on the CPU
    the memo itself, as before. A plain KV is uploaded into buffers with ``room`` more entries
    per layer (the question and the answer append in place); a stored book moves per use (its
    own entry, opened in place): each layout says how (:meth:`kvcli.caches.base.CacheBase.for_device`)."""
    if not _on_accelerator(device):
        return cache
    return cache.for_device(device, room)


@dataclass
class KVStore:
    """The disk store under ``root`` (see the module doc): :meth:`fetch` for the pipeline, the
    building blocks of the book store (:mod:`kvcli.store.book`), the cap, and what the cache
    commands list and remove."""

    root: Path  # <cache_dir>/kv
    enabled: bool = True
    _memo: tuple[str, Loaded] | None = field(default=None, repr=False)  # (digest, the entry on the host)
    reclaimed: Leftovers = field(default_factory=Leftovers)  # what opening removed (kvcli cache info)
    max_bytes: int | None = None  # the cap: a new entry is kept only under it (None: no cap)
    watcher: Watcher = field(default_factory=Watcher, repr=False)
    _held: tuple | None = field(default=None, repr=False)  # (lock handle, Holder, when last said)

    @classmethod
    def open(cls, cache_dir: Path, max_bytes: int | None = None) -> KVStore:
        """The store under ``cache_dir``, after removing what killed runs left in it (:meth:`reclaim`).
        ``max_bytes``: its cap (:func:`kvcli.store.resolve_cap`; None: no cap)."""
        store = cls(Path(cache_dir).expanduser() / "kv", max_bytes=max_bytes)
        store.reclaimed = store.reclaim()
        return store

    # --- the one call the pipeline makes ------------------------------------------------------
    def fetch(
        self, key: StoreKey, compute: Callable[[], object], meta: dict, device="cpu", room: int = 0
    ) -> tuple[object, Fetched]:
        """The state under ``key``: loaded when a valid entry exists, else ``compute()`` d and saved.
        ``room``: entries a plain KV uploaded to an accelerator leaves per layer for what follows it.

        ``meta``: facts about the entry for ``cache ls`` (document, method, ...). Never raises
        because of the disk: a broken entry or an unwritable store (an OSError: read-only, full, a
        quota) only costs the recomputation; any other error is a bug and is raised.
        """
        if not self.enabled:
            return _compute(compute, "off")
        t0 = time.perf_counter()
        hit = self.load(key, device, room)
        if hit is not None:
            return hit.cache, self.served(hit, t0)
        with self.lock(key, meta):
            hit = self.load(key, device, room)  # another process may have written it meanwhile
            if hit is not None:
                return hit.cache, self.served(hit, t0)
            self.miss(key)
            cache, fetched = _compute(compute, "miss")
            if self.enabled:
                fetched.entry_bytes = self._save(key, cache, meta, fetched.seconds, device)
                fetched.key = key.digest
            if not self.enabled:  # the lock or the write failed: the store is off from now on
                fetched.status, fetched.entry_bytes, fetched.key = "off", None, None
        return cache, fetched

    # --- what the book store (kvcli.store.book) builds on -------------------------------------
    @property
    def side_dirs(self) -> dict[str, Path]:
        """The side folders' entries' kind -> their folder: the page vectors (``<cache_dir>/vectors``)
        and the extracted texts (``<cache_dir>/texts``), whose files are entries written whole by
        other modules (no lock, no partial), counted and removed with the KV entries."""
        return {"vectors": self.root.parent / VECTORS_FOLDER, "text": self.root.parent / TEXTS_FOLDER}

    def path_of(self, digest: str) -> Path:
        return entry_path(self.root, digest)

    def load(self, key: StoreKey, device="cpu", room: int = 0) -> Loaded | None:
        """The valid entry under ``key`` (the memo when it is that file), its state on ``device``;
        None when absent or damaged (then removed, with a warning)."""
        path = self.path_of(key.digest)
        if self._memo is not None and self._memo[0] == key.digest:
            memo = self._memo[1]
            with contextlib.suppress(OSError):
                if path.stat().st_size == memo.size:  # still there: the memo is that file
                    return Loaded(_on(memo.cache, device, room), memo.meta, memo.size, path)
            self._memo = None
        try:
            size = path.stat().st_size
        except OSError:
            return None
        try:
            cache, meta = entry_files.read_entry(path, key, _HOST if _on_accelerator(device) else device)
        except OtherFormat as e:  # a codec changed under the same name: never decoded, rewritten
            notices.warn(f"the disk cache's entry {path.name} is of another format ({e}); recomputing it")
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        except DamagedEntry as e:
            notices.warn(f"cache entry {path.name} is damaged ({e}); recomputing it")
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        except OSError:
            return None  # vanished (pruned by another process) or unreadable: recompute
        self.remember(key.digest, Loaded(cache, meta, size, path))
        return Loaded(_on(cache, device, room), meta, size, path)

    def miss(self, key: StoreKey) -> None:
        """``key`` is not stored: when the store holds the same state in another format (an older
        kvcli's codec or store format), say so, once a run; that entry is never decoded (the cap or
        ``kvcli cache prune`` removes it). Only the files the state's other formats would be named
        (:func:`kvcli.store.keys.other_formats`) are looked for: no other entry is read."""
        global _FORMAT_SAID
        if _FORMAT_SAID:
            return
        mine = _sans_format(key.fields)
        for digest in other_formats(key):
            path = self.path_of(digest)
            if not path.is_file():
                continue
            meta, _ = entry_files.read_meta(path)
            if not meta or not isinstance(meta.get("fields"), dict) or _sans_format(meta["fields"]) != mine:
                continue
            try:
                entry_files.check_format(meta)
            except OtherFormat as e:
                _FORMAT_SAID = True
                notices.warn(
                    f"the disk cache holds this document's KV in another format ({e}): not read; "
                    "reading the document again"
                )
                return

    def served(self, hit: Loaded, t0: float) -> Fetched:
        """The :class:`Fetched` of a hit loaded since ``t0``; marks the entry used (for the cap)."""
        seconds = time.perf_counter() - t0
        with contextlib.suppress(OSError):
            os.utime(hit.path)  # last use, for the cap and prune
        compute_s = hit.meta.get("compute_s")
        saved = max(0.0, float(compute_s) - seconds) if isinstance(compute_s, (int, float)) else None
        self.watcher.loaded()
        return Fetched("hit", seconds, saved, hit.size, hit.meta.get("key"))

    def remember(self, digest: str, entry: Loaded) -> None:
        """Keep ``entry`` (on the host) as the memo: the next question on it reads no file."""
        self._memo = (digest, entry)

    @property
    def memo(self) -> Loaded | None:
        """The entry kept in memory for the next question (None: none)."""
        return None if self._memo is None else self._memo[1]

    def forget(self) -> None:
        """Drop the memo: the next fetch reads its entry from the file."""
        self._memo = None

    def turn_off(self, exc: BaseException) -> None:
        """The cache directory cannot be written: run without the store from now on (one warning)."""
        self.enabled = False
        notices.warn(
            f"cannot write to the cache directory {self.root} ({one_line(exc)}); running without the disk cache",
            key=("cache-dir", str(self.root.parent)),
        )

    @contextlib.contextmanager
    def lock(self, key: StoreKey, meta: dict | None = None) -> Iterator[bool]:
        """Exclusive per-key lock across processes (a no-op when it cannot be taken: without
        ``flock`` one warning; any other failure turns the store off). While another process holds
        it the watcher hears what that one says of itself (:class:`Holder`); once taken, this one
        says it computes ``meta``'s document (and how far: :meth:`progress`) and beats
        (:class:`kvcli.store.locks.Heartbeat`). A holder whose lock file this process has seen
        unchanged for :func:`kvcli.store.locks.stale_after` seconds of its own monotonic clock
        (stopped, or on a host gone: :class:`kvcli.store.locks.Staleness`) is given up on,
        with one line: the block runs without the lock and yields False (then nothing may be written
        where the holder writes: a book is read into memory), else True."""
        handle, heartbeat, owned = None, None, True
        try:
            path = lock_path(self.root, key.digest)
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = take_lock(path, blocking=False)
            watch = Staleness(path) if handle is None else None
            while handle is None:  # another process computes it: say so, look again
                holder = read_holder(path)
                self.watcher.waiting(holder)
                silent = watch.silent()
                if silent > stale_after():
                    who = holder.describe() if holder is not None else "another kvcli process"
                    notices.warn(
                        f"{who} has given no sign of life for {silent:.0f}s (stopped or hung): not waiting for it, "
                        f"reading the document here (the wait: {STALE_ENV}, now {stale_after():g}s)",
                        key=("lock-stale", key.digest),
                    )
                    self.watcher.waited()
                    owned = False
                    break
                time.sleep(WAIT_POLL_S)
                handle = take_lock(path, blocking=False)
                if handle is not None:
                    self.watcher.waited()
            if handle is not None:
                holder = Holder.me((meta or {}).get("document"), key.fields.get("n_tokens"))
                write_holder(handle, holder)
                self._held = (handle, holder, time.monotonic())
                heartbeat = Heartbeat(path)
        except LocksUnsupported as e:  # compute without the lock: maybe twice, one entry kept
            notices.warn(
                f"the cache directory {self.root} has no file locks ({e.strerror}); concurrent kvcli processes "
                "may compute an entry twice (one is kept)",
                key=("cache-no-locks", str(self.root)),
            )
        except OSError as e:
            self.turn_off(e)
        try:
            yield owned
        finally:
            self._held = None
            if heartbeat is not None:
                heartbeat.stop()
            if handle is not None:
                handle.close()  # releases the flock

    @contextlib.contextmanager
    def watching(self, watcher: Watcher) -> Iterator[None]:
        """``watcher`` hears what the store does until the block ends."""
        self.watcher = watcher
        try:
            yield
        finally:
            self.watcher = Watcher()

    def progress(self, done: int) -> None:
        """This process has computed ``done`` tokens of the entry whose lock it holds: said in the
        lock file (at most every :data:`PROGRESS_EVERY_S`) for the processes waiting for it."""
        if self._held is None:
            return
        handle, holder, said = self._held
        now = time.monotonic()
        if now - said < PROGRESS_EVERY_S or handle.closed:
            return
        holder.done = min(done, holder.n_tokens) if holder.n_tokens else done
        write_holder(handle, holder)
        self._held = (handle, holder, now)

    # --- save -----------------------------------------------------------------------------------
    def _save(self, key: StoreKey, cache, meta: dict, compute_s: float, device=None) -> int | None:
        """Write the entry atomically, when the cap keeps it; returns its size, or None when it was
        not kept (over the cap: nothing else removed either; or the store had to turn off)."""
        entry = entry_files.encode(key, cache, meta, compute_s)
        if self.refuses(entry.size):
            notices.warn(
                f"a {human(entry.size)} cache entry is over the cache cap ({human(self.max_bytes)}) and was not kept "
                f"(no other entry was removed); raise it with --cache-max or {CAP_ENV} (e.g. 20G, or none)",
                key=("cache-cap", self.max_bytes),
            )
            return None
        path = self.path_of(key.digest)
        try:
            entry_files.write_entry(path, entry)
            size = path.stat().st_size
        except FileNotFoundError:
            if not self.root.is_dir():
                self.turn_off(OSError(f"{self.root} was removed"))
            # else: our temporary file was reclaimed by a process that could not see our lock (a
            # host where flock is per host): the entry is not kept this time, the store stays on
            return None
        except OSError as e:  # read-only, full disk, quota: the store is off (anything else is a bug: raised)
            self.turn_off(e)
            return None
        # the memo stays on the host (see _on): the tensors just written are host copies already
        host = (
            type(cache).from_tensors(entry.tensors, entry.meta["facts"], device=_HOST)
            if _on_accelerator(device)
            else cache
        )
        self.remember(key.digest, Loaded(host, entry.meta, size, path))
        self.make_room(path)
        return size

    # --- the cap (kvcli.store.capacity) ---------------------------------------------------------
    def _files(self, exclude: Path | None = None) -> list[tuple[Path, int, float, bool]]:
        """(path, size, last use, removable) of every entry file but ``exclude``, the side folders'
        files included: a partial entry whose read runs is not removable."""
        out = []
        for path in (p for folder in self.side_dirs.values() for p in folder.glob(f"*{SUFFIX}")):
            if path == exclude:
                continue
            with contextlib.suppress(OSError):
                st = path.stat()
                out.append((path, st.st_size, st.st_mtime, True))
        for path in self.root.glob(f"*{SUFFIX}"):
            if path == exclude:
                continue
            with contextlib.suppress(OSError):
                st = path.stat()
                removable = not (is_partial(path) and self.reading(path))
                out.append((path, held_bytes(path, st), st.st_mtime, removable))
        return out

    def reading(self, path: Path) -> bool:
        """Whether the partial entry ``path`` is being read into now (its key's lock is held)."""
        try:
            handle = take_lock(lock_path(self.root, digest_of(path)), blocking=False)
        except OSError:
            return False
        if handle is None:
            return True
        handle.close()
        return False

    def refuses(self, size: int, exclude: Path | None = None) -> bool:
        """Whether the cap keeps no entry of ``size`` bytes, whatever else goes (``exclude``: a file
        it replaces): then it is not written and nothing is removed for it."""
        if self.max_bytes is None:
            return False
        return room_for(self._files(exclude), size, self.max_bytes, _size, _last_use, _removable) is None

    def make_room(self, written: Path) -> None:
        """After the entry ``written`` was stored: remove the least recently used other entries
        until the store fits under the cap, and say what went (one line)."""
        if self.max_bytes is None:
            return
        try:
            size = written.stat().st_size
        except OSError:
            return
        over = room_for(self._files(written), size, self.max_bytes, _size, _last_use, _removable) or []
        if not over:
            return
        largest, n_largest, _, _ = max(over, key=_size)
        kind = next((k for k, folder in self.side_dirs.items() if largest.parent == folder), "kv")
        meta, _ = entry_files.META_READERS[kind](largest)  # its document, for the line said
        freed = self.remove([Entry(path, n, mtime, None) for path, n, mtime, _ in over])
        notices.warn(
            f"the cache cap ({human(self.max_bytes)}) made room for a {human(size)} entry: removed "
            f"{len(over)} least recently used {'entry' if len(over) == 1 else 'entries'}, {human(freed)} "
            f"(the largest: {_named(largest, meta)}, {human(n_largest)})",
            key=("cache-evicted", written.name, tuple(f[0].name for f in over)),
        )

    def next_evicted(self, entries: list[Entry]) -> Entry | None:
        """The entry of ``entries`` the cap removes first when a new one needs room (the least
        recently used, a partial one whose read runs aside); None when there is none."""
        return min((e for e in entries if not e.reading), key=lambda e: e.last_use, default=None)

    # --- kvcli cache ls / rm / prune -----------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every entry (partial ones and the side folders' files included), most recently used first."""
        out = entry_files.list_entries(self.root)
        for e in out:
            e.reading = e.partial and self.reading(e.path)
        for kind, folder in self.side_dirs.items():
            out += entry_files.list_side(folder, kind)
        out.sort(key=lambda e: e.last_use, reverse=True)
        return out

    def remove(self, entries: list[Entry]) -> int:
        """Delete ``entries`` (a partial one only while its read does not run); returns the bytes freed."""
        freed = housekeeping.remove(self.root, entries)
        if self._memo is not None and not self.path_of(self._memo[0]).exists():
            self._memo = None
        return freed

    def prune(self, max_bytes: int) -> tuple[list[Entry], Leftovers]:
        """Remove least recently used entries (and damaged ones) until the store fits in
        ``max_bytes``, and what killed runs left behind; returns (entries removed, leftovers removed)."""
        entries = self.entries()
        entries = [e for e in entries if not e.reading]  # a partial entry whose read runs stays
        removed = [e for e in entries if e.error]
        removed += least_recently_used(
            [e for e in entries if not e.error], max_bytes, size=lambda e: e.size, last_use=lambda e: e.last_use
        )
        self.remove(removed)
        return removed, self.reclaim(explicit=True)

    def reclaim(self, explicit: bool = False) -> Leftovers:
        """Remove what killed runs left (:func:`kvcli.store.housekeeping.reclaim`; in the side
        folders by age, :func:`kvcli.store.housekeeping.reclaim_by_age`)."""
        sides = (housekeeping.reclaim_by_age(folder, explicit) for folder in self.side_dirs.values())
        return housekeeping.added(housekeeping.reclaim(self.root, explicit), *sides)

    def leftovers(self) -> Leftovers:
        """Every file of the store (and of its side folders) that is not an entry
        (:func:`kvcli.store.housekeeping.leftovers`)."""
        sides = (housekeeping.leftovers(folder) for folder in self.side_dirs.values())
        return housekeeping.added(housekeeping.leftovers(self.root), *sides)

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())


def _size(f) -> int:
    return f[1]


def _last_use(f) -> float:
    return f[2]


def _removable(f) -> bool:
    return f[3]


def _named(path: Path, meta: dict | None) -> str:
    """An entry in words: its document's file name (stdin: "stdin"), else its key's start."""
    document = (meta or {}).get("document")
    if not document:
        return path.name[:12]
    return "stdin" if document == "-" else Path(document).name


def _sans_format(fields: dict) -> dict:
    """An entry's key fields less its format (store version, KV bits' codec): what two formats of
    the same state share."""
    state = fields.get("state")
    if isinstance(state, dict):
        state = {k: v for k, v in state.items() if k != "kv_codec"}
        state.setdefault("kv_bits", 16)
    return {**{k: v for k, v in fields.items() if k != "format"}, "state": state}


def _compute(compute, status: str) -> tuple[object, Fetched]:
    t0 = time.perf_counter()
    cache = compute()
    return cache, Fetched(status, time.perf_counter() - t0)
