"""What kvcli knows about a loaded model: :class:`LoadedModel` (the model, its tokenizer and its
facts: layers, heads, the sliding window of each layer: :class:`kvcli.runtime.windows.Windows`), and the
choices it was loaded with."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch

from ..runtime.windows import Windows

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


from .names import ATTNS, QUANT_SPELLINGS, QUANTS, quant_name, spelled  # noqa: F401  (the loading choices' names)

DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclasses.dataclass
class LoadedModel:
    """A causal LM ready for inference, with what kvcli needs to know about it."""

    model: PreTrainedModel  # a *ForCausalLM in eval mode, requires_grad off
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user asked for: EMBEDDED_MODEL, a hub id or a path
    family: str  # config.model_type: "llama", "mistral", "qwen2", "qwen3", "phi3", ...
    fingerprint: str  # hex sha256 of weights + config + tokenizer + dtype + quant
    device: torch.device
    dtype: torch.dtype
    quant: str  # "none" | "4bit" | "8bit" (what ran: "auto" resolved)
    attn: str  # "sdpa" | "eager" | "flash" (the kernel asked for)
    # kvcli's kernel for 8-bit decoding (kvcli.model.int8_rows): "exact, AVX-512", "8bit, AVX-512 VNNI"...; None: PyTorch's
    int8_kernel: str | None = None
    source: str = ""  # what was actually loaded: the local folder, or the hub id
    cpu_prefill_chunk: int | None = None  # an embedded model's measured chunk on the CPU (EmbeddedModel's)
    check_threshold: float | None = None  # the answer check's measured threshold (EmbeddedModel's)
    check_asked: tuple[str, float] | None = None  # the check's yes/no question and threshold (EmbeddedModel's)

    @property
    def text_config(self) -> Any:
        """The config of the text model (a multimodal model's text part): its layers, heads, RoPE."""
        cfg = self.model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    @property
    def n_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def n_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def n_kv_heads(self) -> int:
        return int(getattr(self.text_config, "num_key_value_heads", None) or self.n_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.text_config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def max_context(self) -> int:
        return int(self.text_config.max_position_embeddings)

    def new_cache(self):
        """An empty plain cache (:class:`kvcli.caches.KVCache`): the one a pass of the engine fills
        when its caller gives none, as a transformers model starts its own ``DynamicCache``."""
        from ..caches import KVCache

        return KVCache()

    @functools.cached_property
    def windows(self) -> Windows:
        """Each decoder layer's sliding window and what follows from it (:mod:`kvcli.runtime.windows`),
        read once from the config."""
        return Windows.of_config(self.text_config, self.n_layers)
