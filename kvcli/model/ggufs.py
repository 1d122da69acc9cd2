"""A GGUF file the user already has (``-m path/to/model.gguf``: what llama.cpp and ollama keep on
disk) of a family kvcli runs, converted once into ``<cache>/models/gguf-<first 12 hex of its
sha256>`` with the tokenizer (and chat template, if any) the GGUF carries, as the embedded models
are (:mod:`.catalog`, :func:`kvcli.model.embedded.convert_once`); the same file as an embedded
model's GGUF is that model's conversion."""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelError, one_line
from ..file_facts import file_fact
from ..files import cache_folder
from .embedded import convert_once, gguf_parsed_once, gguf_sha256, is_converted

# GGUF architectures (``general.architecture``) kvcli runs layer by layer and transformers reads
SUPPORTED_GGUF = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


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
    memoised per file in ``cache_dir`` (:func:`kvcli.file_facts.file_fact`)."""

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

    cache_dir = cache_folder(cache_dir)
    return set(file_fact(Path(path), cache_dir, "linear_types", list, read))


def ensure_gguf_converted(path: Path, cache_dir: Path | None) -> tuple[Path, str]:
    """(converted folder, sha256) of a user's GGUF file of a supported family, converted once into
    ``<cache>/models/gguf-<sha12>`` (keyed by the file's content: a renamed or moved copy is found
    again; the sha256 itself is memoised by path, size and mtime)."""
    path = Path(path).expanduser().resolve()
    cache_dir = cache_folder(cache_dir)
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
