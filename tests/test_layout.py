"""The package's shape: no import cycle between kvcli's modules (module-level imports and those
inside functions alike), and every cache kind registered by importing kvcli.caches alone."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvcli"


def import_graph() -> dict[str, set[str]]:
    """module -> the kvcli modules it imports (``from .x import y`` counts ``x.y`` when y is a module)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    dep = full if full in modules else target
                    if dep in modules and dep != name:
                        graph[name].add(dep)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules and a.name != name)
    return {
        m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()
    }  # a module may import its own package


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = import_graph()
    assert graph["kvcli.cli.ask"] >= {"kvcli.api", "kvcli.cli.options"}  # the graph sees imports at all
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.e2e
def test_importing_caches_registers_every_layout():
    code = "import kvcli.caches as c; print(sorted(c.CACHE_TYPES))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["book", "kv", "kv+infllm", "lazyllm", "qkv", "ragged", "razor"]


def test_only_the_benchmarks_and_the_cli_import_the_benchmark_code():
    """kvcli.bench is `kvcli bench`: a method or a cache that needs a text or a helper of it gets
    that from a module both use (kvcli.texts holds the filler DuoAttention calibrates on)."""
    graph = import_graph()
    importers = {m for m, deps in graph.items() for d in deps if d == "kvcli.bench" or d.startswith("kvcli.bench.")}
    assert importers, "the graph sees kvcli.bench's importers at all"
    assert {m for m in importers if not m.startswith(("kvcli.bench", "kvcli.cli"))} == set()


def test_the_compressors_and_documents_import_nothing_above_them():
    """cli -> api -> answer -> compressors -> cite/store -> ...: a method gets the passages and
    sentences from kvcli.documents and its Selection from kvcli.compressors.selection, never from the
    answer or the sources above it (issue 49), and documents import neither."""
    graph = import_graph()
    assert graph["kvcli.compressors.pages"] >= {"kvcli.documents.units", "kvcli.compressors.selection"}
    above = ("kvcli.answer", "kvcli.cite", "kvcli.api", "kvcli.cli", "kvcli.report")
    low = {m: deps for m, deps in graph.items() if m.startswith(("kvcli.compressors", "kvcli.documents"))}
    assert {(m, d) for m, deps in low.items() for d in deps if d.startswith(above)} == set()


def test_retrieval_imports_only_documents_files_and_errors():
    """kvcli.retrieval (the pages' ranking, BM25 for the citations) sits below the compressors and
    the sources that use it: of kvcli it imports only documents, files (and file_facts: its model's
    id memoised), errors, the runtime's CPU facts (runtime.native: whether bfloat16 is native), the
    runtime's decoding loop and the prompt templates (runtime.decode, templates: Query2doc's passage,
    written by the model before the ranking) and itself."""
    graph = import_graph()
    assert (
        graph["kvcli.compressors.pages"] >= {"kvcli.retrieval"}
        and "kvcli.retrieval.bm25" in graph["kvcli.cite.sources"]
    )
    allowed = (
        "kvcli.retrieval",
        "kvcli.documents",
        "kvcli.files",
        "kvcli.file_facts",
        "kvcli.errors",
        "kvcli.runtime.native",
        "kvcli.runtime.decode",
        "kvcli.templates",
    )
    mine = {m: deps for m, deps in graph.items() if m.startswith("kvcli.retrieval")}
    assert len(mine) >= 4
    assert {
        (m, d) for m, deps in mine.items() for d in deps if d.startswith("kvcli") and not d.startswith(allowed)
    } == set()


def test_the_store_and_the_retrieval_share_the_vectors_folder_without_importing_each_other():
    """The store counts the page vectors (issue 49) by the folder name kvcli.files holds; it imports
    nothing above it (the retrieval, the compressors, the answer, the API, the CLI)."""
    graph = import_graph()
    store = {m: deps for m, deps in graph.items() if m.startswith("kvcli.store")}
    assert "kvcli.files" in graph["kvcli.store.kvstore"] and "kvcli.files" in graph["kvcli.retrieval.vectors"]
    above = ("kvcli.retrieval", "kvcli.compressors", "kvcli.answer", "kvcli.cite", "kvcli.api", "kvcli.cli")
    assert {(m, d) for m, deps in store.items() for d in deps if d.startswith(above)} == set()


def test_the_runtime_imports_nothing_of_the_caches():
    """caches -> runtime, never back: the caches attend with the runtime's kernels, RoPE and
    buffers (kvcli.runtime.buffers) and return its LayerView; the engine's passes make their default
    cache through the model (LoadedModel.new_cache), so the runtime imports only itself, errors and
    notices (two leaves: a step that cannot be captured as a CUDA graph says so and goes on)."""
    graph = import_graph()
    assert {"kvcli.runtime.kernels", "kvcli.runtime.attention"} <= graph["kvcli.caches.book"]
    assert "kvcli.runtime.buffers" in graph["kvcli.runtime.kernels"]
    runtime = {m: deps for m, deps in graph.items() if m.startswith("kvcli.runtime")}
    assert len(runtime) >= 10
    assert {
        (m, d)
        for m, deps in runtime.items()
        for d in deps
        if not d.startswith(("kvcli.runtime", "kvcli.errors", "kvcli.notices"))
    } == set()


def test_the_store_names_no_cache_class():
    """The store stores entries, not classes: a layout says how its entry is read back (loaded, or
    opened in place: CacheBase.opens_in_place / open_entry) and how it moves to an accelerator
    (CacheBase.for_device); kvcli/store names none of them."""
    import kvcli.caches as caches

    names = {name for name in caches.__all__ if isinstance(getattr(caches, name), type)} - {"CacheBase"}
    assert {"KVCache", "BookCache", "QuantKVCache"} <= names
    store = {p.name: p.read_text() for p in (PACKAGE / "store").glob("*.py")}
    assert {(file, name) for file, text in store.items() for name in names if re.search(rf"\b{name}\b", text)} == set()


def test_every_module_is_under_600_lines():
    """One idea per module: none grows past 600 lines (split one along a real seam, not for count)."""
    lengths = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(lengths) > 100
    assert {path: n for path, n in lengths.items() if n >= 600} == {}


def test_no_private_name_crosses_a_module():
    """No kvcli module imports a ``_private`` name of another module or reads one off it
    (``files._X``): what another module needs is public."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("kvcli")):
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private:
                        found.append((name, node.lineno, alias.name))
                    else:
                        modules.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append((name, node.lineno, f"{node.value.id}.{node.attr}"))
    assert found == []


def test_the_model_sits_above_the_caches_and_the_runtime():
    """model -> caches -> runtime (docs/design.md): the loaded model makes its default cache
    (LoadedModel.new_cache) and carries the runtime's windows; neither the caches, the runtime nor
    the store import the model, and the model imports nothing of the rooms above it."""
    graph = import_graph()
    assert "kvcli.runtime.windows" in graph["kvcli.model.facts"]
    below = {m: deps for m, deps in graph.items() if m.startswith(("kvcli.caches", "kvcli.runtime", "kvcli.store"))}
    assert {(m, d) for m, deps in below.items() for d in deps if d.startswith("kvcli.model")} == set()
    above = ("kvcli.answer", "kvcli.compressors", "kvcli.cite", "kvcli.retrieval", "kvcli.documents", "kvcli.api")
    above += ("kvcli.cli", "kvcli.report", "kvcli.bench", "kvcli.batch", "kvcli.store")
    model = {m: deps for m, deps in graph.items() if m.startswith("kvcli.model")}
    assert len(model) >= 10
    assert {(m, d) for m, deps in model.items() for d in deps if d.startswith(above)} == set()
