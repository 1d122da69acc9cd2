"""The docs are written for a reader who was not there, every relative link resolves, and facts the
code also states (the default method, the --json fields) say the same in both places."""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path

import pytest

from kvcli.answer import policy
from kvcli.batch import error_record
from kvcli.cli import reference
from kvcli.compressors import REGISTRY
from kvcli.compressors.selection import Span
from tests.helpers.documented import json_fields

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The fragments GitHub gives the page's headings (lowercase, punctuation dropped, spaces to -)."""
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path) if path else page
        assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
        if fragment and resolved.suffix == ".md":
            assert fragment in _anchors(resolved), f"{page.relative_to(ROOT)}: {target}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_session_or_issue_numbers(page):
    """The reader was not at the sessions or in the tracker: say what changed, or name a commit."""
    text = page.read_text(encoding="utf-8")
    for pattern in (r"\b[Ss]ession[ -]?\d", r"\b[Ii]ssue[ -]#?\d", r"-s\d+\b"):
        found = re.findall(rf".{{0,30}}{pattern}.{{0,30}}", text)
        assert not found, f"{page.relative_to(ROOT)}: {found}"


def test_the_docs_index_names_every_page():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "index.md":
            assert f"]({page.name})" in index, page.name


def test_methods_md_states_the_default_policy_as_the_help_does():
    """`kvcli ask --help` shows policy.DESCRIPTION for -c auto; docs/methods.md says the same words."""
    methods = " ".join((ROOT / "docs" / "methods.md").read_text(encoding="utf-8").split())
    assert policy.DESCRIPTION in methods


def test_methods_md_table_is_the_one_the_method_classes_declare():
    """docs/methods.md's methods table is what ``python -m kvcli.cli.reference`` writes from each
    registered method's class (its row's text, its knobs' defaults), as docs/cli.md is from --help."""
    page = reference.METHODS_PAGE.read_text(encoding="utf-8")
    assert page.count(reference.METHODS_BEGIN) == page.count(reference.METHODS_END) == 1
    rendered = reference.methods_page(page)
    if rendered != page:
        diff = "".join(
            difflib.unified_diff(page.splitlines(True), rendered.splitlines(True), "docs/methods.md", "the classes now")
        )
        pytest.fail(f"docs/methods.md's methods table is out of date: run `{reference.COMMAND}` and commit it\n{diff}")
    for name in REGISTRY:  # one row per method, named by its spec
        assert f"| `{name}" in rendered.split(reference.METHODS_END)[0], name


def test_the_catalog_is_what_the_method_classes_say():
    """kvcli/methods.json (what ``kvcli compressors`` and ``--kv-bits``'s help read, no method
    imported) is what ``python -m kvcli.cli.reference`` writes from every registered class."""
    from kvcli import method_catalog as catalog

    current = reference.CATALOG.read_text(encoding="utf-8")
    rendered = reference.catalog_data()
    if rendered != current:
        diff = "".join(difflib.unified_diff(current.splitlines(True), rendered.splitlines(True), "methods.json", "now"))
        pytest.fail(f"kvcli/methods.json is out of date: run `{reference.COMMAND}` and commit it\n{diff}")
    assert list(catalog.stored()) == list(REGISTRY)
    assert {name: catalog.describe(cls) for name, cls in REGISTRY.items()} == catalog.stored()


def test_the_other_records_fields_are_documented():
    """The fields some records add (docs/usage.md's second table): an error record's, a kept span's."""
    every, some = json_fields()
    record = error_record("a.pdf", "Who?", ValueError("x"))
    assert set(record) <= set(every) | set(some), set(record) - set(every) - set(some)
    spans = some["selected_spans"]
    for field in dataclasses.fields(Span):
        assert f"`{field.name}`" in spans, field.name
    assert {"peak_mem_reserved_mb", "question", "worker"} <= set(some)


def test_the_readme_cpu_table_is_the_one_docs_cpu_md_measured():
    """The README's CPU table repeats three rows of docs/cpu.md's latest peers run: every figure of
    each README row is in the matching docs/cpu.md row."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8").split("## On a CPU", 1)[1].split("\n## ", 1)[0]
    cpu = (ROOT / "docs" / "cpu.md").read_text(encoding="utf-8").split("### The default and 4bit", 1)[1]
    rows = {
        "kvcli 8bit (default)": "| **kvcli (8bit, default)** |",
        "kvcli 4bit": "| kvcli --quant 4 |",
        "llama.cpp, same GGUF": "| llama.cpp 0.3.36 (Q4_1) |",
    }
    for readme_label, cpu_label in rows.items():
        figures = re.findall(r"[\d,]+\.?\d*", readme.split(f"| {readme_label} |", 1)[1].split("\n", 1)[0])
        cpu_row = cpu.split(cpu_label, 1)[1].split("\n", 1)[0]
        assert figures and all(f in cpu_row for f in figures), (readme_label, figures, cpu_row)


# --- no machine's paths in the committed benchmark results (issue 49) ---------------------------------

# an absolute path of the machine that ran a benchmark: a temporary, home or work folder (not
# /Users/..., which the manuals the benchmarks read quote; a path inside a URL or a word,
# "https://x.org/home/", is not one)
MACHINE_PATH = re.compile(r"(?<![\w.~/:-])/(?:tmp|work|home|root|var/folders)/")


def _bench_files() -> list[Path]:
    """Every text file under docs/bench (a file with a NUL byte, a PNG or .npy, is not text)."""
    return sorted(p for p in (ROOT / "docs" / "bench").rglob("*") if p.is_file() and b"\0" not in p.read_bytes())


def test_no_benchmark_result_holds_a_path_of_the_machine_that_ran_it():
    """docs/bench names files repository-relative or under a placeholder (``<tmp>/book.txt``):
    benchmarks/portable.py, which the benchmark scripts write their paths through."""
    files = _bench_files()
    assert len(files) > 100 and any(p.suffix == ".json" for p in files)
    found = {
        str(p.relative_to(ROOT)): m.group(0)
        for p in files
        if (m := MACHINE_PATH.search(p.read_text(encoding="utf-8", errors="replace"))) is not None
    }
    assert found == {}, f"absolute machine paths (rewrite them: python benchmarks/portable.py FILE): {found}"


def test_portable_paths_are_relative_or_a_placeholder(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("portable", ROOT / "benchmarks" / "portable.py")
    portable = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(portable)
    assert portable.portable(ROOT / "kvcli") == "kvcli"
    assert portable.portable("/elsewhere/checkout/benchmarks/out/x", ("/elsewhere/checkout",)) == "benchmarks/out/x"
    assert portable.portable("/tmp/tmpd6ppuwje/book.txt") == "<tmp>/book.txt"
    assert portable.portable("/home/someone/pdfs/R-FAQ.pdf") == "<home>/R-FAQ.pdf"
    assert portable.portable("/usr/sbin/sendmail") == "/usr/sbin/sendmail"  # the same on every machine
    assert portable.portable("docs/bench/cite/x.json") == "docs/bench/cite/x.json"
    command = "python benchmarks/cite.py books --per-head /tmp/cite.npz --out=/home/u/q/x.json --ratio 3/4"
    assert (
        portable.scrub(command)
        == "python benchmarks/cite.py books --per-head <tmp>/cite.npz --out=<home>/x.json --ratio 3/4"
    )
    assert MACHINE_PATH.search(command) and not MACHINE_PATH.search(portable.scrub(command))
    assert not MACHINE_PATH.search("see https://example.org/home/page and tokens/tmp/x")


def test_adding_a_method_names_what_a_class_declares():
    """docs/design.md's recipe names every class attribute a method must declare (the ones
    Compressor announces without a value) and no table to edit by hand: the tests' COMPRESSING
    and docs/methods.md's table are read off the registry."""
    from typing import ClassVar, get_origin

    from kvcli.compressors.base import Compressor

    text = " ".join((ROOT / "docs" / "design.md").read_text(encoding="utf-8").split("Adding a method:", 1)[1].split())
    declared = [
        name
        for name, kind in Compressor.__annotations__.items()
        if (get_origin(kind) is ClassVar or str(kind).startswith("ClassVar")) and not hasattr(Compressor, name)
    ]
    assert {"keep_all", "short_document_spec", "title", "acts"} <= set(declared)
    for name in declared:
        assert f"`{name}`" in text, name
    assert "spec for it in `COMPRESSING`" not in text


def test_the_readme_says_gemfilters_stored_layers_stay_16_bit():
    """GemFilter's prefix state (its filter layers, what the store keeps) names no KV bits: built
    and stored in 16 bits whatever --kv-bits says; the README says so."""
    import dataclasses
    from types import SimpleNamespace

    from kvcli.compressors import parse_one

    gemfilter, full = parse_one("gemfilter:layer=13"), parse_one("full")
    for method in (gemfilter, full):
        method.runtime = dataclasses.replace(method.runtime, kv_bits=8)
    lm = SimpleNamespace(n_layers=30)
    assert full.prefix_state(lm)["kv_bits"] == 8  # full attention's entry: in the bits asked
    assert gemfilter.prefix_state(lm).get("kv_bits", 16) == 16
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "GemFilter's cached filter layers stay 16-bit" in readme


def test_the_readme_tells_of_the_gpu_run():
    """An H200 ran the GPU paths on 2026-11-26 and 2026-11-29: the README says so, and that decoding's
    CUDA graph is not measured yet."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "No real GPU has run" not in readme
    assert "An H200 ran them on 2026-11-26 and 2026-11-29" in readme and "not yet measured" in readme
