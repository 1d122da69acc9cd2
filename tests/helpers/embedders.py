"""An embedding model for the page vectors whose vectors are known (no model loaded): a text's
word count and length, normalised. ``calls`` counts :meth:`encode` calls (a second call on the same
passages must read the stored file instead), ``texts`` holds the last call's texts; ``progress_step`` > 0 reports ``on_progress`` every
that many texts, as the real model does after each batch."""

from __future__ import annotations

import numpy as np


class Counting:
    id = "counting-1"
    folder = "/models/counting"

    def __init__(self, progress_step: int = 0) -> None:
        self.calls = 0
        self.texts: list[str] = []  # the last encode call's texts
        self.wanted: list[list[int]] = []  # the passages each ranking asked for (tests record them)
        self.progress_step = progress_step

    def encode(self, texts, on_progress=None):
        self.calls += 1
        self.texts = list(texts)
        if on_progress is not None:
            for done in range(self.progress_step, len(texts), self.progress_step or len(texts) + 1):
                on_progress(done, len(texts))
            on_progress(len(texts), len(texts))
        v = np.array([[len(t.split()) + 1.0, len(t) + 1.0] for t in texts], dtype=np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    def encode_query(self, question):
        return self.encode([question])[0]


def paged_document(pages: list[str], source: str = "logbook.pdf"):
    """A PDF-like document of ``pages`` (a blank line between two), as load_document makes one."""
    from kvcli.documents import Document
    from kvcli.documents.kept import text_sha256

    text, starts = "", []
    for page in pages:
        starts.append(len(text))
        text += page + "\n\n"
    text = text.rstrip("\n")
    return Document(source, text, tuple(starts), "pdf", text_sha256(text))
