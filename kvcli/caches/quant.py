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
from typing import NamedTuple

import torch

KV_BITS = (16, 8, 4)  # the choices of --kv-bits; 16: the model's own dtype (no quantization)
DEFAULT_KV_BITS = 16
ENV_KV_BITS = "KVCLI_KV_BITS"
GROUP = 64  # channels per scale (fewer where a head is smaller, or a divisor of its size)
ROWS = 32768  # keys whose codes :func:`attend` converts at a time (its transient: ROWS x d float32 per KV head)
SCALE_DTYPE = torch.float16
KV_BITS_HELP = (
    "Bits the KV is held in, in memory and in the disk cache: 16 (the model's own dtype), 8 or 4 "
    "(each row's groups of 64 numbers with their scale: 0.53x / 0.28x the bytes; accuracy: docs/kv-bits.md); "
    "methods whose KV layout is not quantized keep 16 and say so"
)


def check_bits(bits) -> int:
    """``bits`` as one of :data:`KV_BITS`; ValueError naming the choices otherwise."""
    try:
        value = int(bits)
    except (TypeError, ValueError):
        value = None
    if value not in KV_BITS:
        raise ValueError(f"kv bits must be one of {', '.join(map(str, KV_BITS))}, not {bits!r}")
    return value


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
    low: torch.Tensor

    def map(self, fn) -> Packed:
        return Packed(fn(self.codes), fn(self.scale), fn(self.low))

    @property
    def rows(self) -> int:
        return self.codes.shape[-2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


def _rounded_up(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, >= 0) as float16, never below ``x`` (codes computed against it stay in range)."""
    y = x.clamp(max=65504.0).to(SCALE_DTYPE)
    return torch.where(y.to(torch.float32) < x, (x * (1 + 2**-9)).clamp(max=65504.0).to(SCALE_DTYPE), y)


def _rounded_down(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as float16, never above ``x``."""
    y = x.clamp(-65504.0, 65504.0).to(SCALE_DTYPE)
    fix = (x - x.abs() * 2**-9 - 2**-24).clamp(-65504.0, 65504.0).to(SCALE_DTYPE)
    return torch.where(y.to(torch.float32) > x, fix, y)


def quantize(x: torch.Tensor, bits: int) -> Packed:
    """``x`` (…, rows, d) -> :class:`Packed` codes of ``bits`` bits, each group of
    :func:`group_size` channels of each row with its own min/max scale."""
    d = x.shape[-1]
    width, g = code_width(d, bits), group_size(d)
    levels = (1 << bits) - 1
    xf = x.detach().to(torch.float32).reshape(*x.shape[:-1], d // g, g)
    low = _rounded_down(xf.amin(dim=-1))
    lowf = low.to(torch.float32)
    scale = _rounded_up(((xf.amax(dim=-1) - lowf) / levels).clamp(min=2**-24))
    codes = ((xf - lowf[..., None]) / scale.to(torch.float32)[..., None]).round_().clamp_(0, levels)
    codes = codes.to(torch.uint8).reshape(*x.shape[:-1], d)
    if bits == 4:
        half = d // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    assert codes.shape[-1] == width
    return Packed(codes.contiguous(), scale, low)


def codes_of(p: Packed, d: int, dtype=torch.float32) -> torch.Tensor:
    """The codes of ``p`` as numbers (…, rows, d) in ``dtype`` (4-bit: unpacked)."""
    c = p.codes
    if c.shape[-1] != d:  # 4-bit: two codes a byte
        c = torch.cat([c & 15, c >> 4], dim=-1)
    return c.to(dtype)


def dequantize(p: Packed, d: int, dtype: torch.dtype) -> torch.Tensor:
    """``p`` back to numbers (…, rows, d) in ``dtype``: ``low + scale · codes`` per group."""
    g = group_size(d)
    c = codes_of(p, d, torch.float32).reshape(*p.codes.shape[:-1], d // g, g)
    x = c.mul_(p.scale.to(torch.float32)[..., None]).add_(p.low.to(torch.float32)[..., None])
    return x.reshape(*p.codes.shape[:-1], d).to(dtype)


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
    Gemma 2's soft-capped scores (``softcap``). The codes are read :data:`ROWS` keys at a time
    and never dequantized (see the module doc). Returns (1, q_len, n_heads, d_v) in the query's dtype."""
    b, n_heads, q_len, d = query.shape
    n_kv, kv_len = key.codes.shape[1], key.codes.shape[2]
    group = n_heads // n_kv
    gk, gv = group_size(d), group_size(d_v)
    q = (query.to(torch.float32) * scaling).reshape(n_kv, group * q_len, d // gk, gk)  # (n_kv, R, ng, g)
    q_sum = q.sum(dim=-1)  # (n_kv, R, ng): the low ends' weight
    if mask is not None:
        mask = mask.expand(b, n_heads, q_len, kv_len).reshape(n_kv, group * q_len, kv_len)
    parts = []
    for a in range(0, kv_len, ROWS):
        e = min(kv_len, a + ROWS)
        kp = key.map(lambda t: t[0, :, a:e])  # noqa: B023
        ck = codes_of(kp, d).reshape(n_kv, e - a, d // gk, gk)
        scores = torch.zeros(n_kv, group * q_len, e - a)
        for j in range(d // gk):
            s = torch.matmul(q[:, :, j], ck[:, :, j].transpose(-1, -2))  # (n_kv, R, rows)
            scores += s * kp.scale[..., j].to(torch.float32)[:, None, :]
            scores += q_sum[:, :, j : j + 1] * kp.low[..., j].to(torch.float32)[:, None, :]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask[..., a:e], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (n_kv, R, 1)
        w = torch.exp(scores - lse).nan_to_num_(0.0)  # a row with nothing allowed in this chunk: 0
        vp = value.map(lambda t: t[0, :, a:e])  # noqa: B023
        cv = codes_of(vp, d_v).reshape(n_kv, e - a, d_v // gv, gv)
        out = torch.empty(n_kv, group * q_len, d_v // gv, gv)
        for j in range(d_v // gv):
            ws = w * vp.scale[..., j].to(torch.float32)[:, None, :]
            out[:, :, j] = torch.matmul(ws, cv[:, :, j])
            out[:, :, j] += (w * vp.low[..., j].to(torch.float32)[:, None, :]).sum(dim=-1, keepdim=True)
        parts.append((out.reshape(n_kv, group * q_len, d_v), lse[..., 0]))
    if len(parts) == 1:
        out = parts[0][0]
    else:
        total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
        out = sum(o * torch.exp(lse - total).nan_to_num(0.0)[..., None] for o, lse in parts)
    out = out.reshape(n_kv, group, q_len, d_v).reshape(1, n_heads, q_len, d_v)
    return out.transpose(1, 2).contiguous().to(query.dtype)


def read_weights(query: torch.Tensor, key: Packed, scaling: float | None = None) -> torch.Tensor:
    """A decoding step's softmax weights (n_kv, group, kv_len) float32 of ``query`` (1, n_heads, 1,
    d) over quantized ``key`` (the citations' reading, :meth:`kvcli.caches.base.LayerView.read_weights`)."""
    n_heads, d = query.shape[1], query.shape[-1]
    n_kv = key.codes.shape[1]
    scaling = 1 / math.sqrt(d) if scaling is None else scaling
    k = dequantize(key.map(lambda t: t[0]), d, torch.float32)  # (n_kv, kv_len, d): one layer, one step
    q = query[0, :, -1].reshape(n_kv, n_heads // n_kv, d).to(torch.float32) * scaling
    return torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
