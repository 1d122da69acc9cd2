"""Tiny random-weight models of each supported family, for fast tests (no download).

``make_tiny_model("qwen3", tmp_path)`` builds a 2-layer model (hidden 64, 4 attention heads,
2 KV heads -> GQA, head_dim 16, max_position_embeddings 4096; qwen2 is shaped as Qwen2.5: see
_FAMILY) from the family's Config class,
with the embedded SmolLM2 tokenizer (vocab 49152, ChatML chat template), saves both with
``save_pretrained`` and returns the folder, which ``kvcli.models.load_model(str(path))`` loads.

The weights depend only on ``family`` and ``seed``. The tokenizer comes from the converted
embedded model in the kvcli cache (``$KVCLI_CACHE_DIR`` or ``~/.cache/kvcli``): the first test
session on a machine converts it once (~20 s), later ones reuse it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# the hybrids: sliding-window layers (window HYBRID_WINDOW) interleaved with full-attention ones
HYBRID_FAMILIES = ("gemma2", "gemma3")
HYBRID_WINDOW = 16

VOCAB = 49152  # SmolLM2's tokenizer
BOS_ID, EOS_ID, PAD_ID = 1, 2, 2  # <|im_start|>, <|im_end|>, <|im_end|>

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    tie_word_embeddings=False,
    use_cache=True,
)

# What each family needs on top of _COMMON.
_FAMILY: dict[str, dict[str, Any]] = {
    "llama": dict(head_dim=16),
    "mistral": dict(head_dim=16, sliding_window=None),
    # qwen2 shaped as Qwen2.5 (the embedded Qwen2.5-Coder models): q/k/v biases (random, see
    # make_tiny_model), 12 query heads on 2 KV heads (head_dim = 192 / 12), RoPE base 1e6, tied embeddings
    "qwen2": dict(
        use_sliding_window=False,
        sliding_window=None,
        hidden_size=192,
        intermediate_size=256,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3": dict(head_dim=16, use_sliding_window=False, sliding_window=None),
    # phi3: head_dim = 64 / 4; defaults pad/eos 32000 (a Phi-3 id): use SmolLM2's.
    "phi3": dict(original_max_position_embeddings=4096, resid_pdrop=0.0, embd_pdrop=0.0),
    # Gemma 2: sandwich norms, sqrt(hidden) embedding scale, soft-capped attention and final logits,
    # query_pre_attn_scalar != head_dim, sliding layers alternating with full ones (tiny_config)
    "gemma2": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=HYBRID_WINDOW,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    ),
    # Gemma 3: q/k norms, local / global RoPE bases per layer type
    "gemma3": dict(
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=HYBRID_WINDOW,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
}


def _config_class(family: str):
    import transformers

    names = {
        "llama": "LlamaConfig",
        "mistral": "MistralConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "phi3": "Phi3Config",
        "gemma2": "Gemma2Config",
        "gemma3": "Gemma3TextConfig",
    }
    if family not in names:
        raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")
    return getattr(transformers, names[family])


def tiny_config(family: str, **overrides: Any):
    """The Config object of a tiny ``family`` model; ``overrides`` replace any field."""
    cls = _config_class(family)  # raises for an unknown family
    fields = {**_COMMON, **_FAMILY[family], **overrides}
    if family in HYBRID_FAMILIES and "layer_types" not in fields:
        # sliding, full, sliding, full...: every model has both kinds, the last layer full
        fields["layer_types"] = [
            "full_attention" if i % 2 else "sliding_attention" for i in range(fields["num_hidden_layers"])
        ]
    return cls(**fields)


_tokenizer_dir: Path | None = None


def use_tokenizer_from(folder: Path) -> None:
    """Take the tokenizer from ``folder`` (a converted embedded model) instead of the default
    kvcli cache; for tests that convert the embedded model into a temporary cache anyway."""
    global _tokenizer_dir
    if _tokenizer_dir != Path(folder):
        _tokenizer_dir = Path(folder)
        _tokenizer.cache_clear()


def tokenizer_dir() -> Path:
    """Folder of the embedded model converted by kvcli (its tokenizer is what we reuse)."""
    global _tokenizer_dir
    if _tokenizer_dir is None:
        from kvcli.model import embedded_model_path

        _tokenizer_dir = embedded_model_path()
    return _tokenizer_dir


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


def make_tiny_model(family: str, tmp_path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Build, save and return ``tmp_path/tiny-<family>-s<seed>`` (reused if already there).

    ``overrides`` go into the config (e.g. ``num_hidden_layers=4``, ``sliding_window=64``); a
    folder with overrides gets their values in its name so variants don't collide.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    suffix = "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
    folder = Path(tmp_path) / f"tiny-{family}-s{seed}{suffix}"
    if (folder / "config.json").is_file():
        return folder

    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):  # deterministic, and leaves the global RNG alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # transformers starts biases at zero: make them count (qwen2's q/k/v)
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.5)
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(str(tmp))
    _tokenizer().save_pretrained(str(tmp))
    tmp.rename(folder)
    return folder


def make_parrot_model(tmp_path: Path, text: str) -> Path:
    """A tiny llama that, greedily, writes ``text`` over and over whatever the prompt: its layers
    add nothing (zero output projections), so the last hidden state is the current token's
    embedding, and its LM head maps it to the next token of the cycle (a bigram table). Every token
    outside the cycle leads to the first one. ``text``'s tokens must be distinct (at most 63)."""
    from transformers import AutoModelForCausalLM

    ids = _tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert len(set(ids)) == len(ids) <= 63, ids
    folder = Path(tmp_path) / f"parrot-{abs(hash(tuple(ids))) % 10**8}"
    if (folder / "config.json").is_file():
        return folder
    config = tiny_config("llama", num_hidden_layers=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hidden, other = config.hidden_size, config.hidden_size - 1
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, other] = 1.0  # every token outside the cycle: direction `other`
        head = model.lm_head.weight
        head.zero_()
        head[ids[0], other] = 10.0
        for i, t in enumerate(ids):
            embed[t].zero_()
            embed[t, i] = 1.0
            head[ids[(i + 1) % len(ids)], i] = 10.0
    assert hidden > len(ids)
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(str(tmp))
    _tokenizer().save_pretrained(str(tmp))
    tmp.rename(folder)
    return folder
