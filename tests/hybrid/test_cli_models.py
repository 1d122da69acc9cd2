"""``kvcli models`` lists both embedded models with their windows; ``-m gemma3-270m`` without its
packages is one line with the exact pip install line; a missing GGUF path is one line."""

from __future__ import annotations

import importlib.util
import json

from kvcli.model import ggufs
from tests.helpers.cli_runner import run_cli


def test_models_lists_both_embedded_models_with_their_windows(capsys, monkeypatch):
    code, out, err = run_cli(["models"], capsys, monkeypatch)
    assert code == 0 and not err
    assert "smollm2-135m-instruct" in out and "8,192 tokens" in out
    assert "gemma3-270m" in out and "32,768 tokens" in out and "512" in out
    code, out, _ = run_cli(["models", "--json"], capsys, monkeypatch)
    data = json.loads(out)
    assert [m["name"] for m in data["embedded"]] == ["smollm2-135m-instruct", "gemma3-270m"]
    assert "gemma3" in data["gguf_architectures"]


def test_gemma_without_its_packages_names_the_pip_line(capsys, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a)
    )
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted seven gulls.")
    code, out, err = run_cli(["ask", doc, "Who?", "-m", "gemma3-270m", "--cache-dir", tmp_path], capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code != 0 and not out and len(lines) == 1 and lines[0].startswith("kvcli: error:")
    assert ggufs.GEMMA_INSTALL in lines[0]


def test_a_missing_gguf_path_is_one_line(capsys, monkeypatch, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted seven gulls.")
    code, out, err = run_cli(["ask", doc, "Who?", "-m", tmp_path / "nope.gguf"], capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code != 0 and not out and len(lines) == 1 and lines[0].startswith("kvcli: error:")
