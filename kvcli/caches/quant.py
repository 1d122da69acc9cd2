"""Small KV: keys and values held in 8 or 4 bits with their scales (``--kv-bits``), and attention
read straight from those codes.

The format (chosen by measurement, docs/kv-bits.md): every row of a layer — one token of one KV
head, ``head_dim`` numbers — is cut into groups of :data:`GROUP` channels (fewer where the head is
smaller), and each group is stored as unsigned codes ``c`` of ``bits`` bits with a float16 scale
``s`` and low end ``m``, asymmetric min/max: ``x ≈ m + s·c``. Keys and values alike, one row at a
time, as llama.cpp's ``q8_0``/``q4_1`` KV caches do: a row is quantized the moment it is appended
and never again, so every cache operation (append, gather an eviction's kept rows, cut a sliding
layer's front, truncate a prefix) moves a row's codes and scales together, exactly. 4-bit codes pack
two to a byte: the first half of a row's channels in the low nibbles, the second half in the high.

At 4 bits each group is first turned by a Hadamard rotation ``H`` (orthonormal and its own
inverse), ``x ≈ (m + s·c) H``: QuaRot's (Ashkboos et al. 2024) answer to what KIVI (Liu et al.
2024) found, that a few channels of the keys are far larger than the rest and waste one scale's 16
levels. KIVI quantizes keys per channel over groups of tokens instead; the rotation spreads an
outlier over its group and keeps the format per row. Measured on SmolLM2 (``python
benchmarks/kv_bits_codecs.py``, docs/kv-bits.md): it halves the 4-bit error (KL from 16 bits 0.009
-> 0.0044; KIVI's keys 0.0049) and changes nothing at 8 bits, which stay unrotated
(:data:`ROTATED`). Attention turns the query instead of the keys — ``q·(yH) = (qH)·y`` — and its
output once at the end.

Bytes per row against 16 bits: 8-bit ``d + 4·d/G`` (0.53x at G=64), 4-bit ``d/2 + 4·d/G`` (0.28x).

A quantized tensor is three tensors with the same leading shape (…, rows): ``codes`` (…, rows,
d·bits/8) uint8, ``scale`` and ``low`` (…, rows, d/G) float16 — :class:`Packed`. Attention over it
(:func:`attend`) never builds the 16-bit keys: a query row's score against a key is
``Σ_g s_g (q_g·c_g) + m_g Σ q_g`` and a row's output ``Σ_t (w_t s_tg) c_tg + Σ_t w_t m_tg``, so only
the codes are converted (to float32, :data:`ROWS` keys at a time, the softmax merged over the
chunks by log-sum-exp): on a 2-core CPU that decodes as fast as the bfloat16 kernel does.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch

from ..kv_bits import AUTO, DEFAULT_KV_BITS, ENV_KV_BITS, KV_BITS, KV_BITS_HELP, check_bits  # noqa: F401  (as before)

ROTATED = (4,)  # the bits whose groups are turned by a Hadamard rotation before they are quantized
# each precision's stored format, named with its version in every store key and header (:func:`state`):
# 16 the tensors as they are in the dtype the key names (the model's, or the method's kv_dtype); 8 each
# row's groups as signed codes around their middle (v1 was unsigned codes up from the minimum); 4 the
# same groups turned by a Hadamard rotation, unsigned codes up from their minimum. A codec whose bytes
# change (the golden bytes of tests/test_kv_codecs.py fail) gets a new name: an entry of the old
# format is then a miss, never decoded.
CODECS = {16: "dtype-cast-v1", 8: "rows-int8-mid-v2", 4: "rows-hadamard"}
# every name each precision's codec has had (the current one too; a state that names none is older
# still): a codec renamed keeps its old name here, so that a run asking for an entry finds the one of
# the old format by its key alone and says why it is not read (kvcli.store.keys.other_formats)
CODEC_NAMES = {16: ("dtype-cast-v1",), 8: ("rows-int8-mid-v2",), 4: ("rows-hadamard",)}
GROUP = 64  # channels per scale (fewer where a head is smaller, or a divisor of its size)
ROWS = 32768  # keys whose codes :func:`attend` converts at a time (its transient: ROWS x d float32 per KV head)
SCALE_DTYPE = torch.float16


def state(bits: int) -> dict:
    """What a stored KV's key and header say of its format: the bits and their codec (:data:`CODECS`),
    so a stored KV of another format is never read."""
    return {"kv_bits": bits, "kv_codec": CODECS[bits]}


def named(state_: dict) -> dict:
    """``state_`` with its format named: a state that says no bits holds its KV in 16 (gemfilter's
    layers, DuoAttention's cache, ...)."""
    return state_ if "kv_bits" in state_ else {**state_, **state(16)}


def other_format(state_) -> str | None:
    """Why a stored state's format is not one this kvcli reads (its bits' codec renamed since, or
    none named: written before formats were named), or None when it is."""
    if not isinstance(state_, dict):
        return None
    bits, codec = state_.get("kv_bits", 16), state_.get("kv_codec")
    if bits in CODECS and codec == CODECS[bits]:
        return None
    now = CODECS.get(bits)
    return f"its {bits}-bit KV is in format {codec or 'unnamed (an older kvcli)'}, this kvcli's is {now}"


def without_bits(state_: dict) -> dict:
    """``state_`` held in 16 bits (for a method that reads its prefix in 16 bits)."""
    return {**{k: v for k, v in state_.items() if k not in ("kv_bits", "kv_codec")}, **state(16)}


def hadamard(g: int, device=None) -> torch.Tensor:
    """The orthonormal ``g`` x ``g`` Hadamard matrix (Sylvester's, ``g`` a power of two), float32:
    symmetric, so ``H H = I``."""
    device = torch.device("cpu" if device is None else device)
    h = _HADAMARD.get((g, device))
    if h is None:
        h = torch.ones(1, 1)
        while h.shape[0] < g:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        if h.shape[0] != g:
            raise ValueError(f"a Hadamard rotation needs a power of two, got {g}")
        h = _HADAMARD[(g, device)] = (h / math.sqrt(g)).to(device)
    return h


_HADAMARD: dict[tuple, torch.Tensor] = {}


def rotate(x: torch.Tensor, g: int) -> torch.Tensor:
    """``x`` (…, d) float32 with each group of ``g`` channels turned by :func:`hadamard` (its own
    inverse: rotating twice gives ``x`` back)."""
    d = x.shape[-1]
    return (x.reshape(*x.shape[:-1], d // g, g) @ hadamard(g, x.device)).reshape(x.shape)


def bits_of(p: Packed, d: int) -> int:
    """The bits ``p`` holds rows of ``d`` channels in (its codes' width says)."""
    return 8 if p.codes.shape[-1] == d else 4


def group_size(d: int) -> int:
    """Channels per scale for a head of ``d`` channels: :data:`GROUP`, or the largest power of two
    below it that divides ``d``."""
    g = GROUP
    while g > 1 and d % g:
        g //= 2
    return min(g, d)


def code_width(d: int, bits: int) -> int:
    """Bytes of codes per row of ``d`` channels."""
    if bits not in (8, 4):
        raise ValueError(f"kv bits must be 8 or 4 to quantize, got {bits}")
    if bits == 4 and d % 2:
        raise ValueError(f"4-bit codes need an even head size, got {d}")
    return d if bits == 8 else d // 2


def row_bytes(d: int, bits: int) -> int:
    """Bytes one row (a token of a KV head) takes at ``bits``: codes and scales (16: 2 bytes a channel)."""
    if bits == 16:
        return 2 * d
    return code_width(d, bits) + 2 * (d // group_size(d)) * SCALE_DTYPE.itemsize


class Packed(NamedTuple):
    """A quantized tensor (…, rows, d): codes (…, rows, d·bits/8) uint8, scale and low (…, rows,
    d/G) float16. Row operations apply to the three alike (:meth:`map`)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor  # the number code 0 stands for

    def map(self, fn) -> Packed:
        return Packed(fn(self.codes), fn(self.scale), fn(self.zero))

    @property
    def rows(self) -> int:
        return self.codes.shape[-2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


def _rounded_up(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, >= 0) as float16, never below ``x`` (codes computed against it stay in range)."""
    y = x.clamp(max=65504.0).to(SCALE_DTYPE)
    return torch.where(y.to(torch.float32) < x, (x * (1 + 2**-9)).clamp(max=65504.0).to(SCALE_DTYPE), y)


def _nearest(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as the nearest float16 (within its range)."""
    return x.clamp(-65504.0, 65504.0).to(SCALE_DTYPE)


def _rounded_down(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as float16, never above ``x``."""
    y = _nearest(x)
    fix = _nearest(x - x.abs() * 2**-9 - 2**-24)
    return torch.where(y.to(torch.float32) > x, fix, y)


def quantize(x: torch.Tensor, bits: int) -> Packed:
    """``x`` (…, rows, d) -> :class:`Packed` codes of ``bits`` bits, each group of
    :func:`group_size` channels of each row with its own scale and zero (min/max: 8-bit codes
    -128..127 around the group's middle, 4-bit codes 0..15 up from its minimum, of the group turned
    by :func:`rotate`)."""
    d = x.shape[-1]
    width, g = code_width(d, bits), group_size(d)
    xf = x.detach().to(torch.float32)
    xf = (rotate(xf, g) if bits in ROTATED else xf).reshape(*x.shape[:-1], d // g, g)
    lo, hi = xf.amin(dim=-1), xf.amax(dim=-1)
    if bits == 8:  # the zero in float16 first, then a scale that reaches both ends from it
        zero = _nearest((lo + hi) / 2)
        zf = zero.to(torch.float32)
        scale = _rounded_up(torch.maximum((zf - lo) / 128, (hi - zf) / 127).clamp(min=2**-24))
        first, last = -128, 127
    else:
        zero = _rounded_down(lo)
        zf = zero.to(torch.float32)
        scale = _rounded_up(((hi - zf) / 15).clamp(min=2**-24))
        first, last = 0, 15
    codes = ((xf - zf[..., None]) / scale.to(torch.float32)[..., None]).round_().clamp_(first, last)
    codes = codes.reshape(*x.shape[:-1], d)
    if bits == 8:
        codes = codes.to(torch.int8).view(torch.uint8)  # stored as bytes; read as int8 (PyTorch's int8 kernels)
    else:
        codes = codes.to(torch.uint8)
        codes = codes[..., : d // 2] | (codes[..., d // 2 :] << 4)
    assert codes.shape[-1] == width
    return Packed(codes.contiguous(), scale, zero)


def codes_of(p: Packed, d: int, dtype=torch.float32) -> torch.Tensor:
    """The codes of ``p`` as numbers (…, rows, d) in ``dtype``: 8-bit signed, 4-bit unpacked."""
    c = p.codes
    if c.shape[-1] == d:
        return c.view(torch.int8).to(dtype)
    return torch.cat([c & 15, c >> 4], dim=-1).to(dtype)  # two codes a byte


def dequantize(p: Packed, d: int, dtype: torch.dtype) -> torch.Tensor:
    """``p`` back to numbers (…, rows, d) in ``dtype``: ``zero + scale · code`` per group (turned
    back by :func:`rotate` at 4 bits), computed in
    float32 :data:`ROWS` rows at a time (a layer of 128k tokens would otherwise hold a float32 copy
    of itself, twice its 16-bit size, beside the result)."""
    g, rows = group_size(d), p.codes.shape[-2]
    if rows <= ROWS:
        return _dequantized(p, d, g).to(dtype)
    out = torch.empty(*p.codes.shape[:-1], d, dtype=dtype, device=p.codes.device)
    for a in range(0, rows, ROWS):
        out[..., a : a + ROWS, :] = _dequantized(p.map(lambda t: t[..., a : a + ROWS, :]), d, g)  # noqa: B023
    return out


def _dequantized(p: Packed, d: int, g: int) -> torch.Tensor:
    c = codes_of(p, d, torch.float32).reshape(*p.codes.shape[:-1], d // g, g)
    x = c.mul_(p.scale.to(torch.float32)[..., None]).add_(p.zero.to(torch.float32)[..., None])
    x = x.reshape(*p.codes.shape[:-1], d)
    return rotate(x, g) if bits_of(p, d) in ROTATED else x


def attend(
    query: torch.Tensor,
    key: Packed,
    value: Packed,
    d_v: int,
    scaling: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention of ``query`` (1, n_heads, q_len, d) over quantized ``key`` / ``value``
    (1, n_kv, kv_len, ·) — GQA as it is, the query heads of a KV head grouped — with ``mask``
    (q_len, kv_len) or per head (1, n_heads, q_len, kv_len), True where allowed, None: all; and
    Gemma 2's soft-capped scores (``softcap``). Read :data:`ROWS` keys at a time, the chunks' softmax
    merged by log-sum-exp, never dequantized (see the module doc; at 4 bits the query turned by the
    keys' rotation, the output by the values'): 8-bit codes with 16-bit queries on
    the CPU by PyTorch's int8 matrix kernel (:func:`_chunk_int8`), else converted to float32
    (:func:`_chunk_float`). Returns (1, q_len, n_heads, d_v) in the query's dtype."""
    b, n_heads, q_len, d = query.shape
    n_kv, kv_len = key.codes.shape[1], key.codes.shape[2]
    rows = n_heads // n_kv * q_len
    if mask is not None:
        mask = mask.expand(b, n_heads, q_len, kv_len).reshape(n_kv, rows, kv_len)
    q = query.to(torch.float32) * scaling
    q = (rotate(q, group_size(d)) if bits_of(key, d) in ROTATED else q).reshape(n_kv, rows, d)
    int8 = key.codes.shape[-1] == d and query.dtype in (torch.bfloat16, torch.float16) and _INT8_MM is not None
    chunk = _chunk_int8 if int8 and query.device.type == "cpu" else _chunk_float
    parts = []
    for a in range(0, kv_len, ROWS):
        e = min(kv_len, a + ROWS)
        k, v = key.map(lambda t: t[0, :, a:e]), value.map(lambda t: t[0, :, a:e])  # noqa: B023
        part = chunk(q, k, v, d_v, None if mask is None else mask[..., a:e], softcap, query.dtype)
        parts.append(part)
    out = parts[0][0]
    if len(parts) > 1:  # one softmax over all chunks: each chunk's output weighed by exp(its lse - the whole's)
        lses = torch.stack([lse for _, lse in parts])  # (chunks, n_kv, R, 1)
        weights = torch.exp(lses - torch.logsumexp(lses, dim=0)).nan_to_num_(0.0)
        out = sum(o * wt for (o, _), wt in zip(parts, weights))
    if bits_of(value, d_v) in ROTATED:
        out = rotate(out, group_size(d_v))
    out = out.reshape(n_kv, n_heads // n_kv, q_len, d_v).reshape(1, n_heads, q_len, d_v)
    return out.transpose(1, 2).contiguous().to(query.dtype)


_INT8_MM = getattr(torch, "_weight_int8pack_mm", None)
_SCRATCH = threading.local()


def _scratch(shape, device) -> torch.Tensor:
    """A float32 tensor of ``shape`` on the CPU, a view of a buffer this thread keeps (grown, never
    shrunk: at most :data:`ROWS` keys of one layer, e.g. 3 MB for SmolLM2 at 4k tokens). One made
    under ``torch.inference_mode`` is made again for a call outside it (an inference tensor takes
    no in-place write there)."""
    n = math.prod(shape)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < n or (buf.is_inference() and not torch.is_inference_mode_enabled()):
        buf = _SCRATCH.buf = torch.empty(n, dtype=torch.float32, device=device)
    return buf[:n].view(shape)  # x (m, k) @ (w (n, k) int8 · scale (n,))ᵀ, on the CPU


def _softmax(scores: torch.Tensor, mask, softcap) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised softmax weights of float32 ``scores`` (…, R, t), their row sums and maxima."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).clamp_(min=-3e38)  # a row with nothing allowed here: weights 0
    w = scores.sub_(top).exp_()
    return w, w.sum(dim=-1, keepdim=True), top


def _finish(out: torch.Tensor, total: torch.Tensor, top: torch.Tensor):
    """The chunk's softmax output and its log-sum-exp (a row with nothing allowed here: -inf)."""
    return out.div_(total.clamp(min=1e-30)), top + total.log()


def _chunk_float(q, k: Packed, v: Packed, d_v: int, mask, softcap, dtype):
    """One chunk's attention, the codes converted to float32: ``q`` (n_kv, R, d) float32 (scaled);
    ``k``/``v`` (n_kv, t, ·); ``mask`` (n_kv, R, t) or None. Returns (output (n_kv, R, d_v), lse (n_kv, R, 1))."""
    n_kv, rows, d = q.shape
    gk = group_size(d)
    qg = q.view(n_kv, rows, d // gk, gk)
    # q·k = Σ_g s_g (q_g·c_g) + z_g Σ q_g, group by group (SmolLM2's heads: one group)
    codes = codes_of(k, d)
    scores = torch.bmm(qg.sum(dim=-1), k.zero.to(torch.float32).transpose(1, 2))  # (n_kv, R, t)
    scale = k.scale.to(torch.float32)
    for j in range(d // gk):
        part = torch.bmm(qg[..., j, :], codes[..., j * gk : (j + 1) * gk].transpose(1, 2))
        scores.addcmul_(part, scale[:, None, :, j])
    w, total, top = _softmax(scores, mask, softcap)
    return _finish(_values(w, v, d_v), total, top)


def _values(w: torch.Tensor, v: Packed, d_v: int) -> torch.Tensor:
    """Σ_t w_t v_t = Σ_t (w_t s_tg) c_tg + Σ_t w_t z_tg, group by group: ``w`` (n_kv, R, t) float32
    weights over ``v`` (n_kv, t, ·), the codes converted to float32 -> (n_kv, R, d_v). On the CPU
    8-bit codes are converted into a buffer kept from call to call (:func:`_scratch`: a new 3 MB
    block per layer and step, mapped and faulted in afresh, cost more than the product itself)."""
    gv = group_size(d_v)
    scale = v.scale.to(torch.float32)
    if v.codes.shape[-1] == d_v and v.codes.device.type == "cpu":  # 8-bit
        codes = _scratch(v.codes.shape, v.codes.device).copy_(v.codes.view(torch.int8))
    else:
        codes = codes_of(v, d_v)
    zero = torch.bmm(w, v.zero.to(torch.float32))  # (n_kv, R, ng)
    if gv == d_v:
        return torch.bmm(w * scale[:, None, :, 0], codes).add_(zero)
    out = zero[..., None].expand(*zero.shape, gv).reshape(*zero.shape[:-1], d_v)  # each group's zero over its channels
    for j in range(d_v // gv):
        out[..., j * gv : (j + 1) * gv] += torch.bmm(w * scale[:, None, :, j], codes[..., j * gv : (j + 1) * gv])
    return out


def _chunk_int8(q, k: Packed, v: Packed, d_v: int, mask, softcap, dtype):
    """:func:`_chunk_float`'s attention for 8-bit codes on the CPU, the scores from PyTorch's int8
    matrix kernel KV head by KV head with a 16-bit (``dtype``) query, as the CPU's 16-bit attention
    has it: x·cᵀ over the signed codes times each row's scale, the zeros added apart.
    The values as :func:`_chunk_float` reads them (the int8 kernel would want them transposed)."""
    n_kv, rows, d = q.shape
    gk = group_size(d)
    q16 = q.to(dtype)
    q_sum = q.view(n_kv, rows, d // gk, gk).sum(dim=-1)  # (n_kv, R, ng)
    # Σ_g s_g (q_g·c_g) + z_g Σ q_g: the second term one small product
    scores = torch.bmm(q_sum, k.zero.to(torch.float32).transpose(1, 2))  # (n_kv, R, t)
    codes, scale = k.codes.view(torch.int8), k.scale.to(dtype)
    for j in range(d // gk):
        cols = slice(j * gk, (j + 1) * gk)
        part = [
            _INT8_MM(q16[h], codes[h], scale[h, :, 0])
            if gk == d
            else _INT8_MM(q16[h][:, cols].contiguous(), codes[h][:, cols].contiguous(), scale[h, :, j].contiguous())
            for h in range(n_kv)
        ]
        scores += torch.stack(part)
    w, total, top = _softmax(scores, mask, softcap)
    return _finish(_values(w, v, d_v), total, top)


def read_weights(query: torch.Tensor, key: Packed, scaling: float | None = None) -> torch.Tensor:
    """A decoding step's softmax weights (n_kv, group, kv_len) float32 of ``query`` (1, n_heads, 1,
    d) over quantized ``key`` (the citations' reading, :meth:`kvcli.runtime.attention.LayerView.read_weights`)."""
    n_heads, d = query.shape[1], query.shape[-1]
    n_kv = key.codes.shape[1]
    scaling = 1 / math.sqrt(d) if scaling is None else scaling
    k = dequantize(key.map(lambda t: t[0]), d, torch.float32)  # (n_kv, kv_len, d): one layer, one step
    q = query[0, :, -1].reshape(n_kv, n_heads // n_kv, d).to(torch.float32) * scaling
    return torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
