"""The disk store: prefix states kept between runs, so a second question costs a fraction of the first.

What is stored is a method's *prefix state* (:meth:`kvcli.compressors.base.Compressor.prefix_state`):
the KV of the question-agnostic start of the prompt (all layers for full attention, layers 0..r for
GemFilter, a compressed cache for question-agnostic methods). A new question runs only its own
tokens on top of it.

One entry is one file, ``<cache_dir>/kv/<key>.safetensors``: the tensors of the cache plus, in the
safetensors header, a JSON document (``metadata["kvcli"]``) with what the key hashes, the shapes,
a CRC-32 of the tensor bytes and facts for ``kvcli cache ls``. Data, never code: no pickle.

Keys (:func:`make_key`) hash everything that changes the state: the store format version, the
model fingerprint (weights, config, tokenizer and chat template, dtype, quantisation), the device
type and attention kernel, the prefix token ids (the document and the prompt template around it),
the method's state parameters (e.g. ``{"kind": "kv", "layers": 16}``: GemFilter's k does not
change what is stored, so ``gemfilter:k=256`` and ``gemfilter:k=512`` share an entry), and the
question's tokens only for states that depend on it.

Safety:

* writes go to a temporary file in the same folder, then ``os.replace`` — readers see the old
  entry or the new one, never half a file;
* an exclusive ``flock`` per key makes concurrent kvcli processes wait for the one computing an
  entry and then load it, instead of all computing it; the temporary file of an entry is only
  written while its key's lock is held. On a shared filesystem the lock holds across hosts where
  ``flock`` does (NFS, CephFS, Lustre with ``-o flock``); where ``flock`` fails (``ENOLCK``,
  ``EOPNOTSUPP``) the store runs without locks — one warning, and concurrent processes may compute
  an entry twice and keep one (each write is atomic) — and temporary files are reclaimed by age
  only; where it silently locks per host only, the same holds without the warning, and a writer
  whose temporary file another host reclaimed just does not keep its entry;
* nothing is left behind: an entry is serialised by kvcli itself straight into its temporary file
  (:func:`kvcli.files.write_safetensors`: no library writes a temporary file of its own beside it); opening the
  store (and ``kvcli cache prune`` / ``rm --all``) removes the temporary files of writers that died
  (their key's lock is free — a killed process holds no lock), any other file that is not an entry
  once nobody has written to it for a while, and the lock files nobody holds (:meth:`KVStore.reclaim`);
  ``kvcli cache info`` counts every byte of them; a lock file is only removed
  by a process holding it, and a process that took the lock of a file since removed takes it again;
* every load checks the JSON, the format version, the key, the tensor names, shapes, dtypes and
  CRC-32 and the cache's own consistency; anything wrong is a warning, the entry is dropped and the
  state recomputed — never a crash or a wrong answer;
* a cache directory that cannot be created or written (read-only, full disk) turns the store off
  for the rest of the run, with one warning.

Size: the store is capped (:func:`resolve_cap`; ``KVCLI_CACHE_MAX`` / ``--cache-max``). After each
write the least recently used entries are removed until the store fits (:meth:`KVStore._enforce_cap`);
the default cap and why: :mod:`kvcli.capacity`. The KV is stored in the
dtype the model computes in: 16 bits on a GPU (bfloat16/float16), float32 on CPU.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import accelerator, notices
from .caches import CACHE_TYPES, KVCache
from .errors import one_line
from .capacity import CAP_ENV, SUFFIX, least_recently_used, parse_size  # noqa: F401  (kvcli.store.parse_size)
from .files import save_safetensors_atomic

FORMAT_VERSION = 1
_META_KEY = "kvcli"
_STALE_TEMP_S = 3600.0  # a temporary file not named after a key is removed after this long
_IDLE_FOREIGN_S = 60.0  # ... and by ``kvcli cache prune`` / ``rm --all`` after this long unwritten
# the temporary file of an entry: ``.<key>.safetensors.<random>.tmp`` (kvcli.files.atomic_write)
_TEMP_NAME = re.compile(r"^\.([0-9a-f]{64})" + re.escape(SUFFIX) + r"\..+\.tmp$")

try:  # POSIX advisory locks; elsewhere concurrent runs may compute an entry twice (still safe)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

# what flock raises on a filesystem without (working) locks: some NFS mounts, FUSE, SMB
_NO_LOCK_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


class LocksUnsupported(OSError):
    """The filesystem of the lock file does not support ``flock``."""


# --------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class StoreKey:
    digest: str  # sha256 hex of the canonical JSON of ``fields``
    fields: dict  # everything the entry depends on


def _ids_digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def make_key(lm, prefix_ids: torch.Tensor, state: dict, question_ids: torch.Tensor | None = None) -> StoreKey:
    """The key of the prefix state ``state`` of ``prefix_ids`` (n,) for the model ``lm``."""
    fields = {
        "format": FORMAT_VERSION,
        "model": lm.fingerprint,
        "device": lm.device.type,
        "attn": lm.attn,
        "tokens": _ids_digest(prefix_ids),
        "n_tokens": int(prefix_ids.numel()),
        "state": state,
        "question": None if question_ids is None else _ids_digest(question_ids),
    }
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return StoreKey(hashlib.sha256(canonical.encode()).hexdigest(), fields)


# --------------------------------------------------------------------------- entries


@dataclass
class Entry:
    """One file of the store, as ``kvcli cache ls`` shows it."""

    path: Path
    size: int
    last_use: float  # mtime: set when written and on every hit
    meta: dict | None  # None: the header could not be read
    error: str | None = None

    @property
    def key(self) -> str:
        return self.path.name[: -len(SUFFIX)]

    def to_json(self) -> dict:
        meta = self.meta or {}
        return {
            "key": self.key,
            "path": str(self.path),
            "size_bytes": self.size,
            "last_use": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.last_use)),
            "document": meta.get("document"),
            "document_sha256": meta.get("document_sha256"),
            "model": meta.get("model_name"),
            "method": meta.get("method"),
            "state": (meta.get("fields") or {}).get("state"),
            "n_tokens": (meta.get("fields") or {}).get("n_tokens"),
            "compute_s": meta.get("compute_s"),
            "created": meta.get("created"),
            "error": self.error,
        }


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


class DamagedEntry(Exception):
    """A store file that cannot be trusted (torn, corrupted, foreign, old format)."""


def _crc32(tensors: dict[str, torch.Tensor]) -> int:
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        crc = zlib.crc32(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"", crc)
    return crc


def _take_lock(path: Path, blocking: bool = True):
    """An open handle holding the exclusive ``flock`` of the lock file ``path`` (created if absent);
    None when ``blocking`` is False and another process holds it. Raises OSError.

    Lock files are removed by :meth:`KVStore.reclaim`, only while it holds them. A process that
    opened the file just before it was removed would lock a file no longer at ``path``: the
    inode is checked after locking, and the lock taken again on the file now there. Raises
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


@dataclass
class Leftovers:
    """Files of the store that are not entries: temporary files (with their bytes) and lock files."""

    temp_files: int = 0
    temp_bytes: int = 0
    lock_files: int = 0


# --------------------------------------------------------------------------- the store


_HOST = torch.device("cpu")


def _on(cache, device, room: int = 0):
    """The memo (the last entry read or written, kept for the next question) lives on the host: on
    an accelerator the question's copy of the prefix would otherwise hold its KV a second time
    there. Each fetch for an accelerator gets its own upload (nothing else holds it); on the CPU
    the memo itself, as before. A plain KV is uploaded into buffers with ``room`` more entries
    per layer (the question and the answer append in place, :meth:`KVCache.upload`); a stored
    book moves per use (its own entry, opened in place)."""
    if not accelerator.on_accelerator(device) or hasattr(cache, "open_entry"):
        return cache
    if type(cache) is KVCache and cache.kept is None:
        return cache.upload(device, room)
    return type(cache).from_tensors(*cache.to_tensors(), device=device)


@dataclass
class KVStore:
    root: Path  # <cache_dir>/kv
    enabled: bool = True
    _memo: tuple[str, object] | None = field(default=None, repr=False)
    reclaimed: Leftovers = field(default_factory=Leftovers)  # what opening removed (kvcli cache info)
    max_bytes: int | None = None  # the cap enforced after each write (None: none)

    @classmethod
    def open(cls, cache_dir: Path, max_bytes: int | None = None) -> "KVStore":
        """The store under ``cache_dir``, after removing what killed runs left in it (:meth:`reclaim`).
        ``max_bytes``: its cap (:func:`resolve_cap`; None: no cap)."""
        store = cls(Path(cache_dir).expanduser() / "kv", max_bytes=max_bytes)
        store.reclaimed = store.reclaim()
        return store

    # --- the one call the pipeline makes ------------------------------------------------------
    def fetch(self, key: StoreKey, compute: Callable[[], object], meta: dict, device="cpu", room: int = 0) -> tuple[object, Fetched]:
        """The state under ``key``: loaded when a valid entry exists, else ``compute()`` d and saved.
        ``room``: entries a plain KV uploaded to an accelerator leaves per layer for what follows it.

        ``meta``: facts about the entry for ``cache ls`` (document, method, ...). Never raises
        because of the store itself: a broken or unwritable store only costs the recomputation.
        """
        if not self.enabled:
            return self._compute(compute, "off")
        t0 = time.perf_counter()
        hit = self._try_load(key, device, room)
        if hit is not None:
            return hit[0], self._hit(hit, t0)
        with self._lock(key.digest):
            hit = self._try_load(key, device, room)  # another process may have written it meanwhile
            if hit is not None:
                return hit[0], self._hit(hit, t0)
            cache, fetched = self._compute(compute, "miss")
            if self.enabled:
                fetched.entry_bytes = self._save(key, cache, meta, fetched.seconds, device)
                fetched.key = key.digest
            if not self.enabled:  # the lock or the write failed: the store is off from now on
                fetched.status, fetched.entry_bytes, fetched.key = "off", None, None
        return cache, fetched

    def _compute(self, compute, status: str) -> tuple[object, Fetched]:
        t0 = time.perf_counter()
        cache = compute()
        return cache, Fetched(status, time.perf_counter() - t0)

    def _hit(self, hit, t0: float) -> Fetched:
        cache, meta, size, path = hit
        seconds = time.perf_counter() - t0
        with contextlib.suppress(OSError):
            os.utime(path)  # last use, for prune
        compute_s = meta.get("compute_s")
        saved = max(0.0, float(compute_s) - seconds) if isinstance(compute_s, (int, float)) else None
        return Fetched("hit", seconds, saved, size, meta.get("key"))

    # --- paths and failure handling -------------------------------------------------------------
    def path_of(self, digest: str) -> Path:
        return self.root / f"{digest}{SUFFIX}"

    def _disable(self, exc: BaseException) -> None:
        self.enabled = False
        notices.warn(
            f"cannot write to the cache directory {self.root} ({one_line(exc)}); running without the disk cache",
            key=("cache-dir", str(self.root.parent)),
        )

    @contextlib.contextmanager
    def _lock(self, digest: str) -> Iterator[None]:
        """Exclusive per-key lock across processes (a no-op when it cannot be taken)."""
        handle = None
        try:
            locks = self.root / "locks"
            locks.mkdir(parents=True, exist_ok=True)
            handle = _take_lock(locks / f"{digest}.lock")
        except LocksUnsupported as e:  # compute without the lock: maybe twice, one entry kept
            notices.warn(
                f"the cache directory {self.root} has no file locks ({e.strerror}); concurrent kvcli processes "
                "may compute an entry twice (one is kept)",
                key=("cache-no-locks", str(self.root)),
            )
        except OSError as e:
            if handle is not None:
                handle.close()
                handle = None
            self._disable(e)
        try:
            yield
        finally:
            if handle is not None:
                handle.close()  # releases the flock

    # --- load -----------------------------------------------------------------------------------
    def _try_load(self, key: StoreKey, device, room: int = 0):
        """(cache, meta, size, path) of a valid entry; None when absent or damaged (then removed)."""
        if self._memo is not None and self._memo[0] == key.digest:
            path = self.path_of(key.digest)
            with contextlib.suppress(OSError):
                cache, meta, size = self._memo[1]
                if path.stat().st_size == size:  # still there: the memo is that file
                    return _on(cache, device, room), meta, size, path
            self._memo = None
        path = self.path_of(key.digest)
        try:
            size = path.stat().st_size
        except OSError:
            return None
        try:
            cache, meta = self._read(path, key, _HOST if accelerator.on_accelerator(device) else device)
        except DamagedEntry as e:
            notices.warn(f"cache entry {path.name} is damaged ({e}); recomputing it")
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        except OSError:
            return None  # vanished (pruned by another process) or unreadable: recompute
        self._memo = (key.digest, (cache, meta, size))
        return _on(cache, device, room), meta, size, path

    def _read(self, path: Path, key: StoreKey, device):
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
                meta = json.loads(header.get(_META_KEY, "null"))
                if not isinstance(meta, dict):
                    raise DamagedEntry("no kvcli metadata")
                if meta.get("format") != FORMAT_VERSION:
                    raise DamagedEntry(f"store format {meta.get('format')}, expected {FORMAT_VERSION}")
                if meta.get("key") != key.digest or meta.get("fields") != key.fields:
                    raise DamagedEntry("it belongs to another key (model, document or method)")
                lazy = getattr(CACHE_TYPES.get(meta.get("cache_kind")), "open_entry", None)
                expected = meta.get("tensors")
                if lazy is not None:  # read in place, as needed (a stored book: kvcli.bookstore)
                    expected = {}
                elif not isinstance(expected, dict) or set(expected) != set(f.keys()):
                    raise DamagedEntry("tensor names differ from its metadata")
                tensors = {}
                for name, (dtype, shape) in expected.items():
                    t = f.get_tensor(name)
                    if str(t.dtype) != dtype or list(t.shape) != shape:
                        raise DamagedEntry(f"tensor {name} is {t.dtype} {list(t.shape)}, metadata says {dtype} {shape}")
                    tensors[name] = t
        except DamagedEntry:
            raise
        except FileNotFoundError:
            raise
        except Exception as e:  # safetensors' own errors (torn header, truncated data), bad JSON
            raise DamagedEntry(one_line(e)) from e
        if lazy is not None:
            try:
                cache = lazy(path, meta)
            except (ValueError, KeyError, TypeError, OSError) as e:
                raise DamagedEntry(one_line(e)) from e
            if cache.n_tokens != key.fields["n_tokens"]:
                raise DamagedEntry(f"{cache.n_tokens} tokens, expected {key.fields['n_tokens']}")
            return cache, meta
        if _crc32(tensors) != meta.get("crc32"):
            raise DamagedEntry("checksum mismatch")
        cls = CACHE_TYPES.get(meta.get("cache_kind"))
        if cls is None:
            raise DamagedEntry(f"unknown cache kind {meta.get('cache_kind')!r}")
        try:
            cache = cls.from_tensors(tensors, meta.get("facts") or {}, device=device)
        except (ValueError, KeyError, TypeError) as e:
            raise DamagedEntry(one_line(e)) from e
        if cache.n_tokens != key.fields["n_tokens"]:
            raise DamagedEntry(f"{cache.n_tokens} tokens, expected {key.fields['n_tokens']}")
        return cache, meta

    # --- save -----------------------------------------------------------------------------------
    def _save(self, key: StoreKey, cache, meta: dict, compute_s: float, device=None) -> int | None:
        """Write the entry atomically; returns its size, or None when the store had to turn off."""
        tensors, facts = cache.to_tensors()
        full_meta = {
            **meta,
            "format": FORMAT_VERSION,
            "key": key.digest,
            "fields": key.fields,
            "cache_kind": cache.kind,
            "facts": facts,
            "tensors": {name: [str(t.dtype), list(t.shape)] for name, t in tensors.items()},
            "crc32": _crc32(tensors),
            "compute_s": round(compute_s, 4),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        path = self.path_of(key.digest)
        try:
            save_safetensors_atomic(path, tensors, {_META_KEY: json.dumps(full_meta, sort_keys=True)})
            size = path.stat().st_size
        except FileNotFoundError:
            if not self.root.is_dir():
                self._disable(OSError(f"{self.root} was removed"))
            # else: our temporary file was reclaimed by a process that could not see our lock (a
            # host where flock is per host): the entry is not kept this time, the store stays on
            return None
        except Exception as e:  # read-only, full disk, quota (safetensors wraps some I/O errors)
            self._disable(e)
            return None
        # the memo stays on the host (see _on): the tensors just written are host copies already
        memo = type(cache).from_tensors(tensors, facts, device=_HOST) if accelerator.on_accelerator(device) else cache
        self._memo = (key.digest, (memo, full_meta, size))
        self._enforce_cap(path)
        return size

    def _enforce_cap(self, written: Path) -> None:
        """Remove least recently used entries until the store fits in ``max_bytes``; the entry just
        ``written`` goes last, and only when it alone is over the cap (one warning)."""
        if self.max_bytes is None:
            return
        files = []
        for path in self.root.glob(f"*{SUFFIX}"):
            with contextlib.suppress(OSError):
                st = path.stat()
                # the new entry counts as the most recently used whatever the clock granularity
                files.append((path, st.st_size, math.inf if path == written else st.st_mtime))
        over = least_recently_used(files, self.max_bytes, size=lambda f: f[1], last_use=lambda f: f[2])
        self.remove([Entry(path, size, 0.0, None) for path, size, _ in over])
        size = next((size for path, size, _ in over if path == written), None)
        if size is not None:
            notices.warn(
                f"a {size / 2**20:,.0f} MiB cache entry is over the cache cap ({self.max_bytes / 2**20:,.0f} MiB) and was not kept; "
                f"raise it with --cache-max or {CAP_ENV} (e.g. 20G, or none)",
                key=("cache-cap", self.max_bytes),
            )

    # --- kvcli cache ls / rm / prune -----------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every entry, most recently used first."""
        from safetensors import safe_open

        out = []
        if not self.root.is_dir():
            return out
        for path in self.root.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            meta, error = None, None
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = json.loads((f.metadata() or {}).get(_META_KEY, "null"))
                if not isinstance(meta, dict):
                    meta, error = None, "no kvcli metadata"
            except Exception as e:
                error = one_line(e)
            out.append(Entry(path, st.st_size, st.st_mtime, meta, error))
        out.sort(key=lambda e: e.last_use, reverse=True)
        return out

    def remove(self, entries: list[Entry]) -> int:
        """Delete ``entries``; returns the bytes freed."""
        freed = 0
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                e.path.unlink()
                freed += e.size
        if self._memo is not None and not self.path_of(self._memo[0]).exists():
            self._memo = None
        return freed

    def prune(self, max_bytes: int) -> tuple[list[Entry], Leftovers]:
        """Remove least recently used entries (and damaged ones) until the store fits in
        ``max_bytes``, and what killed runs left behind; returns (entries removed, leftovers removed)."""
        entries = self.entries()
        removed = [e for e in entries if e.error]
        removed += least_recently_used([e for e in entries if not e.error], max_bytes, size=lambda e: e.size, last_use=lambda e: e.last_use)
        self.remove(removed)
        return removed, self.reclaim(explicit=True)

    def reclaim(self, explicit: bool = False) -> Leftovers:
        """Remove the temporary files of writers that died, any other file of the store's folder
        that is not an entry, and the lock files nobody holds.

        An entry's temporary file is written only while its key's lock is held, and the kernel
        releases the lock of a killed process: a temporary file whose lock can be taken has no
        writer, whatever its age. Any other file directly under ``kv/`` that is not an entry (a
        ``.tmpXXXXXX`` the safetensors library left when kvcli wrote through it, a stray copy) has
        no lock to ask, so it goes by how long nobody wrote to it: an hour when a run opens the
        store, a minute for ``explicit`` (``kvcli cache prune`` / ``rm --all``); a file being
        written is never that idle. Lock files nobody holds are removed (while holding them).
        Files that cannot be removed (a read-only cache) are left. Returns what was removed."""
        out = Leftovers()
        if not self.root.is_dir():
            return out
        idle_limit = _IDLE_FOREIGN_S if explicit else _STALE_TEMP_S
        locks = set((self.root / "locks").glob("*.lock"))  # checking a temporary file may create its lock
        for path in _stray_files(self.root):
            try:
                size, mtime = (st := path.stat()).st_size, st.st_mtime
            except OSError:
                continue
            match = _TEMP_NAME.match(path.name)
            idle = time.time() - mtime
            if match is None or fcntl is None:  # not an entry's temporary file (or no locks here): by age
                if idle > (idle_limit if match is None else _STALE_TEMP_S) and _unlink(path):
                    out.temp_files, out.temp_bytes = out.temp_files + 1, out.temp_bytes + size
                continue
            try:
                handle = _take_lock(self.root / "locks" / f"{match.group(1)}.lock", blocking=False)
            except LocksUnsupported:  # no locks on this filesystem: by age
                if idle > _STALE_TEMP_S and _unlink(path):
                    out.temp_files, out.temp_bytes = out.temp_files + 1, out.temp_bytes + size
                continue
            except OSError:
                continue  # cannot tell whether its writer lives: leave it
            if handle is None:
                continue  # its writer holds the lock: a write in progress
            with handle:
                if _unlink(path):
                    out.temp_files, out.temp_bytes = out.temp_files + 1, out.temp_bytes + size
        if fcntl is not None:
            for path in (self.root / "locks").glob("*.lock"):
                try:
                    handle = _take_lock(path, blocking=False)
                except OSError:
                    continue
                if handle is not None:
                    with handle:
                        if _unlink(path) and path in locks:
                            out.lock_files += 1
        return out

    def leftovers(self) -> Leftovers:
        """Every file of the store that is not an entry: temporary files (writes in progress, or
        not yet reclaimed, whatever their name) with their bytes, and lock files."""
        out = Leftovers()
        if not self.root.is_dir():
            return out
        for path in _stray_files(self.root):
            with contextlib.suppress(OSError):
                out.temp_bytes += path.stat().st_size
                out.temp_files += 1
        out.lock_files = sum(1 for _ in (self.root / "locks").glob("*.lock"))
        return out

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())


def _stray_files(root: Path) -> Iterator[Path]:
    """The files directly under ``root`` (the store's ``kv/``) that are not entries."""
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
