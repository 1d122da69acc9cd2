"""Quantised weights kept on disk (kvcli.model.kept): a model quantised once is saved beside its
conversion, and a later load builds the skeleton on the meta device and reads the codes back: the
same logits bit for bit, no float32 weights loaded, nothing quantised again; a kept folder that
does not match is ignored (the model quantised again), never half-used. Kept weights are the CPU's
int8 (:mod:`kvcli.model.cpu_quant`; CUDA's 8bit is bitsandbytes): every model here loads on the CPU."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvcli.model import kept, load_model
from kvcli.model.cpu_quant import DTYPE, Int4Linear, Int8Embedding, Int8Linear, int8_paths, quantize_model
from tests.model.test_gguf_files import write_tiny_llama_gguf

IDS = torch.tensor([[1, 520, 1280, 30000, 7, 99, 4000]])


def _file_at(address: int) -> str | None:
    """The file mapped at ``address`` in this process (None: anonymous memory, e.g. a read tensor)."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        lines = maps.read().splitlines()
    for line in lines:
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return rest[4] if len(rest) > 4 and rest[4].startswith("/") else None
    return None


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {}), ("qwen2", {}), ("gemma3", {})],
    ids=["llama-untied", "qwen2-biases-tied", "gemma3-scaled-embedding"],
)
def test_kept_weights_load_back_to_the_same_logits(tiny_dir, tmp_path, family, overrides):
    folder = tmp_path / "models" / f"tiny-{family}"
    shutil.copytree(tiny_dir(family, **overrides), folder)
    lm = load_model(str(folder), dtype="float32", device="cpu")
    quantize_model(lm.model, 8, DTYPE)
    want = _logits(lm.model)
    assert kept.save(lm.model, folder, DTYPE) == kept.kept_folder(folder, DTYPE)
    back = kept.load(folder, lm.model.config, DTYPE, "sdpa")
    assert back is not None and not any(t.is_meta for t in back.state_dict().values())
    embed, head = back.get_input_embeddings(), back.get_output_embeddings()
    mapped = {"model.embed_tokens.table.codes"} if not back.config.tie_word_embeddings else set()
    assert kept._gathered(back) == mapped  # an untied table is only gathered from: mapped, not read
    if mapped:
        weights = (kept.kept_folder(folder, DTYPE) / kept._WEIGHTS).resolve()  # as the kernel names it
        assert _file_at(embed.table.codes.data_ptr()) == str(weights)
    read = {name: t for name, t in back.state_dict().items() if name not in mapped}
    assert all(t.data_ptr() % kept.ALIGN == 0 for t in read.values())  # the int8 kernel's need
    assert torch.equal(_logits(back.eval()), want)
    assert isinstance(embed, Int8Embedding) and isinstance(head, Int8Linear)
    assert (embed.head[0] is head) == back.config.tie_word_embeddings  # one table when tied, else two
    assert back.config.tie_word_embeddings == (family == "qwen2")
    if family == "qwen2":
        q = back.model.layers[0].self_attn.q_proj
        assert isinstance(q, Int8Linear) and q.bias is not None and q.bias.abs().sum() > 0


def test_four_bit_weights_are_kept_with_the_matrices_left_in_int8(tiny_dir, tmp_path):
    """``--quant 4``'s weights kept and loaded back: the same logits bit for bit, the same matrices
    in int8 (a GGUF's finer blocks; here one forced by hand), in a folder of their own that names
    the PyTorch whose packing they are in."""
    folder = tmp_path / "models" / "tiny-qwen2"
    shutil.copytree(tiny_dir("qwen2"), folder)
    lm = load_model(str(folder), dtype="float32", device="cpu")
    down = "model.layers.1.mlp.down_proj"
    counts = quantize_model(lm.model, 4, DTYPE, int8={down})
    assert counts["int8"] >= 2 and counts["int4"] > 0
    want, int8 = _logits(lm.model), int8_paths(lm.model)
    assert down in int8 and "model.layers.0.mlp.down_proj" not in int8
    target = kept.save(lm.model, folder, DTYPE, 4)
    assert target == kept.kept_folder(folder, DTYPE, 4) != kept.kept_folder(folder, DTYPE)
    assert torch.__version__ in target.name and json.loads((target / "kept.json").read_text())["int8"] == int8
    assert kept.load(folder, lm.model.config, DTYPE, "sdpa") is None  # the 8-bit folder: none kept
    back = kept.load(folder, lm.model.config, DTYPE, "sdpa", 4)
    assert back is not None and not any(t.is_meta for t in back.state_dict().values())
    assert isinstance(back.get_submodule(down), Int8Linear) and int8_paths(back) == int8
    assert isinstance(back.get_submodule("model.layers.0.mlp.down_proj"), Int4Linear)
    assert torch.equal(_logits(back.eval()), want)


@pytest.mark.parametrize("quant", ["8bit", "4bit"])
def test_a_gguf_is_quantised_once_then_loaded_from_its_kept_weights(tiny_dir, tmp_path, monkeypatch, quant):
    gguf = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(tiny_dir("llama"), gguf)
    cache = tmp_path / "cache"
    first = load_model(str(gguf), cache_dir=cache, quant=quant, device="cpu")
    converted = next((cache / "models").glob("gguf-" + "?" * 12))
    folder = kept.kept_folder(converted, DTYPE, 4 if quant == "4bit" else 8)
    assert json.loads((folder / "kept.json").read_text())["format"] == kept.FORMAT
    want = _logits(first.model)

    import transformers

    def no_float_weights(*args, **kwargs):
        raise AssertionError("the float32 weights were loaded again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_float_weights)
    monkeypatch.setattr("kvcli.model.load.quantize_model", no_float_weights)
    second = load_model(str(gguf), cache_dir=cache, quant=quant, device="cpu")
    assert torch.equal(_logits(second.model), want) and second.fingerprint == first.fingerprint


def test_kept_weights_of_another_source_or_format_are_ignored(tiny_dir, tmp_path):
    folder = tmp_path / "models" / "tiny-llama"
    shutil.copytree(tiny_dir("llama"), folder)
    lm = load_model(str(folder), dtype="float32", device="cpu")
    quantize_model(lm.model, 8, DTYPE)
    target = kept.save(lm.model, folder, DTYPE)
    facts = json.loads((target / "kept.json").read_text())
    (target / "kept.json").write_text(json.dumps({**facts, "format": kept.FORMAT + 1}))
    assert kept.load(folder, lm.model.config, DTYPE, "sdpa") is None
    (target / "kept.json").write_text(json.dumps(facts))
    smaller = lm.model.config.__class__(**{**lm.model.config.to_dict(), "num_hidden_layers": 1})
    assert kept.load(folder, smaller, DTYPE, "sdpa") is None  # tensors that do not fit: none used
