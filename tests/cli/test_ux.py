"""What a user sees besides answers: ``kvcli --version``, layer numbers (0-based everywhere), the
``cache ls`` table on a terminal (cells never cut mid-word)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from kvcli.report import terminal as render
from kvcli.store import Entry

REPO = Path(__file__).resolve().parents[2]


# --- --version -------------------------------------------------------------------------------------


def test_version_prints_the_installed_versions_and_exits_0(cli):
    from importlib import metadata

    code, out, err = cli("--version")
    assert code == 0 and err == ""
    assert (
        out
        == f"kvcli {metadata.version('kvcli')} (torch {metadata.version('torch')}, transformers {metadata.version('transformers')}, Python {sys.version.split()[0]})\n"
    )


@pytest.mark.e2e
def test_version_through_the_real_entry_point(tmp_path):
    # eager: answered before any command runs, even with a cache folder that cannot exist
    env = {"PYTHONPATH": str(REPO), "KVCLI_CACHE_DIR": str(tmp_path / "file" / "x"), "PATH": "/usr/bin:/bin"}
    (tmp_path / "file").write_text("not a folder")
    proc = subprocess.run(
        [sys.executable, "-m", "kvcli", "--version"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    assert re.fullmatch(r"kvcli \S+ \(torch \S+, transformers \S+, Python \S+\)\n", proc.stdout), proc.stdout


# --- layer numbers: 0-based, as kvcli heads, inspect --layers and gemfilter:layer= -----------------


def test_inspect_per_layer_table_and_json_number_layers_from_0(cli, model, tmp_path):
    doc = tmp_path / "log.txt"
    doc.write_text(" ".join(f"Entry {i}: the keeper logged {i * 7 % 13} ships." for i in range(40)))
    code, out, err = cli(
        "inspect", doc, "How many ships?", "-c", "snapkv:budget=48", "-m", model, "--no-cache", "--json"
    )
    assert code == 0, err
    assert [row["layer"] for row in json.loads(out)["layers"]] == [0, 1, 2, 3]
    code, out, err = cli("inspect", doc, "How many ships?", "-c", "snapkv:budget=48", "-m", model, "--no-cache")
    assert code == 0, err
    table = out.split("kept per layer", 1)[1]
    assert "0-based" in table.splitlines()[0]
    rows = [line.split()[0] for line in table.splitlines()[1:] if re.match(r"\s*\d+\s+\d", line)]
    assert rows == ["0", "1", "2", "3"], table


# --- cache ls on a terminal ------------------------------------------------------------------------

LONG = {
    "document": "/data/quarterly-financial-statements-of-the-northern-lighthouse-board.pdf",
    "model_name": "/models/smollm2-135m-instruct",
    "method": "gemfilter:layer=15,k=256",
}


def _entries() -> list[Entry]:
    now = time.time()
    out = []
    for i, (doc, model) in enumerate(
        (
            (LONG["document"], LONG["model_name"]),
            ("/tmp/a.txt", "HuggingFaceTB/SmolLM2-1.7B-Instruct-long-context-variant"),
        )
    ):
        meta = {
            "document": doc,
            "model_name": model,
            "method": LONG["method"],
            "fields": {"state": {"kind": "kv", "layers": 16}, "n_tokens": 123456},
        }
        out.append(Entry(Path(f"/c/kv/{i:064x}.safetensors"), 1234567890, now - i, meta))
    return out


def _cells() -> set[str]:
    """Every whole cell value the table may show (each at most shortened with an ellipsis)."""
    cells = set()
    for e in _entries():
        j = e.to_json()
        cells |= {
            j["key"][:12],
            Path(j["document"]).name,
            Path(j["model"]).name,
            j["method"].split(":")[0],
            "kv ×16 layers",
            "123,456",
            render.human_bytes(e.size),
        }
        cells |= {j["last_use"][5:16].replace("T", " ")}
    return cells


@pytest.mark.parametrize("width", [60, 80, 100, 120, 160, 200])
def test_cache_table_never_cuts_a_cell_mid_word(width):
    console = Console(file=StringIO(), width=width, force_terminal=True, color_system=None)
    render.cache_table(console, _entries())
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 1 + 2 + 1  # header, one line per entry, totals
    words = {w for cell in _cells() for w in cell.split()}
    for line in lines[1:3]:
        for token in line.split():
            if token.endswith("…"):  # shortened: the start of a cell, never a piece from its middle
                assert any(
                    c.startswith(token[:-1]) or any(w.startswith(token[:-1]) for w in c.split()) for c in _cells()
                ), token
            else:
                assert token in words, (token, line)
    if width >= 160:  # room enough: whole names
        assert "smollm2-135m-instruct" in lines[1]
