"""Which layer would make the best GemFilter filter (``kvcli inspect --layers``, the paper's
Figure 5): one forward pass over all layers with an observer on every layer scores each layer as a
GemFilter filter (:func:`~kvcli.compressors.gemfilter.gem_scores`: the last query row against
every key, summed over heads, pooled), then reports per layer where the needle ranks, whether
GemFilter's top-k at that layer would keep it, and the distance the paper plots:
``min |topk_index - needle_index|`` (0 when a selected token is a needle token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..answer.pipeline import Pipeline
from ..answer.prompt import Prompt, build_prompt
from ..compressors.gemfilter import GemFilter, gem_scores, top_k_positions
from ..documents import Document
from ..errors import UsageError

# --------------------------------------------------------------------------- what was kept


@dataclass
class LayerScore:
    layer: int  # 0-based: the gemfilter:layer= index (layers 0..layer run)
    best_rank: int  # rank (1 = best) of the best needle token among the tokens competing for the top-k
    k_needed: int  # the smallest k that keeps one whole occurrence of the needle at this layer
    n_in_topk: int  # needle tokens inside the top-k
    n_needle: int
    found: bool  # one whole occurrence of the needle is inside the top-k
    distance: int | None  # Figure 5 of the paper: min |topk_index - needle_index| (0: a needle token is kept)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class LayerReport:
    model: str
    document: str
    question: str
    needle: str
    needle_chars: list[tuple[int, int]]  # each occurrence of the needle in Document.text
    needle_tokens: list[list[int]]  # prompt indices of each occurrence's tokens
    n_prompt: int
    n_document: int
    k: int
    kernel: int
    keep_question: bool
    span: int
    layers: list[LayerScore]

    @property
    def first_found(self) -> int | None:
        return next((row.layer for row in self.layers if row.found), None)

    @property
    def first_touched(self) -> int | None:
        return next((row.layer for row in self.layers if row.distance == 0), None)

    @property
    def best_layer(self) -> int:
        """The layer that needs the smallest k to keep the whole needle (earliest on ties)."""
        return min(self.layers, key=lambda row: (row.k_needed, row.layer)).layer

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "document": self.document,
            "question": self.question,
            "needle": self.needle,
            "needle_chars": [list(c) for c in self.needle_chars],
            "needle_tokens": self.needle_tokens,
            "n_prompt_tokens": self.n_prompt,
            "n_document_tokens": self.n_document,
            "k": self.k,
            "kernel": self.kernel,
            "keep_question": self.keep_question,
            "span": self.span,
            "first_found_layer": self.first_found,
            "first_distance0_layer": self.first_touched,
            "best_layer": self.best_layer,
            "layers": [row.to_json() for row in self.layers],
        }


def find_needle(prompt: Prompt, document: Document, needle: str) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Every occurrence of ``needle`` in the document: its characters and the prompt indices of the
    document tokens that overlap them. UsageError when it does not occur."""
    if not needle.strip():
        raise UsageError("--needle: give the text to look for")
    chars, groups, at = [], [], 0
    text = document.text
    while True:
        i = text.find(needle, at)
        if i < 0:
            break
        chars.append((i, i + len(needle)))
        at = i + max(1, len(needle))
    if not chars:
        shown = needle if len(needle) <= 60 else needle[:57] + "..."
        raise UsageError(f"--needle '{' '.join(shown.split())}' is not in the document")
    for start, end in chars:
        tokens = [
            prompt.doc_start + t for t, (a, b) in enumerate(prompt.doc_offsets) if a < end and b > start and b > a
        ]
        if tokens:
            groups.append(tokens)
    return chars, groups


def layer_scores(engine, ids: torch.Tensor, kernel: int) -> list[torch.Tensor]:
    """GemFilter's filter scores (n,) at every layer, from one forward pass over all layers."""
    captured: dict[int, torch.Tensor] = {}

    def observer(layer):
        def observe(query: torch.Tensor, key: torch.Tensor) -> None:
            captured[layer] = gem_scores(query, key, kernel).float().cpu()

        return observe

    observers = {i: [observer(i)] for i in range(engine.n_layers)}
    engine.forward(ids, torch.arange(ids.numel()), None, observers=observers)
    return [captured[i] for i in range(engine.n_layers)]


def rank_layers(
    per_layer: list[torch.Tensor],
    groups: list[list[int]],
    k: int,
    protected: int,
    keep_question: bool = True,
    span: int = 1,
) -> list[LayerScore]:
    """Per layer: where the needle ranks in GemFilter's scores and whether its top-k keeps it."""
    rows = []
    for layer, scores in enumerate(per_layer):
        n = scores.numel()
        forced = torch.arange(n - protected, n) if keep_question and protected else None
        n_forced = 0 if forced is None else forced.numel()
        selected = top_k_positions(scores, min(k, n), forced, span)
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[selected] = True
        # the ranks the scores give among the tokens competing for the budget (forced ones excluded)
        competing = scores.clone()
        if forced is not None:
            competing[forced] = float("-inf")
        order = torch.argsort(competing, descending=True, stable=True)
        rank = torch.empty(n, dtype=torch.long)
        rank[order] = torch.arange(1, n + 1)
        needle = sorted({i for g in groups for i in g})
        best_rank = int(rank[needle].min())
        k_needed = min(int(rank[g].max()) for g in groups) + n_forced
        found = any(bool(chosen[g].all()) for g in groups)
        picks = chosen.clone()
        if forced is not None:
            picks[forced] = False
        pick_idx = torch.nonzero(picks).flatten()
        distance = None
        if pick_idx.numel():
            needle_t = torch.tensor(needle)
            distance = int((pick_idx.view(-1, 1) - needle_t.view(1, -1)).abs().min())
        rows.append(
            LayerScore(
                layer=layer,
                best_rank=best_rank,
                k_needed=k_needed,
                n_in_topk=int(chosen[needle].sum()),
                n_needle=len(needle),
                found=found,
                distance=distance,
            )
        )
    return rows


def filter_settings(pipeline: Pipeline | None, lm, k: int | None = None) -> GemFilter:
    """GemFilter's knobs for the layer scan: the pipeline's gemfilter stage if it has one (else the
    defaults for the model), ``k`` overriding its k."""
    gem = next((s for s in (pipeline.stages if pipeline else []) if isinstance(s, GemFilter)), None)
    gem = dataclasses.replace(gem) if gem is not None else GemFilter()
    if k is not None:
        if k < 1:
            raise UsageError(f"--k must be at least 1, got {k}")
        gem.k = k
    gem.configure(lm)
    return gem


def inspect_layers(
    session, document: Document, question: str, needle: str, pipeline: Pipeline | None = None, k: int | None = None
) -> LayerReport:
    """Score every layer as a GemFilter filter for (document, question) and locate ``needle``."""
    lm = session.lm
    gem = filter_settings(pipeline, lm, k)
    prompt = build_prompt(lm.tokenizer, document.text, question, session.template)
    chars, groups = find_needle(prompt, document, needle)
    if lm.max_context and prompt.n_tokens > lm.max_context:
        raise UsageError(
            f"the prompt is {prompt.n_tokens:,} tokens, over the {lm.max_context:,}-token window of {lm.name}"
        )
    per_layer = layer_scores(session.engine, prompt.ids, gem.kernel)
    rows = rank_layers(per_layer, groups, gem.k, prompt.n_after_document, gem.keep_question, gem.span)
    return LayerReport(
        model=lm.name,
        document=document.source,
        question=question,
        needle=needle,
        needle_chars=chars,
        needle_tokens=groups,
        n_prompt=prompt.n_tokens,
        n_document=prompt.n_document_tokens,
        k=min(gem.k, prompt.n_tokens),
        kernel=gem.kernel,
        keep_question=gem.keep_question,
        span=gem.span,
        layers=rows,
    )


def plot_layers(report: LayerReport, path) -> None:
    """Figure 5 of the paper for this question: distance per layer, and the k each layer needs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r.layer for r in report.layers]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    try:
        dist = [r.distance if r.distance is not None else float("nan") for r in report.layers]
        top.plot(layers, dist, marker="o", color="#3b5bdb")
        found = [r.layer for r in report.layers if r.found]
        top.scatter(found, [0] * len(found), color="#e8590c", zorder=3, label="whole needle in top-k")
        top.set_ylabel("min |top-k index − needle index|")
        top.set_title(f"{report.model}: needle {report.needle!r}, k={report.k}, {report.n_prompt:,} prompt tokens")
        if found:
            top.legend(loc="upper right")
        bottom.semilogy(layers, [r.k_needed for r in report.layers], marker="o", color="#2b8a3e", label="k needed")
        bottom.axhline(report.k, color="#e8590c", linestyle="--", label=f"k = {report.k}")
        bottom.set_ylabel("k to keep the whole needle")
        bottom.set_xlabel("filter layer (gemfilter:layer=, 0-based)")
        bottom.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def needle_from_full_attention(session, document, question: str) -> str:
    """The needle to look for when the user gave none: full attention's answer, unquoted and
    without its final period; a UsageError when that answer is not text of the document."""
    from ..answer.pipeline import Pipeline

    found = session.ask(document, question, Pipeline.parse("full")).answer.strip().strip("\"'“”").rstrip(".")
    if not found or found not in document.text:
        raise UsageError(f"the answer under full attention ('{found[:60]}') is not in the document; pass --needle TEXT")
    return found
