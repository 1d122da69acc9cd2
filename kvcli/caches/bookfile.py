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

The result is an ordinary safetensors file (``safe_open`` reads it; ``kvcli cache ls`` does).
Tensors, per layer ``l``: ``k.l`` and ``v.l`` (n_kv, n, d) — the keys *before* RoPE (see
:mod:`kvcli.caches.book`) and the values of every token, in 16 bits; ``repsum.l`` (n_kv,
n_blocks, d) float32 — the sum of each block's representative keys. Data, never code.
"""

from __future__ import annotations

import json
import os
import zlib

import torch

from ..files import _ST_DTYPES

HEADER_ROOM = 1 << 16  # bytes reserved for the JSON header (the metadata is written last)
_CRC_READ = 8 << 20  # bytes per read while checksumming


def tensor_specs(n_layers: int, n_kv: int, n: int, d: int, n_blocks: int, dtype: torch.dtype) -> dict:
    """name -> (dtype, shape) of a book of ``n`` tokens with ``n_blocks`` memory blocks."""
    specs = {}
    for layer in range(n_layers):
        specs[f"k.{layer}"] = (dtype, (n_kv, n, d))
        specs[f"v.{layer}"] = (dtype, (n_kv, n, d))
        specs[f"repsum.{layer}"] = (torch.float32, (n_kv, n_blocks, d))
    return specs


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
        self.tensors = tensors if tensors is not None else {name: torch.zeros(shape, dtype=dt) for name, (dt, shape) in specs.items()}

    def write(self, name: str, index: tuple, value: torch.Tensor) -> None:
        """``tensor[name][head, lo:hi]`` (index = (head, lo, hi)) <- value (hi - lo, ...)."""
        head, lo, hi = index
        self.tensors[name][head, lo:hi] = value

    def read(self, name: str, head: int, lo: int, hi: int) -> torch.Tensor:
        return self.tensors[name][head, lo:hi]

    def whole(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def close(self) -> None:
        pass


class FileStorage:
    """The book's tensors in a safetensors file, written and read in place (see the module doc)."""

    def __init__(self, path, specs: dict, fd: int, offsets: dict, data_start: int) -> None:
        self.path = str(path)
        self.specs = specs
        self.fd = fd
        self.offsets = offsets  # name -> byte offset of the tensor in the file
        self.data_start = data_start

    # --- layout -------------------------------------------------------------------------------
    @staticmethod
    def _layout(specs: dict) -> tuple[dict, dict]:
        header, offsets, offset = {}, {}, 0
        # largest element first (aligned), then by name: as kvcli.files.write_safetensors orders them
        for name in sorted(specs, key=lambda n: (-torch.empty((), dtype=specs[n][0]).element_size(), n)):
            dt, shape = specs[name]
            size = torch.empty((), dtype=dt).element_size() * _numel(shape)
            header[name] = {"dtype": _ST_DTYPES[str(dt).removeprefix("torch.")], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offsets[name] = offset
            offset += size
        return header, offsets

    @classmethod
    def create(cls, path, specs: dict) -> "FileStorage":
        """A new file of the final size (sparse until written), its header room reserved."""
        header, offsets = cls._layout(specs)
        total = sum(h["data_offsets"][1] - h["data_offsets"][0] for h in header.values())
        fd = os.open(str(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, 8 + HEADER_ROOM + total)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, specs, fd, {n: 8 + HEADER_ROOM + o for n, o in offsets.items()}, 8 + HEADER_ROOM)

    @classmethod
    def open(cls, path) -> tuple["FileStorage", dict]:
        """An existing book file and its ``__metadata__``; raises ValueError when it is not one."""
        fd = os.open(str(path), os.O_RDONLY)
        try:
            n = int.from_bytes(os.pread(fd, 8, 0), "little")
            if not 0 < n <= HEADER_ROOM:
                raise ValueError(f"header of {n} bytes, expected at most {HEADER_ROOM}")
            header = json.loads(os.pread(fd, n, 8))
            meta = header.pop("__metadata__", {}) or {}
            inverse = {v: k for k, v in _ST_DTYPES.items()}
            specs, offsets = {}, {}
            for name, h in header.items():
                specs[name] = (getattr(torch, inverse[h["dtype"]]), tuple(h["shape"]))
                offsets[name] = 8 + n + h["data_offsets"][0]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            os.close(fd)
            raise ValueError(f"not a book file: {e}") from e
        except BaseException:
            os.close(fd)
            raise
        return cls(path, specs, fd, offsets, 8 + n), meta

    # --- rows -----------------------------------------------------------------------------------
    def _row_bytes(self, name: str) -> tuple[int, int]:
        dt, shape = self.specs[name]
        size = torch.empty((), dtype=dt).element_size()
        per_row = size * _numel(shape[2:])
        return per_row, per_row * shape[1]

    def write(self, name: str, index: tuple, value: torch.Tensor) -> None:
        head, lo, hi = index
        per_row, per_head = self._row_bytes(name)
        data = value.detach().to("cpu", self.specs[name][0]).contiguous().view(-1).view(torch.uint8).numpy()
        os.pwrite(self.fd, data.data, self.offsets[name] + head * per_head + lo * per_row)

    def read(self, name: str, head: int, lo: int, hi: int) -> torch.Tensor:
        dt, shape = self.specs[name]
        per_row, per_head = self._row_bytes(name)
        out = torch.empty((hi - lo, *shape[2:]), dtype=dt)
        buf = out.view(-1).view(torch.uint8).numpy()
        got = os.preadv(self.fd, [buf.data], self.offsets[name] + head * per_head + lo * per_row)
        if got != buf.nbytes:
            raise OSError(f"short read in {self.path}")
        return out

    def whole(self, name: str) -> torch.Tensor:
        shape = self.specs[name][1]
        return torch.stack([self.read(name, h, 0, shape[1]) for h in range(shape[0])]) if shape[0] else torch.empty(shape, dtype=self.specs[name][0])

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

    def finish(self, metadata: dict) -> None:
        """Write the header (tensor layout + string ``metadata``) into the reserved room, then fsync."""
        header, _ = self._layout(self.specs)
        blob = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
        if len(blob) > HEADER_ROOM:
            raise ValueError(f"book header of {len(blob)} bytes over its {HEADER_ROOM}-byte room")
        blob += b" " * (HEADER_ROOM - len(blob))
        os.pwrite(self.fd, HEADER_ROOM.to_bytes(8, "little") + blob, 0)
        os.fsync(self.fd)

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
