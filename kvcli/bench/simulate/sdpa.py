"""Which kernel ``F.scaled_dot_product_attention`` would run on a CUDA GPU, and what it allocates.

On ``meta`` (and on the CPU) PyTorch picks SDPA's backend for that device, not for a GPU: meta
always decomposes into the math path, the CPU into its own flash kernel. :class:`CudaSdpa` (a
``TorchFunctionMode``) intercepts the call and runs, on the simulated device, the op the CUDA
dispatcher would choose (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``,
``select_sdp_backend``; sm80/sm90, cuDNN attention not preferred):

* **flash** (``_scaled_dot_product_flash_attention``): fp16/bf16, no ``attn_mask``, head_dim <= 256,
  ``is_causal`` only with as many queries as keys (PyTorch's causal is upper-left), GQA native.
  Allocates the output and a float32 logsumexp per query and head.
* **efficient** (``_scaled_dot_product_efficient_attention``): fp16/bf16/fp32, a mask is an additive
  bias (a boolean mask is first turned into one: ``where(mask, 0, -inf)`` in the query's dtype, its
  last dim padded to a multiple of 16). GQA: only with ``efficient_gqa`` (PyTorch added it to this
  backend in 2026, pytorch#191085; before, GQA with a mask fell to math).
* **math** (``_scaled_dot_product_attention_math``): everything else — fp32 upcasts of q/k/v, K/V
  repeated to every query head, the (heads, q, k) score matrix in fp32.
* a ``torch.nn.attention.bias.CausalBias`` lower-right mask runs flash with causal (lower-right)
  when flash fits, else efficient with that mask type, as ``CausalBias._dispatch`` does on CUDA.

Each call is counted in :attr:`CudaSdpa.calls` by (phase, backend) so the rows can say where the
math fallback was taken. ``backend="math"`` forces the math path everywhere (the fidelity test
runs it on CPU and on meta: the same decomposition on both).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten
BACKENDS = ("flash", "efficient", "math")


def choose(query, key, value, attn_mask, is_causal: bool, enable_gqa: bool, efficient_gqa: bool = False) -> str:
    """The backend CUDA's SDPA would select for these arguments (see the module docstring)."""
    half = query.dtype in (torch.float16, torch.bfloat16)
    d = query.shape[-1]
    same_d = key.shape[-1] == d and value.shape[-1] == d
    gqa = key.shape[-3] != query.shape[-3]
    if gqa and not enable_gqa:
        return "math"
    if half and attn_mask is None and same_d and d <= 256 and not (is_causal and query.shape[-2] != key.shape[-2]):
        return "flash"
    align = 8 if half else 4
    if same_d and d % align == 0 and (not gqa or efficient_gqa):
        return "efficient"
    return "math"


class CudaSdpa(TorchFunctionMode):
    def __init__(self, backend: str | None = None, efficient_gqa: bool = False, tracker=None) -> None:
        super().__init__()
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.backend = backend
        self.efficient_gqa = efficient_gqa
        self.tracker = tracker
        self.calls: Counter = Counter()  # (phase, backend) -> calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self._on_the_host(args, kwargs):
            return func(*args, **kwargs)
        return self.attend(*args, **kwargs)

    def _on_the_host(self, args, kwargs) -> bool:
        """A host computation inside the run (the sentence-embedding model ``pages`` ranks passages
        with runs on the CPU whatever the device): the CPU's own SDPA, as on a GPU machine; a
        forced ``backend`` (the fidelity test's math on the CPU) applies everywhere."""
        query = args[0] if args else kwargs.get("query")
        return self.backend is None and isinstance(query, torch.Tensor) and query.device.type == "cpu"

    def attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        from torch.nn.attention.bias import CausalBias, CausalVariant

        lower_right = False
        if isinstance(attn_mask, CausalBias):
            if attn_mask.variant == CausalVariant.LOWER_RIGHT and attn_mask.seq_len_q != attn_mask.seq_len_kv:
                lower_right = True
            attn_mask, is_causal = None, True
        backend = self.backend or choose(
            query, key, value, attn_mask, is_causal and not lower_right, enable_gqa, self.efficient_gqa
        )
        if lower_right and backend == "math":  # CausalBias materialises its mask for math
            attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril(
                key.shape[-2] - query.shape[-2]
            )
            is_causal = False
        self.calls[(self.tracker.phase if self.tracker is not None else "", backend)] += 1
        if backend == "flash":
            out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[
                0
            ]
            return out
        if backend == "efficient":
            bias = None
            if attn_mask is not None:
                bias = attn_mask
                if bias.dtype == torch.bool:
                    bias = torch.where(bias, 0.0, float("-inf")).to(query.dtype)
                pad = -bias.shape[-1] % 16
                if pad:
                    bias = F.pad(bias, (0, pad))[..., : bias.shape[-1]]
                bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            # GQA (efficient_gqa): the kernel reads each KV head for its query group, nothing repeated
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, False, dropout_p, is_causal, scale=scale
            )[0]
        return aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]
