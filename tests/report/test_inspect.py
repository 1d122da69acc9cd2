"""``kvcli inspect``: what a method kept (spans -> characters and pages of a real PDF, per-layer
summaries, JSON, a self-contained HTML page that Chromium renders) and the GemFilter layer scan.

Models are tiny random ones (``tiny_dir``), so *which* tokens are kept is arbitrary: the tests
check that whatever is kept maps exactly onto the document, against an independent computation.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

from kvcli import api
from kvcli.answer.prompt import build_prompt
from kvcli.compressors import parse_one
from kvcli.documents import document_from_text, load_document
from kvcli.report.inspection import inspect_kept
from kvcli.report.layers import find_needle, rank_layers

PAGES = [
    "The keeper's log begins on the first page. The relief boat brought flour, lamp oil and two crates "
    "of tinned herring. The fog signal was sticking on cold mornings.",
    "On the second page the gale arrived from the south west. The padlock combination of the oil store "
    "is 4417 and the spare key hangs behind the door. ZEBRA marks page two.",
    "The third page ends the log: the inspector came in March, praised the brass and left a new "
    "logbook. Nothing else happened that winter.",
]
QUESTION = "What is the combination of the oil store padlock?"


# --- helpers ---------------------------------------------------------------------------------


def make_pdf(path: Path, pages: list[str]) -> Path:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    pdf.output(str(path))
    return path


def assert_user_error(result, code: int, *needles: str) -> None:
    got, out, err = result
    assert "Traceback" not in out + err
    assert got == code, (got, out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcli: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture(scope="module")
def model(tiny_dir) -> str:
    return str(tiny_dir("llama", num_hidden_layers=4))


@pytest.fixture(scope="module")
def session(model):
    return api.Session.open(api.AskOptions(model=model, use_cache=False))


@pytest.fixture(scope="module")
def pdf(tmp_path_factory) -> Path:
    return make_pdf(tmp_path_factory.mktemp("inspect") / "log.pdf", PAGES)


@pytest.fixture(scope="module")
def document(pdf):
    doc = load_document(pdf)
    assert doc.n_pages == 3
    return doc


def expected_spans(session, document, spec: str):
    """The kept document runs of a GemFilter spec computed independently of kvcli.inspect: the
    filter's own select_tokens on the prompt, then offsets -> characters -> pages by hand."""
    lm = session.lm
    prompt = build_prompt(lm.tokenizer, document.text, QUESTION, session.template)
    gem = parse_one(spec)
    gem.configure(lm)
    kept = gem.select_tokens(session.engine, prompt.ids, protected=prompt.n_after_document).kept.tolist()
    doc_tokens = [i - prompt.doc_start for i in kept if prompt.doc_start <= i < prompt.doc_end]
    runs = []
    for t in doc_tokens:
        if runs and t == runs[-1][-1] + 1:
            runs[-1].append(t)
        else:
            runs.append([t])
    out = []
    for run in runs:
        start, end = prompt.doc_offsets[run[0]][0], prompt.doc_offsets[run[-1]][1]
        page = 1 + sum(1 for s in document.page_starts[1:] if s <= start)
        last = 1 + sum(1 for s in document.page_starts[1:] if s <= end - 1)
        out.append((start, end, page, last, len(run), document.text[start:end]))
    return out


# --- what was kept: spans, pages, per-layer summaries ----------------------------------------------


def test_gemfilter_spans_map_to_the_pdfs_characters_and_pages(session, document):
    spec = "gemfilter:layer=2,k=60"
    ins = inspect_kept(session, document, QUESTION, api.parse_pipeline(spec))
    assert ins.view == "selection" and ins.score_kind == "filter" and ins.answer is None
    got = [(s.start, s.end, s.page, s.last_page, s.n_tokens, s.text) for s in ins.spans]
    assert got == expected_spans(session, document, spec)
    assert {s.page for s in ins.spans} == {1, 2, 3}  # the kept tokens fall on every page of this PDF
    for s in ins.spans:
        assert document.text[s.start : s.end] == s.text
        assert s.page == document.page_of(s.start) and s.last_page == document.page_of(s.end - 1)
        page_text = document.text[document.page_starts[s.page - 1] :]
        assert PAGES[s.page - 1].split()[0] in page_text[:40]  # the page really begins with that PDF page's text
        assert s.score is not None and s.score == s.score  # the filter's score, not NaN
    assert ins.n_kept == 60 and ins.compression_ratio == pytest.approx(ins.n_prompt / 60)
    assert int(ins.kept.sum()) == 60
    # every kept document token's characters lie inside a span, and every span is made of kept tokens
    prompt = ins.prompt
    for t, (a, b) in enumerate(prompt.doc_offsets):
        inside = any(s.start <= a and b <= s.end for s in ins.spans)
        assert inside == bool(ins.kept[prompt.doc_start + t]) or b == a


def test_full_attention_keeps_everything(session, document):
    ins = inspect_kept(session, document, QUESTION, api.parse_pipeline("full"))
    assert ins.view == "all" and ins.compression_ratio == 1.0 and ins.n_kept == ins.n_prompt
    assert len(ins.spans) == 1
    (span,) = ins.spans
    assert (span.page, span.last_page) == (1, 3)
    assert span.text == document.text[span.start : span.end] and span.n_tokens == ins.n_document
    assert document.text[: span.start].strip() == "" and document.text[span.end :].strip() == ""
    assert [row.kept_min for row in ins.layers] == [ins.n_prompt] * 4


def test_snapkv_per_layer_summary_matches_the_budget(session, document):
    ins = inspect_kept(session, document, QUESTION, api.parse_pipeline("snapkv:budget=48"))
    assert ins.n_prompt > 48
    assert ins.view == "per-head" and ins.score_kind == "share"
    assert len(ins.layers) == 4
    for row in ins.layers:
        assert row.kept_min == row.kept_max == 48 and row.kept_mean == 48
    assert ins.n_kept == 48 and ins.compression_ratio == pytest.approx(ins.n_prompt / 48)
    # the document view: a token counts as kept when any layer/head holds it, scored by the share
    assert 48 <= ins.n_kept_any <= ins.n_prompt
    assert all(0 < s.score <= 1 for s in ins.spans)
    assert ins.scores.max() <= 1 and float(ins.scores[-1]) == 1.0  # the observation window: every head
    for s in ins.spans:
        assert document.text[s.start : s.end] == s.text and s.page == document.page_of(s.start)


def test_answer_only_when_asked(session, document):
    import dataclasses

    short = dataclasses.replace(session, options=dataclasses.replace(session.options, max_new_tokens=4))
    ins = inspect_kept(short, document, QUESTION, api.parse_pipeline("gemfilter:layer=2,k=60"), generate=True)
    assert isinstance(ins.answer, str)
    assert "answer" in ins.to_json()


# --- the command: terminal, --json, --html ---------------------------------------------------------


def test_cli_json_schema(cli, model, pdf, document):
    code, out, err = cli(
        "inspect", pdf, QUESTION, "-c", "gemfilter:layer=2,k=50", "--model", model, "--json", "--no-cache"
    )
    assert code == 0, err
    record = json.loads(out)
    for key in (
        "compressor",
        "model",
        "n_prompt_tokens",
        "n_document_tokens",
        "n_kept_tokens",
        "compression_ratio",
        "spans",
    ):
        assert key in record, key
    assert record["compressor"].startswith("gemfilter:layer=2,k=50")
    assert record["n_kept_tokens"] == 50
    assert record["compression_ratio"] == pytest.approx(record["n_prompt_tokens"] / 50, rel=1e-3)
    assert "answer" not in record  # nothing generated
    assert record["layers"] and set(record["layers"][0]) == {"layer", "kept_min", "kept_mean", "kept_max"}
    for s in record["spans"]:
        assert set(s) == {"start", "end", "page", "last_page", "n_tokens", "score", "text"}
        assert document.text[s["start"] : s["end"]] == s["text"]
        assert s["page"] == document.page_of(s["start"])

    code, out, _ = cli(
        "inspect",
        pdf,
        QUESTION,
        "-c",
        "snapkv:budget=48",
        "--model",
        model,
        "--json",
        "--no-cache",
        "--answer",
        "--max-new-tokens",
        "3",
    )
    record = json.loads(out)
    assert code == 0 and record["view"] == "per-head" and "answer" in record
    assert all(row["kept_min"] == row["kept_max"] == 48 for row in record["layers"])


def test_cli_terminal_views(cli, model, pdf):
    code, out, err = cli(
        "inspect", pdf, QUESTION, "-c", "snapkv:budget=48", "--model", model, "--no-cache", "--show-selected"
    )
    assert code == 0, err
    assert "kept per layer" in out and "compression" in out
    assert "page 2" in out and "ZEBRA" in out  # the whole document, page by page
    code, out, _ = cli("inspect", pdf, QUESTION, "-c", "full", "--model", model, "--no-cache")
    assert code == 0 and "everything kept" in out


def _marks(page: str) -> list[str]:
    return [html.unescape(re.sub(r"<[^>]+>", "", m)) for m in re.findall(r"<mark[^>]*>(.*?)</mark>", page, flags=re.S)]


def test_html_is_self_contained_and_escaped(cli, session, model, tmp_path):
    text = "Intro <b>bold</b> & \"quotes\" 'single' <script>alert(1)</script>\n\n" + " ".join(
        f"Line {i}: the keeper counted {i * 7 % 13} gulls near https://example.com." for i in range(40)
    )
    src = tmp_path / "doc.txt"
    src.write_text(text, encoding="utf-8")
    out_file = tmp_path / "kept.html"
    code, out, err = cli(
        "inspect",
        src,
        "How many gulls <now>?",
        "-c",
        "gemfilter:layer=2,k=80",
        "--model",
        model,
        "--no-cache",
        "--html",
        out_file,
        "--json",
    )
    assert code == 0, err
    page = out_file.read_text(encoding="utf-8")
    record = json.loads(out)
    # self-contained: no script, no external resource; the document's own "https://" is only text
    assert "<script" not in page and "<link" not in page and "src=" not in page and "@import" not in page
    assert not re.search(r"""(href|src|action|xmlns)\s*=\s*["']?[a-z]+:""", page, flags=re.I)
    assert "url(" not in page
    visible = html.unescape(re.sub(r"<[^>]+>", "", page))
    assert page.count("http") == visible.count("http") == text.count("http")  # only the document's own text
    assert "&lt;b&gt;bold&lt;/b&gt;" in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "How many gulls &lt;now&gt;?" in page
    # the marks hold exactly the kept spans' text (a span may be cut at a page or bucket anchor)
    doc = load_document(src)
    assert "".join(_marks(page)) == "".join(s["text"] for s in record["spans"])
    assert (
        html.unescape(re.sub(r"<[^>]+>", "", page.split("<main>")[1].split("</main>")[0]).replace("page 1", "", 1))
        == doc.text
    )


def test_html_stays_small_for_a_long_document(session):
    doc = document_from_text(" ".join(f"word{i % 97}" for i in range(1000)))
    ins = inspect_kept(session, doc, "Which word?", api.parse_pipeline("snapkv:budget=300"))
    from kvcli.report import html as report_html

    page = report_html.render(ins)
    assert page.count("<mark") <= len(ins.spans) + report_html.N_BUCKETS + doc.n_pages
    assert page.count("<rect") <= 3 * report_html.N_BUCKETS + 10  # the strip is bucketed, not per token
    assert len(page) < 2 * len(doc.text) + 160 * len(ins.spans) + 80_000  # linear in text and spans


def test_html_unwritable_path_is_one_line(cli, model, pdf, tmp_path):
    assert_user_error(
        cli("inspect", pdf, QUESTION, "--model", model, "--html", tmp_path / "no" / "such" / "x.html"), 2, "--html"
    )
    assert_user_error(cli("inspect", pdf, QUESTION, "--model", model, "--html", tmp_path), 2, "--html")


def _png_pixels(path: Path):
    """RGB pixels of a non-interlaced 8-bit RGB/RGBA PNG (Chromium's screenshots), via zlib."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", None
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 4], "big")
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color = (
                int.from_bytes(body[:4], "big"),
                int.from_bytes(body[4:8], "big"),
                body[8],
                body[9],
            )
            assert depth == 8 and color in (2, 6) and body[12] == 0
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.e2e
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_html_renders_the_highlight_in_headless_chromium(session, tmp_path):
    from kvcli.report import html as report_html

    doc = document_from_text(
        "Short log. The gale came from the south west and the padlock combination is 4417. "
        "The spare key hangs behind the door. Nothing else happened that winter."
    )
    ins = inspect_kept(session, doc, QUESTION, api.parse_pipeline("gemfilter:layer=2,k=50"))
    assert ins.spans
    page = tmp_path / "kept.html"
    report_html.write(ins, page)
    shot = tmp_path / "shot.png"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--force-color-profile=srgb",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    subprocess.run(
        [CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1000,800", page.as_uri()],
        capture_output=True,
        timeout=90,
        check=False,
    )
    assert shot.exists(), "chromium wrote no screenshot"
    width, height, bpp, rows = _png_pixels(shot)
    assert (width, height) == (1000, 800)
    palette = [tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in report_html.PALETTE]
    levels = set(__import__("kvcli.report.inspection", fromlist=["span_levels"]).span_levels(ins, len(palette)))
    counts = dict.fromkeys(range(len(palette)), 0)
    for row in rows[200:]:  # below the header (its legend and strip use the palette too)
        for x in range(0, width * bpp, bpp):
            px = tuple(row[x : x + 3])
            for i, colour in enumerate(palette):
                if max(abs(p - q) for p, q in zip(px, colour)) <= 6:
                    counts[i] += 1
    highlighted = sum(counts.values())
    assert highlighted > 300, counts  # the kept text's background is on screen
    assert all(counts[i] > 0 for i in levels), (counts, levels)
    # and the DOM holds the kept text inside <mark>
    dom = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=90, check=False
    ).stdout
    assert "".join(_marks(dom)) == "".join(s.text for s in ins.spans)


# --- --layers: which layer finds the needle ------------------------------------------------------------


def test_rank_layers_reproduces_figure_5_distance():
    n = 20
    protected = 2
    good = torch.zeros(n)
    good[[7, 8]] = 5.0  # the needle scores best
    bad = torch.arange(n, dtype=torch.float32)  # the later the better: the needle is far from the top-k
    rows = rank_layers([good, bad], [[7, 8]], k=5, protected=protected)
    assert (rows[0].found, rows[0].best_rank, rows[0].k_needed, rows[0].n_in_topk, rows[0].distance) == (
        True,
        1,
        4,
        2,
        0,
    )
    # layer 2: picks (k - 2 forced = 3) are 17, 16, 15 -> nearest is 15, distance |15 - 8| = 7
    assert rows[1].found is False and rows[1].n_in_topk == 0 and rows[1].distance == 7
    assert rows[1].best_rank == 17 - 8 + 1 - 0 and rows[1].k_needed == (17 - 7 + 1) + 2


def test_cli_layers_table_plot_and_json(cli, model, pdf, document, tmp_path):
    png = tmp_path / "layers.png"
    code, out, err = cli(
        "inspect",
        "--layers",
        pdf,
        QUESTION,
        "--needle",
        "4417",
        "--model",
        model,
        "-c",
        "gemfilter:k=40",
        "--plot",
        png,
    )
    assert code == 0, err
    assert "best rank" in out and "distance" in out and "4417" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    code, out, err = cli(
        "inspect", "--layers", pdf, QUESTION, "--needle", "4417", "--model", model, "--k", "40", "--json"
    )
    assert code == 0, err
    record = json.loads(out)
    assert record["k"] == 40 and record["needle"] == "4417" and len(record["layers"]) == 4
    ((start, end),) = record["needle_chars"]
    assert document.text[start:end] == "4417"
    session = api.Session.open(api.AskOptions(model=model, use_cache=False))
    prompt = build_prompt(session.lm.tokenizer, document.text, QUESTION, session.template)
    for i in record["needle_tokens"][0]:
        a, b = prompt.char_span(i)
        assert a < end and b > start
    for row in record["layers"]:
        assert set(row) == {"layer", "best_rank", "k_needed", "n_in_topk", "n_needle", "found", "distance"}
        assert row["found"] == (row["k_needed"] <= 40)
        assert (row["distance"] == 0) == (row["n_in_topk"] > 0)
    assert record["first_found_layer"] == next((r["layer"] for r in record["layers"] if r["found"]), None)


def test_find_needle_maps_every_occurrence(session):
    doc = document_from_text("The pass key is 71432. Remember it. 71432 is the pass key.")
    prompt = build_prompt(session.lm.tokenizer, doc.text, "What is the pass key?", session.template)
    chars, groups = find_needle(prompt, doc, "71432")
    assert [doc.text[a:b] for a, b in chars] == ["71432", "71432"] and len(groups) == 2
    for (_a, _b), group in zip(chars, groups):
        covered = "".join(doc.text[slice(*prompt.char_span(i))] for i in group)
        assert "71432" in covered


# --- errors: one line, an exit code ---------------------------------------------------------------


def test_errors_are_one_line(cli, model, pdf, tmp_path):
    assert_user_error(cli("inspect", tmp_path / "missing.pdf", QUESTION, "--model", model), 1, "missing.pdf")
    assert_user_error(cli("inspect", pdf, QUESTION, "-c", "nosuchmethod", "--model", model), 2, "nosuchmethod")
    assert_user_error(
        cli("inspect", "--layers", pdf, QUESTION, "--needle", "no such text", "--model", model),
        2,
        "--needle",
        "not in the document",
    )
    assert_user_error(
        cli("inspect", pdf, QUESTION, "--plot", tmp_path / "x.png", "--model", model), 2, "--plot needs --layers"
    )
    assert_user_error(cli("inspect", pdf, "--model", model), 2, "give a document and a question")
    assert_user_error(cli("inspect", "--needle-test", "512", pdf, QUESTION), 2, "--needle-test")
    assert_user_error(cli("inspect", "--layers", pdf, QUESTION, "--html", tmp_path / "x.html"), 2, "--layers")


def test_layers_without_needle_uses_the_full_attention_answer(cli, model, pdf, monkeypatch):
    """No --needle: the answer under full attention is the needle when the document contains it;
    otherwise one line asks for --needle."""
    from kvcli import api

    real = api.Session.ask
    answers = iter(["xq zzz not in the text", "\u201c4417.\u201d"])

    def fake(self, document, question, pipeline, *args, **kwargs):
        if pipeline.spec() == "full":
            return type("R", (), {"answer": next(answers)})()
        return real(self, document, question, pipeline, *args, **kwargs)

    monkeypatch.setattr(api.Session, "ask", fake)
    assert_user_error(
        cli("inspect", "--layers", pdf, QUESTION, "--model", model), 2, "not in the document", "--needle TEXT"
    )
    code, out, err = cli("inspect", "--layers", pdf, QUESTION, "--model", model, "--k", "40", "--json")
    assert code == 0, err
    assert json.loads(out)["needle"] == "4417"


# --- the terminal views: whole words, each piece of text once ------------------------------------


def _spans_at(doc, pieces):
    from kvcli.compressors.selection import Span

    return [Span(a, b, doc.page_of(a), doc.page_of(b - 1), 1, None, doc.text[a:b]) for a, b in pieces]


def _plain_console():
    from io import StringIO

    from rich.console import Console

    return Console(file=StringIO(), width=100, color_system=None, highlight=False)  # as in a pipe: ⟦ ⟧ marks


def test_document_view_highlights_whole_words_and_merges_what_overlaps():
    from types import SimpleNamespace

    from kvcli.report import terminal as render

    doc = document_from_text("The GNOME desktop ran fine. Nothing else: x_y and 42 items.")
    t = doc.text
    g, d, n = t.index("GNOME"), t.index("desktop"), t.index("Nothing")
    # token pieces: "NO" and "ME" of GNOME (adjacent), "desk" and "top" of desktop (each widens to
    # the word, then they overlap), the "thin" of "Nothing" and the "4" of "42"
    spans = _spans_at(
        doc,
        [
            (g + 1, g + 3),
            (g + 3, g + 5),
            (d, d + 4),
            (d + 4, d + 7),
            (n + 2, n + 6),
            (t.index("42"), t.index("42") + 1),
        ],
    )
    console = _plain_console()
    render.document_view(console, SimpleNamespace(document=doc, spans=spans, score_kind=None, sources=None))
    out = console.file.getvalue()
    assert "The ⟦GNOME⟧ ⟦desktop⟧ ran fine. ⟦Nothing⟧ else: x_y and ⟦42⟧ items." in out
    assert not re.search(r"\w⟦\w|\w⟧\w", out)
    # the JSON keeps token offsets: the spans themselves are unchanged
    assert [s.text for s in spans] == ["NO", "ME", "desk", "top", "thin", "4"]


def test_kept_spans_list_shows_each_piece_of_text_once():
    from kvcli.report import terminal as render

    doc = document_from_text(" ".join(f"s{i:02d} alpha beta gamma." for i in range(60)))
    t = doc.text
    near = [t.index(f"s{i:02d}") for i in range(0, 30, 2)]  # kept spans ~40 characters apart
    far = t.index("s55")
    spans = _spans_at(doc, [(a, a + 3) for a in near] + [(far, far + 3)])
    console = _plain_console()
    render.selected_spans(console, spans, doc, n_kept=16, n_total=400)
    out = console.file.getvalue()
    rows = [line for line in out.splitlines() if line.lstrip().startswith("p.1")]
    assert len(rows) == 2  # the 15 close spans share one row; the far one has its own
    for i in range(60):  # nothing printed twice (the old view repeated the overlapping context ~20 times)
        assert out.count(f"s{i:02d}") <= 1, (i, out)
    assert "s00" in out and "s28" in out and "s55" in out and "s40" not in out
    console = _plain_console()
    render.selected_spans(console, spans, doc, n_kept=16, n_total=400, max_spans=1)
    assert "… 1 more span (use --json for all)" in console.file.getvalue()


def test_cli_show_selected_marks_whole_words(cli, model, pdf):
    code, out, err = cli(
        "inspect", pdf, QUESTION, "-c", "snapkv:budget=48", "--model", model, "--no-cache", "--show-selected"
    )
    assert code == 0, err
    assert "⟦" in out and not re.search(r"\w⟦\w|\w⟧\w", out)


def _cited(page: str) -> dict[int, str]:
    """The text of each outlined source in an HTML page, by rank (a source may be cut into pieces
    at a page or bucket anchor; the pieces are joined)."""
    main = page.split("<main>")[1].split("</main>")[0]
    main = re.sub(r'<span class="cite-n">\d+</span>', "", main)
    out: dict[int, str] = {}
    for n, inner in re.findall(
        r'<span class="cite"[^>]*title="source (\d+) of the answer">(.*?)</span>', main, flags=re.S
    ):
        out[int(n)] = out.get(int(n), "") + html.unescape(re.sub(r"<[^>]+>", "", inner))
    return out


def test_answer_sources_are_marked_apart_from_the_kept_text(cli, model, pdf, document, tmp_path):
    """inspect --answer: the JSON's sources as ask --json has them; the HTML outlines exactly their
    text (and still marks exactly the kept spans); --show-selected puts [n] ... [/n] around exactly
    their text; without --answer there are none."""
    page_file = tmp_path / "cited.html"
    args = ("inspect", pdf, QUESTION, "-c", "snapkv:budget=60", "--model", model, "--no-cache")
    code, out, err = cli(*args, "--answer", "--max-new-tokens", "6", "--json", "--html", page_file)
    assert code == 0, err
    record = json.loads(out)
    sources = record["sources"]
    assert sources, record.get("sources_note")
    for s in sources:
        assert set(s) == {"pages", "start", "end", "text", "score"}
        assert document.text[s["start"] : s["end"]] == s["text"]
        assert s["pages"] == [document.page_of(s["start"]), document.page_of(s["end"] - 1)]
    page = page_file.read_text(encoding="utf-8")
    assert _cited(page) == {i: s["text"] for i, s in enumerate(sources, 1)}
    assert "".join(_marks(page)) == "".join(s["text"] for s in record["spans"])
    assert all(f'href="#src-{i}"' in page and f'id="src-{i}"' in page for i in range(1, len(sources) + 1))

    code, out, err = cli(*args, "--answer", "--max-new-tokens", "6", "--show-selected")
    assert code == 0, err
    view = out.replace("⟦", "").replace("⟧", "")
    flat = " ".join(view.split())
    for i, s in enumerate(sources, 1):
        inner = re.search(rf"\[{i}\](.*?)\[/{i}\]", view, flags=re.S)
        assert inner is not None, i
        # the terminal folds long lines and draws a rule at each page start: compare the words
        assert " ".join(re.sub(r"─*\s*page \d+\s*─+", " ", inner.group(1)).split()) == " ".join(s["text"].split())
        assert f"[{i}] p. {s['pages'][0]}" in flat or f"[{i}] pp. {s['pages'][0]}-" in flat
    assert "sources:" in out

    code, out, err = cli(*args, "--json")
    assert code == 0 and "sources" not in json.loads(out)
