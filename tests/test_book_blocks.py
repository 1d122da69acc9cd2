"""A book's retrieved blocks read in one call (:meth:`~kvcli.caches.bookfile.MemoryStorage.read_blocks`,
:class:`~kvcli.caches.bookfile.FileStorage`'s and :class:`~kvcli.caches.bookfile.QuantRows`'): the
rows per-span reads return, bit for bit, for every storage and precision — against a reference
made here from the rows written (sliced span by span; at 8 and 4 bits each span quantized and
dequantized on its own by the codec), and against the storage's own one-span reads. And the rows
of every head written at once (``head`` a slice: how the book writes them) are the bytes written
head by head."""

from __future__ import annotations

import pytest
import torch

from kvcli.caches import quant
from kvcli.caches.bookfile import FileStorage, MemoryStorage, kv_rows, tensor_specs

N_KV, N, D, SIZE = 3, 64, 16, 8
# head 0: adjacent blocks and the head's last one (the file runs on into head 1's first block);
# head 1: out of order, a block at an offset that is no multiple of SIZE; head 2: one block twice
STARTS = [[8, 16, 56], [0, 40, 21], [32, 32, 0]]


def _storage(kind: str, specs: dict, tmp_path, name: str = "book"):
    return MemoryStorage(specs) if kind == "memory" else FileStorage.create(tmp_path / f"{name}.safetensors", specs)


def _reference(rows: torch.Tensor, starts: list[list[int]], bits: int) -> torch.Tensor:
    """(heads, k * SIZE, D) of ``rows`` (heads, N, D): each span sliced, rounded by the codec on its own."""

    def span(h: int, lo: int) -> torch.Tensor:
        x = rows[h, lo : lo + SIZE]
        return x if bits == 16 else quant.dequantize(quant.quantize(x, bits), D, rows.dtype)

    return torch.stack([torch.cat([span(h, lo) for lo in row]) if row else rows[h, :0] for h, row in enumerate(starts)])


@pytest.mark.parametrize("kind", ["memory", "file"])
@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("starts", [STARTS, [[], [], []]], ids=["blocks", "none"])
def test_read_blocks_is_the_spans_read_one_by_one(kind, bits, starts, tmp_path):
    torch.manual_seed(0)
    specs = tensor_specs(1, N_KV, N, D, 4, torch.float16, bits)
    storage = _storage(kind, specs, tmp_path)
    rows = kv_rows(storage, D, torch.float16)
    written = torch.randn(N_KV, N, D).to(torch.float16)
    for h in range(N_KV):
        for lo in range(0, N, 16):  # written in pieces, as a book writes its blocks
            rows.write("k.0", (h, lo, lo + 16), written[h, lo : lo + 16])
    got = rows.read_blocks("k.0", torch.tensor(starts, dtype=torch.long).reshape(N_KV, -1), SIZE)
    assert got.shape == (N_KV, len(starts[0]) * SIZE, D) and got.dtype == torch.float16
    assert torch.equal(got, _reference(written, starts, bits))
    one_by_one = [[rows.read("k.0", h, lo, lo + SIZE) for lo in row] for h, row in enumerate(starts)]
    if starts[0]:
        assert torch.equal(got, torch.stack([torch.cat(spans) for spans in one_by_one]))
    storage.close()


@pytest.mark.parametrize("kind", ["memory", "file"])
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_a_write_of_every_head_is_the_writes_head_by_head(kind, bits, tmp_path):
    torch.manual_seed(0)
    specs = tensor_specs(1, N_KV, N, D, 4, torch.float16, bits)
    written = torch.randn(N_KV, N, D).to(torch.float16)
    stored = []
    for at_once in (False, True):
        storage = _storage(kind, specs, tmp_path, f"at_once={at_once}")
        rows = kv_rows(storage, D, torch.float16)
        for lo in range(0, N, 24):  # pieces of 24 rows, the last one shorter
            hi = min(N, lo + 24)
            if at_once:
                rows.write("k.0", (slice(None), lo, hi), written[:, lo:hi])
            else:
                for h in range(N_KV):
                    rows.write("k.0", (h, lo, hi), written[h, lo:hi])
        stored.append({name: storage.whole(name).clone() for name in specs if name.startswith("k.0")})
        storage.close()
    assert stored[0].keys() == stored[1].keys() and len(stored[0]) == (1 if bits == 16 else 3)
    assert all(torch.equal(stored[0][name], stored[1][name]) for name in stored[0])
    assert not all(torch.equal(t, torch.zeros_like(t)) for t in stored[1].values())
