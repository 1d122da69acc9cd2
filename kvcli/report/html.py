"""``kvcli inspect --html FILE``: one self-contained HTML page of what a method kept.

The page needs nothing but a browser: inline CSS, no script, no external URL (fonts, images or
styles). It shows a header (method, model, question, kept tokens, compression ratio), a score strip
(an inline SVG: the document cut into at most :data:`N_BUCKETS` equal character ranges, each with
its best token score as a grey bar and the share of its tokens kept as a coloured bar; click a
bucket to jump to it), the per-layer summary for per-layer/per-head methods, and the document text
with the kept spans in ``<mark>`` elements coloured by score (:data:`PALETTE`, low to high) and a
marker at each page start. With ``inspect --answer`` the answer's sources are listed in the
header (links) and outlined in the text (``<span class="cite">``), apart from the kept marks.

Size stays linear in the document: one ``<mark>`` per kept span (split only at page starts and
bucket anchors), never one element per token.
"""

from __future__ import annotations

import bisect
import html
from pathlib import Path

from ..errors import UsageError
from .inspection import Inspection, cited_at, cited_ranges, document_profile, span_levels

# kept-span backgrounds, lowest score first: saturated, so kept text stands out (and a screenshot
# test can count its pixels)
PALETTE = ("#ffe14d", "#ffb830", "#ff8a1f", "#ff4d00")
TEXT_ON = ("#000000", "#000000", "#000000", "#ffffff")
N_BUCKETS = 200

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1c1c1c;background:#ffffff}
header{padding:12px 20px;border-bottom:1px solid #ddd;background:#fafafa;position:sticky;top:0}
h1{font-size:18px;margin:0 0 4px 0}
.meta{font-size:13px;color:#444;margin:2px 0}
.meta b{color:#000}
.legend span{display:inline-block;min-width:14px;padding:0 6px;margin-right:4px;border-radius:2px;font-size:12px}
svg.strip{display:block;width:100%;height:56px;margin-top:6px}
details.layers{margin:10px 20px;font-size:13px}
table.layers{border-collapse:collapse;font-size:12px;margin:6px 0}
table.layers td,table.layers th{padding:1px 8px;text-align:right}
table.layers .bar{display:inline-block;height:9px;background:#ff8a1f}
main{padding:12px 20px 40px 20px;white-space:pre-wrap;font-family:ui-monospace,"DejaVu Sans Mono",monospace;
font-size:14px;line-height:1.55;max-width:120ch}
mark{border-radius:2px;padding:0}
.cite{outline:2px solid #1f6feb;outline-offset:1px}
.cite-n{font-family:system-ui,sans-serif;font-size:11px;font-weight:bold;color:#fff;background:#1f6feb;
padding:0 4px;margin-right:2px;border-radius:2px}
.sources a{color:#1f6feb}
.page{display:block;margin:14px 0 6px 0;padding:2px 6px;font-family:system-ui,sans-serif;font-size:11px;color:#666;
border-top:1px dashed #bbb}
""" + "".join(
    f"mark.k{i}{{background:{bg};color:{fg}}}\n.legend .k{i}{{background:{bg};color:{fg}}}\n"
    for i, (bg, fg) in enumerate(zip(PALETTE, TEXT_ON))
)


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _score_strip(ins: Inspection, profile: list[dict]) -> str:
    """Inline SVG: per bucket, the best score (grey, top) and the kept share (colour, bottom);
    click a bucket to jump to its place in the text."""
    n = max(len(profile), 1)
    width = 1000.0
    w = width / n

    def num(v: float) -> str:
        return f"{v:.1f}".rstrip("0").rstrip(".")

    parts = [
        f'<svg class="strip" viewBox="0 0 {width:.0f} 56" preserveAspectRatio="none" role="img" '
        f'aria-label="score along the document">'
    ]
    for i, b in enumerate(profile):
        x, wx = num(i * w), num(w)
        title = f"chars {b['start']:,}-{b['end']:,}, p.{b['page']}: {b['kept']:.0%} of {b['n_tokens']} tokens kept"
        if b["score"] is not None:
            title += f", best score {b['score']:.2f}"
        # the bucket's background doubles as its click area
        bits = [f"<title>{_e(title)}</title>", f'<rect x="{x}" y="0" width="{wx}" height="56" fill="#f1f3f5"/>']
        if b["score"] is not None:
            h = 26 * b["score"]
            bits.append(f'<rect x="{x}" y="{num(28 - h)}" width="{wx}" height="{num(h)}" fill="#868e96"/>')
        if b["kept"] > 0:
            level = min(len(PALETTE) - 1, int(b["kept"] * len(PALETTE)))
            h = 4 + 22 * b["kept"]
            bits.append(f'<rect x="{x}" y="{num(56 - h)}" width="{wx}" height="{num(h)}" fill="{PALETTE[level]}"/>')
        parts.append(f'<a href="#b{i}">{"".join(bits)}</a>')
    # page starts as thin ticks
    text_len = max(len(ins.document.text), 1)
    for start in ins.document.page_starts[1:]:
        parts.append(f'<rect x="{num(width * start / text_len)}" y="0" width="1" height="56" fill="#495057"/>')
    parts.append("</svg>")
    return "".join(parts)


def _read_layers_table(ins: Inspection) -> str:
    """Where layers read different blocks: per layer, the tokens read and the pages."""
    n = max(ins.n_prompt, 1)
    rows = [
        (
            '<details class="layers">'
            "<summary>read per layer (0-based): tokens (mean over KV heads) and pages</summary>"
            '<table class="layers"><tr><th>layer</th><th>read</th><th></th>'
            '<th style="text-align:left">pages</th></tr>'
        )
    ]
    for row in ins.read_layers:
        pct = 100 * row.n_read / n
        rows.append(
            f"<tr><td>{row.layer}</td><td>{row.n_read:,.1f}</td>"
            f'<td style="text-align:left"><span class="bar" style="width:{max(1, 3 * pct):.0f}px"></span>'
            f" {pct:.1f}%</td>"
            f'<td style="text-align:left">{_e(row.pages())}</td></tr>'
        )
    rows.append("</table></details>")
    return "".join(rows)


def _layers_table(ins: Inspection) -> str:
    if ins.read_layers:
        return _read_layers_table(ins)
    if not ins.per_layer or not ins.layers:
        return ""
    n = max(ins.n_prompt, 1)
    rows = [
        '<details class="layers"><summary>prompt tokens kept per layer (min / mean / max over KV heads)</summary>'
        '<table class="layers"><tr><th>layer</th><th>kept min</th><th>mean</th><th>max</th><th></th></tr>'
    ]
    for row in ins.layers:
        pct = 100 * row.kept_mean / n
        rows.append(
            f"<tr><td>{row.layer}</td><td>{row.kept_min:,}</td><td>{row.kept_mean:,.1f}</td><td>{row.kept_max:,}</td>"
            f'<td style="text-align:left"><span class="bar" style="width:{max(1, 3 * pct):.0f}px"></span> {pct:.1f}%</td></tr>'
        )
    rows.append("</table></details>")
    return "".join(rows)


def _document_body(ins: Inspection, profile: list[dict]) -> str:
    text = ins.document.text
    spans = ins.spans
    levels = span_levels(ins, len(PALETTE))
    page_at = {start: i + 1 for i, start in enumerate(ins.document.page_starts)}
    bucket_at: dict[int, list[int]] = {}
    for i, b in enumerate(profile):
        # the anchor goes to the next word start, so it never splits a word (or a URL)
        at = min(b["start"], len(text))
        while 0 < at < len(text) and not text[at - 1].isspace():
            at += 1
        bucket_at.setdefault(at, []).append(i)
    cited = cited_ranges(ins)
    cuts = {0, len(text)} | set(page_at) | set(bucket_at) | {c for a, b, _ in cited for c in (a, b)}
    for s in spans:
        cuts.add(s.start)
        cuts.add(s.end)
    cuts = sorted(c for c in cuts if 0 <= c <= len(text))
    starts = [s.start for s in spans]
    out = []
    for a, b in zip(cuts, cuts[1:] + [None]):
        if a in page_at:
            out.append(f'<span class="page" id="page-{page_at[a]}">page {page_at[a]}</span>')
        if a in bucket_at:
            out.append("".join(f'<a id="b{i}"></a>' for i in bucket_at[a]))
        if b is None or b <= a:
            continue
        piece = _e(text[a:b])
        j = bisect.bisect_right(starts, a) - 1
        if j >= 0 and spans[j].start <= a < spans[j].end:
            s = spans[j]
            pages = f"p.{s.page}" if s.page == s.last_page else f"p.{s.page}-{s.last_page}"
            if s.score is None or s.score != s.score:
                score = ""
            elif ins.score_kind == "share":
                score = f", held by {s.score:.0%} of layer/head pairs"
            elif ins.score_kind == "read":
                score = f", read by {s.score:.0%} of layer/head pairs"
            else:
                score = f", score {s.score:.3g}"
            verb = "read" if ins.view == "read" else "kept"
            title = f"{verb}: {s.n_tokens} tokens, chars {s.start:,}-{s.end:,}, {pages}{score}"
            piece = f'<mark class="k{levels[j]}" title="{_e(title)}">{piece}</mark>'
        source = cited_at(cited, a)
        if source is not None:  # the answer's source: outlined, its rank where it starts
            first = a == source[0]
            label = f'<span class="cite-n">{source[2]}</span>' if first else ""
            anchor = f' id="src-{source[2]}"' if first else ""
            piece = f'{label}<span class="cite"{anchor} title="source {source[2]} of the answer">{piece}</span>'
        out.append(piece)
    return "".join(out)


def _sources(ins: Inspection) -> str:
    """The header's line of the answer's sources, each a link to its place in the text."""
    if ins.sources is None:
        return ""
    items = ins.sources.items
    if not items:
        return f'<p class="meta sources">sources: {_e(ins.sources.reason or "none")}</p>'
    links = " · ".join(
        f'<a href="#src-{i}"><b>[{i}]</b> {_e(s.where())}: “{_e(s.quote(60))}”</a>' for i, s in enumerate(items, 1)
    )
    lead = "no clear source; the answer read most: " if not ins.sources.clear else "sources: "
    return f'<p class="meta sources">{lead}{links}</p>'


def render(ins: Inspection) -> str:
    """The whole page as a string."""
    profile = document_profile(ins, N_BUCKETS)
    doc_name = Path(ins.document.source).name if ins.document.source != "-" else "stdin"
    if ins.read is not None:  # a method that retrieves: what it read, not a compression
        kept_line = html.escape(ins.read_line())
    elif ins.view == "all":
        kept_line = f"everything kept: <b>{ins.n_prompt:,}</b> prompt tokens (no compression)"
    elif ins.view == "read":
        kept_line = (
            f"holds all <b>{ins.n_prompt:,}</b> prompt tokens (nothing evicted); the question and its answer read "
            f"<b>{ins.n_read:,.1f}</b> of them per layer and KV head on average "
            f"(<b>{ins.read_share:.1%}</b> of the KV), "
            + ("the same in every layer" if ins.read_layers is None else "different blocks per layer (table below)")
        )
    elif ins.view == "per-head":
        kept_line = (
            f"each layer and KV head holds <b>{ins.n_kept:,.1f}</b> of <b>{ins.n_prompt:,}</b> prompt tokens on average "
            f"(<b>{ins.compression_ratio:.1f}×</b> compression); {ins.n_kept_any:,} are held by at least one"
        )
    else:
        kept_line = (
            f"kept <b>{int(ins.n_kept):,}</b> of <b>{ins.n_prompt:,}</b> prompt tokens "
            f"(<b>{ins.compression_ratio:.1f}×</b> compression)"
        )
    score_note = {
        "filter": "colour: the filter score's rank among the kept spans",
        "share": "colour: share of (layer, KV head) pairs that hold the span's best token",
        "read": "colour: share of (layer, KV head) pairs that read the span's best token",
        None: "",
    }[ins.score_kind]
    verb = "read" if ins.view == "read" else "kept"
    legend = "".join(
        f'<span class="k{i}">{label}</span>' for i, label in enumerate(("low", "", "", "high")[: len(PALETTE)])
    )
    answer = f'<p class="meta">answer: <b>{_e(ins.answer)}</b></p>' if ins.answer is not None else ""
    head = (
        f'<h1 title="{_e(ins.method)}">What {_e(ins.label)} {verb} of {_e(doc_name)}</h1>'
        f'<p class="meta">model <b>{_e(ins.model)}</b> · {ins.document.n_pages} page(s) · '
        f"{ins.n_document:,} document tokens · question: <b>{_e(ins.question)}</b></p>"
        f'<p class="meta">{kept_line} · {len(ins.spans):,} {verb} document spans</p>'
        f"{answer}{_sources(ins)}"
        f'<p class="meta legend">{legend} {_e(score_note)}</p>'
        f"{_score_strip(ins, profile)}"
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>kvcli inspect: {_e(doc_name)} ({_e(ins.label)})</title>"
        f"<style>{CSS}</style></head><body>"
        f"<header>{head}</header>"
        f"{_layers_table(ins)}"
        f"<main>{_document_body(ins, profile)}</main>"
        "</body></html>\n"
    )


def write(ins: Inspection, path) -> Path:
    """Write the page to ``path``; UsageError (one line) when it cannot be written."""
    path = Path(path)
    page = render(ins)
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--html: cannot write {path}: {e.strerror or e}") from None
    return path
