"""The models the simulator runs: real published configs, built on ``meta`` with bf16 or nf4 weights.

``CONFIGS`` holds the ``config.json`` values of each model (as published on the Hugging Face hub)
that shape memory: sizes, heads, KV heads, head_dim, vocabulary, RoPE scaling, window. The model is
``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` in bfloat16: every parameter
has its shape and dtype, no data.

nf4 weights are stored as bitsandbytes 0.50 stores them for transformers'
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` — what ``kvcli --quant 4bit``
asks for (:func:`kvcli.model.device.quant_config`): every ``nn.Linear`` but ``lm_head`` becomes a
packed uint8 tensor of ``ceil(out*in/2)`` bytes, a float32 absmax per block of 64 weights and the
16-entry float32 nf4 code; ``bnb_4bit_use_double_quant`` is False by default there, so the absmax
is not quantised again. Embeddings, norms, biases and ``lm_head`` stay bf16. Its forward
allocates what bitsandbytes' CUDA ``gemm_4bit`` allocates (``backends/cuda/ops.py``): for up to
4 rows the fused kernel writes only the output; for more, the fallback dequantises the whole
weight into a bf16 (out, in) tensor and runs ``F.linear`` (the kernel's values are not computed:
this is a memory model).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from ...errors import UsageError

LLAMA_3_1_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
QWEN2_5_7B = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
MISTRAL_NEMO_12B = {
    "model_type": "mistral",
    "architectures": ["MistralForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 14336,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 131072,
    "max_position_embeddings": 1024000,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_PHI_LONG = [
    1.0800000429153442,
    1.1100000143051147,
    1.1399999856948853,
    1.340000033378601,
    1.5899999141693115,
    1.600000023841858,
    1.6200000047683716,
    2.620000123977661,
    3.2300000190734863,
    3.2300000190734863,
    4.789999961853027,
    7.400000095367432,
    7.700000286102295,
    9.09000015258789,
    12.199999809265137,
    17.670000076293945,
    24.46000099182129,
    28.57000160217285,
    30.420001983642578,
    30.840002059936523,
    32.590003967285156,
    32.93000411987305,
    42.320003509521484,
    44.96000289916992,
    50.340003967285156,
    50.45000457763672,
    57.55000305175781,
    57.93000411987305,
    58.21000289916992,
    60.1400032043457,
    62.61000442504883,
    62.62000274658203,
    62.71000289916992,
    63.1400032043457,
    63.1400032043457,
    63.77000427246094,
    63.93000411987305,
    63.96000289916992,
    63.970001220703125,
    64.02999877929688,
    64.06999969482422,
    64.08000183105469,
    64.12000274658203,
    64.41000366210938,
    64.4800033569336,
    64.51000213623047,
    64.52999877929688,
    64.83999633789062,
]
_PHI_SHORT = [
    1.0,
    1.0199999809265137,
    1.0299999713897705,
    1.0299999713897705,
    1.0499999523162842,
    1.0499999523162842,
    1.0499999523162842,
    1.0499999523162842,
    1.0499999523162842,
    1.0699999332427979,
    1.0999999046325684,
    1.1099998950958252,
    1.1599998474121094,
    1.1599998474121094,
    1.1699998378753662,
    1.2899998426437378,
    1.339999794960022,
    1.679999828338623,
    1.7899998426437378,
    1.8199998140335083,
    1.8499997854232788,
    1.8799997568130493,
    1.9099997282028198,
    1.9399996995925903,
    1.9899996519088745,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0799996852874756,
    2.0899996757507324,
    2.189999580383301,
    2.2199995517730713,
    2.5899994373321533,
    2.729999542236328,
    2.749999523162842,
    2.8399994373321533,
]
PHI_3_5_MINI = {
    "model_type": "phi3",
    "architectures": ["Phi3ForCausalLM"],
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {"long_factor": _PHI_LONG, "short_factor": _PHI_SHORT, "type": "longrope"},
    "sliding_window": 262144,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 32000,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attention_dropout": 0.0,
}
CONFIGS = {
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", LLAMA_3_1_8B),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", QWEN2_5_7B),
    "mistral-nemo-12b": ("mistralai/Mistral-Nemo-Instruct-2407", MISTRAL_NEMO_12B),
    "phi-3.5-mini": ("microsoft/Phi-3.5-mini-instruct", PHI_3_5_MINI),
}
WEIGHTS = ("bf16", "nf4")
NF4_BLOCK = 64
NF4_CODE = 16  # float32 entries of the nf4 code kept with every weight


def hf_config(name: str, layers: int | None = None):
    """The transformers config object of ``name`` (a key of :data:`CONFIGS`); with ``layers``
    decoder layers instead of its own, where given."""
    from transformers import AutoConfig

    key = name.strip().lower()
    if key not in CONFIGS:
        raise UsageError(f"--config: unknown model '{name}'; choose from {', '.join(CONFIGS)}")
    values = dict(CONFIGS[key][1], **({} if layers is None else {"num_hidden_layers": layers}))
    model_type = values.pop("model_type")
    values.pop("architectures")
    return AutoConfig.for_model(model_type, **values)


class SimLinear4bit(nn.Module):
    """A bitsandbytes ``Linear4bit`` (nf4, blocksize 64, no double quantisation) as far as memory
    goes: its stored tensors and the allocations of its CUDA forward (see the module docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        n = self.in_features * self.out_features
        dev = linear.weight.device
        self.weight = nn.Parameter(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=dev), requires_grad=False)
        self.register_buffer("absmax", torch.empty(math.ceil(n / NF4_BLOCK), dtype=torch.float32, device=dev))
        self.register_buffer("code", torch.empty(NF4_CODE, dtype=torch.float32, device=dev))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= 4:  # the fused gemm_4bit kernel: A made contiguous, the output
            x = x.contiguous()
            out = torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype, device=x.device)
            return out if self.bias is None else out + self.bias
        dequantized = torch.empty((self.out_features, self.in_features), dtype=x.dtype, device=x.device)
        return nn.functional.linear(x, dequantized, self.bias)


def linears_but_head(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, module) of every ``nn.Linear`` but the output embedding: what 4-bit
    weights replace (bitsandbytes keeps ``lm_head`` in 16 bits)."""
    head = model.get_output_embeddings()
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child is not head
    ]


def quantize_nf4(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` but the output embedding by :class:`SimLinear4bit`; returns how many."""
    swaps = linears_but_head(model)
    for parent, name, child in swaps:
        setattr(parent, name, SimLinear4bit(child))
    return len(swaps)


def build_model(
    name: str,
    weights: str = "nf4",
    device: str = "meta",
    dtype: torch.dtype = torch.bfloat16,
    layers: int | None = None,
):
    """``from_config`` of ``name`` on ``device`` in ``dtype``, nf4-quantised when ``weights`` is nf4;
    with ``layers`` decoder layers instead of its own, where given (a test's shorter run of the same shapes)."""
    from transformers import AutoModelForCausalLM

    if weights not in WEIGHTS:
        raise UsageError(f"--weights must be one of {', '.join(WEIGHTS)}, not '{weights}'")
    config = hf_config(name, layers)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if weights == "nf4":
        quantize_nf4(model)
    model.eval()
    model.requires_grad_(False)
    return model


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


class SimTokenizer:
    """A word-level tokenizer for the simulated models (their real tokenizers are downloads): each
    whitespace-separated word is one token, its id a fixed function of the word, below ``vocab``
    and above the special ids. Enough for :func:`kvcli.answer.prompt.build_prompt` to lay out a prompt of
    exactly the length asked for; the answer's text is the ids written out."""

    chat_template = None
    bos_token = "<s>"

    def __init__(self, vocab: int, bos_id: int = 1, eos_id: int = 2) -> None:
        self.vocab, self.bos_token_id, self.eos_token_id = vocab, bos_id, eos_id

    def _id(self, word: str) -> int:
        if word == self.bos_token:
            return self.bos_token_id
        h = 0
        for ch in word:
            h = (h * 131 + ord(ch)) % 1_000_003
        return 1000 + h % (self.vocab - 1000)

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False):
        spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
        out = {"input_ids": [self._id(text[a:b]) for a, b in spans]}
        if return_offsets_mapping:
            out["offset_mapping"] = spans
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(f"<{int(i)}>" for i in ids)

    def __len__(self) -> int:
        return self.vocab

    def get_vocab(self) -> dict:
        return {self.bos_token: self.bos_token_id}
