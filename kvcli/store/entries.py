"""An entry of the store: one safetensors file, written whole and checked whole when read.

One entry is one file, ``<cache_dir>/kv/<key>.safetensors``: the tensors of the cache plus, in the
safetensors header, a JSON document (``metadata["kvcli"]``, :func:`header`) with what the key
hashes, the shapes, a CRC-32 of the tensor bytes and facts for ``kvcli cache ls``. Data, never
code: no pickle.

Writes go to a temporary file in the same folder, then ``os.replace`` (:func:`write_entry`):
readers see the old entry or the new one, never half a file. The bytes are serialised by kvcli
itself straight into that temporary file (:func:`kvcli.files.write_safetensors`: no library writes
a temporary file of its own beside it). Every read (:func:`read_entry`) checks the JSON, the format
version, the key, the tensor names, shapes, dtypes and CRC-32 and the cache's own consistency;
anything wrong raises :class:`DamagedEntry`.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import one_line
from ..files import safetensors_metadata, safetensors_size, save_safetensors_atomic
from ..resume_points import read_progress
from .keys import FORMAT_VERSION, SUFFIX, StoreKey, digest_of, held_bytes, is_partial

if TYPE_CHECKING:
    import torch

META_KEY = "kvcli"  # the safetensors metadata field holding the entry's JSON


class DamagedEntry(Exception):
    """A store file that cannot be trusted (torn, corrupted, foreign, old format)."""


class OtherFormat(DamagedEntry):
    """A store file whose KV is in a format this kvcli does not read (another codec or version): a
    miss, never decoded."""


def check_format(meta: dict) -> None:
    """Raise :class:`OtherFormat` unless the header ``meta`` names this kvcli's store format and
    its KV's codec (:func:`kvcli.caches.quant.other_format`)."""
    from ..caches.quant import other_format  # PyTorch only when an entry is read: `kvcli cache ls` needs none

    if meta.get("format") != FORMAT_VERSION:
        raise OtherFormat(f"store format {meta.get('format')}, this kvcli's is {FORMAT_VERSION}")
    why = other_format((meta.get("fields") or {}).get("state"))
    if why is not None:
        raise OtherFormat(why)


def crc32(tensors: dict[str, torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes, by name (what an entry's header records)."""
    import torch

    crc = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        crc = zlib.crc32(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"", crc)
    return crc


def header(key: StoreKey, meta: dict, kind: str, facts: dict, specs: dict, crc: int, compute_s: float) -> dict:
    """The JSON an entry's header holds: ``meta`` (document, method, ... for ``cache ls``), the key
    and what it hashes, the cache's kind and facts, each tensor's dtype and shape (``specs``: name ->
    (dtype, shape)), the CRC-32 of the tensors and the seconds the state took to compute."""
    return {
        **meta,
        "format": FORMAT_VERSION,
        "key": key.digest,
        "fields": key.fields,
        "cache_kind": kind,
        "facts": facts,
        "tensors": {name: [str(dt), list(shape)] for name, (dt, shape) in specs.items()},
        "crc32": crc,
        "compute_s": round(compute_s, 4),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@dataclass
class Encoded:
    """An entry ready to be written: its tensors, its header's JSON and its size in bytes."""

    tensors: dict
    meta: dict
    size: int

    @property
    def metadata(self) -> dict[str, str]:
        return {META_KEY: json.dumps(self.meta, sort_keys=True)}


def encode(key: StoreKey, cache, meta: dict, compute_s: float) -> Encoded:
    """The entry of ``cache`` under ``key``, sized before a byte of it is written."""
    tensors, facts = cache.to_tensors()
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    full = header(key, meta, cache.kind, facts, specs, crc32(tensors), compute_s)
    out = Encoded(tensors, full, 0)
    out.size = safetensors_size(tensors, out.metadata)
    return out


def write_entry(path: Path, entry: Encoded) -> None:
    """Write ``entry`` to ``path`` atomically (temporary file + ``os.replace``). Raises OSError."""
    save_safetensors_atomic(path, entry.tensors, entry.metadata)


def read_entry(path: Path, key: StoreKey, device):
    """(cache, header JSON) of the entry at ``path`` for ``key``, its tensors on ``device``.
    Raises :class:`DamagedEntry` when anything differs from what ``key`` and the header say, and
    FileNotFoundError when it is gone. A stored book is opened in place
    (:attr:`~kvcli.caches.base.CacheBase.opens_in_place`, :meth:`~kvcli.caches.base.CacheBase.open_entry`)."""
    from safetensors import safe_open

    from ..caches import CACHE_TYPES

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(META_KEY, "null"))
            if not isinstance(meta, dict):
                raise DamagedEntry("no kvcli metadata")
            check_format(meta)  # before a byte of its KV is decoded
            if meta.get("key") != key.digest or meta.get("fields") != key.fields:
                raise DamagedEntry("it belongs to another key (model, document or method)")
            cls = CACHE_TYPES.get(meta.get("cache_kind"))
            if cls is None:
                raise DamagedEntry(f"unknown cache kind {meta.get('cache_kind')!r}")
            in_place = cls.opens_in_place  # read in place, as needed (its CRC checked there)
            expected = {} if in_place else meta.get("tensors")
            if not in_place and (not isinstance(expected, dict) or set(expected) != set(f.keys())):
                raise DamagedEntry("tensor names differ from its metadata")
            tensors = {}
            for name, (dtype, shape) in expected.items():
                t = f.get_tensor(name)
                if str(t.dtype) != dtype or list(t.shape) != shape:
                    raise DamagedEntry(f"tensor {name} is {t.dtype} {list(t.shape)}, metadata says {dtype} {shape}")
                tensors[name] = t
    except (DamagedEntry, FileNotFoundError):
        raise
    except Exception as e:  # safetensors' own errors (torn header, truncated data), bad JSON
        raise DamagedEntry(one_line(e)) from e
    if in_place:
        try:
            cache = cls.open_entry(path, meta)
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise DamagedEntry(one_line(e)) from e
    else:
        if crc32(tensors) != meta.get("crc32"):
            raise DamagedEntry("checksum mismatch")
        try:
            cache = cls.from_tensors(tensors, meta.get("facts") or {}, device=device)
        except (ValueError, KeyError, TypeError) as e:
            raise DamagedEntry(one_line(e)) from e
    if cache.n_tokens != key.fields["n_tokens"]:
        raise DamagedEntry(f"{cache.n_tokens} tokens, expected {key.fields['n_tokens']}")
    return cache, meta


def read_meta(path: Path) -> tuple[dict | None, str | None]:
    """(header JSON, None) of the store file at ``path``, or (None, why) when it cannot be read."""
    try:
        meta = json.loads(safetensors_metadata(path).get(META_KEY, "null"))
    except Exception as e:
        return None, one_line(e)
    return (meta, None) if isinstance(meta, dict) else (None, "no kvcli metadata")


@dataclass
class Entry:
    """One file of the store, as ``kvcli cache ls`` shows it."""

    path: Path
    size: int
    last_use: float  # mtime: set when written and on every hit
    meta: dict | None  # None: the header could not be read
    error: str | None = None
    partial: bool = False  # a book read that stopped (kvcli.store.book): never served, resumed
    read_tokens: int | None = None  # a partial entry: the tokens its read kept (None: none)
    reading: bool = False  # a partial entry being read into now (by a running kvcli process)
    # "kv": a KV entry (<cache_dir>/kv); "vectors": a document's page vectors (<cache_dir>/vectors);
    # "text": a document's extracted text (<cache_dir>/texts)
    kind: str = "kv"

    @property
    def key(self) -> str:
        return digest_of(self.path)

    def to_json(self) -> dict:
        meta = self.meta or {}
        return {
            "key": self.key,
            "kind": self.kind,
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
            "partial": self.partial,
            "read_tokens": self.read_tokens,
            "reading": self.reading,
        }


def _listed(folder: Path, make) -> list[Entry]:
    """``make(path, stat)`` for every file of ``folder`` ending in :data:`SUFFIX` (a file gone
    meanwhile is skipped), most recently used first."""
    out = []
    if not folder.is_dir():
        return out
    for path in folder.glob(f"*{SUFFIX}"):
        try:
            st = path.stat()
        except OSError:
            continue
        out.append(make(path, st))
    out.sort(key=lambda e: e.last_use, reverse=True)
    return out


def list_entries(root: Path) -> list[Entry]:
    """Every entry under the store folder ``root`` (partial ones included), most recently used first."""

    def make(path: Path, st) -> Entry:
        meta, error = read_meta(path)
        entry = Entry(path, held_bytes(path, st), st.st_mtime, meta, error, partial=is_partial(path))
        if entry.partial:
            entry.read_tokens = (read_progress(path) or {}).get("tokens")
        return entry

    return _listed(root, make)


def side_meta(path: Path, what: str) -> tuple[dict | None, str | None]:
    """(its ``about`` (JSON) with the header's key and format and ``method`` None, None) of a side
    folder's file (:func:`list_side`), or (None, why) when it cannot be read; ``what``: the file
    in words, for the why."""
    try:
        header = safetensors_metadata(path)
        about = json.loads(header.get("about") or "{}")
    except Exception as e:
        return None, one_line(e)
    if not isinstance(about, dict) or "key" not in header:
        return None, f"no {what} metadata"
    return {**about, "key": header["key"], "format": header.get("format"), "method": None}, None


def vectors_meta(path: Path) -> tuple[dict | None, str | None]:
    """(what ``kvcli cache`` shows of it, None) of a page-vectors file (``<cache_dir>/vectors``,
    :mod:`kvcli.retrieval.vectors` writes them): its header's key and format and its ``about``
    (the embedding model, the window size, the passages' count and, in files written since it is
    recorded, the document: ``document``, ``document_sha256``), the embedding model's name (its
    folder's, or the package's that ships it) as ``model_name`` and ``method`` None; or (None, why)
    when it cannot be read."""
    meta, error = side_meta(path, "page-vectors")
    if meta is None:
        return None, error
    model = Path(meta["model"]) if isinstance(meta.get("model"), str) and meta["model"] else None
    # the model's folder, or the package that ships it (its folder is ``<package>/model``)
    meta["model_name"] = None if model is None else model.parent.name if model.name == "model" else model.name
    meta["fields"] = {
        "state": {
            "kind": "vectors",
            "passages": meta.get("passages"),
            "embedded": meta.get("embedded"),  # the passages embedded so far (the rest when a question wants them)
            "window_words": meta.get("window_words"),
        }
    }
    return meta, None


def text_meta(path: Path) -> tuple[dict | None, str | None]:
    """(what ``kvcli cache`` shows of it, None) of an extracted text's file (``<cache_dir>/texts``,
    :mod:`kvcli.documents.kept` writes them): its header's key and format and its ``about`` (the
    document, ``document_sha256``, its kind and pages), ``model_name`` and ``method`` None; or
    (None, why) when it cannot be read."""
    meta, error = side_meta(path, "extracted-text")
    if meta is None:
        return None, error
    meta["model_name"] = None
    meta["fields"] = {"state": {"kind": "text", "pages": meta.get("pages"), "chars": meta.get("chars")}}
    return meta, None


META_READERS = {"kv": read_meta, "vectors": vectors_meta, "text": text_meta}  # an entry's kind -> its reader


def list_side(folder: Path, kind: str) -> list[Entry]:
    """Every file under the side folder ``folder`` (``<cache_dir>/vectors``, ``<cache_dir>/texts``)
    as an entry of ``kind`` ("vectors", "text"), most recently used first: the store counts them
    against its cap and ``kvcli cache`` lists and removes them beside the KV entries."""
    read = META_READERS[kind]

    def make(path: Path, st) -> Entry:
        meta, error = read(path)
        return Entry(path, st.st_size, st.st_mtime, meta, error, kind=kind)

    return _listed(folder, make)
