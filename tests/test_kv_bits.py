"""Small KV (``--kv-bits 8|4``): the codec, attention read from the codes, and the quantized plain
layout, each against an independent computation (numbers rounded by hand; attention over those
numbers by SDPA; a plain cache holding the same rounded numbers)."""

from __future__ import annotations

import json

import pytest
import torch

from kvcli.caches import KVCache, QuantKVCache, QuantLayer, quant
from kvcli.runtime.engine import Engine
from tests.helpers.runs import random_ids

TOL = 1e-4


def hadamard_by_hand(g: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix entry by entry, (-1)^popcount(i & j) / sqrt(g): an independent
    construction of the rotation the codec applies to each group."""
    return torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(g)] for i in range(g)]) / g**0.5


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("d", [64, 128, 96, 8])
def test_codes_round_each_group_as_by_hand(bits, d):
    torch.manual_seed(d + bits)
    x = torch.randn(1, 2, 9, d) * 3 + torch.linspace(-2, 5, d)  # channels of different ranges
    p = quant.quantize(x, bits)
    g = quant.group_size(d)
    assert p.codes.dtype == torch.uint8 and p.codes.shape[-1] == d * bits // 8
    assert p.scale.shape == p.zero.shape == (1, 2, 9, d // g)
    h = hadamard_by_hand(g) if bits == 4 else torch.eye(g)
    assert torch.allclose(h @ h, torch.eye(g), atol=1e-6)
    back = quant.dequantize(p, d, torch.float32).reshape(1, 2, 9, d // g, g)
    # 4-bit codes are of each group turned by H (its own inverse): compare in the turned space
    got, grp = back @ h, x.reshape(1, 2, 9, d // g, g) @ h
    lo, hi = grp.amin(-1), grp.amax(-1)
    step = (hi - lo) / (2**bits - 1)
    scale, zero = p.scale.float(), p.zero.float()
    first, last = (-128, 127) if bits == 8 else (0, 15)
    # each group's grid reaches both its ends (within a float16 rounding of the zero) ...
    assert (zero + first * scale <= lo + 1e-6).all() and (zero + last * scale >= hi - 1e-6).all()
    assert (scale >= step).all() and (scale <= step * (1 + 2**-7) + zero.abs() * 2**-10 / 127 + 2**-20).all()
    # ... and every number is its nearest point on that grid: zero + scale * an integer code in range
    codes = (got - zero[..., None]) / scale[..., None]
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    assert codes.min() > first - 1e-3 and codes.max() < last + 1e-3
    assert ((got - grp).abs() <= scale[..., None] * 0.5 + 1e-5).all()
    # the numbers given back are the rounded ones turned back: as far from x as they are from x·H
    err = (back - x.reshape(back.shape)).norm(dim=-1)
    assert torch.allclose(err, (got - grp).norm(dim=-1), atol=1e-4)
    assert quant.row_bytes(d, bits) * 9 * 2 == p.nbytes()


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantizing_by_chunks_of_rows_is_the_same(bits, monkeypatch):
    x = torch.randn(1, 2, 50, 64)
    p = quant.quantize(x, bits)
    whole = quant.dequantize(p, 64, torch.bfloat16)
    monkeypatch.setattr(quant, "ROWS", 16)
    assert torch.equal(quant.dequantize(p, 64, torch.bfloat16), whole)


def test_store_keys_name_the_format():
    """Every precision names its bits and codec (the 8-bit codes changed from unsigned-from-the-minimum
    to signed-around-the-middle: v2), so no entry of another format is read (tests/test_kv_codecs.py)."""
    assert quant.state(16) == {"kv_bits": 16, "kv_codec": "dtype-cast-v1"}  # every precision names its codec
    assert quant.state(8) == {"kv_bits": 8, "kv_codec": "rows-int8-mid-v2"}
    assert quant.state(4) == {"kv_bits": 4, "kv_codec": "rows-hadamard"}
    assert quant.without_bits({"kind": "kv", **quant.state(4)}) == {"kind": "kv", **quant.state(16)}


def test_bytes_per_row_against_16_bits():
    assert quant.row_bytes(64, 8) / quant.row_bytes(64, 16) == pytest.approx(68 / 128)
    assert quant.row_bytes(128, 4) / quant.row_bytes(128, 16) == pytest.approx(72 / 256)
    with pytest.raises(ValueError):
        quant.code_width(64, 3)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", ["decode", "causal", "window", "softcap", "chunks", "groups"])
def test_attention_from_codes_equals_attention_over_their_numbers(bits, case, monkeypatch):
    torch.manual_seed(3)
    n_heads, n_kv, d, kv_len = 8, 2, 64, 70
    if case == "groups":  # heads of two groups, each turned by its own rotation
        d = 128
    q_len = 1 if case == "decode" else 5
    query = torch.randn(1, n_heads, q_len, d)
    k, v = torch.randn(1, n_kv, kv_len, d), torch.randn(1, n_kv, kv_len, d)
    kp, vp = quant.quantize(k, bits), quant.quantize(v, bits)
    kd, vd = quant.dequantize(kp, d, torch.float32), quant.dequantize(vp, d, torch.float32)
    rows = torch.arange(q_len)[:, None] + kv_len - q_len
    cols = torch.arange(kv_len)[None, :]
    mask = None if case == "decode" else cols <= rows
    if case == "window":
        mask = mask & (cols > rows - 20)
    if case == "chunks":
        monkeypatch.setattr(quant, "ROWS", 16)
    softcap = 5.0 if case == "softcap" else None
    kr, vr = kd.repeat_interleave(n_heads // n_kv, 1), vd.repeat_interleave(n_heads // n_kv, 1)
    scores = query @ kr.transpose(-1, -2) * 0.125
    if case == "groups":
        assert quant.group_size(d) == 64
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    want = (torch.softmax(scores, -1) @ vr).transpose(1, 2)
    got = quant.attend(query, kp, vp, d, 0.125, mask, softcap)
    assert torch.allclose(got, want, atol=TOL)
    if case == "decode":
        w = quant.read_weights(query, kp, 0.125)
        assert torch.allclose(w.reshape(1, n_heads, 1, kv_len), torch.softmax(scores, -1), atol=TOL)


def test_attention_from_codes_runs_outside_inference_mode_after_a_run_inside_it():
    """The 8-bit values' scratch buffer (kept per thread) made under torch.inference_mode is made
    again for a call outside it, where an inference tensor takes no in-place write."""
    query = torch.randn(1, 4, 1, 64)
    kp, vp = (quant.quantize(torch.randn(1, 2, 300, 64), 8) for _ in range(2))
    with torch.inference_mode():
        inside = quant.attend(query, kp, vp, 64, 0.125, None, None)
    outside = quant.attend(query, kp, vp, 64, 0.125, None, None)  # RuntimeError before the fix
    assert torch.equal(inside, outside)


class RoundedKV(KVCache):
    """The reference: a plain cache holding each appended row rounded the same way."""

    bits = 8

    def update(self, key, value, layer_idx, *args, **kwargs):
        d = key.shape[-1]
        key = quant.dequantize(quant.quantize(key, self.bits), d, key.dtype)
        value = quant.dequantize(quant.quantize(value, self.bits), d, value.dtype)
        return super().update(key, value, layer_idx, *args, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_cache_answers_as_a_cache_of_its_numbers(tiny_lm, family, bits):
    # one layer: its keys and values come from the embeddings, the same numbers on both sides (with
    # more, a layer's new rows come from the attention before it, whose kernels differ in the last
    # bits, and a code one rounding apart flips: a chain compares roundings, not the cache)
    lm = tiny_lm(family, num_hidden_layers=1)
    engine = Engine(lm)
    ids = random_ids(60, seed=4)
    ref, qc = RoundedKV(), QuantKVCache(bits)
    ref.bits = bits
    for cache in (ref, qc):
        engine.forward(ids[:40], torch.arange(40), cache)  # a prompt: the layers dequantized, the same numbers
    # a question (a pass of few queries: read from the codes), then decoding steps
    for a, e in [(40, 52), *((i, i + 1) for i in range(52, 60))]:
        got, want = (engine.logits(engine.forward(ids[a:e], torch.arange(a, e), c)) for c in (qc, ref))
        assert torch.allclose(got, want, atol=TOL), (got - want).abs().max()
    assert qc.get_seq_length() == 60 and qc.positions.tolist() == list(range(60))
    assert qc.nbytes() == quant.row_bytes(lm.head_dim, bits) * 2 * 60 * qc.n_kv * qc.n_layers  # keys and values


def test_a_decoding_step_reads_the_codes_and_a_pass_gets_the_layer():
    cache = QuantKVCache(8)
    k = torch.randn(1, 2, 20, 16)
    k_out, _ = cache.update(k, k, 0)
    assert isinstance(k_out, torch.Tensor) and k_out.shape == (1, 2, 20, 16)
    view, _ = cache.update(k[:, :, :1], k[:, :, :1], 0)
    assert isinstance(view, QuantLayer) and cache.get_seq_length(0) == 21


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trips(bits, tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    ids = random_ids(30, seed=5)
    plain = KVCache()
    engine.forward(ids, torch.arange(30), plain)
    plain.kept = [torch.arange(30).view(1, -1).expand(plain.keys[0].shape[1], -1)[:, ::2] for _ in plain.keys]
    plain.keys = [k[:, :, ::2] for k in plain.keys]
    plain.values = [v[:, :, ::2] for v in plain.values]
    want_mask = plain.kept_mask(30)
    keys = [quant.dequantize(quant.quantize(k, bits), k.shape[-1], k.dtype) for k in plain.keys]
    q = QuantKVCache.of(plain, bits)
    assert torch.equal(q.kept_mask(30), want_mask)
    assert all(k.untyped_storage().nbytes() == 0 for k in plain.keys)  # released as converted
    dense = q.dense()
    assert all(t.untyped_storage().nbytes() == 0 for t in q.kc)  # released as converted
    assert all(torch.equal(a, b) for a, b in zip(dense.keys, keys))
    assert torch.equal(dense.kept_mask(30), want_mask)
    # what the store writes (a prefix: nothing evicted) reads back the same
    whole = KVCache()
    engine.forward(ids, torch.arange(30), whole)
    q = QuantKVCache.of(whole, bits)
    tensors, facts = q.to_tensors()
    back = QuantKVCache.from_tensors(tensors, facts)
    assert back.to_tensors()[1] == facts
    assert all(torch.equal(a, b) for a, b in zip(back.to_tensors()[0].values(), tensors.values()))


def test_auto_decodes_from_16_bits_on_a_cpu_and_holds_the_methods_bits():
    """``--kv-bits auto`` on a CPU: the KV is held (and stored) in the method's bits, and decoding
    reads it turned back to 16 (``Pipeline.decode_bits``, ``Pipeline.small_kv``): the numbers of its
    codes, by the codec's own dequantization. Elsewhere, or with bits asked for, decoding reads
    those bits."""
    from kvcli.answer.pipeline import Pipeline

    full = Pipeline.parse("full")
    assert full.kv_bits("auto") == 8 and full.decode_bits("auto", "cpu") == 16
    assert full.decode_bits("auto", "cuda") == 8 and full.decode_bits(8, "cpu") == 8 and full.decode_bits(4, "cpu") == 4
    assert Pipeline.parse("lazyllm").decode_bits("auto", "cuda") == 16
    torch.manual_seed(6)
    k, v = torch.randn(1, 2, 20, 16).bfloat16(), torch.randn(1, 2, 20, 16).bfloat16()
    held = QuantKVCache(8)
    held.update(k, v, 0)
    codes = held.packed(0)
    want = [quant.dequantize(p, 16, torch.bfloat16) for p in codes]
    decoding = full.small_kv(held, 16)
    assert type(decoding) is KVCache and decoding.kv_bits == 16
    assert torch.equal(decoding.keys[0], want[0]) and torch.equal(decoding.values[0], want[1])
    assert full.small_kv(decoding, 16) is decoding  # 16 already: as it is
    roomy = QuantKVCache(8)
    roomy.update(k, v, 0)
    decoding = full.small_kv(roomy, 16, room=5)  # the answer's room in the buffers: appended in place
    assert torch.equal(decoding.keys[0], want[0]) and torch.equal(decoding.values[0], want[1])
    before = decoding.keys[0].untyped_storage().data_ptr()
    decoding.update(k[:, :, :3], v[:, :, :3], 0)
    assert decoding.keys[0].untyped_storage().data_ptr() == before and decoding.get_seq_length() == 23
    assert torch.equal(decoding.keys[0][:, :, 20:], k[:, :, :3])


def test_truncate_drop_front_and_copy():
    cache = QuantKVCache(8)
    rows = torch.randn(1, 2, 30, 16)
    cache.update(rows, rows, 0)
    cache.record_positions(torch.arange(30))
    copy = cache.copy()
    cache.truncate(12)
    assert cache.get_seq_length() == 12 and cache.positions.numel() == 12 and copy.get_seq_length() == 30
    copy.drop_front(0, 10)
    assert copy.get_seq_length() == 20 and copy.held_positions(0)[0].tolist() == list(range(10, 30))
    kept = quant.dequantize(copy.packed(0)[0], 16, torch.float32)
    assert torch.equal(kept, quant.dequantize(quant.quantize(rows, 8), 16, torch.float32)[:, :, 10:])
    cache.update(rows[:, :, :1], rows[:, :, :1], 0)  # appends after a truncation leave the copy alone
    assert copy.get_seq_length() == 20


def test_bad_facts_are_refused():
    cache = QuantKVCache(4)
    rows = torch.randn(1, 2, 5, 16)
    cache.update(rows, rows, 0)
    cache.record_positions(torch.arange(5))
    tensors, facts = cache.to_tensors()
    with pytest.raises(ValueError):
        QuantKVCache.from_tensors(tensors, {**facts, "bits": 3})
    with pytest.raises(ValueError):
        QuantKVCache.from_tensors({**tensors, "kc.0": tensors["kc.0"][:, :, :4]}, facts)


# --------------------------------------------------------------------------- the command line


def test_cli_kv_bits_error_is_one_line_naming_the_choices(cli, tmp_path, monkeypatch):
    doc = tmp_path / "d.txt"
    doc.write_text("Hello there.")
    for command in ("ask", "inspect"):
        code, out, err = cli(command, doc, "What?", "--kv-bits", "3")
        assert code == 2 and not out and err.count("\n") == 1 and err.startswith("kvcli: error: ")
        assert all(b in err for b in ("'16'", "'8'", "'4'", "'auto'"))
    monkeypatch.setenv(quant.ENV_KV_BITS, "2")
    code, out, err = cli("ask", doc, "What?")
    assert code == 2 and err.count("\n") == 1 and ("KVCLI_KV_BITS" in err or "--kv-bits" in err)
    for grid in ("16,3", "auto,2"):  # auto is a setting of the grid too (each method's bits); 3 and 2 are not
        code, _, err = cli("bench", "memory", "--simulate", "--kv-bits", grid, "--out", tmp_path / "m")
        assert code == 2 and err.count("\n") == 1 and "--kv-bits" in err


def test_cli_json_reports_the_bits_and_the_smaller_entry(cli, tmp_path, tiny_dir):
    model = tiny_dir("llama")
    doc = tmp_path / "d.txt"
    doc.write_text("Cats sleep a lot. " * 40)
    records = {}
    for bits in ("16", "8", "4"):
        code, out, err = cli(
            "ask", doc, "What?", "-m", model, "--kv-bits", bits, "--json", "--max-new-tokens", "3",
            "--cache-dir", tmp_path / "cache", "--no-sources",
        )  # fmt: skip
        assert code == 0, err
        records[bits] = json.loads(out)
    assert [r["kv_bits"] for r in records.values()] == [16, 8, 4]
    assert [r["cache"] for r in records.values()] == ["miss", "miss", "miss"]  # a key per precision
    sizes = [r["cache_entry_bytes"] for r in records.values()]
    kv = [r["kv_cache_bytes"] for r in records.values()]
    assert sizes[0] > sizes[1] > sizes[2] and kv[0] > kv[1] > kv[2]


# --------------------------------------------------------------------------- --kv-bits auto (the default)


def test_auto_is_each_methods_declared_bits_and_the_help_names_them():
    """auto resolves to the bits the stages declare (Compressor.auto_kv_bits): 8 where the KV
    layout is quantized (full attention, the evictions, Finch, GemFilter, pages, InfLLM's book), 16
    when a stage's is not; an explicit setting is kept. The help names every method whose auto is
    16, and no other."""
    from kvcli.answer.pipeline import Pipeline
    from kvcli.cli.options import kv_bits_help
    from kvcli.compressors import REGISTRY

    assert quant.DEFAULT_KV_BITS == quant.AUTO == quant.check_bits("Auto")
    for spec in ("infllm", "full", "snapkv", "pyramidkv", "h2o", "pages", "finch", "gemfilter+snapkv"):
        assert Pipeline.parse(spec).kv_bits("auto") == 8, spec
    for spec in ("blocksparse", "razor", "lazyllm", "adakv", "kvzip", "duo", "snapkv+decoding"):
        assert Pipeline.parse(spec).kv_bits("auto") == 16, spec
    assert Pipeline.parse("infllm").kv_bits(16) == 16 and Pipeline.parse("full").kv_bits(4) == 4
    sixteen = {name for name, cls in REGISTRY.items() if cls.auto_kv_bits == 16}
    assert sixteen == {"adakv", "blocksparse", "decoding", "duo", "expectedattention", "kvzip", "lazyllm", "razor"}
    help_ = kv_bits_help()
    said = {name for name in REGISTRY if f"-c {name}," in help_ or help_.endswith(f"-c {name}")}
    assert said == sixteen and "auto: 8" in help_
    with pytest.raises(ValueError, match="16, 8, 4 or auto"):
        quant.check_bits("3")
