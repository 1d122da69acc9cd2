"""4- and 8-bit weights on the CPU, through PyTorch's own CPU kernels and kvcli's for 8-bit decoding.

``--quant 4`` / ``8bit`` on the CPU replace every ``nn.Linear`` of the decoder layers:

* **4bit** — :class:`Int4Linear`: groups of :data:`GROUP` weights along the input dimension, each
  ``scale · q + min`` with q in 0..15 (asymmetric, as llama.cpp's Q4_1), run by
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (weights packed once by
  ``_convert_weight_to_int4pack_for_cpu``). The embedded model's GGUF stores its linear layers as
  Q4_1 blocks of 32 along that same dimension, so its dequantised float32 weights are quantised back
  to exactly those blocks (:func:`quantize_int4`: a block's smallest and largest values are codes 0
  and 15): 4bit runs the GGUF's own weights, not a second rounding of them. Q4_K's sub-blocks of 32
  (Qwen's Q4_K_M) come back exact too, their codes wherever they lie in 0..15 (:func:`grid_steps`);
  a matrix the GGUF holds in more bits (Q5_0, Q6_K, Q8_0) stays :class:`Int8Linear`
  (:func:`four_bit_fits`), as ``--quant 8`` runs it.
* **8bit** — :class:`Int8Linear`: one scale per output row (symmetric), run by
  ``torch.ops.aten._weight_int8pack_mm``, its passes under :attr:`Int8Linear.dense_rows` rows by
  kvcli's own kernel where it compiles: exact activations by default, 8-bit ones asked for (those
  in decoding's passes only; :func:`use_int8_rows`, :mod:`kvcli.model.int8_rows`).
* The token embedding and the LM head (one table when tied) are int8 per row in both modes
  (:class:`Int8Embedding` gathers and scales rows; the head is an :class:`Int8Linear`): the GGUF
  stores that table as Q8_0, and the head is the one matrix every decoding step reads whole.

Both kernels are fast only with bfloat16 activations on this CPU (measured: float32 activations run
them 10-40x slower), so a quantised model runs in bfloat16 (:func:`check_cpu_quant`), its KV too. A
prefill's many rows run the weights made dense and oneDNN's bfloat16 GEMM only where that GEMM
outruns float32's (AMX: :func:`kvcli.runtime.native.fast_gemm`), else the float32 one (docs/cpu.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from ..runtime.measure import HEAP_BLOCK_MAX
from ..runtime.native import avx512, fast_gemm
from . import int8_rows

GROUP = 32  # weights per 4-bit group along the input dimension (the GGUF's Q4_1 block)
INNER_K_TILES = 2  # the int4 packing's tile parameter on the CPU
N_MULTIPLE = 16  # the int4 packing needs the output size a multiple of this
DTYPE = torch.bfloat16  # the activations' dtype of a quantised model on the CPU


# --- the quantisers -----------------------------------------------------------------------------
ROWS = 2048  # rows quantised at a time: temporaries bounded (the 49,152-row token table: ~20 MB, not ~450)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> (int8 codes (out, in), float32 scale per row): ``w ≈ scale · q``, |q| ≤ 127."""
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for a in range(0, weight.shape[0], ROWS):
        w = weight.detach()[a : a + ROWS].to(torch.float32)
        s = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        codes[a : a + ROWS] = torch.round(w / s[:, None]).clamp(-127, 127)
        scale[a : a + ROWS] = s
    return codes, scale


GRID_TOL = 1e-3  # how far from a code a weight may lie, in steps, and still be on a group's grid


def _fits(n: torch.Tensor, groups: torch.Tensor, lo: torch.Tensor, span: torch.Tensor, most: int) -> torch.Tensor:
    """Whether each group's values lie on ``lo + span / n · c`` for integers c, 1 <= n <= ``most``."""
    x = (groups - lo[..., None]) * (n / span.clamp(min=torch.finfo(torch.float32).tiny))[..., None]
    return ((x - x.round()).abs().amax(dim=-1) <= GRID_TOL) & (n >= 1) & (n <= most)


def _guessed(groups: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's steps guessed from the smallest gap between its distinct values (a grid's
    step when two of its codes are neighbours), and whether the group is on that grid."""
    span = hi - lo
    gaps = groups.sort(dim=-1).values.diff(dim=-1)
    floor = span[..., None] * GRID_TOL / most
    smallest = torch.where(gaps > floor, gaps, torch.full_like(gaps, float("inf"))).amin(dim=-1)
    guess = (span / smallest).round()
    return guess, _fits(guess, groups, lo, span, most) | (span == 0)  # one value: code 0 of any grid


def grid_steps(groups: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., group) weights, their groups' smallest and largest -> (steps: how many codes the range
    spans, float32; on_grid: bool), per group. A group on a 4-bit grid (``lo + step · c``, c in 0..n,
    n <= 15: what Q4_1 and Q4_K blocks dequantise to, wherever their codes lie in 0..15) gets that n,
    found from the smallest gap between its distinct values and checked, else each n from 15 down;
    a group on no such grid gets 15 (the nearest code, as Q4_1's quantiser rounds)."""
    guess, on_grid = _guessed(groups, lo, hi, 15)
    steps = torch.where(on_grid & (hi > lo), guess, torch.full_like(guess, 15.0))
    left = (~on_grid).nonzero(as_tuple=True)
    if left[0].numel():  # codes whose smallest gap is 2 or more apart: each n in turn, the rest only
        w, low, span = groups[left], lo[left], hi[left] - lo[left]
        found = torch.zeros(span.shape, dtype=torch.bool)
        chosen = torch.full_like(span, 15.0)
        for n in range(15, 0, -1):
            new = ~found & _fits(torch.full_like(span, float(n)), w, low, span, 15)
            chosen[new], found = float(n), found | new
        steps[left], on_grid[left] = chosen, found
    return steps, on_grid


FINE_GROUPS, FINE_STEPS = (16, 32), 255  # Q6_K's sub-blocks of 16 (64 codes); Q5_0's, Q8_0's blocks of 32 (32, 255)
GRID_SHARE = 0.9  # the share of a matrix's groups on a grid that says the GGUF stored it so


def _share_on_grid(weight: torch.Tensor, group: int, steps: int) -> float:
    """The share of an (out, in) matrix's groups of ``group`` inputs on a grid of at most ``steps``
    steps, each found from its smallest gap (:func:`_guessed`) or, for 4-bit grids, every n (:func:`grid_steps`)."""
    n, k = weight.shape
    hits = 0
    for a in range(0, n, ROWS):
        w = weight.detach()[a : a + ROWS].to(torch.float32).reshape(-1, group)
        lo, hi = w.amin(-1), w.amax(-1)
        hits += int((grid_steps(w, lo, hi) if steps == 15 else _guessed(w, lo, hi, steps))[1].sum())
    return hits / (n * k // group)


def held_in_more_bits(weight: torch.Tensor) -> bool:
    """Whether an (out, in) matrix is a GGUF's block of more than 4 bits dequantised (Q5_0, Q6_K,
    Q8_0): most of its groups of 16 or of 32 (:data:`FINE_GROUPS`) on grids of at most
    :data:`FINE_STEPS` steps, but not most of its groups of :data:`GROUP` on 4-bit grids. A float
    model's matrix is on neither."""
    if weight.shape[1] % GROUP:
        return False
    if max(_share_on_grid(weight, g, FINE_STEPS) for g in FINE_GROUPS) < GRID_SHARE:
        return False
    return _share_on_grid(weight, GROUP, 15) < GRID_SHARE


def quantize_int4(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float -> (codes 0..15 as int32 (out, in), scale, minimum: float32 (out, in/group)):
    ``w ≈ scale · q + minimum`` per group of ``group`` inputs, the group's smallest value code 0.
    A group already on a 4-bit grid keeps it exactly (:func:`grid_steps`: Q4_1- and Q4_K-dequantised
    weights come back as they were); any other has its largest value code 15 and the rest rounded to
    the nearest code (what llama.cpp's Q4_1 stores)."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.int32)
    scale = torch.empty(n, k // group, dtype=torch.float32)
    low = torch.empty(n, k // group, dtype=torch.float32)
    for a in range(0, n, ROWS):
        w = weight.detach()[a : a + ROWS].to(torch.float32).reshape(-1, k // group, group)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        s = (hi - lo) / grid_steps(w, lo, hi)[0]
        s = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: code 0 is its value
        codes[a : a + ROWS] = torch.round((w - lo[..., None]) / s[..., None]).clamp(0, 15).reshape(-1, k)
        scale[a : a + ROWS], low[a : a + ROWS] = s, lo
    return codes, scale, low


# --- the layers ---------------------------------------------------------------------------------
# Rows from which a product runs on float32 weights made dense and the float32 GEMM where the
# 16-bit GEMM is not faster than float32's (:func:`~kvcli.runtime.native.fast_gemm`: no AMX), instead of the integer kernel:
# there the 1.5B Qwen read a 2,034-token prompt in 108 s through the int8 kernel against 63 s in
# float32 (docs/cpu.md); fewer rows stay on the kernel (kvcli's exact one, :func:`use_int8_rows`):
# measured again with freed memory kept and the pieces of :func:`piece_rows` (an AMD EPYC with AVX2,
# 2026-12-03, benchmarks/dense_rows.py), the exact kernel and float32 dense cross near 256-384 rows;
# where the float32 GEMM runs AVX-512 (:func:`~kvcli.runtime.native.avx512`: a Xeon without AMX,
# 2026-12-03, ``--through``), near 128: the 1.5B's passes of 128-240 rows 1.26-1.45x faster so.
FLOAT_ROWS = 128 if avx512() else 256


def dense_from(dense_rows: int | None, dtype: torch.dtype) -> int | float:
    """Rows from which a layer's pass runs on its weights made dense on this CPU, ``dtype`` its
    activations': its ``dense_rows``, or :data:`FLOAT_ROWS` where the 16-bit GEMM is not the faster
    (inf: never, ``dense_rows`` None)."""
    if dense_rows is None:
        return float("inf")
    return dense_rows if fast_gemm(dtype) else FLOAT_ROWS


def piece_rows(in_features: int, dtype: torch.dtype) -> int:
    """Output rows of a matrix made dense at a time (:meth:`QuantLinear.dense_product`): whole
    blocks of :data:`PACK_ROWS` under :data:`~kvcli.runtime.measure.HEAP_BLOCK_MAX` bytes, so each
    piece comes from the heap kept by :func:`~kvcli.runtime.measure.keep_freed_memory` instead of a
    fresh mapping faulted in page by page: the 1.5B Qwen's 8960 × 1536 MLP matrices made dense in
    float32 (55 MB; an AVX2-only CPU) took 24-29 ms each so (a 9 MB one 0.4 ms); a layer's pass of
    32 rows dense 166.7 → 97.4 ms in pieces (docs/cpu.md)."""
    fit = (HEAP_BLOCK_MAX - 1) // (in_features * dtype.itemsize)
    return max(PACK_ROWS, fit // PACK_ROWS * PACK_ROWS)


class QuantLinear(nn.Module):
    """What the quantised ``nn.Linear`` layers share: rows in, the kernel's product (:meth:`product`,
    on (rows, in) in the activations' dtype), the bias, the input's shape back."""

    dtype: torch.dtype  # the activations' dtype

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    # rows from which a product runs on the weights made dense (:meth:`dense`) and oneDNN's 16-bit
    # GEMM instead of the integer kernel, on a CPU whose 16-bit GEMM is the faster (:func:`~kvcli.runtime.native.fast_gemm`); None: never
    dense_rows: int | None = None

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense(self, dtype: torch.dtype | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The weights of output rows ``start:stop`` (all by default) the layer multiplies by,
        transposed, in ``dtype`` (the activations'): (in, stop - start)."""
        raise NotImplementedError

    def dense_product(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``rows`` times the weights made dense in ``dtype`` for this call, then freed: in pieces
        of output rows (:func:`piece_rows`) where the whole would be a block glibc maps afresh."""
        step = piece_rows(self.in_features, dtype)
        if step >= self.out_features:
            return torch.mm(rows, self.dense(dtype))
        y = torch.empty(rows.shape[0], self.out_features, dtype=dtype)
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            torch.mm(rows, self.dense(dtype, start, stop), out=y[:, start:stop])
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.dtype)
        if rows.shape[0] >= dense_from(self.dense_rows, self.dtype):
            # a prefill: dense for this call only; in float32 where 16 bits are not the faster
            gemm = self.dtype if fast_gemm(self.dtype) else torch.float32
            y = self.dense_product(rows.to(gemm), gemm).to(self.dtype)
        else:
            y = self.product(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(QuantLinear):
    """``nn.Linear`` with int8 weights, one scale per output row: ``_weight_int8pack_mm`` for a few
    rows (decoding); from :attr:`dense_rows` rows on (a prefill) the codes times their scale in
    bfloat16 (:meth:`dense`, a 576 × 1536 matrix in 0.1 ms) and oneDNN's bfloat16 GEMM, 2.4-3.3×
    faster than the kernel there on this CPU (measured, docs/cpu.md): the int8 kernel is built for
    the one row of a decoding step."""

    # measured alone with freed memory kept (benchmarks/dense_rows.py, the Xeon with AMX, 2026-12-03):
    # dense with kvcli's making is faster than the exact kernel from ~24 rows on all three embedded
    # models (the 1.5B at 32 rows 10.4 against 15.2 ms a layer), with PyTorch's making than PyTorch's
    # kernel from 24-32; once 64 (dense then slower below: PyTorch's making faulted its pages in)
    dense_rows = 32

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*codes.shape, bias, dtype)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.to(dtype))

    @classmethod
    def of(cls, linear: nn.Linear | nn.Embedding, dtype: torch.dtype) -> Int8Linear:
        """``linear`` (or an embedding table) quantised; on the meta device, its empty shape."""
        bias = getattr(linear, "bias", None)
        if linear.weight.is_meta:  # a skeleton's (:func:`quantize_model` on the meta device): shapes only
            n = linear.weight.shape[0]
            return cls(
                torch.empty(linear.weight.shape, dtype=torch.int8, device="meta"),
                torch.empty(n, device="meta"),
                bias,
                dtype,
            )
        return cls(*quantize_int8(linear.weight), bias, dtype)

    # kvcli's kernel :meth:`product` runs for passes of up to :attr:`kernel_rows` rows, both set by
    # :func:`use_int8_rows`: int8_rows.exact (PyTorch's arithmetic) for every pass below :attr:`dense_rows`,
    # or int8_rows.product (8-bit activations) for decoding's passes only (:data:`int8_rows.ROWS`: a
    # step, a draft's check); None: PyTorch's. With 8-bit activations a prompt's short pieces stay on
    # PyTorch's: SmolLM2 with a 37-token question read through them too answered 2 of 4 rephrasings of
    # a question it answers in full precision; with only its decoding so, 4 of 4 (tests/model/test_int8_rows.py).
    rows_kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    kernel_rows = 0

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.rows_kernel is not None and rows.shape[0] <= self.kernel_rows:
            return self.rows_kernel(rows, self.codes, self.scale)
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scale)

    # kvcli's kernel making the dense weights (int8_rows.dense: PyTorch's bits in one pass), set by
    # :func:`use_int8_rows` where the library loads; None: PyTorch's multiplication
    dense_kernel: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor] | None = None

    def dense(self, dtype: torch.dtype | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        codes, scale = self.codes[start:stop], self.scale[start:stop]
        if self.dense_kernel is not None and dtype in (torch.bfloat16, torch.float32):
            return self.dense_kernel(codes, scale, dtype).t()
        return torch.mul(codes, scale.to(dtype)[:, None]).t()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


def use_int8_rows(model: nn.Module, cache_dir: Path | None) -> tuple[str, str] | None:
    """Every :class:`Int8Linear` of ``model`` whose inputs the kernel takes whole set to run kvcli's
    kernel (``KVCLI_INT8_KERNEL``: exact by default, or 8bit) for its passes under
    :attr:`Int8Linear.dense_rows` rows (8bit: decoding's, :data:`int8_rows.ROWS`), compiled first where needed: (the mode, its instructions on this CPU), e.g. ("exact", "AVX-512");
    None where PyTorch's runs (``pytorch``; no compiler) and nothing changes. Where the library loads,
    every :class:`Int8Linear` also makes its dense weights with it (:attr:`Int8Linear.dense_kernel`)."""
    chosen = int8_rows.mode()
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    layers = [m for m in int8 if m.in_features % int8_rows.step(chosen) == 0]
    path = int8_rows.load(cache_dir, chosen) if layers else None
    kernel = int8_rows.product if chosen == "8bit" else int8_rows.exact
    # exact: every pass PyTorch's kernel would run (1.4-2x faster at 8-31 rows on the 1.5B's shapes
    # with AMX; 1.4-2x at 32-255 rows on an AVX2-only CPU, docs/cpu.md), so a short question's passes too
    for layer in layers if path else ():  # the LM head (never dense) bounded as the layers are
        most = int8_rows.ROWS if chosen == "8bit" else dense_from(Int8Linear.dense_rows, layer.dtype) - 1
        layer.rows_kernel, layer.kernel_rows = kernel, most
    for layer in int8 if path else ():
        layer.dense_kernel = int8_rows.dense  # any input width: a prefill's weights made dense
    return (chosen, path) if path else None


PACK_ROWS = 64  # output rows per block of the CPU int4 packing (:func:`unpack_int4` reads its layout)


def pack_int4(weight: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weights -> what ``_weight_int4pack_mm_for_cpu`` takes: the packed codes and
    (in/group, out, 2) scale and zero in ``dtype`` (the kernel computes (q - 8) · scale + zero:
    zero = the group's minimum + 8 · scale)."""
    q, scale, low = quantize_int4(weight, group)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    return packed, torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(dtype)


def unpack_int4(
    packed: torch.Tensor, scale_zero: torch.Tensor, out_features: int, in_features: int, group: int
) -> torch.Tensor:
    """The weights of :func:`pack_int4`'s output unpacked, transposed, in ``scale_zero``'s dtype:
    (in, out). The CPU packing (torch 2.13, ``_convert_weight_to_int4pack_for_cpu``) stores each
    block of :data:`PACK_ROWS` output rows as (in, 32) bytes, byte j of input k holding row j (low
    nibble) and row 32 + j (high nibble); :func:`packing_read` checks that once per process."""
    n, k, g = out_features, in_features, group
    b = packed.view(n // PACK_ROWS, k, 1, PACK_ROWS // 2)
    codes = torch.cat([b & 15, b >> 4], dim=2).permute(1, 0, 2, 3).reshape(k // g, g, n).to(scale_zero.dtype)
    scale = scale_zero[..., 0].contiguous().unsqueeze(1)  # (in/group, 1, out): addcmul is 9x slower on a strided one
    low = (scale_zero[..., 1] - 8 * scale_zero[..., 0]).unsqueeze(1)  # the group's code 0
    return torch.addcmul(low, codes, scale).view(k, n)


def int4_on_identity(packed: torch.Tensor, scale_zero: torch.Tensor, in_features: int, group: int) -> torch.Tensor:
    """The weights the int4 kernel multiplies by, (out, in) float32: the kernel run on the identity."""
    eye = torch.eye(in_features, dtype=torch.float32)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, group, scale_zero.to(torch.float32)).T.contiguous()


@functools.cache
def packing_read() -> bool:
    """Whether :func:`unpack_int4` reads this PyTorch's int4 packing right: a random 64 x 64 layer
    unpacked against the kernel run on the identity, once per process (a layout changed by a later
    PyTorch leaves the int4 layers on their kernel, not wrong)."""
    k = 2 * GROUP
    packed, scale_zero = pack_int4(torch.randn(PACK_ROWS, k, generator=torch.Generator().manual_seed(0)), GROUP, DTYPE)
    unpacked = unpack_int4(packed, scale_zero, PACK_ROWS, k, GROUP).float().t()
    return bool(torch.allclose(unpacked, int4_on_identity(packed, scale_zero, k, GROUP), rtol=1e-2, atol=1e-2))


class Int4Linear(QuantLinear):
    """``nn.Linear`` with 4-bit weights in groups of :data:`GROUP`: ``_weight_int4pack_mm_for_cpu``
    for a few rows (decoding); from :attr:`dense_rows` rows on (a prefill) the weights unpacked to
    bfloat16 for that call (:func:`unpack_int4`, ~0.35 ms for a 576 × 1536 matrix on one core) and
    oneDNN's GEMM, as :class:`Int8Linear` does: measured on one core, the kernel takes 0.67 / 1.27 /
    5.1 / 20.5 ms for 64 / 128 / 512 / 2,048 rows of that matrix, unpacking + GEMM 0.70 / 0.92 /
    2.3 / 8.1."""

    dense_rows = 128

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, group: int = GROUP) -> None:
        super().__init__(*weight.shape, bias, dtype)
        self.group = group
        n, k = weight.shape
        if weight.is_meta:  # a skeleton's (:func:`quantize_model` on the meta device): the packing's shapes
            packed = torch.empty(n, k // 2, dtype=torch.uint8, device="meta")
            scale_zero = torch.empty(k // group, n, 2, dtype=dtype, device="meta")
        else:
            packed, scale_zero = pack_int4(weight, group, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)  # (in/group, out, 2)
        if self.out_features % PACK_ROWS or not packing_read():
            self.dense_rows = None  # a layout :func:`unpack_int4` does not read: the kernel for every call

    @classmethod
    def of(cls, linear: nn.Linear, dtype: torch.dtype) -> Int4Linear:
        return cls(linear.weight, linear.bias, dtype)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scale_zero)

    def dense(self, dtype: torch.dtype | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.out_features if stop is None else stop  # whole blocks of PACK_ROWS (piece_rows')
        scale_zero = self.scale_zero[:, start:stop].to(dtype or self.dtype)
        return unpack_int4(self.packed[start:stop], scale_zero, stop - start, self.in_features, self.group)

    def dequantized(self) -> torch.Tensor:
        """The weights it multiplies by, (out, in) float32 (the kernel run on the identity)."""
        return int4_on_identity(self.packed, self.scale_zero, self.in_features, self.group)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group}"


class Int8Embedding(nn.Module):
    """A token embedding table in int8 per row, gathered and scaled to ``dtype`` on lookup; a
    scaled embedding (Gemma's ``embed_scale``) keeps its scale. Tied to an LM head, it shares its
    codes with that head's :class:`Int8Linear` (one table in memory, as before). ``after_lookup``:
    called after each lookup (:mod:`.kept` sets it where the codes are mapped from a file: it hands
    the looked-up pages back)."""

    after_lookup: Callable[[], None] | None = None

    def __init__(self, head: Int8Linear, embed_scale: torch.Tensor | None, own: bool = False) -> None:
        super().__init__()
        self.head = [head]  # not a submodule: the head is the model's own...
        if own:  # ...unless the table is this embedding's alone (untied): then its submodule, saved with it
            self.table = head
        self.num_embeddings, self.embedding_dim = head.codes.shape
        self.register_buffer("embed_scale", None if embed_scale is None else embed_scale.detach().clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        rows = head.codes[ids].to(head.dtype) * head.scale[ids].unsqueeze(-1)
        if self.after_lookup is not None:
            self.after_lookup()
        return rows if self.embed_scale is None else rows * self.embed_scale.to(rows.dtype)


# --- the model ----------------------------------------------------------------------------------
def kernel_error(bits: int) -> str | None:
    """None if this PyTorch runs the ``bits``-bit CPU kernel here, else why not (one line)."""
    try:
        w = torch.randn(N_MULTIPLE, GROUP * 2)
        layer = Int4Linear(w, None, DTYPE) if bits == 4 else Int8Linear(*quantize_int8(w), None, DTYPE)
        layer(torch.randn(2, GROUP * 2, dtype=DTYPE))
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        from ..errors import one_line

        return one_line(e)
    return None


def four_bit_fits(linear: nn.Linear) -> bool:
    """Whether ``--quant 4`` runs ``linear`` in 4 bits: its shape fits the int4 packing, and its
    weights are not a GGUF's finer blocks (rounding Q6_K or Q5_0 to 4 bits would undo what the
    file's mixed quantisation kept; they stay int8, as ``--quant 8`` runs them)."""
    if linear.in_features % GROUP or linear.out_features % N_MULTIPLE:
        return False
    return linear.weight.is_meta or not held_in_more_bits(linear.weight)


def quantize_model(model: nn.Module, bits: int, dtype: torch.dtype = DTYPE, int8: set[str] | None = None) -> dict:
    """Replace, in place, the decoder layers' ``nn.Linear`` modules by :class:`Int4Linear` (4: a layer
    whose input size is not a multiple of :data:`GROUP`, or output size of :data:`N_MULTIPLE`, or that
    a GGUF held in more than 4 bits (:func:`held_in_more_bits`), is int8) or :class:`Int8Linear` (8), and the
    embedding + LM head by int8 rows; everything else (norms) goes to ``dtype``. Returns what was
    done: {"int4": n, "int8": n} (matrices of each kind). A model on the meta device gets the same
    layers with empty codes: the skeleton :mod:`.kept` loads kept weights into; ``int8``: at 4 bits,
    the paths of the layers' matrices that are int8 (what :func:`int8_paths` recorded of the
    quantised model), where a skeleton's weights cannot say."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    counts = {"int4": 0, "int8": 0}
    decoder = model.get_decoder()
    paths = {id(m): name for name, m in model.named_modules()}
    for layer in decoder.layers:
        for name, child in list(layer.named_modules()):
            if not isinstance(child, nn.Linear):
                continue
            parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
            fits = four_bit_fits(child) if int8 is None else paths[id(child)] not in int8
            if bits == 4 and fits:
                new: nn.Module = Int4Linear.of(child, dtype)
                counts["int4"] += 1
            else:
                new = Int8Linear.of(child, dtype)
                counts["int8"] += 1
            setattr(parent, name.rpartition(".")[2], new)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embed.weight or (
        not embed.weight.is_meta and head.weight.data_ptr() == embed.weight.data_ptr()
    )
    q_head = Int8Linear.of(head, dtype)
    q_head.dense_rows = None  # the head's dense copy would be ~56 MB; its prefill reads one row anyway
    model.set_output_embeddings(q_head)
    # the embedding: the head's codes when tied (one table, as before), else a table of its own
    table = q_head if tied else Int8Linear.of(embed, dtype)
    decoder.embed_tokens = Int8Embedding(table, getattr(embed, "embed_scale", None), own=not tied)
    counts["int8"] += 1 if tied else 2
    # what stays float (norms, biases) runs in the activations' dtype; buffers keep theirs (the
    # rotary tables' inverse frequencies stay float32, as transformers makes them)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return counts


def int8_paths(model: nn.Module) -> list[str]:
    """The paths of a quantised model's decoder-layer matrices held in int8 (at ``--quant 4``: those
    :func:`four_bit_fits` left in 8 bits), for :func:`quantize_model`'s ``int8`` of a skeleton."""
    layers = {id(m) for layer in model.get_decoder().layers for m in layer.modules()}
    return sorted(name for name, m in model.named_modules() if id(m) in layers and isinstance(m, Int8Linear))
