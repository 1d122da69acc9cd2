"""A partial book file's resume points, read and written without PyTorch (``kvcli cache ls`` shows
how far a stopped read got, and lists the store, before PyTorch is imported).

A book file (:class:`kvcli.caches.bookfile.FileStorage`) is a safetensors file: 8 bytes of header
length, the JSON header (each tensor's dtype, shape and ``data_offsets``; ``__metadata__``), then
the data. While a read is under way, a ``resume`` U8 tensor after the data is its *resume region*:
two slots, each a point the read reached: a 32-byte head (magic, sequence number, payload length,
CRC-32 of the payload, padding) and the payload (:func:`pack`: its facts as JSON, then a blob).
A point is written to slot ``seq % 2``, so a slot torn by a kill leaves the other; the newer slot
whose CRC-32 holds is the one to resume from."""

from __future__ import annotations

import json
import os
import zlib

from .files import safetensors_header

HEADER_ROOM = 1 << 16  # bytes reserved for a book file's JSON header (the metadata is written last)
RESUME = "resume"  # a partial book's resume region, in its header: a U8 tensor after the data
SLOT_MAGIC = b"kvcli-rp"
SLOT_HEAD = 32  # magic, sequence number (8 bytes), payload length (8), CRC-32 of the payload (4), padding


def region_bytes(point: int) -> int:
    """The bytes of a resume region whose two slots each hold a point of ``point`` bytes."""
    return 2 * (SLOT_HEAD + point)


def pack(facts: dict, blob: bytes) -> bytes:
    """A resume point's bytes: its facts (JSON) and a blob (tensors' bytes)."""
    text = json.dumps(facts, sort_keys=True, separators=(",", ":")).encode()
    return len(text).to_bytes(8, "little") + text + blob


def unpack(payload: bytes) -> tuple[dict, bytes]:
    """(facts, blob) of :func:`pack`'s bytes; ValueError when they are not that."""
    n = int.from_bytes(payload[:8], "little")
    if not 0 < n <= len(payload) - 8:
        raise ValueError("not a resume point")
    facts = json.loads(payload[8 : 8 + n])
    if not isinstance(facts, dict):
        raise ValueError("not a resume point")
    return facts, payload[8 + n :]


def slot(seq: int, payload: bytes, half: int) -> bytes:
    """The bytes of slot number ``seq`` holding ``payload``, in a slot of ``half`` bytes."""
    if SLOT_HEAD + len(payload) > half:
        raise ValueError(f"a resume point of {len(payload)} bytes over its {half - SLOT_HEAD}-byte slot")
    head = SLOT_MAGIC + seq.to_bytes(8, "little") + len(payload).to_bytes(8, "little")
    return head + zlib.crc32(payload).to_bytes(4, "little") + bytes(4) + payload


def latest_slot(fd: int, at: int, size: int) -> tuple[int, bytes] | None:
    """(number, payload) of the newest slot whose CRC-32 holds in the region of ``size`` bytes at
    ``at`` of the open file ``fd``; None when no slot does."""
    half, best = size // 2, None
    for i in (0, 1):
        start = at + i * half
        head = os.pread(fd, SLOT_HEAD, start) if half >= SLOT_HEAD else b""
        if len(head) < SLOT_HEAD or head[:8] != SLOT_MAGIC:
            continue
        seq, n = int.from_bytes(head[8:16], "little"), int.from_bytes(head[16:24], "little")
        if n > half - SLOT_HEAD:
            continue
        payload = os.pread(fd, n, start + SLOT_HEAD)
        intact = len(payload) == n and zlib.crc32(payload) == int.from_bytes(head[24:28], "little")
        if intact and (best is None or seq > best[0]):
            best = (seq, payload)
    return best


def region_of(header: dict, n: int, size: int) -> tuple[int, int]:
    """(offset, bytes) of the resume region of a book file of ``size`` bytes whose header of ``n``
    bytes is ``header``: its ``resume`` tensor, or (a read stopped between writing the final header
    and cutting the region off) the bytes after the data. ValueError when the file is shorter than
    its layout; KeyError or TypeError when the header is not a book's."""
    end = max((8 + n + h["data_offsets"][1] for name, h in header.items() if name != "__metadata__"), default=8 + n)
    if size < end:
        raise ValueError(f"{size:,} bytes, its layout needs {end:,}: cut short")
    if RESUME in header:
        return 8 + n + header[RESUME]["data_offsets"][0], int(header[RESUME]["shape"][0])
    return end, size - end


def read_progress(path) -> dict | None:
    """The facts of the newest resume point of the partial book file at ``path`` (``tokens``: how
    far its read got); None when it has none or cannot be read."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return None
    try:
        n, header = safetensors_header(fd, HEADER_ROOM)
        found = latest_slot(fd, *region_of(header, n, os.fstat(fd).st_size))
        return None if found is None else unpack(found[1])[0]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    finally:
        os.close(fd)
