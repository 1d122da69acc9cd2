"""The model fingerprint in every cache key: weights (content or size+mtime), config, tokenizer,
dtype and quantisation — whatever changes the model's numbers."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _clean_config(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            k: _clean_config(v)
            for k, v in obj.items()
            if k not in _VOLATILE_CONFIG_KEYS and not (k.startswith("_") and k != "_model_name_or_path")
        }
    if isinstance(obj, (list, tuple)):
        return [_clean_config(v) for v in obj]
    import torch  # here: embedded.py hashes files with this module before anything needs PyTorch

    if isinstance(obj, torch.dtype):
        return str(obj)
    return obj


def weights_identity(folder: Path) -> list[list[Any]]:
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
            items.append([p.name, st.st_size, "sha256", file_sha256(p)])
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
    int8_kernel: str | None = None,
) -> str:
    """Hex sha256 that identifies a loaded model, for keying caches of its outputs.

    It hashes, as one canonical JSON document:

    * the model config: ``model.config.to_diff_dict()`` without the fields that change between
      loads or are hashed separately (``_name_or_path`` and other ``_``-fields,
      ``transformers_version``, ``dtype``, ``quantization_config``, ``attn_implementation``);
    * ``weights``: for the embedded model the sha256 of its GGUF file; for a folder (local or
      HF-cache snapshot) the identity of each weight file (see :func:`weights_identity`:
      name + content sha256 for files up to 64 MiB, else HF blob hash or size + mtime);
      for a hub model whose snapshot is not found, its id;
    * the tokenizer: ``len(tokenizer)``, its chat template and its bos/eos/pad/unk tokens;
    * the dtype and the quantization ("none" / "4bit" / "8bit");
    * where 8-bit layers decode with 8-bit activations (``KVCLI_INT8_KERNEL=8bit``,
      :mod:`kvcli.model.int8_rows`), that kernel's path ("AVX-512 VNNI", "AVX2"): its logits round
      differently from PyTorch's. Absent otherwise (kvcli's exact kernel sums PyTorch's products in
      another order, as another CPU's kernels may), so the other fingerprints stay as they were.

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
                k: str(getattr(tokenizer, k, None)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            },
        },
        "dtype": str(dtype),
        "quant": quant,
    }
    if int8_kernel is not None:
        doc["int8_activations"] = int8_kernel
    blob = json.dumps(doc, sort_keys=True, ensure_ascii=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
