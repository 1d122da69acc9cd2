"""Store keys: what an entry depends on, hashed, and the file names a key gives.

A key (:func:`make_key`) hashes everything that changes the state: the store format version, the
model fingerprint (weights, config, tokenizer and chat template, dtype, quantisation), the device
type and attention kernel, the prefix token ids (the document and the prompt template around it),
the method's state parameters (e.g. ``{"kind": "kv", "layers": 16}``: GemFilter's k does not
change what is stored, so ``gemfilter:k=256`` and ``gemfilter:k=512`` share an entry) with the KV's
format, its bits and codec (:func:`kvcli.caches.quant.state`; a state that names none is 16 bits),
and the question's tokens only for states that depend on it.

Names under ``<cache_dir>/kv``: the entry ``<key>.safetensors``; its temporary file while it is
written ``.<key>.safetensors.<random>.tmp`` (:func:`kvcli.files.atomic_write`); the partial entry
of a book read that stopped ``<key>.partial.safetensors`` (:mod:`kvcli.store.book`: never served,
resumed by the next read); its lock ``locks/<key>.lock``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

# PyTorch and the KV codecs (kvcli.caches.quant) are imported where a key is made: the help's
# store facts (the cap's variable, by way of kvcli.store.capacity) need neither

FORMAT_VERSION = 1
SUFFIX = ".safetensors"  # an entry's file: <cache_dir>/kv/<key>.safetensors
PARTIAL = ".partial"  # the partial entry of a book read that stopped: <key>.partial.safetensors
# the temporary file of an entry: ``.<key>.safetensors.<random>.tmp`` (kvcli.files.atomic_write)
TEMP_NAME = re.compile(r"^\.([0-9a-f]{64})" + re.escape(SUFFIX) + r"\..+\.tmp$")


@dataclass(frozen=True)
class StoreKey:
    digest: str  # sha256 hex of the canonical JSON of ``fields``
    fields: dict  # everything the entry depends on


def _ids_digest(ids: torch.Tensor) -> str:
    import torch

    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def key_of(fields: dict) -> StoreKey:
    """The key of ``fields``: the sha256 of their canonical JSON."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return StoreKey(hashlib.sha256(canonical.encode()).hexdigest(), fields)


def other_formats(key: StoreKey) -> list[str]:
    """The keys the same state would have had in the store's other formats — each store format
    version up to this one, and each name its bits' codec has had (:data:`kvcli.caches.quant.CODEC_NAMES`)
    or none (a state from before codecs were named) — but ``key`` itself: where an entry of
    another format of it may be, found by name, without reading any other entry."""
    from ..caches import quant

    state = key.fields.get("state")
    states = [state]
    if isinstance(state, dict):
        bits = state.get("kv_bits", 16)
        bare = {k: v for k, v in state.items() if k not in ("kv_bits", "kv_codec")}
        states = [{**bare, "kv_bits": bits, "kv_codec": codec} for codec in quant.CODEC_NAMES.get(bits, ())]
        states += [{**bare, "kv_bits": bits}] + ([bare] if bits == 16 else [])
    out = []
    for version in range(1, FORMAT_VERSION + 1):
        for s in states:
            digest = key_of({**key.fields, "format": version, "state": s}).digest
            if digest != key.digest and digest not in out:
                out.append(digest)
    return out


def make_key(lm, prefix_ids: torch.Tensor, state: dict, question_ids: torch.Tensor | None = None) -> StoreKey:
    """The key of the prefix state ``state`` of ``prefix_ids`` (n,) for the model ``lm``."""
    from ..caches import quant

    fields = {
        "format": FORMAT_VERSION,
        "model": lm.fingerprint,
        "device": lm.device.type,
        "attn": lm.attn,
        "tokens": _ids_digest(prefix_ids),
        "n_tokens": int(prefix_ids.numel()),
        "state": quant.named(state) if isinstance(state, dict) else state,
        "question": None if question_ids is None else _ids_digest(question_ids),
    }
    return key_of(fields)


def entry_path(root: Path, digest: str) -> Path:
    """The file of the entry ``digest`` in the store folder ``root``."""
    return root / f"{digest}{SUFFIX}"


def partial_path(root: Path, digest: str) -> Path:
    """The partial entry of the key ``digest`` (a book read that stopped) in ``root``."""
    return root / f"{digest}{PARTIAL}{SUFFIX}"


def is_partial(path: Path) -> bool:
    return path.name.endswith(PARTIAL + SUFFIX)


def held_bytes(path: Path, st) -> int:
    """The bytes the store file ``path`` (``st``: its ``os.stat``) holds on disk, as the cap counts
    them: a whole entry its size; a partial one (a book read that stopped, created at its full size
    as a sparse file, :meth:`kvcli.caches.bookfile.FileStorage.create`) the blocks written so far."""
    if is_partial(path):
        blocks = getattr(st, "st_blocks", None)
        if blocks is not None:
            return min(st.st_size, blocks * 512)
    return st.st_size


def digest_of(path: Path) -> str:
    """The key an entry's file (whole or partial) is named after."""
    return path.name[: -len(SUFFIX)].removesuffix(PARTIAL)


def lock_path(root: Path, digest: str) -> Path:
    return root / "locks" / f"{digest}.lock"
