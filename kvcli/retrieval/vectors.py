"""A document's passage vectors, computed once and kept on disk beside the KV store's entries.

Each passage is cut into windows of :data:`WINDOW_WORDS` words (its last one shorter; a passage
under that is one window) and each window embedded (:mod:`.embed`); a passage's semantic score is
its best window's (a page answers the question when one part of it does). Only the passages a
question wants are embedded (the ranking's candidates, :data:`kvcli.retrieval.ranking.CANDIDATES`);
the file keeps every passage embedded so far, so a document's vectors fill in question by question.
The vectors of a document go to ``<cache_dir>/vectors/<key>.safetensors`` (``vectors``: float32
(windows, dim), unit rows; ``owner``: int32, each window's passage, in passage order; ``done``:
uint8 (passages,), which passages' windows are there), written atomically (:func:`kvcli.files.save_safetensors_atomic`),
with its key and format in the header and, in its ``about`` (JSON), the embedding model, the window
size, the passages' count, how many are embedded (``embedded``) and the document they came from (``document``, ``document_sha256``,
when the caller names it). The disk store counts these files
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

FORMAT = 2  # the file's layout: bump when it changes (old files are then misses); 2: the passages embedded so far
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


def load(path: Path, digest: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(vectors, owner, done) from ``path`` when it holds this key's, else None (missing, damaged,
    another format): ``done[i]`` says whether passage i's windows are among the rows."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("key") != digest or meta.get("format") != str(FORMAT):
                return None
            vectors, owner, done = f.get_tensor("vectors"), f.get_tensor("owner"), f.get_tensor("done")
    except Exception:  # noqa: BLE001 - any unreadable file is a miss
        return None
    if vectors.ndim != 2 or owner.shape != (vectors.shape[0],) or done.ndim != 1 or not np.isfinite(vectors).all():
        return None
    owner = owner.astype(np.int64)
    if len(owner) and (owner.min() < 0 or owner.max() >= len(done) or not done[owner].all()):
        return None
    return vectors.astype(np.float32, copy=False), owner, done.astype(bool)


def save(path: Path, digest: str, vectors: np.ndarray, owner: np.ndarray, done: np.ndarray, about: dict) -> bool:
    """Write the file atomically; a store that cannot be written only costs the recomputation next
    time. Returns whether it was written."""
    import torch

    meta = {"key": digest, "format": str(FORMAT), "about": json.dumps(about, sort_keys=True)}
    tensors = {"vectors": torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32)),
               "owner": torch.from_numpy(np.ascontiguousarray(owner, dtype=np.int32)),
               "done": torch.from_numpy(np.ascontiguousarray(done, dtype=np.uint8))}  # fmt: skip
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
    wanted: list[int] | None = None,
    document: dict | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    on_stored: Callable[[Path], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, str]:
    """The windows' vectors of the ``wanted`` passages (their indices; None: every passage) and
    each row's passage, in passage order; the third value says where they came from: "hit" (all
    from the store), "computed" (some or all embedded now). ``cache_dir``: where they are kept
    (None: computed, not kept).

    The file keeps every passage embedded so far (``done``): a question embeds only the wanted
    passages not yet in it and writes the union back (two processes adding at once: the last
    write wins, the other's passages are embedded again when next wanted).

    ``document``: what the file records of the document the passages came from (``document``: its
    path, ``document_sha256``), for ``kvcli cache ls`` and ``cache rm DOCUMENT``;
    ``on_progress(done, total)``: the windows embedded so far, while they are
    (:meth:`kvcli.retrieval.embed.Embedder.encode`); ``on_stored(path)``: the file was written
    (the disk store makes room for it under its cap)."""
    digest = key(embedder.id, passages, size)
    path = path_for(cache_dir, digest) if cache_dir is not None else None
    want = np.ones(len(passages), bool) if wanted is None else np.isin(np.arange(len(passages)), wanted)
    found = load(path, digest) if path is not None else None
    if found is not None and len(found[2]) != len(passages):
        found = None
    vecs, owner, done = found if found is not None else (None, np.zeros(0, np.int64), np.zeros(len(passages), bool))
    missing = np.flatnonzero(want & ~done).tolist()
    if not missing:
        if vecs is None:  # nothing wanted, nothing stored
            return np.zeros((0, 0), np.float32), owner, "hit"
        with contextlib.suppress(OSError):
            os.utime(path)  # last use, for the cap (least recently used first)
        rows = want[owner]
        return vecs[rows], owner[rows], "hit"
    cut = {i: windows(passages[i], size) for i in missing}
    new_owner = np.array([i for i in missing for _ in cut[i]], dtype=np.int64)
    new = embedder.encode([w for i in missing for w in cut[i]], on_progress=on_progress)
    vecs = new if vecs is None else np.concatenate([vecs, new])
    owner = np.concatenate([owner, new_owner])
    order = np.argsort(owner, kind="stable")  # passage order; a passage's windows in their order
    vecs, owner = vecs[order], owner[order]
    done[missing] = True  # a fresh array (loaded or made here)
    if path is not None:
        about = {"model": str(embedder.folder), "window_words": size, "passages": len(passages)}
        about["embedded"] = int(done.sum())
        about.update({k: v for k, v in (document or {}).items() if k in ("document", "document_sha256") and v})
        if save(path, digest, vecs, owner, done, about) and on_stored is not None:
            on_stored(path)
    rows = want[owner]
    return vecs[rows], owner[rows], "computed"


FILL_STEP = 2  # passages a step of :func:`fill` embeds (~8 windows: under a second on two cores)


def fill(
    embedder,
    passages: list[str],
    cache_dir: Path,
    stop,
    step: int = FILL_STEP,
    document: dict | None = None,
    order: list[int] | None = None,
    on_step: Callable[[int, int], None] | None = None,
    on_stored: Callable[[Path], None] | None = None,
) -> bool:
    """Embed every passage whose windows the file lacks, ``step`` passages at a time in ``order``
    (passage indices, first first; None: document order; passages it leaves out come after it),
    until all are there or ``stop`` (a :class:`threading.Event`) is set, which is read between
    steps: what an idle chat does (:meth:`kvcli.api.Session.embed_rest`) and ``kvcli cache add``
    (:func:`kvcli.api.keep_document`), so that a later question finds its candidates embedded.
    Each step is :func:`passage_vectors` (the file written whole, atomically); a file that cannot
    be written ends it. ``on_step(embedded, total)``: the passages in the file after each step
    (and once before the first); ``on_stored(path)``: the file was written. Returns whether it was."""
    digest = key(embedder.id, passages)
    found = load(path_for(cache_dir, digest), digest)
    done = found[2] if found is not None and len(found[2]) == len(passages) else np.zeros(len(passages), bool)
    first = list(order or [])
    todo = [i for i in first + sorted(set(range(len(passages))) - set(first)) if not done[i]]
    wrote = False
    if on_step is not None:
        on_step(len(passages) - len(todo), len(passages))
    while todo and not stop.is_set():
        missing, stored = todo[:step], []
        _, _, how = passage_vectors(
            embedder, passages, cache_dir, wanted=missing, document=document, on_stored=stored.append
        )
        if how == "computed" and not stored:  # not written: the next step would redo this one
            break
        wrote, todo = wrote or bool(stored), todo[step:]  # "hit": another process embedded them
        if on_stored is not None and stored:
            on_stored(stored[-1])
        if on_step is not None:
            on_step(len(passages) - len(todo), len(passages))
    return wrote
