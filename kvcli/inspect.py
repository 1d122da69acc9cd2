"""What a method keeps of a document, and which layer would make the best GemFilter filter.

Two questions a person asks before trusting a compressed answer (``kvcli inspect``):

* :func:`inspect_kept` — *what did the method keep?* It runs the method's selection and prefill
  only (the TTFT path: ``max_new_tokens=1``; the first token's logits are computed anyway, no
  answer is decoded unless ``generate=True``) and returns an :class:`Inspection`: the kept
  document spans (characters, pages, text, score), the compression ratio and, for methods that
  keep different tokens per layer or KV head (SnapKV, H2O, PyramidKV, RazorAttention, Finch, ...),
  a per-layer summary. A token counts as kept in the document view when any (layer, KV head)
  holds it; its score is then the share of (layer, KV head) pairs that hold it.

* :func:`score_layers` — *which layer finds the needle?* One forward pass over all layers with an
  observer on every layer scores each layer as a GemFilter filter (:func:`gem_scores`: the last
  query row against every key, summed over heads, pooled), then reports per layer where the needle
  ranks, whether GemFilter's top-k at that layer would keep it, and the distance the paper plots in
  its Figure 5: ``min |topk_index - needle_index|`` (0 when a selected token is a needle token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .compressors.gemfilter import GemFilter, gem_scores, top_k_positions
from .documents import Document
from .errors import UsageError
from .pipeline import Pipeline
from .prompt import Prompt, build_prompt
from .selection import Selection, Span

# --------------------------------------------------------------------------- what was kept


@dataclass
class LayerKept:
    """Prompt tokens one layer holds, over its KV heads."""

    layer: int  # 1-based
    kept_min: int
    kept_mean: float
    kept_max: int

    def to_json(self) -> dict:
        return {"layer": self.layer, "kept_min": self.kept_min, "kept_mean": round(self.kept_mean, 2), "kept_max": self.kept_max}


@dataclass
class Inspection:
    method: str
    model: str
    document: Document
    question: str
    prompt: Prompt
    kept: torch.Tensor  # (n_prompt,) bool: held by the method (any layer / KV head)
    scores: torch.Tensor | None  # (n_prompt,) float per token, NaN where unknown; None: no scores
    score_kind: str | None  # "filter" (the selector's score), "share" (of layer/head pairs), None
    view: str  # "selection" (one token set), "per-head" (union over layers/heads), "all" (everything)
    n_kept: float  # tokens the model reads per layer and KV head (mean for per-head methods)
    spans: list[Span]
    layers: list[LayerKept] | None  # per-layer summary, when the cache reports what it held
    answer: str | None = None
    method_stats: dict = field(default_factory=dict)

    @property
    def n_prompt(self) -> int:
        return self.prompt.n_tokens

    @property
    def n_document(self) -> int:
        return self.prompt.n_document_tokens

    @property
    def n_kept_any(self) -> int:
        return int(self.kept.sum())

    @property
    def n_document_kept(self) -> int:
        return int(self.kept[self.prompt.doc_start : self.prompt.doc_end].sum())

    @property
    def compression_ratio(self) -> float:
        return self.n_prompt / max(self.n_kept, 1e-9)

    @property
    def per_layer(self) -> bool:
        """True when layers or heads keep different tokens (the per-layer table says more)."""
        return self.view == "per-head"

    def to_json(self) -> dict:
        record = {
            "compressor": self.method,
            "model": self.model,
            "document": self.document.source,
            "n_pages": self.document.n_pages,
            "question": self.question,
            "n_prompt_tokens": self.n_prompt,
            "n_document_tokens": self.n_document,
            "n_kept_tokens": round(self.n_kept, 2) if self.view == "per-head" else int(self.n_kept),
            "n_kept_any": self.n_kept_any,
            "n_document_kept": self.n_document_kept,
            "compression_ratio": round(self.compression_ratio, 4),
            "view": self.view,
            "score": self.score_kind,
            "spans": [s.to_json() for s in self.spans],
        }
        if self.layers is not None:
            record["layers"] = [row.to_json() for row in self.layers]
        if self.answer is not None:
            record["answer"] = self.answer
        record["method_stats"] = self.method_stats
        return record

    def token_chars(self) -> list[tuple[int, int]]:
        """Character span of each document token (index: document token number)."""
        return self.prompt.doc_offsets


def _uniform(mask: torch.Tensor) -> bool:
    flat = mask.reshape(-1, mask.shape[-1])
    return bool((flat == flat[:1]).all())


def inspect_kept(session, document: Document, question: str, pipeline: Pipeline, generate: bool = False) -> Inspection:
    """Run ``pipeline`` on (document, question) and report what it kept (see the module doc).

    Without ``generate`` only the selection and the prefill run (``max_new_tokens=1``); with it
    the answer is decoded as ``kvcli ask`` would (``session.options.max_new_tokens``)."""
    if not generate:
        session = dataclasses.replace(session, options=dataclasses.replace(session.options, max_new_tokens=1))
    result = session.ask(document, question, pipeline)
    prompt = result.prompt
    n = prompt.n_tokens
    selection = result.selection
    selected = torch.zeros(n, dtype=torch.bool)
    selected[selection.kept] = True
    mask = result.kept_mask()
    layers = None
    if mask is not None and mask.numel():
        per_head = mask.sum(dim=-1)  # (n_layers, n_kv)
        layers = [
            LayerKept(i + 1, int(row.min()), float(row.float().mean()), int(row.max())) for i, row in enumerate(per_head)
        ]
    scores, score_kind = None, None
    if mask is None or not mask.numel() or _uniform(mask):
        kept = selected if mask is None or not mask.numel() else mask[0, 0].clone()
        n_kept = float(kept.sum())
        if selection.scores is not None and torch.equal(kept, selected):
            scores, score_kind = selection.scores.float(), "filter"
        view = "all" if bool(kept.all()) else "selection"
    else:
        kept = mask.any(dim=0).any(dim=0)
        scores, score_kind = mask.float().mean(dim=(0, 1)), "share"
        n_kept = float(mask.sum()) / (mask.shape[0] * mask.shape[1])
        view = "per-head"
    spans = Selection(torch.nonzero(kept).flatten(), scores).spans(prompt, document)
    return Inspection(
        method=pipeline.spec(),
        model=session.lm.name,
        document=document,
        question=question,
        prompt=prompt,
        kept=kept,
        scores=scores,
        score_kind=score_kind,
        view=view,
        n_kept=n_kept,
        spans=spans,
        layers=layers,
        answer=result.answer if generate else None,
        method_stats=result.extra.get("method_stats", {}),
    )


def document_profile(ins: Inspection, n_buckets: int = 200) -> list[dict]:
    """The document cut into at most ``n_buckets`` equal character ranges, each with the share of
    its tokens kept and its best token score scaled to 0..1 (the HTML page's score strip)."""
    prompt, text_len = ins.prompt, max(len(ins.document.text), 1)
    n_buckets = max(1, min(n_buckets, prompt.n_document_tokens))
    kept = torch.zeros(n_buckets)
    total = torch.zeros(n_buckets)
    best = torch.full((n_buckets,), float("nan"))
    scores = ins.scores
    norm = None
    if scores is not None:
        doc_scores = scores[prompt.doc_start : prompt.doc_end].float()
        finite = doc_scores[torch.isfinite(doc_scores)]
        if finite.numel():
            lo, hi = float(finite.min()), float(finite.max())
            if ins.score_kind == "share":
                lo, hi = 0.0, 1.0
            norm = ((doc_scores - lo) / (hi - lo if hi > lo else 1.0)).clamp(0, 1)
    for t, (start, _end) in enumerate(prompt.doc_offsets):
        b = min(n_buckets - 1, start * n_buckets // text_len)
        total[b] += 1
        if ins.kept[prompt.doc_start + t]:
            kept[b] += 1
        if norm is not None and torch.isfinite(norm[t]):
            v = float(norm[t])
            if not (best[b] >= v):  # nan or smaller
                best[b] = v
    out = []
    for b in range(n_buckets):
        start = b * text_len // n_buckets
        out.append(
            {
                "start": start,
                "end": (b + 1) * text_len // n_buckets,
                "page": ins.document.page_of(start),
                "n_tokens": int(total[b]),
                "kept": float(kept[b] / total[b]) if total[b] else 0.0,
                "score": None if torch.isnan(best[b]) else float(best[b]),
            }
        )
    return out


def span_levels(ins: Inspection, n_levels: int = 4) -> list[int]:
    """A colour level 0..n_levels-1 per span (higher: better score): ranks of the filter scores
    among the kept spans, or the share of layer/head pairs that hold the span's best token."""
    spans = ins.spans
    if not spans:
        return []
    if ins.score_kind == "share":
        return [min(n_levels - 1, int((s.score or 0.0) * n_levels)) for s in spans]
    if ins.score_kind != "filter":  # no scores: one readable middle colour
        return [min(1, n_levels - 1)] * len(spans)
    if len(spans) == 1:
        return [n_levels - 1]
    values = [float("-inf") if s.score is None or s.score != s.score else s.score for s in spans]
    order = sorted(range(len(spans)), key=lambda i: values[i])
    levels = [0] * len(spans)
    for r, i in enumerate(order):
        levels[i] = min(n_levels - 1, r * n_levels // len(spans))
    return levels


# --------------------------------------------------------------------------- filter layer choice


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
    per_layer: list[torch.Tensor], groups: list[list[int]], k: int, protected: int, keep_question: bool = True, span: int = 1
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
