"""Terminal views (rich) of answers, selections and the compressor list."""

from __future__ import annotations

import bisect
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .compressors import REGISTRY, owned_phases

CONTEXT_CHARS = 60
GEM_STYLE = "bold black on yellow"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def selected_spans(console: Console, spans, document, n_kept: int, n_total: int, max_spans: int | None = None) -> None:
    """Print each kept document span highlighted inside a little of its context, with its page."""
    console.rule(f"[bold]kept {n_kept:,} of {n_total:,} prompt tokens ({n_kept / max(n_total, 1):.1%}) — {len(spans)} document spans")
    shown = spans if max_spans is None else spans[:max_spans]
    for span in shown:
        before = document.text[max(0, span.start - CONTEXT_CHARS) : span.start]
        after = document.text[span.end : span.end + CONTEXT_CHARS]
        pages = f"p.{span.page}" if span.page == span.last_page else f"p.{span.page}-{span.last_page}"
        line = Text()
        line.append(f"{pages:>8}  ", style="cyan")
        line.append("…" + _one_line(before)[-CONTEXT_CHARS:] + " ", style="dim")
        line.append(_one_line(span.text), style=GEM_STYLE)
        line.append(" " + _one_line(after)[:CONTEXT_CHARS] + "…", style="dim")
        console.print(line, overflow="fold")
    if len(shown) < len(spans):
        console.print(f"… {len(spans) - len(shown)} more spans (use --json for all)", style="dim")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def cache_table(console: Console, entries) -> None:
    """``kvcli cache ls``: one row per store entry, most recently used first (``--json``: all fields)."""
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1))
    for col in ("key", "document", "model", "method", "state", "tokens", "size", "last use"):
        right = col in ("tokens", "size")
        table.add_column(col, justify="right" if right else "left", overflow="fold", no_wrap=col in ("key", "size"))
    for e in entries:
        j = e.to_json()
        state = j["state"] if isinstance(j["state"], dict) else {}
        # short: the kind, and the layers of a KV state (every parameter: `kvcli cache info KEY`)
        what = f"{state.get('kind', '-')}" + (f" ×{state['layers']} layers" if "layers" in state else "")
        table.add_row(
            j["key"][:12],
            Path(j["document"]).name if j["document"] else f"[red]damaged: {e.error}[/red]",
            Path(j["model"]).name if j["model"] else "-",
            (j["method"] or "-").split(":")[0],
            what,
            f"{j['n_tokens']:,}" if j["n_tokens"] is not None else "-",
            human_bytes(j["size_bytes"]),
            j["last_use"][5:16].replace("T", " "),  # MM-DD HH:MM
        )
    console.print(table)
    console.print(f"[dim]{len(entries)} entries, {human_bytes(sum(e.size for e in entries))}[/dim]")


def compressor_table(console: Console) -> None:
    for name in sorted(REGISTRY):
        cls = REGISTRY[name]
        doc = " ".join((cls.__doc__ or "").split())
        phases = ", ".join(sorted(owned_phases(cls))) or "none (reference)"
        console.print(f"[bold]{name}[/bold] — {doc}")
        console.print(f"  [dim]acts at: {phases}; paper: {cls.paper}[/dim]")
        knobs = cls.knobs()
        if knobs:
            table = Table(show_header=True, header_style="bold", box=None, padding=(0, 2))
            table.add_column("knob")
            table.add_column("default")
            table.add_column("meaning")
            for f in knobs:
                default = "auto" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
                table.add_row(f.name, default, f.metadata.get("help", ""))
            console.print(table)
        console.print()


# --------------------------------------------------------------------------- kvcli inspect

# kept-span styles by score level (low -> high), the terminal twin of kvcli.report_html.PALETTE
LEVEL_STYLES = ("black on #ffe14d", "black on #ffb830", "black on #ff8a1f", "bold white on #ff4d00")


def inspect_summary(console: Console, ins) -> None:
    """``kvcli inspect``: one header block: method, what it kept, the compression ratio."""
    doc = ins.document
    console.print(
        f"[bold]{ins.method}[/bold] on [bold]{ins.model}[/bold] · {doc.n_pages} page(s) · "
        f"{ins.n_document:,} document tokens in a {ins.n_prompt:,}-token prompt"
    )
    if ins.view == "all":
        console.print(f"everything kept: all {ins.n_prompt:,} prompt tokens in every layer (no compression)")
    elif ins.view == "per-head":
        console.print(
            f"each layer and KV head holds [bold]{ins.n_kept:,.1f}[/bold] of {ins.n_prompt:,} prompt tokens on average "
            f"([bold]{ins.compression_ratio:.1f}×[/bold] compression); {ins.n_kept_any:,} are held by at least one "
            f"({ins.n_document_kept:,} of the document's)"
        )
    else:
        console.print(
            f"kept [bold]{int(ins.n_kept):,}[/bold] of {ins.n_prompt:,} prompt tokens "
            f"([bold]{ins.compression_ratio:.1f}×[/bold] compression), {ins.n_document_kept:,} of them from the document"
        )
    if ins.answer is not None:
        console.print(f"answer: [bold]{ins.answer}[/bold]")


def layer_kept_table(console: Console, layers, n_prompt: int) -> None:
    """Per layer: prompt tokens its KV heads hold (min / mean / max over heads)."""
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1), title="kept per layer (over KV heads)", title_justify="left")
    for col in ("layer", "min", "mean", "max", "share"):
        table.add_column(col, justify="right")
    table.add_column("", justify="left")
    for row in layers:
        share = row.kept_mean / max(n_prompt, 1)
        table.add_row(
            str(row.layer), f"{row.kept_min:,}", f"{row.kept_mean:,.1f}", f"{row.kept_max:,}", f"{share:.1%}", "█" * max(1, round(share * 30))
        )
    console.print(table)


def document_view(console: Console, ins) -> None:
    """The whole document with the kept tokens highlighted (colour: score level), a rule per page."""
    from .inspect import span_levels

    text, doc = ins.document.text, ins.document
    levels = span_levels(ins, len(LEVEL_STYLES))
    cuts = sorted({0, len(text)} | set(doc.page_starts) | {c for s in ins.spans for c in (s.start, s.end)})
    page_at = {start: i + 1 for i, start in enumerate(doc.page_starts)}
    starts = [s.start for s in ins.spans]

    # without colours (a pipe, NO_COLOR) the highlight would vanish: mark kept text with ⟦ ⟧
    plain = console.color_system is None
    line = Text()
    for a, b in zip(cuts, cuts[1:]):
        if a in page_at:
            if line:
                console.print(line, overflow="fold")
                line = Text()
            console.rule(f"[cyan]page {page_at[a]}[/cyan]", align="left", style="dim")
        j = bisect.bisect_right(starts, a) - 1
        inside = j >= 0 and ins.spans[j].start <= a < ins.spans[j].end
        if inside and plain:
            line.append(("⟦" if a == ins.spans[j].start else "") + text[a:b] + ("⟧" if b == ins.spans[j].end else ""))
        else:
            line.append(text[a:b], style=LEVEL_STYLES[levels[j]] if inside else "")
    if line:
        console.print(line, overflow="fold")


def layer_scan_table(console: Console, report) -> None:
    """``kvcli inspect --layers``: per layer, whether GemFilter's top-k there keeps the needle."""
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1))
    for col, justify in (("layer", "right"), ("best rank", "right"), ("k needed", "right"), (f"in top-{report.k}", "right"), ("found", "left"), ("distance", "right")):
        table.add_column(col, justify=justify)
    for row in report.layers:
        table.add_row(
            str(row.layer),
            f"{row.best_rank:,}",
            f"{row.k_needed:,}",
            f"{row.n_in_topk}/{row.n_needle}",
            "[bold green]yes[/bold green]" if row.found else "[dim]no[/dim]",
            "-" if row.distance is None else f"{row.distance:,}",
        )
    console.print(
        f"[bold]{report.model}[/bold] · needle {report.needle!r} ({len(report.needle_tokens)} occurrence(s), "
        f"{sum(len(g) for g in report.needle_tokens)} tokens) · {report.n_prompt:,}-token prompt · "
        f"k={report.k}, kernel={report.kernel}"
    )
    console.print(table)
    first = report.first_found
    console.print(
        (f"first layer whose top-{report.k} keeps the whole needle: [bold]{first}[/bold]" if first is not None else f"no layer's top-{report.k} keeps the whole needle")
        + f" · first layer with distance 0: {'-' if report.first_touched is None else report.first_touched}"
        + f" · smallest k needed: layer {report.best_layer} (layers are gemfilter:layer= indices, 0-based)"
    )
