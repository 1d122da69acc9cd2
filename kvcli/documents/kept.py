"""A document's extracted text kept on disk, so a later question in a new process does not extract it
again.

Extracting a PDF's text costs a Python loop over its characters (:func:`kvcli.documents._page_text`:
~1.4 s for the 236-page R-exts.pdf on two cores, every time a process reads it), an HTML page's
a parse. The text and its page map are kept in ``<cache_dir>/texts/<key>.safetensors`` (``text``:
uint8, its UTF-8 bytes; ``page_starts``: int64), written atomically
(:func:`kvcli.files.save_safetensors_atomic`), with the key and :data:`FORMAT` in the header and, in
its ``about`` (JSON), the document's path, the kind, the pages' count and the sha256 of the text
(``document_sha256``, as the KV entries and page vectors record it). A file read back is checked
against that sha256: a damaged file is a miss, extracted again and replaced.

The key hashes everything that changes the text: :data:`FORMAT`, the file's bytes, its kind, and
the extraction itself (:func:`extractor`: the bytes of the module that extracts, and the PDFium
build that does). The disk store lists these files as entries of kind "text", counts them against
its cap and removes them by the same policy as the page vectors (:mod:`kvcli.store`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from ..files import TEXTS_FOLDER, save_safetensors_atomic

FORMAT = 1  # the file's layout: bump when it changes (old files are then misses)
FOLDER = TEXTS_FOLDER  # <cache_dir>/texts
KEPT_KINDS = ("pdf", "html")  # what is extracted; a text file is read as fast as its kept text would be


@functools.cache
def extractor(kind: str) -> str:
    """What extracts a ``kind``'s text, as the key hashes it: the bytes of the module that extracts
    (kvcli/documents/__init__.py: any change to the extraction or its normalising is another key),
    and for a PDF the pypdfium2 and PDFium builds."""
    digest = hashlib.sha256(Path(__file__).with_name("__init__.py").read_bytes())
    if kind == "pdf":
        from pypdfium2.version import PDFIUM_INFO, PYPDFIUM_INFO

        digest.update(f"{PYPDFIUM_INFO}/{PDFIUM_INFO}".encode())
    return digest.hexdigest()


def key(data: bytes, kind: str) -> str:
    digest = hashlib.sha256(f"kvcli-text/{FORMAT}/{kind}/{extractor(kind)}/".encode())
    digest.update(data)
    return digest.hexdigest()


def path_for(cache_dir: Path, digest: str) -> Path:
    return Path(cache_dir) / FOLDER / f"{digest}.safetensors"


def text_sha256(text: str) -> str:
    """The document's identity in every cache file: the sha256 of its text as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load(path: Path, digest: str) -> tuple[str, tuple[int, ...]] | None:
    """(text, page_starts) from ``path`` when it holds this key's whole, else None (missing,
    damaged, another format)."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("key") != digest or meta.get("format") != str(FORMAT):
                return None
            raw, starts = f.get_tensor("text"), f.get_tensor("page_starts")
        text = raw.tobytes().decode("utf-8")
        about = json.loads(meta.get("about") or "{}")
    except Exception:  # noqa: BLE001 - any unreadable file is a miss
        return None
    if starts.ndim != 1 or not isinstance(about, dict) or about.get("document_sha256") != text_sha256(text):
        return None
    return text, tuple(int(s) for s in starts)


def save(path: Path, digest: str, text: str, page_starts: tuple[int, ...], about: dict) -> bool:
    """Write the file atomically; a cache that cannot be written only costs the extraction next
    time. Returns whether it was written."""
    import numpy as np
    import torch

    meta = {"key": digest, "format": str(FORMAT), "about": json.dumps(about, sort_keys=True)}
    tensors = {"text": torch.from_numpy(np.frombuffer(bytearray(text.encode("utf-8")), dtype=np.uint8)),
               "page_starts": torch.tensor(page_starts, dtype=torch.int64)}  # fmt: skip
    try:
        save_safetensors_atomic(path, tensors, meta)
    except OSError:
        return False
    return True


def extracted(
    cache_dir: Path, data: bytes, kind: str, source: str, extract: Callable[[], tuple[str, tuple[int, ...]]]
) -> tuple[str, tuple[int, ...]]:
    """The text and page map of the file of bytes ``data`` (a ``kind`` of :data:`KEPT_KINDS`): the
    kept ones when ``cache_dir`` holds them (marked used: the cap removes the least recently used
    first), else ``extract()``'s, kept for the next process. ``source``: the file's path, recorded
    for ``kvcli cache ls`` and ``kvcli cache rm DOCUMENT``. What ``extract`` raises (a document a
    user cannot use) is raised and nothing is kept."""
    digest = key(data, kind)
    path = path_for(cache_dir, digest)
    found = load(path, digest)
    if found is not None:
        with contextlib.suppress(OSError):
            os.utime(path)
        return found
    text, page_starts = extract()
    if not text.strip():  # the caller says the document is empty: nothing worth keeping
        return text, page_starts
    about = {"document": os.path.abspath(source), "document_sha256": text_sha256(text), "kind": kind}
    about.update({"pages": len(page_starts), "chars": len(text)})
    save(path, digest, text, page_starts, about)
    return text, page_starts
