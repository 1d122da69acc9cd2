"""Every stored KV names its format, and each format's bytes are pinned.

Golden bytes: a fixed tensor gives fixed codes, scales and zeros for each codec (16 bits: the tensor
in its storage dtype; 8 bits; 4 bits rotated), written here as literal values and hashes under the
codec's name. A change of a codec's bytes fails these tests, and must come with a new name in
:data:`kvcli.caches.quant.CODECS` (then every store key changes: an entry of the old format is a
miss, never decoded). And the store side: an entry of another format is not decoded, and a run says
so once."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from kvcli import notices
from kvcli.caches import KVCache, quant
from kvcli.files import save_safetensors_atomic
from kvcli.store import KVStore, make_key
from kvcli.store import entries as entry_files
from tests.helpers.stores import (
    DOC,
    Q1,
    ask,
    session_for,
    silent_notices,  # noqa: F401  (autouse)
)
from tests.helpers.stores import entry_files as stored_files


def fixed(rows: int, d: int) -> torch.Tensor:
    """The fixed tensor the golden bytes are of (float32, rows x d)."""
    r = torch.arange(rows, dtype=torch.float64)[:, None]
    c = torch.arange(d, dtype=torch.float64)[None, :]
    return (torch.sin(1.3 * r + 0.7 * c) * (1 + (c % 5)) + 0.25 * r).to(torch.float32)


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def as_int16(t: torch.Tensor) -> list:
    return t.contiguous().view(torch.int16).tolist()


# codec name -> (bits, codes, scale bits, zero bits) of fixed(2, 8), and the hash of fixed(3, 128)'s
GOLDEN = {
    "rows-int8-mid-v2": (
        8,
        [[246, 41, 107, 127, 56, 232, 177, 129], [90, 127, 104, 5, 129, 6, 244, 38]],
        [[9847], [9717]],
        [[13323], [-17641]],
        "10422ac03909621d",
    ),
    "rows-hadamard": (
        4,
        [[250, 72, 8, 104], [243, 178, 180, 64]],
        [[14384], [13725]],
        [[-15392], [-16588]],
        "9f6e0492d78c13e0",
    ),
}
GOLDEN_16 = {  # dtype-cast-v1: the tensor in its storage dtype, as is
    torch.float16: (
        [
            [0, 15655, 16874, 17128, 16051, -19043, -16647, -15899],
            [15579, 16419, 15905, -17875, -15441, -17928, -17243, 4607],
        ],
        "006dac7701b5e9be",
    ),
    torch.bfloat16: (
        [
            [0, 16293, 16445, 16477, 16342, -16716, -16417, -16323],
            [16283, 16388, 16324, -16570, -16266, -16577, -16491, 14912],
        ],
        "d3b1a7668e8623bd",
    ),
}


def test_every_precision_has_a_named_codec_with_golden_bytes():
    assert set(quant.CODECS) == set(quant.KV_BITS)
    assert quant.CODECS[16] == "dtype-cast-v1"
    for bits in (8, 4):
        assert quant.CODECS[bits] in GOLDEN, f"{bits}-bit codec {quant.CODECS[bits]} has no golden bytes here"
        assert GOLDEN[quant.CODECS[bits]][0] == bits


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_codes_scales_and_zeros_are_the_golden_ones(bits):
    golden_bits, codes, scale, zero, big = GOLDEN[quant.CODECS[bits]]
    p = quant.quantize(fixed(2, 8), bits)
    assert p.codes.tolist() == codes
    assert as_int16(p.scale) == scale and as_int16(p.zero) == zero
    assert digest(*quant.quantize(fixed(3, 128), bits)) == big


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_storage_is_the_tensor_in_its_dtype(dtype):
    values, big = GOLDEN_16[dtype]
    x = fixed(2, 8).to(dtype)
    assert as_int16(x) == values and digest(fixed(3, 128).to(dtype)) == big
    cache = KVCache()  # what a 16-bit entry stores: the layer's tensors, bytes unchanged
    cache.keys, cache.values = [x.reshape(1, 1, 2, 8)], [x.reshape(1, 1, 2, 8).clone()]
    cache.positions = torch.arange(2)
    tensors, _ = cache.to_tensors()
    assert tensors["k.0"].dtype == dtype and digest(tensors["k.0"]) == digest(x)


def test_every_state_names_its_bits_and_codec():
    for bits in quant.KV_BITS:
        assert quant.state(bits) == {"kv_bits": bits, "kv_codec": quant.CODECS[bits]}
        assert quant.other_format(quant.state(bits)) is None
    assert quant.named({"kind": "kv", "layers": 3}) == {"kind": "kv", "layers": 3, **quant.state(16)}
    assert quant.without_bits({"kind": "kv", **quant.state(4)}) == {"kind": "kv", **quant.state(16)}
    assert "an older kvcli" in quant.other_format({"kind": "kv", "kv_bits": 8})  # v1 wrote no codec
    assert "rows-int8-mid-v2" in quant.other_format({"kind": "kv", "kv_bits": 8, "kv_codec": "rows-int8-min"})
    assert quant.other_format({"kind": "kv"}) is not None  # a 16-bit state from before formats were named


def _key(lm, state):
    from kvcli.answer.prompt import build_prompt

    prompt = build_prompt(lm.tokenizer, DOC, Q1)
    return make_key(lm, prompt.ids[: prompt.prefix_len], state)


def test_the_key_and_header_name_the_format_and_another_is_never_decoded(tiny_lm, tmp_path, monkeypatch):
    lm = tiny_lm("llama")
    cold = ask(session_for(lm, tmp_path), "full")
    [path] = stored_files(tmp_path)
    meta, _ = entry_files.read_meta(path)
    assert meta["fields"]["state"]["kv_codec"] == quant.CODECS[16] and meta["format"] == entry_files.FORMAT_VERSION

    # the same key, its header naming another codec (a codec changed under the same name): not decoded
    key = _key(lm, {"kind": "kv", "layers": lm.n_layers})
    assert path.name == f"{key.digest}.safetensors"
    decoded = []
    monkeypatch.setattr(KVCache, "from_tensors", classmethod(lambda cls, *a, **k: decoded.append(a)))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    old = {**meta, "fields": {**meta["fields"], "state": {**meta["fields"]["state"], "kv_codec": "dtype-cast-v0"}}}
    save_safetensors_atomic(path, tensors, {entry_files.META_KEY: json.dumps(old)})
    store = KVStore.open(tmp_path)
    assert store.load(key) is None and decoded == []
    [warning] = notices.collected()
    assert "another format" in warning and "dtype-cast-v0" in warning
    monkeypatch.undo()
    notices.reset()

    # a new codec name (as an upgrade gives): the old entry is a miss, said once, never decoded
    assert ask(session_for(lm, tmp_path), "full").extra["cache"]["status"] == "miss"  # rewritten in this format
    [old_path] = stored_files(tmp_path)
    monkeypatch.setitem(quant.CODECS, 16, "dtype-cast-v9")
    monkeypatch.setattr("kvcli.store.kvstore._FORMAT_SAID", False)
    monkeypatch.setattr(KVCache, "from_tensors", classmethod(lambda cls, *a, **k: decoded.append(a)))
    upgraded = ask(session_for(lm, tmp_path), "full")
    assert upgraded.extra["cache"]["status"] == "miss" and decoded == []
    assert upgraded.answer_ids == cold.answer_ids
    [warning] = notices.collected()
    assert "another format" in warning and "dtype-cast-v1" in warning and "dtype-cast-v9" in warning
    [new_path] = [p for p in stored_files(tmp_path) if p != old_path]
    new_path.unlink()
    assert ask(session_for(lm, tmp_path), "full").extra["cache"]["status"] == "miss"
    assert len(notices.collected()) == 1  # once a run
