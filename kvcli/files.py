"""Atomic file writes: the one way kvcli puts a file into a folder other processes read (and the
safetensors files it writes that way, byte by byte itself)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# ``<cache_dir>/vectors``: the retrieval's passage vectors (:mod:`kvcli.retrieval.vectors` writes
# them); ``<cache_dir>/texts``: documents' extracted texts (:mod:`kvcli.documents.kept`). The disk
# store (:mod:`kvcli.store`) lists them, counts them against its cap and removes them beside its KV
# entries. Here, below all three, so that none imports another.
VECTORS_FOLDER = "vectors"
TEXTS_FOLDER = "texts"


def cache_folder(cache_dir: str | os.PathLike | None) -> Path:
    """The cache folder a command was given (``~`` expanded), else :func:`default_cache_dir`."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def default_cache_dir() -> Path:
    """``$KVCLI_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvcli``, else ``~/.cache/kvcli``."""
    env = os.environ.get("KVCLI_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "kvcli"
    return Path.home() / ".cache" / "kvcli"


def umask() -> int:
    """The process's umask (read without changing it for good)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain ``open()`` would give a new file: 0666 less the umask (0644 with umask 022,
    0664 with 002 — a cache folder shared by a group stays writable by the group)."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode a plain ``mkdir`` would give a new folder: 0777 less the umask."""
    return 0o777 & ~umask()


def share_like_umask(folder) -> None:
    """Give ``folder`` and everything in it the modes the umask gives new files and folders:
    mkdtemp makes a folder 0700 and safetensors writes files 0600, which would lock the other
    users of a cache folder shared by a group out of what one of them wrote (a converted model,
    its kept weights)."""
    fmode, dmode = file_mode(), dir_mode()
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, dmode)
        for name in files:
            os.chmod(os.path.join(root, name), fmode)


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Create ``path`` by ``write(tmp)`` on a temporary file in the same folder (``.<name>.*.tmp``),
    then ``os.replace``: readers see the old file or the new one, never half of one. On failure the
    temporary file is removed and the error raised. The file gets the mode the umask gives new
    files (:func:`file_mode`), not mkstemp's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())  # mkstemp makes it 0600; a shared cache follows the umask
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def safetensors_header(fd: int, room: int = 0) -> tuple[int, dict]:
    """(its length, the JSON header) of the safetensors file open as ``fd``, read as the format's spec
    lays it out (8 bytes of length, then JSON), without PyTorch or the safetensors library: what
    ``kvcli cache ls`` reads. The header at most ``room`` bytes (0: the safetensors library's own
    bound); ValueError when the file is not that, OSError when it cannot be read."""
    room = room or SAFETENSORS_HEADER_MAX
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    if not 2 <= n <= room:
        raise ValueError(f"not a safetensors file (a header of {n} bytes, at most {room})")
    blob = os.pread(fd, n, 8)
    if len(blob) != n:
        raise ValueError(f"not a safetensors file (a header of {n} bytes, {len(blob)} there)")
    header = json.loads(blob)
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (its header is not a JSON object)")
    return n, header


def safetensors_metadata(path) -> dict[str, str]:
    """The ``__metadata__`` of the safetensors file at ``path`` (:func:`safetensors_header`)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        meta = safetensors_header(fd)[1].get("__metadata__") or {}
    finally:
        os.close(fd)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("its metadata is not a table of strings")
    return meta


def save_safetensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` + string ``metadata`` to ``path`` as safetensors, atomically: a temporary
    file in the same folder (``.<name>.*.tmp``), then ``os.replace``. Readers see the old file or
    the new one, never half of one; on failure the temporary file is removed and the error raised.

    The bytes are written by :func:`write_safetensors` into that temporary file itself: the
    safetensors library's own ``save_file`` writes through a temporary file of its own
    (``.tmpXXXXXX``, beside it), which a killed run would leave under a name no kvcli process
    could tell from someone else's file."""
    atomic_write(path, lambda tmp: write_safetensors(tmp, tensors, metadata))


SAFETENSORS_HEADER_MAX = 100_000_000  # the safetensors library's own bound on a header
# torch dtype name -> safetensors dtype name (the format's spec)
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16",
    "uint32": "U32", "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip


def _safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[str]]:
    """The header of a safetensors file of ``tensors`` + ``metadata`` as the format's spec has it
    (JSON padded with spaces to 8 bytes) and the order of the tensors' bytes after it: largest
    element first (aligned), then by name."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        dtype = SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-len(blob) % 8), order


def safetensors_size(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """The bytes :func:`write_safetensors` would write, without writing them."""
    blob, _ = _safetensors_header(tensors, metadata)
    return 8 + len(blob) + sum(t.numel() * t.element_size() for t in tensors.values())


def write_safetensors(filename: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write the safetensors file ``filename`` as the format's spec has it (what ``safe_open``
    reads): an 8-byte little-endian header length, the JSON header (padded with spaces to 8
    bytes), then each tensor's bytes, largest element first (aligned), then by name; streamed
    from the tensors, never a second copy of them in memory."""
    import torch

    blob, order = _safetensors_header(tensors, metadata)
    with open(filename, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for name in order:
            t = tensors[name].detach().to("cpu").contiguous()
            if t.numel():
                fh.write(t.view(-1).view(torch.uint8).numpy().data)
