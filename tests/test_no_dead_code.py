"""No dead code: every top-level function of kvcli/ is called (or named) somewhere in kvcli/ or
benchmarks/ besides its own definition; one that only its tests use is dead, and goes with its test.
Decorated functions (commands, callbacks) are called by what registers them."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# used by their tests alone, left to their owners: a reference the tests compare with
# (attribution.step_weights), what made kvcli/heads' files (attribution.save_heads), a row's bytes
# the tests count with (quant.row_bytes)
KNOWN = {"step_weights", "save_heads", "row_bytes"}


def test_every_function_has_a_caller_outside_the_tests():
    files = sorted((ROOT / "kvcli").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    texts = {path: path.read_text(encoding="utf-8") for path in files}
    names = Counter(word for text in texts.values() for word in re.findall(r"\w+", text))
    dead = []
    for path, text in texts.items():
        if path.is_relative_to(ROOT / "benchmarks"):
            continue
        for node in ast.parse(text).body:
            if not isinstance(node, ast.FunctionDef) or node.decorator_list or node.name in KNOWN:
                continue
            if names[node.name] <= 1 and not node.name.startswith("__"):
                dead.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert dead == [], "no caller outside the tests (delete it, and a test of it alone):\n" + "\n".join(dead)
