"""Where a stored book's KV lives: in memory, or in a safetensors file written while it is read.

A book (:mod:`kvcli.caches.book`) is read once in chunks; the KV of every token it has read goes
out of memory into its *storage* as soon as the token leaves the local window, so reading a
150k-token document holds no more than reading an 8k one. Two storages, one interface:

* :class:`MemoryStorage` — preallocated tensors (no disk store, ``--no-cache``, or an entry over
  the store's cap or free space: then the KV is held in memory, the entry is not written);
* :class:`FileStorage` — a safetensors file whose layout is fixed before a byte of data is
  written (the document's length is known up front): every tensor's shape, dtype and offset, the
  JSON header padded to a reserved size. Rows are written in place (``os.pwrite``) and read back
  (``os.preadv`` into fresh buffers: never ``mmap``, whose touched pages would count as the
  process's memory). :meth:`FileStorage.finish` writes the final header (the store's metadata,
  with the CRC-32 of the data computed by reading it back once) into the reserved space.

A file read may stop half-way (Ctrl-C, a kill) and resume (:class:`Destination`, the disk store's
partial entry, :mod:`kvcli.store.book`): its file then has, after the data, a *resume region* (a
``resume`` U8 tensor in its header) of two slots, each a point the read reached (:meth:`FileStorage.write_slot`:
a sequence number and a CRC-32; the newer valid slot is the one to resume from, so a slot torn by a
kill leaves the other; its bytes: :mod:`kvcli.resume_points`, which reads them without PyTorch).
:meth:`FileStorage.finish` cuts the region off.

The result is an ordinary safetensors file (``safe_open`` reads it; ``kvcli cache ls`` does).
Tensors, per layer ``l``: ``k.l`` and ``v.l`` (n_kv, n, d) — the keys *before* RoPE (see
:mod:`kvcli.caches.book`) and the values of every token, in 16 bits; ``repsum.l`` (n_kv,
n_blocks, d) float32 — the sum of each block's representative keys. Data, never code.

A book in 8 or 4 bits (``--kv-bits``, :mod:`kvcli.caches.quant`) holds each of ``k.l`` and ``v.l``
as the three tensors of its :class:`~kvcli.caches.quant.Packed` rows instead: ``k.l.codes`` (n_kv,
n, d·bits/8) uint8, ``k.l.scale`` and ``k.l.zero`` (n_kv, n, d/G) float16 (``repsum.l`` stays
float32). Either storage holds them; :class:`QuantRows` is how the book reads and writes such rows
— quantized as they are written, dequantized a block at a time as they are read, never the whole
book.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable

import torch

from .. import resume_points
from ..files import SAFETENSORS_DTYPES, safetensors_header
from ..resume_points import HEADER_ROOM, RESUME
from . import quant

_CRC_READ = 8 << 20  # bytes per read while checksumming
PART_DTYPES = (torch.uint8, quant.SCALE_DTYPE, quant.SCALE_DTYPE)  # of a quantized row's codes, scale, zero


def tensor_specs(n_layers: int, n_kv: int, n: int, d: int, n_blocks: int, dtype: torch.dtype, bits: int = 16) -> dict:
    """name -> (dtype, shape) of a book of ``n`` tokens with ``n_blocks`` memory blocks, its keys and
    values in ``dtype`` (16 bits) or quantized to ``bits`` (8, 4: :class:`QuantRows`)."""
    specs = {}
    for layer in range(n_layers):
        for t in ("k", "v"):
            if bits == 16:
                specs[f"{t}.{layer}"] = (dtype, (n_kv, n, d))
            else:
                groups = d // quant.group_size(d)
                shapes = ((n_kv, n, quant.code_width(d, bits)), (n_kv, n, groups), (n_kv, n, groups))
                for part, part_dtype, shape in zip(quant.Packed._fields, PART_DTYPES, shapes):
                    specs[f"{t}.{layer}.{part}"] = (part_dtype, shape)
        specs[f"repsum.{layer}"] = (torch.float32, (n_kv, n_blocks, d))
    return specs


def bits_of(specs: dict, d: int) -> int:
    """The bits a book's keys and values are stored in, by its tensors (``d``: the head size):
    16 (``k.0`` in its dtype; a book of no layers too), or 8 or 4 (``k.0.codes``)."""
    codes = specs.get("k.0.codes")
    if codes is None:
        return 16
    return 8 if codes[1][-1] == d else 4


def block_rows(starts: torch.Tensor, size: int) -> torch.Tensor:
    """The rows of blocks of ``size`` rows starting at ``starts`` (heads, k): (heads, k * size), each
    head's blocks one after another."""
    return (starts.to(torch.long)[..., None] + torch.arange(size)).flatten(1)


class QuantRows:
    """The keys and values (``k.l``, ``v.l``) of a book stored in ``bits`` bits, as the book reads
    and writes them — ``write(name, (head, lo, hi), rows)`` and ``read(name, head, lo, hi)``, the
    storage's own calls on rows (hi - lo, d) in ``dtype`` — over the three tensors of their
    :class:`~kvcli.caches.quant.Packed` rows in ``storage``: each row is quantized on its own as it
    is written (its bytes do not depend on the rows written with it) and only the rows read are
    dequantized."""

    def __init__(self, storage, d: int, dtype: torch.dtype, bits: int) -> None:
        self.storage, self.d, self.dtype, self.bits = storage, d, dtype, bits

    def write(self, name: str, index: tuple, value: torch.Tensor) -> None:
        """The storage's ``write`` of ``value``'s rows quantized (every head given at once)."""
        for part, tensor in zip(quant.Packed._fields, quant.quantize(value, self.bits)):
            self.storage.write(f"{name}.{part}", index, tensor)

    def read(self, name: str, head: int, lo: int, hi: int) -> torch.Tensor:
        parts = (self.storage.read(f"{name}.{part}", head, lo, hi) for part in quant.Packed._fields)
        return quant.dequantize(quant.Packed(*parts), self.d, self.dtype)

    def read_blocks(self, name: str, starts: torch.Tensor, size: int) -> torch.Tensor:
        """The storage's :meth:`~MemoryStorage.read_blocks` of each part, dequantized together."""
        parts = (self.storage.read_blocks(f"{name}.{part}", starts, size) for part in quant.Packed._fields)
        return quant.dequantize(quant.Packed(*parts), self.d, self.dtype)


def kv_rows(storage, d: int, dtype: torch.dtype):
    """What a book reads and writes its keys and values through: ``storage`` itself (16 bits: its
    rows are the numbers), or a :class:`QuantRows` over it (8 or 4 bits, rows in ``dtype``)."""
    bits = bits_of(storage.specs, d)
    return storage if bits == 16 else QuantRows(storage, d, dtype, bits)


def precision_facts(specs: dict, d: int, dtype: torch.dtype) -> dict:
    """What a book's facts say of its precision: nothing at 16 bits (its tensors' dtype says it, and a
    16-bit book's header stays as it was), else its ``bits`` and the ``dtype`` its rows are read in."""
    bits = bits_of(specs, d)
    return {} if bits == 16 else {"bits": bits, "dtype": str(dtype).removeprefix("torch.")}


def precision_of(facts: dict, specs: dict, d: int) -> torch.dtype | None:
    """The dtype a stored book's rows are read back in (None: its tensors'), its facts'
    :func:`precision_facts` checked against its tensors; ValueError when they differ."""
    bits, held = int(facts.get("bits", 16)), bits_of(specs, d)
    if bits != held:
        raise ValueError(f"its facts say {bits}-bit keys and values, its tensors hold {held} bits")
    if bits == 16:
        return None
    dtype = getattr(torch, str(facts.get("dtype")), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"bad dtype {facts.get('dtype')!r} to read its rows in")
    return dtype


def nbytes_of(specs: dict) -> int:
    return sum(torch.empty((), dtype=dt).element_size() * _numel(shape) for dt, shape in specs.values())


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


class MemoryStorage:
    """The book's tensors in memory (preallocated; nothing written to disk)."""

    path = None

    def __init__(self, specs: dict, tensors: dict | None = None) -> None:
        self.specs = specs
        self.tensors = (
            tensors
            if tensors is not None
            else {name: torch.zeros(shape, dtype=dt) for name, (dt, shape) in specs.items()}
        )

    def write(self, name: str, index: tuple, value: torch.Tensor) -> None:
        """``tensor[name][head, lo:hi]`` (index = (head, lo, hi)) <- value (hi - lo, ...); ``head`` a
        slice of heads: value (heads, hi - lo, ...), every head in one copy."""
        head, lo, hi = index
        self.tensors[name][head, lo:hi] = value

    def read(self, name: str, head: int, lo: int, hi: int) -> torch.Tensor:
        return self.tensors[name][head, lo:hi]

    def read_blocks(self, name: str, starts: torch.Tensor, size: int) -> torch.Tensor:
        """Blocks of ``size`` rows of every head at once (a step's retrieved blocks): row ``h`` of
        ``starts`` (heads, k) the first rows of head ``h``'s blocks; (heads, k * size, ...), each
        head's blocks one after another. One indexing op, whatever the number of blocks."""
        rows = block_rows(starts, size)
        return self.tensors[name][torch.arange(rows.shape[0])[:, None], rows]

    def whole(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def close(self) -> None:
        pass


class FileStorage:
    """The book's tensors in a safetensors file, written and read in place (see the module doc)."""

    def __init__(
        self, path, specs: dict, fd: int, offsets: dict, data_start: int, resume: tuple[int, int] = (0, 0)
    ) -> None:
        self.path = str(path)
        self.specs = specs
        self.fd = fd
        self.offsets = offsets  # name -> byte offset of the tensor in the file
        self.data_start = data_start
        self.resume_at, self.resume_size = resume  # the resume region: offset and bytes (0: none)

    # --- layout -------------------------------------------------------------------------------
    @staticmethod
    def _layout(specs: dict) -> tuple[dict, dict]:
        header, offsets, offset = {}, {}, 0
        # largest element first (aligned), then by name: as kvcli.files.write_safetensors orders them;
        # the resume region after all of them (cut off at the end: a book's uint8 codes stay before it)
        order = sorted(specs, key=lambda n: (n == RESUME, -torch.empty((), dtype=specs[n][0]).element_size(), n))
        for name in order:
            dt, shape = specs[name]
            size = torch.empty((), dtype=dt).element_size() * _numel(shape)
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[str(dt).removeprefix("torch.")],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offsets[name] = offset
            offset += size
        return header, offsets

    @classmethod
    def create(cls, path, specs: dict, resume_point: int = 0, metadata: dict | None = None) -> FileStorage:
        """A new file of the final size (sparse until written), its header room reserved; with a
        resume region after the data for points of ``resume_point`` bytes at most
        (:func:`kvcli.resume_points.region_bytes`), and its header (string ``metadata`` and the layout, the region
        included) written at once, so that the file is a readable safetensors file from the start."""
        resume_room = resume_points.region_bytes(resume_point) if resume_point else 0
        full = {**specs, RESUME: (torch.uint8, (resume_room,))} if resume_room else specs
        header, offsets = cls._layout(full)
        total = sum(h["data_offsets"][1] - h["data_offsets"][0] for h in header.values())
        fd = os.open(str(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, 8 + HEADER_ROOM + total)
            at = {n: 8 + HEADER_ROOM + o for n, o in offsets.items()}
            resume = (at.pop(RESUME), resume_room) if resume_room else (0, 0)
            storage = cls(path, specs, fd, at, 8 + HEADER_ROOM, resume)
            if metadata is not None:
                storage._write_header(metadata, full)
        except BaseException:
            os.close(fd)
            raise
        return storage

    @classmethod
    def open(cls, path, writable: bool = False) -> tuple[FileStorage, dict]:
        """An existing book file and its ``__metadata__``; raises ValueError when it is not one. Its
        resume region: the ``resume`` tensor of a partial book's header, or — a read stopped between
        writing the final header and cutting the region off — the bytes after the data."""
        fd = os.open(str(path), os.O_RDWR if writable else os.O_RDONLY)
        try:
            n, header = safetensors_header(fd, HEADER_ROOM)
            resume = resume_points.region_of(header, n, os.fstat(fd).st_size)
            meta = header.pop("__metadata__", {}) or {}
            inverse = {v: k for k, v in SAFETENSORS_DTYPES.items()}
            specs, offsets = {}, {}
            for name, h in header.items():
                if name != RESUME:
                    offsets[name] = 8 + n + h["data_offsets"][0]
                    specs[name] = (getattr(torch, inverse[h["dtype"]]), tuple(h["shape"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            os.close(fd)
            raise ValueError(f"not a book file: {e}") from e
        except BaseException:
            os.close(fd)
            raise
        return cls(path, specs, fd, offsets, 8 + n, resume), meta

    # --- rows -----------------------------------------------------------------------------------
    def _row_bytes(self, name: str) -> tuple[int, int]:
        dt, shape = self.specs[name]
        size = torch.empty((), dtype=dt).element_size()
        per_row = size * _numel(shape[2:])
        return per_row, per_row * shape[1]

    def write(self, name: str, index: tuple, value: torch.Tensor) -> None:
        """:meth:`MemoryStorage.write` into the file: a write per head."""
        head, lo, hi = index
        per_row, per_head = self._row_bytes(name)
        data = value.detach().to("cpu", self.specs[name][0]).contiguous().view(-1).view(torch.uint8).numpy()
        heads = range(self.specs[name][1][0])[head] if isinstance(head, slice) else [head]
        span = (hi - lo) * per_row
        for i, h in enumerate(heads):
            os.pwrite(self.fd, data[i * span : (i + 1) * span].data, self.offsets[name] + h * per_head + lo * per_row)

    def read(self, name: str, head: int, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty((hi - lo, *self.specs[name][1][2:]), dtype=self.specs[name][0])
        self._read_into(out, name, [(head, lo)], hi - lo)
        return out

    def read_blocks(self, name: str, starts: torch.Tensor, size: int) -> torch.Tensor:
        """:meth:`MemoryStorage.read_blocks` from the file: every block read into its place in one
        buffer (a read per run of adjacent blocks)."""
        dt, shape = self.specs[name]
        heads, k = starts.shape
        out = torch.empty((heads, k * size, *shape[2:]), dtype=dt)
        self._read_into(out, name, [(h, lo) for h, row in enumerate(starts.tolist()) for lo in row], size)
        return out

    def _read_into(self, out: torch.Tensor, name: str, blocks: list[tuple[int, int]], size: int) -> None:
        """Fill ``out`` with the blocks of ``size`` rows of ``name`` at (head, first row) ``blocks``, in
        order: one read per run of blocks adjacent in the file."""
        per_row, per_head = self._row_bytes(name)
        buf, span, at = memoryview(out.view(-1).view(torch.uint8).numpy()), size * per_row, 0
        runs: list[list[int]] = []  # [file offset, bytes]
        for head, lo in blocks:
            offset = self.offsets[name] + head * per_head + lo * per_row
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1][1] += span
            else:
                runs.append([offset, span])
        for offset, n in runs:
            if os.preadv(self.fd, [buf[at : at + n]], offset) != n:
                raise OSError(f"short read in {self.path}")
            at += n

    def whole(self, name: str) -> torch.Tensor:
        shape = self.specs[name][1]
        return (
            torch.stack([self.read(name, h, 0, shape[1]) for h in range(shape[0])])
            if shape[0]
            else torch.empty(shape, dtype=self.specs[name][0])
        )

    # --- checksum and header ----------------------------------------------------------------------
    def crc32(self) -> int:
        """CRC-32 of the tensors' bytes, by name (the store's definition, :func:`kvcli.store.entries.crc32`),
        read back in pieces: the file is never held in memory."""
        crc = 0
        for name in sorted(self.specs):
            dt, shape = self.specs[name]
            left, at = torch.empty((), dtype=dt).element_size() * _numel(shape), self.offsets[name]
            while left > 0:
                piece = os.pread(self.fd, min(left, _CRC_READ), at)
                if not piece:
                    raise OSError(f"short read in {self.path}")
                crc = zlib.crc32(piece, crc)
                at += len(piece)
                left -= len(piece)
        return crc

    def _write_header(self, metadata: dict, specs: dict) -> None:
        """The header (the layout of ``specs`` + string ``metadata``) into the reserved room."""
        header, _ = self._layout(specs)
        blob = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
        if len(blob) > HEADER_ROOM:
            raise ValueError(f"book header of {len(blob)} bytes over its {HEADER_ROOM}-byte room")
        blob += b" " * (HEADER_ROOM - len(blob))
        os.pwrite(self.fd, HEADER_ROOM.to_bytes(8, "little") + blob, 0)

    def finish(self, metadata: dict) -> None:
        """Write the final header (tensor layout + string ``metadata``) into the reserved room, cut
        the resume region off, then fsync."""
        self._write_header(metadata, self.specs)
        if self.resume_size:
            os.fsync(self.fd)  # the header before the cut: a read stopped between them still resumes
            os.ftruncate(self.fd, self.resume_at)
            self.resume_size = 0
        os.fsync(self.fd)

    # --- the resume region ----------------------------------------------------------------------
    def sync(self) -> None:
        os.fsync(self.fd)

    def write_slot(self, seq: int, payload: bytes) -> None:
        """Keep ``payload`` (a point the read reached) as number ``seq`` in the resume region's slot
        ``seq % 2``, then fsync: the other slot keeps the point before it."""
        half = self.resume_size // 2
        os.pwrite(self.fd, resume_points.slot(seq, payload, half), self.resume_at + (seq % 2) * half)
        os.fsync(self.fd)

    def latest_slot(self) -> tuple[int, bytes] | None:
        """(number, payload) of the newest slot whose CRC-32 holds; None when no slot does."""
        return resume_points.latest_slot(self.fd, self.resume_at, self.resume_size)

    def nbytes(self) -> int:
        return 0  # on disk, not in memory

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Destination:
    """Where a read (:meth:`kvcli.compressors.infllm.InfLLM.read`) puts the book it reads."""

    def start(self, specs: dict, room: int, new: Callable) -> object:
        """The book to read into, ``new(storage)`` for a storage laid out by ``specs``; or — a
        destination that keeps the reads it did not finish — that book resumed where the last read
        stopped. ``room``: the bytes of a resume point at most (:meth:`BookCache.point_bytes`)."""
        raise NotImplementedError

    def reached(self, book) -> None:
        """After each chunk of the read."""

    def interrupted(self) -> None:
        """The read stopped before its end (an error, Ctrl-C); its storage is still open."""


class InMemory(Destination):
    """The book in memory (no disk store, ``--no-cache``, an entry over the cap or the free space)."""

    def start(self, specs: dict, room: int, new: Callable) -> object:
        return new(MemoryStorage(specs))


class NewFile(Destination):
    """The book into a new file at ``path`` (a read that stops leaves nothing to resume)."""

    def __init__(self, path) -> None:
        self.path = path

    def start(self, specs: dict, room: int, new: Callable) -> object:
        return new(FileStorage.create(self.path, specs))
