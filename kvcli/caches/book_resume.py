"""A book's read that resumes (:class:`kvcli.caches.book.BookCache`, InfLLM's stored book).

A read that stops can resume from the end of any chunk (:meth:`BookCache.read_point`): every row
of the storage is only ever written with its final bytes, so a point needs the storage's rows up to
it (Local's rows and the representatives written there by :meth:`BookCache.save_point`) and, beside
them, its facts and Local's representative scores (:meth:`BookCache.resume`). A book stored in 8 or
4 bits holds Local's rows rounded, while the read holds them in 16: its points carry Local's keys
and values too (:meth:`ResumableRead.carried_bytes`). The resumed read runs the same chunks on the
same state: the same KV, bit for bit.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

POINT_FACTS = 4096  # bytes a resume point's facts take at most
GEOMETRY = ("n_doc", "n_layers", "n_kv", "head_dim", "initial", "block_size", "local")  # a book's shape, in its facts


@dataclass
class ReadPoint:
    """Where a read stood at the end of a chunk (:meth:`BookCache.read_point`): its counters, and
    the tensors (held, never copied) that the storage does not hold yet."""

    tokens: int
    origin: int
    n_blocks: int
    tail_k: list
    tail_v: list
    tail_score: list
    repsum: list  # rows [0, n_blocks) are final: later blocks write only rows after them


class ResumableRead:
    """What :class:`~kvcli.caches.book.BookCache` does to stop a read at the end of a chunk and take
    it up again (its storage, counters and Local are the book's own)."""

    @staticmethod
    def point_bytes(
        n_doc: int, n_layers: int, n_kv: int, initial: int, local: int, block_size: int, carried: int = 0
    ) -> int:
        """The bytes of a resume point at most: its facts, Local's scores and ``carried`` bytes a
        Local token (:meth:`carried_bytes`), at the end of a chunk under ``initial + local +
        block_size`` tokens (:meth:`end_chunk` moves every block followed by ``local`` tokens)."""
        return POINT_FACTS + (4 * n_layers * n_kv + carried) * min(n_doc, initial + local + block_size)

    @staticmethod
    def carried_bytes(n_layers: int, n_kv: int, d: int, dtype: torch.dtype, bits: int) -> int:
        """The bytes a resume point carries per Local token besides its scores: none when the
        storage holds Local's rows as they are (16 bits), else its keys and values in ``dtype``."""
        return 0 if bits == 16 else 2 * n_layers * n_kv * d * dtype.itemsize

    def _carried(self) -> int:
        return self.carried_bytes(self.n_layers_, self.n_kv, self.d, self.dtype, self.kv_bits)

    def read_point(self) -> ReadPoint:
        """Where this read stands (call it at the end of a chunk): cheap, the tensors are held."""
        return ReadPoint(
            self.n_tokens,
            self.origin,
            self.n_blocks,
            list(self.tail_k),
            list(self.tail_v),
            list(self.tail_score),
            list(self.repsum),
        )

    def _geometry(self) -> dict:
        shape = (self.n_doc, self.n_layers_, self.n_kv, self.d, self.initial, self.block_size, self.local)
        return dict(zip(GEOMETRY, shape))

    def save_point(self, point: ReadPoint, extra: dict | None = None) -> bytes:
        """Write what the storage lacks of ``point`` into it — Local's rows (at their final place)
        and the representatives of its Memory blocks — and return the rest, for a resume region
        (:meth:`kvcli.caches.bookfile.FileStorage.write_slot`): the facts (with ``extra``),
        Local's representative scores and, in 8 or 4 bits, Local's keys and values (:meth:`carried_bytes`)."""
        from .bookfile import pack

        for layer in range(self.n_layers_):
            self._write(layer, point.origin, point.tail_k[layer], point.tail_v[layer])
            for h in range(self.n_kv):
                self.storage.write(f"repsum.{layer}", (h, 0, point.n_blocks), point.repsum[layer][h, : point.n_blocks])
        facts = {
            **(extra or {}),
            **self._geometry(),
            "tokens": point.tokens,
            "origin": point.origin,
            "n_blocks": point.n_blocks,
            "local_len": point.tokens - point.origin,
            "tail_crc": _crc(point.tail_k, point.tail_v),
        }
        carried = (*point.tail_k, *point.tail_v) if self._carried() else ()
        return pack(facts, b"".join(_bytes(t) for t in (*point.tail_score, *carried)))

    def resume(self, payload: bytes) -> dict:
        """Take up the read where the point ``payload`` (:meth:`save_point`) stood: Local read back
        from the storage or, in 8 or 4 bits, from the point (checked against the point's CRC-32),
        its scores, the representatives of Memory. Returns the point's facts; ValueError when the
        point is not one of this book's."""
        from .bookfile import unpack

        facts, blob = unpack(payload)
        if any(facts.get(k) != v for k, v in self._geometry().items()):
            raise ValueError("a resume point of another book")
        tokens, origin, n_blocks = int(facts["tokens"]), int(facts["origin"]), int(facts["n_blocks"])
        first_local = self.initial + n_blocks * self.block_size if n_blocks else 0
        if not (
            0 <= n_blocks <= self.max_blocks
            and origin == first_local
            and origin <= tokens <= self.n_doc
            and len(blob) == (4 * self.n_layers_ * self.n_kv + self._carried()) * (tokens - origin)
        ):
            raise ValueError(f"an inconsistent resume point ({tokens} tokens, {n_blocks} blocks)")
        self.origin, self.n_blocks = origin, n_blocks
        n_loc, at = tokens - origin, 4 * self.n_layers_ * self.n_kv * (tokens - origin)
        if self._carried():  # Local's keys, then its values, layer by layer, after the scores
            rows = _tensor(blob[at:], self.dtype).view(2, self.n_layers_, 1, self.n_kv, n_loc, self.d)
            self.tail_k, self.tail_v = list(rows[0].clone().unbind(0)), list(rows[1].clone().unbind(0))
        else:
            self.tail_k = [self.storage_rows("k", layer, origin, tokens) for layer in range(self.n_layers_)]
            self.tail_v = [self.storage_rows("v", layer, origin, tokens) for layer in range(self.n_layers_)]
        if _crc(self.tail_k, self.tail_v) != facts["tail_crc"]:
            raise ValueError("its local window differs from what the point recorded")
        scores = _tensor(blob[:at], torch.float32).view(self.n_layers_, self.n_kv, n_loc)
        self.tail_score = list(scores.clone().unbind(0))
        if n_blocks:
            self.init_k = [self.storage_rows("k", layer, 0, self.initial) for layer in range(self.n_layers_)]
            self.init_v = [self.storage_rows("v", layer, 0, self.initial) for layer in range(self.n_layers_)]
        for layer in range(self.n_layers_):
            for h in range(self.n_kv):
                self.repsum[layer][h, :n_blocks] = self.storage.read(f"repsum.{layer}", h, 0, n_blocks)
        self.positions = torch.arange(tokens) if tokens else None
        return facts


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _tensor(blob: bytes, dtype: torch.dtype) -> torch.Tensor:
    """``blob``'s numbers in ``dtype`` (1-D; a copy: the blob stays as it is)."""
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(dtype) if blob else torch.zeros(0, dtype=dtype)


def _crc(tail_k: list, tail_v: list) -> int:
    """CRC-32 of Local's keys and values, layer by layer."""
    crc = 0
    for k, v in zip(tail_k, tail_v):
        for t in (k, v):
            crc = zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy().data if t.numel() else b"", crc)
    return crc
