"""What a method keeps of a document (``kvcli inspect``): :func:`inspect_kept` runs the method's
selection and prefill only (the TTFT path: ``max_new_tokens=1``; the first token's logits are
computed anyway, no answer is decoded unless ``generate=True``) and returns an
:class:`Inspection`: the kept document spans (characters, pages, text, score), the compression
ratio and, for methods that keep different tokens per layer or KV head (SnapKV, H2O, PyramidKV,
RazorAttention, Finch, ...), a per-layer summary. A token counts as kept in the document view when
any (layer, KV head) holds it; its score is then the share of (layer, KV head) pairs that hold it.

A method that holds everything but reads only part of it (InfLLM's stored book: Initial, the
Memory blocks a retrieval chose, Local) is shown by what the question and its answer *read*
(view ``read``): the spans read by any (layer, KV head), scored by the share of pairs that read
them, the share of the prompt read, and — where layers read different blocks — each layer's
pages. What it holds (``n_kept``, the compression ratio) stays all of it.

With ``generate`` (``inspect --answer``) the answer's sources come too (:mod:`kvcli.cite.sources`):
the spans the answer was read from, which the views mark apart from the merely kept ones
(:func:`cited_ranges`).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

import torch

from ..answer.labels import spec_label
from ..answer.pipeline import Pipeline
from ..answer.prompt import Prompt
from ..answer.question import QuestionOptions
from ..compressors.selection import Read, Selection, Span, read_line, read_record
from ..documents import Document
from .record import read_mask

# --------------------------------------------------------------------------- what was kept


@dataclass
class LayerKept:
    """Prompt tokens one layer holds, over its KV heads."""

    layer: int  # 0-based, as kvcli heads, inspect --layers and gemfilter:layer= number layers
    kept_min: int
    kept_mean: float
    kept_max: int

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "kept_min": self.kept_min,
            "kept_mean": round(self.kept_mean, 2),
            "kept_max": self.kept_max,
        }


def page_ranges(spans) -> str:
    """ "p.1, p.12-13, p.40": the pages of ``spans`` (in document order), a page said once."""
    ranges: list[list[int]] = []
    for s in spans:
        if ranges and s.page <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], s.last_page)
        else:
            ranges.append([s.page, s.last_page])
    return ", ".join(f"p.{a}" if a == b else f"p.{a}-{b}" for a, b in ranges) or "-"


@dataclass
class LayerRead:
    """What one layer read of the prompt (over its KV heads), where layers read different blocks."""

    layer: int
    n_read: float  # prompt tokens read, mean over the layer's KV heads
    spans: list[Span]  # document spans any of its KV heads read

    def pages(self) -> str:
        return page_ranges(self.spans)

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "n_read_tokens": round(self.n_read, 2),
            "pages": [[s.page, s.last_page] for s in self.spans],
            "spans": [[s.start, s.end] for s in self.spans],
        }


@dataclass
class Inspection:
    method: str  # the resolved spec, every knob (JSON); ``label``: its name and the knobs the user set
    model: str
    document: Document
    question: str
    prompt: Prompt
    kept: torch.Tensor  # (n_prompt,) bool: held by the method (any layer / KV head); view "read": read
    scores: torch.Tensor | None  # (n_prompt,) float per token, NaN where unknown; None: no scores
    score_kind: str | None  # "filter" (the selector's score), "share" / "read" (of layer/head pairs), None
    # "selection" (one token set), "per-head" (union over layers/heads), "all" (everything), "read"
    # (holds everything, read part of it: the union read over layers/heads)
    view: str
    n_kept: float  # tokens the model reads per layer and KV head (mean for per-head methods)
    spans: list[Span]
    layers: list[LayerKept] | None  # per-layer summary, when the cache reports what it held
    answer: str | None = None
    method_stats: dict = field(default_factory=dict)
    label: str = ""
    # view "read": tokens read per layer and KV head (mean), and per layer where layers differ
    n_read: float | None = None
    read_layers: list[LayerRead] | None = None
    sources: object | None = None  # kvcli.cite.sources.Sources of the answer (with --answer), else None
    # a method that retrieves (pages): the passages it read (Selection.read), shown instead of a ratio
    read: tuple[Read, ...] | None = None
    ranked_by: str | None = None  # what ranked the passages read (Selection.ranked_by)
    expansion: str | None = None  # the passage the model wrote to rank them with (Selection.expansion)
    policy: str | None = None  # "auto" when the default policy chose the method (as ask --json says)

    def read_line(self) -> str | None:
        """ "read p. 12 whole, p. 3 skimmed: 760 of 74,000 document tokens", or None: it did not retrieve."""
        return None if self.read is None else read_line(self.read, self.prompt, self.document)

    @property
    def read_share(self) -> float | None:
        """The share of the prompt's KV the question and its answer read (view ``read``)."""
        return None if self.n_read is None else self.n_read / max(self.n_prompt, 1)

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
            "policy": self.policy,  # "auto" when the default policy chose the method, as ask --json
            "model": self.model,
            "document": self.document.source,
            "n_pages": self.document.n_pages,
            "question": self.question,
            "n_prompt_tokens": self.n_prompt,
            "n_document_tokens": self.n_document,
            "n_kept_tokens": round(self.n_kept, 2) if self.view == "per-head" else int(self.n_kept),
            # view "read": everything is held; ``kept`` is what was read
            "n_kept_any": self.n_prompt if self.view == "read" else self.n_kept_any,
            "n_document_kept": self.n_document if self.view == "read" else self.n_document_kept,
            # none for a method that retrieves: what it read is ``read`` (as ask --json has them)
            "compression_ratio": None if self.read is not None else round(self.compression_ratio, 4),
            "read": read_record(self.read, self.prompt, self.document, self.ranked_by, self.expansion),
            "view": self.view,
            "score": self.score_kind,
            "spans": [s.to_json() for s in self.spans],
        }
        if self.layers is not None:
            record["layers"] = [row.to_json() for row in self.layers]
        if self.n_read is not None:
            record["n_read_tokens"] = round(self.n_read, 2)
            record["n_read_any"] = self.n_kept_any
            record["n_document_read"] = self.n_document_kept
            record["kv_read_frac"] = round(self.read_share, 4)
            record["read_same_in_every_layer"] = self.read_layers is None
            if self.read_layers is not None:
                record["read_layers"] = [row.to_json() for row in self.read_layers]
        if self.answer is not None:
            record["answer"] = self.answer
        if self.sources is not None:  # as ask --json has them: best first, and why none / none clear
            record["sources"] = self.sources.to_json()
            record["sources_note"] = self.sources.reason
        record["method_stats"] = self.method_stats
        return record


def _uniform(mask: torch.Tensor) -> bool:
    flat = mask.reshape(-1, mask.shape[-1])
    return bool((flat == flat[:1]).all())


def inspect_kept(
    session,
    document: Document,
    question: str,
    pipeline: Pipeline,
    generate: bool = False,
    options: QuestionOptions | None = None,
) -> Inspection:
    """Run ``pipeline`` on (document, question) and report what it kept (see the module doc).

    Without ``generate`` only the selection and the prefill run (``max_new_tokens=1``); with it
    the answer is decoded as ``kvcli ask`` would (``session.options.max_new_tokens``).
    ``options``: Session.ask's callbacks (``on_prompt``, ``on_progress``, ...: what the CLI shows
    meanwhile); whether the answer is cited is decided here."""
    if not generate:
        session = dataclasses.replace(session, options=dataclasses.replace(session.options, max_new_tokens=1))
    cite = generate and session.options.sources  # sources of a one-token answer would say nothing
    options = dataclasses.replace(QuestionOptions() if options is None else options, sources=cite)
    result = session.ask(document, question, pipeline, options)
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
            LayerKept(i, int(row.min()), float(row.float().mean()), int(row.max())) for i, row in enumerate(per_head)
        ]
    scores, score_kind = None, None
    read = read_mask(result)
    n_read, read_layers = None, None
    if read is not None:  # holds everything, read part of it: show what was read
        kept = read.any(dim=0).any(dim=0)
        scores, score_kind = read.float().mean(dim=(0, 1)), "read"
        n_kept = float(mask.sum()) / (mask.shape[0] * mask.shape[1]) if mask is not None and mask.numel() else float(n)
        n_read = float(read.sum()) / (read.shape[0] * read.shape[1])
        view = "read"
        if not _uniform(read):
            read_layers = [
                LayerRead(
                    i,
                    float(layer.sum()) / layer.shape[0],
                    Selection(torch.nonzero(layer.any(dim=0)).flatten()).spans(prompt, document),
                )
                for i, layer in enumerate(read)
            ]
    elif mask is None or not mask.numel() or _uniform(mask):
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
        method=result.extra["compressor"],  # resolved: -c auto's choice, every knob
        policy=result.extra.get("policy"),
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
        n_read=n_read,
        read_layers=read_layers,
        sources=result.sources if cite else None,
        read=selection.read,
        ranked_by=selection.ranked_by,
        expansion=selection.expansion,
        label=spec_label(result.extra["compressor"], pipeline),
    )


def cited_ranges(ins: Inspection) -> list[tuple[int, int, int]]:
    """The answer's sources as (start, end, rank) character ranges of the document, in document
    order (rank 1: the best source); none without sources or where none stands out."""
    if ins.sources is None:
        return []
    return sorted((s.start, s.end, i + 1) for i, s in enumerate(ins.sources.items))


def cited_at(ranges: list[tuple[int, int, int]], char: int) -> tuple[int, int, int] | None:
    """The range of ``ranges`` (:func:`cited_ranges`) that holds ``char``, else None."""
    j = bisect.bisect_right([a for a, _, _ in ranges], char) - 1
    return ranges[j] if j >= 0 and ranges[j][0] <= char < ranges[j][1] else None


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
            if ins.score_kind in ("share", "read"):
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
    if ins.score_kind in ("share", "read"):
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
