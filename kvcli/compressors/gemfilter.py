"""GemFilter: early layers select the input tokens (Shi et al., 2024, arXiv:2409.17422).

"Discovering the Gems in Early Layers: Accelerating Long-Context LLMs with 1000x Input Token
Reduction", Algorithm 1 and Appendix C.1:

1. run only layers 0..r of the model over the whole prompt (the rest is never computed);
2. at layer r, after RoPE, score every key by the last query row, summed over heads:
   ``s = sum_j Q_n^(r,j) K^(r,j)ᵀ`` (GQA: each query head reads its group's KV head);
3. smooth with an average pool of width ``kernel`` (5 in the paper), take the top-k indices,
   sort them back into input order;
4. run the full model on the selected token ids (fresh positions 0..k-1) and generate greedily.

``layer`` (r) is a 0-based layer index, as ``select_layer_idx`` in the official code
(github.com/SalesforceAIResearch/GemFilter): it keeps ``model.layers[:r+1]`` and scores with
``model.layers[r]``'s queries and keys, so Llama-3.1-8B's ``13`` ("13, 14 out of 32") is its 14th
layer. The defaults are the official code's per-model layers (:data:`PAPER_LAYERS`), the measured
one for the embedded model, else ``round(13/32 · depth)``.

Never materialises an attention matrix: step 2 is one (heads x d) by (d x n) product.

kvcli additions, each a knob: ``keep_question`` forces every token after the document (the
template's instructions, the question and the chat template's closing tokens) into the k, so the
second pass always reads the whole request and ends on the generation prompt — the paper leaves
this to the scores, which almost always rank them first; ``span`` > 1 keeps whole windows of that
many tokens around each selected token (off by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..runtime.attention import StopForward, last_query_scores
from .base import Compressor, knob
from .selection import Selection

PAPER_K = 1024  # the paper's budget for 8B models with 32k-128k contexts

# The official code's filter layers (``select_layer_idx``, 0-based), by (config.model_type, number
# of layers): my_baseline/GemFilter/{llama,mistral,phi3}_select_attention.py and needle_eval.py.
PAPER_LAYERS: dict[tuple[str, int], int] = {
    ("llama", 32): 13,  # Meta-Llama-3.1-8B-Instruct: "13, 14 out of 32"
    ("mistral", 40): 19,  # Mistral-Nemo-Instruct-2407 (12B): "19 out of 40"
    ("phi3", 32): 19,  # Phi-3.5-mini-instruct: "19 out of 32"
}

# Defaults measured per model (layer: 0-based index, as the knob); they win over PAPER_LAYERS.
MEASURED_DEFAULTS: dict[str, dict[str, int]] = {
    # passkey needles at 2k-4k tokens (filler haystack): the digits' worst rank among ~4k tokens is
    # 33-148 at the 16th of 30 layers (index 15) and 341-2768 at the 14th (index 13); k=256 finds 3/6
    # needles where k=1024 finds 0/6. Measured when the knob was 1-based ("layer=16"): the same layer.
    "smollm2-135m-instruct": {"layer": 15, "k": 256},
}


def default_filter_layer(n_layers: int, model_name: str = "", family: str = "") -> int:
    """The default filter layer index r (layers 0..r run): measured for the model, else the
    official code's for the family and depth, else ``round(13/32 · n_layers)`` (Llama-3.1-8B's
    13 of 32), within 0..n_layers-1."""
    if "layer" in MEASURED_DEFAULTS.get(model_name, {}):
        return MEASURED_DEFAULTS[model_name]["layer"]
    if (family, n_layers) in PAPER_LAYERS:
        return PAPER_LAYERS[(family, n_layers)]
    return max(0, min(n_layers - 1, round(13 / 32 * n_layers)))


def gem_scores(query: torch.Tensor, key: torch.Tensor, kernel: int) -> torch.Tensor:
    """Paper's ``top_index`` scores: (batch, n_heads, q, d), (batch, n_kv, n, d) -> (n,) float32."""
    scores = last_query_scores(query, key)[0]  # (n,)
    if kernel > 1:
        scores = F.avg_pool1d(scores.view(1, 1, -1), kernel, stride=1, padding=kernel // 2)[0, 0]
    return scores


def top_k_positions(scores: torch.Tensor, k: int, forced: torch.Tensor | None = None, span: int = 1):
    """Indices of the k best ``scores`` in input order, ``forced`` indices always included.

    With ``span`` > 1 the sequence is cut into windows of ``span`` tokens, each window scored by
    its best token, and whole windows are kept best-first until k tokens are chosen.
    """
    n = scores.numel()
    keep = torch.zeros(n, dtype=torch.bool, device=scores.device)
    if forced is not None:
        keep[forced] = True
    budget = k - int(keep.sum())
    if budget > 0:
        if span > 1:
            pad = (-n) % span
            windows = F.pad(scores, (0, pad), value=float("-inf")).view(-1, span).amax(dim=1)
            for w in torch.argsort(windows, descending=True).tolist():
                idx = torch.arange(w * span, min(n, (w + 1) * span), device=scores.device)
                idx = idx[~keep[idx]][:budget]
                keep[idx] = True
                budget -= idx.numel()
                if budget <= 0:
                    break
        else:
            masked = scores.masked_fill(keep, float("-inf"))
            keep[torch.topk(masked, budget).indices] = True
    return torch.nonzero(keep).flatten()


@dataclass
class GemFilter(Compressor):
    """GemFilter (Shi et al., 2024): layers 0..r of the model choose k input tokens, the full
    model then reads only those. arXiv:2409.17422."""

    name: ClassVar[str] = "gemfilter"
    auto_kv_bits: ClassVar[int] = 8  # its layout is quantized: --kv-bits auto holds it in 8 bits (docs/kv-bits.md)
    paper: ClassVar[str] = "Shi et al. 2024, Discovering the Gems in Early Layers, arXiv:2409.17422"
    keep_all: ClassVar[str] = (
        "k={n}"  # the top-k of the filter layer is every prompt token (an explicit k may not exceed the prompt)
    )
    short_document_spec: ClassVar[str] = (
        "gemfilter:k=60,layer=1"  # layer 1: a full-attention layer of the tiny hybrids too
    )
    title: ClassVar[str] = "GemFilter"
    acts: ClassVar[str] = "selects prompt tokens with layers 0..r (r: 0-based index), re-runs them"
    positions: ClassVar[str] = "fresh 0..k-1"
    disk_cache: ClassVar[str] = "prefix KV of layers 0..r"

    layer: int | None = knob(
        None,
        "filter layer index r (0-based, the official code's select_layer_idx): layers 0..r run on the whole prompt and "
        "layer r's queries and keys score it; auto = the paper's (Llama-3.1-8B 13, Mistral-Nemo 19, Phi-3.5-mini 19), "
        "the measured one (SmolLM2-135M 15), else ~13/32 of the depth",
    )
    k: int | None = knob(
        None,
        "number of prompt tokens kept for the second pass; auto = 1024 (the paper's), or the value measured for the model",
    )
    kernel: int = knob(5, "width of the average pool over the scores (odd; 1 = none)")
    keep_question: bool = knob(
        True, "always keep every token after the document (instructions, question, chat template tail)"
    )
    span: int = knob(1, "keep whole windows of this many tokens around the best scores (1 = plain top-k)")

    def __post_init__(self) -> None:
        if self.k is not None and self.k < 1:
            raise UsageError(f"gemfilter: k must be at least 1, got {self.k}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise UsageError(f"gemfilter: kernel must be odd and at least 1, got {self.kernel}")
        if self.span < 1:
            raise UsageError(f"gemfilter: span must be at least 1, got {self.span}")
        if self.layer is not None and self.layer < 0:
            raise UsageError(f"gemfilter: layer is a 0-based layer index, got {self.layer}")

    def configure(self, lm) -> None:
        full = lm.windows.full_layers
        if self.layer is None:
            self.layer = default_filter_layer(lm.n_layers, lm.name, lm.family)
            if full and self.layer not in full:
                # a hybrid (Gemma 2 / 3): the filter's last query must see the whole prompt, so the
                # filter layer is the full-attention layer nearest the default depth (the earlier on a tie)
                self.layer = min(full, key=lambda layer: (abs(layer - self.layer), layer))
        if self.k is None:
            self.k = MEASURED_DEFAULTS.get(lm.name, {}).get("k", PAPER_K)
        if self.layer >= lm.n_layers:
            raise UsageError(
                f"gemfilter: layer={self.layer} but the model has {lm.n_layers} layers "
                f"(layer is a 0-based index: 0..{lm.n_layers - 1})"
            )
        if full and self.layer not in full:
            raise UsageError(
                f"gemfilter: layer {self.layer} of {lm.name} is a sliding-window layer "
                f"({lm.windows.window(self.layer)} tokens): its last "
                f"query cannot see the whole prompt; choose a full-attention layer: {', '.join(map(str, full))}"
            )

    def filter_scores(self, engine, ids: torch.Tensor, cache=None) -> torch.Tensor:
        """Run layers 0..r over ``ids`` and return the pooled scores (n,) of every token.

        Layer r is only run up to its queries and keys (and its cache update): its attention output
        and MLP are never computed.
        """
        captured: list[torch.Tensor] = []
        r = self.layer

        def observe(query: torch.Tensor, key: torch.Tensor) -> None:
            captured.append(gem_scores(query, key, self.kernel))
            raise StopForward

        positions = torch.arange(ids.numel())
        if cache is not None and cache.positions is not None:
            positions = positions + int(cache.positions[-1]) + 1
        engine.forward(ids, positions, cache, layers=range(r + 1), observers={r: [observe]})
        return captured[0]

    def prefix_state(self, lm) -> dict:
        """What the disk store keeps: the prefix KV of the r + 1 layers 0..r that the filter pass
        runs (k, kernel, span act after it)."""
        return {"kind": "kv", "layers": self.layer + 1}

    def select_tokens(
        self, engine, prompt_ids: torch.Tensor, protected: int = 0, prefix=None, prompt=None
    ) -> Selection:
        """With a ``prefix`` (the KV of layers 0..r of the first prefix.n_tokens tokens, from the
        store or just computed), only the remaining tokens run through layers 0..r; the scores are
        the same as one pass over the whole prompt. With ``keep_question`` the last ``protected``
        tokens are always kept: the pipeline passes the tokens after the document
        (``Prompt.n_after_document``: instructions, question, generation prompt)."""
        n = prompt_ids.numel()
        if self.k > n:
            if "k" in self.explicit_knobs:
                raise UsageError(
                    f"gemfilter: k={self.k} is larger than the prompt ({n} tokens); "
                    f"use k <= {n}, or -c full to keep everything"
                )
            return Selection(torch.arange(n))  # automatic k and a short document: nothing to filter
        if prefix is not None:
            scores = self.filter_scores(engine, prompt_ids[prefix.n_tokens :], cache=prefix.take()).cpu()
        else:
            scores = self.filter_scores(engine, prompt_ids).cpu()
        forced = torch.arange(n - protected, n) if self.keep_question and protected else None
        return Selection(top_k_positions(scores, self.k, forced, self.span), scores)
