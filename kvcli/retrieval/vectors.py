"""A document's passage vectors, computed once and kept on disk beside the KV store's entries.

Each passage is cut into windows of :data:`WINDOW_WORDS` words (its last one shorter; a passage
under that is one window) and each window embedded (:mod:`.embed`); a passage's semantic score is
its best window's (a page answers the question when one part of it does). The vectors of a
document go to ``<cache_dir>/vectors/<key>.safetensors`` (``vectors``: float32 (windows, dim), unit
rows; ``owner``: int32, each window's passage), written atomically (:func:`kvcli.files.save_safetensors_atomic`),
with its key and format in the header and, in its ``about`` (JSON), the embedding model, the window
size, the passages' count and the document they came from (``document``, ``document_sha256``,
when the caller names it; files written before it say none). The disk store counts these files
against its cap and ``kvcli cache`` lists and removes them (:mod:`kvcli.store`): a hit marks the
file used (its mtime), so the cap removes the least recently used first, as it does KV entries. The key hashes everything that changes them: the
format, the model (its files' bytes: :attr:`Embedder.id`), the window size and the passages' texts
(the document and how it is cut into passages at once). A file that cannot be read, or whose
header is not this key's, is a miss: the vectors are computed again and the file replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..files import VECTORS_FOLDER, save_safetensors_atomic

FORMAT = 1  # the file's layout: bump when it changes (old files are then misses)
WINDOW_WORDS = (
    100  # what one window embeds: chosen on the tuning questions (200 words often ran past the model's 256 tokens)
)
FOLDER = VECTORS_FOLDER  # <cache_dir>/vectors


def windows(text: str, size: int = WINDOW_WORDS) -> list[str]:
    """The passage's words (whitespace-separated) in runs of ``size``, each joined by one space."""
    words = text.split()
    return [" ".join(words[i : i + size]) for i in range(0, len(words), size)] or [""]


def key(model_id: str, passages: list[str], size: int = WINDOW_WORDS) -> str:
    digest = hashlib.sha256(f"kvcli-vectors/{FORMAT}/{model_id}/{size}/{len(passages)}".encode())
    for text in passages:
        raw = text.encode("utf-8")
        digest.update(len(raw).to_bytes(8, "little") + raw)
    return digest.hexdigest()


def path_for(cache_dir: Path, digest: str) -> Path:
    return Path(cache_dir) / FOLDER / f"{digest}.safetensors"


def load(path: Path, digest: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(vectors, owner) from ``path`` when it holds this key's, else None (missing, damaged, another format)."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("key") != digest or meta.get("format") != str(FORMAT):
                return None
            vectors, owner = f.get_tensor("vectors"), f.get_tensor("owner")
    except Exception:  # noqa: BLE001 - any unreadable file is a miss
        return None
    if vectors.ndim != 2 or owner.shape != (vectors.shape[0],) or not np.isfinite(vectors).all():
        return None
    return vectors.astype(np.float32, copy=False), owner.astype(np.int64)


def save(path: Path, digest: str, vectors: np.ndarray, owner: np.ndarray, about: dict) -> bool:
    """Write the file atomically; a store that cannot be written only costs the recomputation next
    time. Returns whether it was written."""
    import torch

    meta = {"key": digest, "format": str(FORMAT), "about": json.dumps(about, sort_keys=True)}
    tensors = {"vectors": torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32)),
               "owner": torch.from_numpy(np.ascontiguousarray(owner, dtype=np.int32))}  # fmt: skip
    try:
        save_safetensors_atomic(path, tensors, meta)
    except OSError:
        return False
    return True


def passage_vectors(
    embedder,
    passages: list[str],
    cache_dir: Path | None,
    size: int = WINDOW_WORDS,
    *,
    document: dict | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    on_stored: Callable[[Path], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, str]:
    """Every window's vector and its passage, from the store when there (``cache_dir``: None
    computes them without storing); the third value says which: "hit", "computed".

    ``document``: what the file records of the document the passages came from (``document``: its
    path, ``document_sha256``), for ``kvcli cache ls`` and ``cache rm DOCUMENT``;
    ``on_progress(done, total)``: the windows embedded so far, while they are
    (:meth:`kvcli.retrieval.embed.Embedder.encode`); ``on_stored(path)``: the file was written
    (the disk store makes room for it under its cap)."""
    digest = key(embedder.id, passages, size)
    path = path_for(cache_dir, digest) if cache_dir is not None else None
    if path is not None and (found := load(path, digest)) is not None:
        with contextlib.suppress(OSError):
            os.utime(path)  # last use, for the cap (least recently used first)
        return *found, "hit"
    cut = [windows(p, size) for p in passages]
    owner = np.array([i for i, ws in enumerate(cut) for _ in ws], dtype=np.int64)
    texts = [w for ws in cut for w in ws]
    vectors = embedder.encode(texts, on_progress=on_progress)
    if path is not None:
        about = {"model": str(embedder.folder), "window_words": size, "passages": len(passages)}
        about.update({k: v for k, v in (document or {}).items() if k in ("document", "document_sha256") and v})
        if save(path, digest, vectors, owner, about) and on_stored is not None:
            on_stored(path)
    return vectors, owner, "computed"
