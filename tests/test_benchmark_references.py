"""The benchmarks reach into kvcli by dotted names (``kvcli.answer.citing.cite = keep`` to record
what a run cited) and import from it: each such name still exists, so a moved function breaks this test, not a
measurement hours later."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def dotted_references(path: Path) -> set[str]:
    """Every ``kvcli.a.b.c`` attribute chain in the file's code (the longest of each chain) and
    every name imported ``from kvcli.a import b``."""
    found, inner = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kvcli":
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        if not isinstance(node, ast.Attribute):
            continue
        parts, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            inner.add(id(value))
            parts.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id == "kvcli" and id(node) not in inner:
            found.add(".".join(["kvcli", *reversed(parts)]))
    return found


def resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


REFERENCES = sorted({(p.name, ref) for p in BENCHMARKS.rglob("*.py") for ref in dotted_references(p)})


def test_the_benchmarks_reach_into_kvcli_somewhere():
    assert any(ref.startswith("kvcli.answer.citing") for _, ref in REFERENCES)


@pytest.mark.parametrize(("script", "name"), REFERENCES)
def test_each_name_a_benchmark_reaches_exists(script, name):
    assert resolves(name), f"benchmarks/{script}: {name} no longer exists"


def test_a_moved_name_is_caught():
    assert not resolves("kvcli.api.cite")  # where it was before it moved to kvcli.answer.citing
    assert resolves("kvcli.answer.citing.cite")
