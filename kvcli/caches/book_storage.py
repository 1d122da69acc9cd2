"""The book on its storage (:class:`kvcli.caches.book.BookCache`, InfLLM's stored book): what it
writes there and reads back. Its rows are written as they leave Local (:meth:`StoredBook.write_rows`)
and, once the document is read, the rest (:meth:`StoredBook.finish_read`); a finished storage is
the book (:meth:`StoredBook.from_storage`), and a disk-store entry is opened in place as one
(:meth:`StoredBook.open_entry`).

A read that stops can resume from the end of any chunk (:meth:`BookCache.read_point`): every row
of the storage is only ever written with its final bytes, so a point needs the storage's rows up to
it (Local's rows and the representatives written there by :meth:`BookCache.save_point`) and, beside
them, its facts and Local's representative scores (:meth:`BookCache.resume`). A book stored in 8 or
4 bits holds Local's rows rounded, while the read holds them in 16: its points carry Local's keys
and values too (:meth:`StoredBook.carried_bytes`). The resumed read runs the same chunks on the
same state: the same KV, bit for bit.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from ..resume_points import pack, unpack
from .bookfile import FileStorage, precision_facts, precision_of

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


class StoredBook:
    """What :class:`~kvcli.caches.book.BookCache` writes to its storage and reads back: its rows, a
    finished read, the entry it is opened from, a read stopped at the end of a chunk and taken up
    again. It works on the book's state, declared here; the book's attention keeps it up to date."""

    storage: object  # the rows' storage: :class:`~kvcli.caches.bookfile.FileStorage` or in memory
    rows: object  # the keys and values in the storage (8 or 4 bits: :class:`~kvcli.caches.bookfile.QuantRows`)
    n_doc: int  # tokens of the document the storage is laid out for
    n_layers_: int
    n_kv: int
    d: int  # head_dim
    dtype: torch.dtype  # Local's, the rows read
    initial: int
    block_size: int
    local: int
    topk: int
    repr_topk: int
    max_blocks: int
    origin: int  # absolute position of the first Local token
    n_blocks: int  # blocks in Memory
    tail_k: list  # per layer: Local's keys before RoPE (1, n_kv, local_len, d), its values, scores
    tail_v: list
    tail_score: list
    init_k: list | None  # per layer: Initial's keys and values, once Initial left Local
    init_v: list | None
    repsum: list  # per layer: (n_kv, max_blocks, d) the sum of each Memory block's representatives
    positions: torch.Tensor | None
    reading: bool  # True while the document is read
    # and the book's properties: tokens seen, Local's length, the storage's bits
    n_tokens: int
    local_len: int
    kv_bits: int

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

    def carried(self) -> int:
        """The bytes a resume point of this book carries per Local token (:meth:`carried_bytes`)."""
        return self.carried_bytes(self.n_layers_, self.n_kv, self.d, self.dtype, self.kv_bits)

    def write_rows(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``start``.. of every head (k, v: (1, n_kv, n, d)) to the storage, in one write of each."""
        self.rows.write(f"k.{layer}", (slice(None), start, start + k.shape[2]), k[0])
        self.rows.write(f"v.{layer}", (slice(None), start, start + v.shape[2]), v[0])

    def storage_rows(self, t: str, layer: int, lo: int, hi: int) -> torch.Tensor:
        return torch.stack([self.rows.read(f"{t}.{layer}", h, lo, hi) for h in range(self.n_kv)])[None]

    def finish_read(self) -> None:
        """The document is read: write the tail still in Local and the representatives; Local is then
        the tail as stored (8 or 4 bits: rounded), as in the book opened from the store (:meth:`from_storage`)."""
        if self.origin + self.local_len != self.n_doc:
            raise ValueError(f"read {self.origin + self.local_len} tokens of a {self.n_doc}-token book")
        for layer in range(self.n_layers_):
            self.write_rows(layer, self.origin, self.tail_k[layer], self.tail_v[layer])
            self.tail_k[layer] = self.storage_rows("k", layer, self.origin, self.n_doc)
            self.tail_v[layer] = self.storage_rows("v", layer, self.origin, self.n_doc)
            self.storage.write(f"repsum.{layer}", (slice(None), 0, self.max_blocks), self.repsum[layer])
        self.tail_score = [torch.zeros(self.n_kv, 0)] * self.n_layers_
        self.reading = False

    # --- the store ------------------------------------------------------------------------------
    def facts(self) -> dict:
        return {
            **self.geometry(),  # the book's shape
            "topk": self.topk,
            "repr_topk": self.repr_topk,
            "origin": self.origin,
            "n_blocks": self.n_blocks,
            **precision_facts(self.storage.specs, self.d, self.dtype),  # 8 or 4 bits: those, the rows' dtype
        }

    @classmethod
    def from_storage(cls, storage, facts: dict, retrieval: str = "step") -> StoredBook:
        """The book a finished storage holds (a file of the disk store, or memory)."""
        f = {k: int(facts[k]) for k in (*GEOMETRY, "topk", "repr_topk", "origin", "n_blocks")}
        dtype = precision_of(facts, storage.specs, f["head_dim"])  # its bits checked against its tensors
        book = cls(
            storage,
            f["n_doc"],
            f["n_layers"],
            f["n_kv"],
            f["head_dim"],
            initial=f["initial"],
            block_size=f["block_size"],
            local=f["local"],
            topk=f["topk"],
            repr_topk=f["repr_topk"],
            retrieval=retrieval,
            dtype=dtype,
        )
        if f["n_blocks"] != book.max_blocks or not 0 <= f["origin"] <= f["n_doc"]:
            raise ValueError(f"{f['n_blocks']} blocks, expected {book.max_blocks}")
        book.origin, book.n_blocks = f["origin"], f["n_blocks"]
        n = book.n_doc
        book.tail_k = [book.storage_rows("k", layer, book.origin, n) for layer in range(book.n_layers_)]
        book.tail_v = [book.storage_rows("v", layer, book.origin, n) for layer in range(book.n_layers_)]
        if book.n_blocks:
            book.init_k = [book.storage_rows("k", layer, 0, book.initial) for layer in range(book.n_layers_)]
            book.init_v = [book.storage_rows("v", layer, 0, book.initial) for layer in range(book.n_layers_)]
        book.repsum = [storage.whole(f"repsum.{layer}").to(torch.float32) for layer in range(book.n_layers_)]
        book.positions = torch.arange(n)
        return book

    @classmethod
    def open_entry(cls, path, meta: dict) -> StoredBook:
        """The book a disk-store entry holds (:mod:`kvcli.store.book`), read in place: its layout
        checked against the entry's metadata and its CRC-32 against the bytes (read back in
        pieces, never held); ValueError when anything differs."""
        storage, _ = FileStorage.open(path)
        try:
            got = {n: [str(dt), list(shape)] for n, (dt, shape) in storage.specs.items()}
            if meta.get("tensors") != got:
                raise ValueError("tensors differ from its metadata")
            if storage.crc32() != meta.get("crc32"):
                raise ValueError("checksum mismatch")
            return cls.from_storage(storage, meta.get("facts") or {})
        except BaseException:
            storage.close()
            raise

    # --- a read that stops and resumes ----------------------------------------------------------
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

    def geometry(self) -> dict:
        """The book's shape, as its facts and its resume points hold it (:data:`GEOMETRY`)."""
        shape = (self.n_doc, self.n_layers_, self.n_kv, self.d, self.initial, self.block_size, self.local)
        return dict(zip(GEOMETRY, shape))

    def save_point(self, point: ReadPoint, extra: dict | None = None) -> bytes:
        """Write what the storage lacks of ``point`` into it — Local's rows (at their final place)
        and the representatives of its Memory blocks — and return the rest, for a resume region
        (:meth:`kvcli.caches.bookfile.FileStorage.write_slot`): the facts (with ``extra``),
        Local's representative scores and, in 8 or 4 bits, Local's keys and values (:meth:`carried_bytes`)."""
        for layer in range(self.n_layers_):
            self.write_rows(layer, point.origin, point.tail_k[layer], point.tail_v[layer])
            for h in range(self.n_kv):
                self.storage.write(f"repsum.{layer}", (h, 0, point.n_blocks), point.repsum[layer][h, : point.n_blocks])
        facts = {
            **(extra or {}),
            **self.geometry(),
            "tokens": point.tokens,
            "origin": point.origin,
            "n_blocks": point.n_blocks,
            "local_len": point.tokens - point.origin,
            "tail_crc": _crc(point.tail_k, point.tail_v),
        }
        carried = (*point.tail_k, *point.tail_v) if self.carried() else ()
        return pack(facts, b"".join(_bytes(t) for t in (*point.tail_score, *carried)))

    def resume(self, payload: bytes) -> dict:
        """Take up the read where the point ``payload`` (:meth:`save_point`) stood: Local read back
        from the storage or, in 8 or 4 bits, from the point (checked against the point's CRC-32),
        its scores, the representatives of Memory. Returns the point's facts; ValueError when the
        point is not one of this book's."""
        facts, blob = unpack(payload)
        if any(facts.get(k) != v for k, v in self.geometry().items()):
            raise ValueError("a resume point of another book")
        tokens, origin, n_blocks = int(facts["tokens"]), int(facts["origin"]), int(facts["n_blocks"])
        first_local = self.initial + n_blocks * self.block_size if n_blocks else 0
        if not (
            0 <= n_blocks <= self.max_blocks
            and origin == first_local
            and origin <= tokens <= self.n_doc
            and len(blob) == (4 * self.n_layers_ * self.n_kv + self.carried()) * (tokens - origin)
        ):
            raise ValueError(f"an inconsistent resume point ({tokens} tokens, {n_blocks} blocks)")
        self.origin, self.n_blocks = origin, n_blocks
        n_loc, at = tokens - origin, 4 * self.n_layers_ * self.n_kv * (tokens - origin)
        if self.carried():  # Local's keys, then its values, layer by layer, after the scores
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
