"""Run methods over a needle grid (context lengths x depths) in one process, and tabulate.

Every method sees the same documents in the same process, so TTFT ratios and peak memory are
comparable within a run. Rows are plain dicts (JSON-ready); :func:`summary_table` reduces them to
one line per (length, method) with accuracy over depths and means of the timings.
"""

from __future__ import annotations

import statistics
from typing import Callable, Iterable

from ..documents import document_from_text
from ..pipeline import Pipeline
from .needle import make_case

PROMPT_OVERHEAD = 64  # template + question tokens, roughly: documents get length - this


def run_grid(
    session,
    specs: Iterable[str],
    lengths: Iterable[int],
    depths: Iterable[float],
    haystack: str = "filler",
    seed: int = 0,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    specs, lengths, depths = list(specs), list(lengths), list(depths)
    rows = []
    for length in lengths:
        for d_i, depth in enumerate(depths):
            case = make_case(session.lm.tokenizer, length - PROMPT_OVERHEAD, depth, seed=seed + d_i, haystack=haystack)
            document = document_from_text(case.text, source=f"needle-{length}-{depth}")
            for spec in specs:
                result = session.ask(document, case.question, Pipeline.parse(spec))
                row = {
                    "length": length,
                    "depth": depth,
                    "method": spec,
                    "n_context_tokens": result.prompt.n_tokens,
                    "n_kept_tokens": result.n_kept_tokens,
                    "correct": case.is_correct(result.answer),
                    "answer": result.answer,
                    "ttft_s": result.ttft_s,
                    "total_s": result.total_s,
                    "peak_mem_mb": result.peak_mem_mb,
                    "kv_cache_mb": result.extra["kv_cache_bytes"] / 2**20,
                }
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


def summary(rows: list[dict], baseline: str = "full") -> list[dict]:
    """One entry per (length, method): accuracy, mean TTFT, TTFT / TTFT(baseline), peak memory."""
    out = []
    keys = list(dict.fromkeys((r["length"], r["method"]) for r in rows))
    for length, method in keys:
        group = [r for r in rows if r["length"] == length and r["method"] == method]
        base = [r for r in rows if r["length"] == length and r["method"] == baseline]
        ttft = statistics.mean(r["ttft_s"] for r in group)
        out.append(
            {
                "length": length,
                "method": method,
                "correct": sum(r["correct"] for r in group),
                "cases": len(group),
                "ttft_s": ttft,
                "ttft_ratio": ttft / statistics.mean(r["ttft_s"] for r in base) if base else None,
                "peak_mem_mb": max(r["peak_mem_mb"] for r in group),
                "kv_cache_mb": statistics.mean(r["kv_cache_mb"] for r in group),
                "n_kept_tokens": round(statistics.mean(r["n_kept_tokens"] for r in group)),
                "n_context_tokens": round(statistics.mean(r["n_context_tokens"] for r in group)),
            }
        )
    return out


def markdown_table(entries: list[dict]) -> str:
    head = "| tokens | method | needle | TTFT s | TTFT / full | peak MiB | KV MiB | kept |\n|---:|---|---:|---:|---:|---:|---:|---:|"
    lines = [head]
    for e in entries:
        ratio = "—" if e["ttft_ratio"] is None else f"{e['ttft_ratio']:.2f}"
        lines.append(
            f"| {e['n_context_tokens']:,} | `{e['method']}` | {e['correct']}/{e['cases']} | {e['ttft_s']:.2f} | {ratio} "
            f"| {e['peak_mem_mb']:,.0f} | {e['kv_cache_mb']:.1f} | {e['n_kept_tokens']:,} |"
        )
    return "\n".join(lines)
