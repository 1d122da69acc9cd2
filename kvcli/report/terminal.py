"""Terminal views (rich) of answers, selections and the compressor list."""

from __future__ import annotations

import bisect
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..method_catalog import methods, summary

CONTEXT_CHARS = 60
GEM_STYLE = "bold black on yellow"
MARKS = ("⟦", "⟧")  # around kept text where colours do not show (a pipe, NO_COLOR)


def marks_legend(console: Console, verb: str = "kept") -> None:
    """One line saying what ⟦ ⟧ mean, where the text is marked with them instead of colours."""
    if console.color_system is None:
        console.print(
            f"{MARKS[0]} {MARKS[1]} mark the {verb} text (no colours: the output is not a terminal)",
            style="dim",
            markup=False,
            highlight=False,
        )


def _flat(text: str) -> str:
    return " ".join(text.split())


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def word_spans(text: str, spans) -> list[tuple[int, int, list[int]]]:
    """Kept character spans for the terminal: each widened to whole words (a kept token inside a
    word highlights the word: ``GNOME``, never ``G⟦NO⟧ME``), then merged where they overlap or
    touch. Returns (start, end, indices of the merged spans), in document order. The JSON views
    keep the token offsets."""
    out: list[tuple[int, int, list[int]]] = []
    n = len(text)
    for i, span in enumerate(spans):
        a, b = span.start, span.end
        while 0 < a < n and _is_word(text[a - 1]) and _is_word(text[a]):
            a -= 1
        while 0 < b < n and _is_word(text[b - 1]) and _is_word(text[b]):
            b += 1
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b), out[-1][2] + [i])
        else:
            out.append((a, b, [i]))
    return out


def selected_spans(
    console: Console, spans, document, n_kept: float, n_total: int, max_spans: int | None = None, verb: str = "kept"
) -> None:
    """Print the kept (``verb``: or read) document spans highlighted inside a little of their
    context, with pages; without colours (a pipe) marked ⟦ ⟧, with a line saying so.

    Spans whose context would overlap share one row (the text between them shown once, dim), so
    no part of the document is printed twice; highlights fall on word boundaries (:func:`word_spans`)."""
    per = " per layer and KV head" if verb == "read" else ""
    console.rule(
        f"[bold]{verb} {n_kept:,.0f} of {n_total:,} prompt tokens{per} ({n_kept / max(n_total, 1):.1%}) — "
        f"{len(spans)} document span{'' if len(spans) == 1 else 's'}"
    )
    marks_legend(console, verb)
    plain = console.color_system is None
    text = document.text
    rows: list[list[tuple[int, int, list[int]]]] = []
    for piece in word_spans(text, spans):
        if rows and piece[0] - rows[-1][-1][1] <= 2 * CONTEXT_CHARS:
            rows[-1].append(piece)
        else:
            rows.append([piece])
    shown = rows if max_spans is None else rows[:max_spans]
    for row in shown:
        start, end = row[0][0], row[-1][1]
        first, last = document.page_of(start), document.page_of(max(start, end - 1))
        pages = f"p.{first}" if first == last else f"p.{first}-{last}"
        line = Text()
        line.append(f"{pages:>8}  ", style="cyan")
        before = _flat(text[max(0, start - CONTEXT_CHARS) : start])[-CONTEXT_CHARS:]
        line.append(("…" if start > CONTEXT_CHARS else "") + before + " ", style="dim")
        for j, (a, b, _) in enumerate(row):
            if j:
                line.append(" " + _flat(text[row[j - 1][1] : a]) + " ", style="dim")
            gem = _flat(text[a:b])
            line.append(MARKS[0] + gem + MARKS[1] if plain else gem, style=GEM_STYLE)
        after = _flat(text[end : end + CONTEXT_CHARS])[:CONTEXT_CHARS]
        line.append(" " + after + ("…" if end + CONTEXT_CHARS < len(text) else ""), style="dim")
        console.print(line, overflow="fold")
    if len(shown) < len(rows):
        hidden = sum(len(piece[2]) for row in rows[len(shown) :] for piece in row)
        console.print(f"… {hidden} more {'span' if hidden == 1 else 'spans'} (use --json for all)", style="dim")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def _cache_state(state) -> str:
    """Short: the kind, and the layers of a KV state or the passages embedded of page vectors (every
    parameter: ``kvcli cache info KEY``)."""
    state = state if isinstance(state, dict) else {}
    if state.get("kind") == "vectors" and state.get("embedded") is not None and state.get("passages"):
        return f"vectors {state['embedded']}/{state['passages']} passages"  # filled in as questions want them
    if state.get("kind") == "text" and state.get("pages") is not None:
        return f"text, {_plural(state['pages'], 'page')}"
    return f"{state.get('kind', '-')}" + (f" ×{state['layers']} layers" if "layers" in state else "")


SIDE_METHODS = {"vectors": "page vectors", "text": "extracted text"}  # what a side folder's entry is, in words
CACHE_COLUMNS = ("key", "document", "model", "method", "state", "tokens", "size", "last use")
_FLEX = ("document", "model")  # shortened to fit the terminal; the others keep their width
_FLEX_MIN = 10
_DROP_ORDER = ("state", "tokens", "last use", "method", "size")  # left out first on a narrow terminal


def _cache_rows(entries) -> list[dict[str, Text]]:
    rows = []
    for e in entries:
        j = e.to_json()
        rows.append(
            {
                "key": Text(j["key"][:12]),
                "document": Text(Path(j["document"]).name)
                if j["document"]
                else Text(f"damaged: {e.error}", style="red")
                if e.error
                else Text("-"),  # page vectors written before they named their document
                "model": Text(Path(j["model"]).name if j["model"] else "-"),
                "method": Text(SIDE_METHODS.get(j["kind"]) or (j["method"] or "-").split(":")[0]),
                # a partial entry (a book read that stopped): how far it got, and whether its read runs now
                "state": Text(
                    _cache_state(j["state"]) + (" · reading" if j["reading"] else " · partial" if j["partial"] else "")
                ),
                "tokens": Text(
                    f"{j['read_tokens'] or 0:,}/{j['n_tokens']:,}"
                    if j["partial"] and j["n_tokens"] is not None
                    else f"{j['n_tokens']:,}"
                    if j["n_tokens"] is not None
                    else "-"
                ),
                "size": Text(human_bytes(j["size_bytes"])),
                "last use": Text(j["last_use"][5:16].replace("T", " ")),  # MM-DD HH:MM
            }
        )
    return rows


def _cache_layout(rows, width: int) -> dict[str, int]:
    """Column -> width for a ``width``-cell terminal: every row on one line. The document and the
    model share what the other columns leave; below ``_FLEX_MIN`` each, columns of ``_DROP_ORDER``
    are left out until they fit (the key, document and model always stay)."""
    natural = {c: max([len(c)] + [r[c].cell_len for r in rows]) for c in CACHE_COLUMNS}
    cols = list(CACHE_COLUMNS)

    def fixed(cs) -> int:
        return sum(natural[c] for c in cs if c not in _FLEX) + 2 * len(cs)  # padding: 1 cell each side

    for col in _DROP_ORDER:
        if fixed(cols) + sum(min(natural[c], _FLEX_MIN) for c in _FLEX) <= width:
            break
        cols.remove(col)
    room = max(width - fixed(cols), 2 * _FLEX_MIN)
    doc, model = natural["document"], natural["model"]
    if doc + model > room:  # each gets half, and what the other does not need
        half = room // 2
        doc, model = (min(doc, max(half, room - model)), min(model, max(room - half, room - doc)))
    return {c: doc if c == "document" else model if c == "model" else natural[c] for c in cols}


def cache_table(console: Console, entries, leftovers=None, reclaimed=None) -> None:
    """``kvcli cache ls`` on a terminal: one row per store entry, most recently used first, and a
    line of totals (with the writes in progress and what opening the store reclaimed).

    Each entry on one line: a cell too wide ends in "…" (never cut mid-word onto a second line);
    on a narrow terminal the least useful columns are left out (:func:`_cache_layout`). The whole
    of every cell: piped (TSV) or ``--json``."""
    rows = _cache_rows(entries)
    widths = _cache_layout(rows, console.width)
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1))
    for col, w in widths.items():
        table.add_column(
            col, justify="right" if col in ("tokens", "size") else "left", width=w, no_wrap=True, overflow="ellipsis"
        )
    for row in rows:
        cells = []
        for col, w in widths.items():
            cell = row[col].copy()
            cell.truncate(w, overflow="ellipsis")
            cells.append(cell)
        table.add_row(*cells)
    if entries:
        console.print(table)
    total = f"{_plural(len(entries), 'entry', 'entries')}, {human_bytes(sum(e.size for e in entries))}"
    if leftovers is not None and leftovers.temp_files:
        total += f" · {_plural(leftovers.temp_files, 'write')} in progress, {human_bytes(leftovers.temp_bytes)}"
    if reclaimed is not None and reclaimed.temp_files:
        total += f" · reclaimed {human_bytes(reclaimed.temp_bytes)} left by killed runs"
    console.print(total, style="dim", markup=False, highlight=False)


# read_tokens: a partial entry's tokens read so far ("-" for a whole entry); kind: "kv", "vectors"
# for a document's page vectors, "text" for its extracted text (last: the columns before it kept
# their places)
CACHE_TSV_COLUMNS = (
    "key", "document", "model", "method", "state", "n_tokens", "size_bytes", "last_use", "read_tokens", "kind"
)  # fmt: skip


def cache_tsv(entries) -> str:
    """``kvcli cache ls`` piped: tab-separated values, a header row, full keys and paths, sizes in
    bytes, the state as compact JSON; never wrapped. A damaged entry's document is ``damaged: ...``."""
    import json

    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return " ".join(str(value).split())  # no tab or newline inside a cell

    lines = ["\t".join(CACHE_TSV_COLUMNS)]
    for e in entries:
        j = e.to_json()
        if j["document"] is None and e.error:
            j["document"] = f"damaged: {e.error}"
        lines.append("\t".join(cell(j[c]) for c in CACHE_TSV_COLUMNS))
    return "\n".join(lines) + "\n"


MAIN_KNOBS = 3  # knobs the table shows per method (the first declared); `kvcli compressors NAME`: all


def compressor_table(console: Console) -> None:
    """``kvcli compressors``: two lines per method — what it does (its docstring's first sentence,
    cut to the width) and its first knobs with their defaults — and how to see the rest."""
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1), pad_edge=False)
    every = methods()
    name_width = max(map(len, every))
    table.add_column("method", no_wrap=True, style="bold", width=name_width)
    table.add_column(
        "what it does; its main knobs (default)",
        no_wrap=True,
        overflow="ellipsis",
        width=max(20, console.width - name_width - 2),
    )
    for name in sorted(every):
        method = every[name]
        knobs = method.knobs
        shown = ", ".join(f"{k.name}={k.default}" for k in knobs[:MAIN_KNOBS])
        more = f" (+{len(knobs) - MAIN_KNOBS} more)" if len(knobs) > MAIN_KNOBS else ""
        about = Text(summary(method) + "\n", overflow="ellipsis", no_wrap=True)
        about.append(f"  {shown}{more}" if knobs else "  no knobs", style="dim")
        table.add_row(name, about)
    console.print(table)
    console.print(
        "kvcli compressors NAME: a method's every knob, what it means, and its paper; "
        "-c NAME:knob=value,... sets them (e.g. -c snapkv:budget=0.25)",
        style="dim",
        markup=False,
    )


def compressor_detail(console: Console, name: str) -> None:
    """``kvcli compressors NAME``: the method's description, its paper and every knob (what
    :mod:`kvcli.method_catalog` says of it: no method is imported)."""
    method = methods()[name]
    console.print(f"[bold]{name}[/bold] — {method.doc}")
    console.print(f"[dim]paper: {method.paper}[/dim]")
    knobs = method.knobs
    if not knobs:
        console.print("no knobs")
        return
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 2))
    table.add_column("knob")
    table.add_column("default")
    table.add_column("meaning")
    for knob in knobs:
        table.add_row(knob.name, knob.default, knob.help)
    console.print(table)


# --------------------------------------------------------------------------- kvcli inspect

# kept-span styles by score level (low -> high), the terminal twin of kvcli.report.html.PALETTE
LEVEL_STYLES = ("black on #ffe14d", "black on #ffb830", "black on #ff8a1f", "bold white on #ff4d00")


def inspect_summary(console: Console, ins) -> None:
    """``kvcli inspect``: one header block: method, what it kept, the compression ratio."""
    doc = ins.document
    console.print(
        f"[bold]{ins.label}[/bold] on [bold]{ins.model}[/bold] · {doc.n_pages} page(s) · "
        f"{ins.n_document:,} document tokens in a {ins.n_prompt:,}-token prompt"
    )
    if ins.read is not None:  # a method that retrieves: what it read, not a compression
        console.print(ins.read_line(), markup=False, highlight=False)
    elif ins.view == "all":
        console.print(f"everything kept: all {ins.n_prompt:,} prompt tokens in every layer (no compression)")
    elif ins.view == "read":
        console.print(
            f"holds all {ins.n_prompt:,} prompt tokens (nothing evicted: 1.0×); the question and its answer read "
            f"[bold]{ins.n_read:,.1f}[/bold] of them per layer and KV head on average "
            f"([bold]{ins.read_share:.1%}[/bold] of the KV), {ins.n_kept_any:,} in at least one "
            f"({ins.n_document_kept:,} of the document's) — "
            + ("the same in every layer" if ins.read_layers is None else "layers read different blocks (table below)")
        )
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
    table = Table(
        show_header=True,
        header_style="bold",
        box=None,
        padding=(0, 1),
        title="kept per layer (0-based), over KV heads",
        title_justify="left",
    )
    for col in ("layer", "min", "mean", "max", "share"):
        table.add_column(col, justify="right")
    table.add_column("", justify="left")
    for row in layers:
        share = row.kept_mean / max(n_prompt, 1)
        table.add_row(
            str(row.layer),
            f"{row.kept_min:,}",
            f"{row.kept_mean:,.1f}",
            f"{row.kept_max:,}",
            f"{share:.1%}",
            "█" * max(1, round(share * 30)),
        )
    console.print(table)


def layer_read_table(console: Console, layers, n_prompt: int) -> None:
    """Per layer (where layers read different blocks): prompt tokens it read (mean over its KV
    heads), their share, and the pages of the document it read."""
    table = Table(
        show_header=True,
        header_style="bold",
        box=None,
        padding=(0, 1),
        title="read per layer (0-based), over KV heads",
        title_justify="left",
    )
    for col in ("layer", "read", "share"):
        table.add_column(col, justify="right")
    table.add_column("pages read", justify="left", overflow="fold")
    for row in layers:
        table.add_row(str(row.layer), f"{row.n_read:,.1f}", f"{row.n_read / max(n_prompt, 1):.1%}", row.pages())
    console.print(table)


def document_view(console: Console, ins, verb: str = "kept") -> None:
    """The whole document with the kept (``verb``: or read) tokens highlighted (colour: the best
    score level of the merged spans), on word boundaries (:func:`word_spans`), a rule per page;
    the answer's sources (``inspect --answer``) underlined after their rank, ``[1]`` ... ``[/1]``
    where colours do not show."""
    from .inspection import cited_at, cited_ranges, span_levels

    text, doc = ins.document.text, ins.document
    levels = span_levels(ins, len(LEVEL_STYLES))
    pieces = [(a, b, max(levels[i] for i in members)) for a, b, members in word_spans(text, ins.spans)]
    cited = cited_ranges(ins)
    cuts = {0, len(text)} | set(doc.page_starts) | {c for a, b, _ in pieces for c in (a, b)}
    cuts = sorted(cuts | {c for a, b, _ in cited for c in (a, b) if 0 <= c <= len(text)})
    page_at = {start: i + 1 for i, start in enumerate(doc.page_starts)}
    starts = [a for a, _, _ in pieces]

    # without colours (a pipe, NO_COLOR) the highlight would vanish: mark kept text with ⟦ ⟧
    plain = console.color_system is None
    marks_legend(console, verb)
    if cited:
        console.print(
            "[n] marks the answer's n-th source" + (" up to [/n]" if plain else ", underlined"),
            style="dim",
            markup=False,
            highlight=False,
        )
    line = Text()
    for a, b in zip(cuts, cuts[1:]):
        if a in page_at:
            if line:
                console.print(line, overflow="fold")
                line = Text()
            console.rule(f"[cyan]page {page_at[a]}[/cyan]", align="left", style="dim")
        j = bisect.bisect_right(starts, a) - 1
        inside = j >= 0 and pieces[j][0] <= a < pieces[j][1]
        source = cited_at(cited, a)
        if source is not None and a == source[0]:
            line.append(f"[{source[2]}]", style="" if plain else "bold blue")
        if inside and plain:
            line.append((MARKS[0] if a == pieces[j][0] else "") + text[a:b] + (MARKS[1] if b == pieces[j][1] else ""))
        else:
            style = LEVEL_STYLES[pieces[j][2]] if inside else ""
            line.append(text[a:b], style=f"{style} underline".strip() if source is not None else style)
        if source is not None and plain and b == source[1]:
            line.append(f"[/{source[2]}]")
    if line:
        console.print(line, overflow="fold")


def sources_list(console: Console, sources) -> None:
    """The answer's sources (``inspect --answer``), numbered as the document view marks them."""
    console.print("sources:", style="bold")
    for line in sources.lines(numbered=True):
        console.print(f"  {line}", markup=False, highlight=False)


def layer_scan_table(console: Console, report) -> None:
    """``kvcli inspect --layers``: per layer, whether GemFilter's top-k there keeps the needle."""
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1))
    for col, justify in (
        ("layer", "right"),
        ("best rank", "right"),
        ("k needed", "right"),
        (f"in top-{report.k}", "right"),
        ("found", "left"),
        ("distance", "right"),
    ):
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
        (
            f"first layer whose top-{report.k} keeps the whole needle: [bold]{first}[/bold]"
            if first is not None
            else f"no layer's top-{report.k} keeps the whole needle"
        )
        + f" · first layer with distance 0: {'-' if report.first_touched is None else report.first_touched}"
        + f" · smallest k needed: layer {report.best_layer} (layers are gemfilter:layer= indices, 0-based)"
    )


def head_table(console, profile, induction: float, echo: float, score: str = "induction") -> None:
    """Layer x head table of one score (x100), protected heads marked: I induction, E echo."""
    import torch

    from ..compressors.razor_heads import REPEATS, summary

    by_ind, by_echo = profile.protected_query_heads(induction, echo)
    kv = profile.protected_kv_heads(induction, echo)
    values = profile.induction if score == "induction" else profile.echo
    s = summary(profile, induction, echo)
    table = Table(
        title=f"{score} score x100 per head — I: top {induction:.0%} induction, E: top {echo:.0%} echo (protected)",
        header_style="bold",
        box=None,
        padding=(0, 1),
    )
    table.add_column("layer", justify="right")
    for h in range(profile.n_heads):
        table.add_column(f"h{h}", justify="right")
    table.add_column("full KV heads", justify="left")
    for layer in range(profile.n_layers):
        cells = []
        for h in range(profile.n_heads):
            mark = ("I" if by_ind[layer, h] else "") + ("E" if by_echo[layer, h] else "")
            text = f"{100 * float(values[layer, h]):.0f}{mark}"
            style = "bold green" if by_ind[layer, h] else "bold magenta" if by_echo[layer, h] else "dim"
            cells.append(f"[{style}]{text}[/{style}]")
        kept = ",".join(str(g) for g in torch.nonzero(kv[layer]).flatten().tolist())
        cells.append(kept or "-")
        table.add_row(str(layer), *cells)
    console.print(table)
    where = (
        f"loaded from {profile.path}"
        if profile.loaded
        else f"computed in {profile.compute_s:.1f}s"
        + (f", stored in {profile.path}" if profile.path is not None else "")
    )
    console.print(
        f"{profile.model_name}: {s['n_protected_query_heads']}/{s['n_query_heads']} query heads protected "
        f"({s['n_by_induction']} induction, {s['n_by_echo']} echo) -> {s['n_protected_kv_heads']}/{s['n_kv_heads']} "
        f"KV heads keep full KV ({s['protected_kv_fraction']:.1%}); probe K={profile.tokens} x {REPEATS}, "
        f"seed {profile.seed}; {where}",
        soft_wrap=True,
    )
