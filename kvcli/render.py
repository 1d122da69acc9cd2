"""Terminal views (rich) of answers, selections and the compressor list."""

from __future__ import annotations

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
