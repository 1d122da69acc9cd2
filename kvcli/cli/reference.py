"""docs/cli.md, the command-line reference, written from the live ``--help`` of every command, and
the methods table of docs/methods.md, written from the method classes.

    python -m kvcli.cli.reference             # rewrites both (run from a source checkout)
    python -m kvcli.cli.reference --check     # exit 1 when either is not what the code says

Every command and group is found by walking the Typer app (a new sub-command is picked up by
itself) and rendered at 80 columns, as in a pipe. ``tests/cli/test_help.py`` fails when the page
is out of date and names the command above. The page records the Typer minor version it was
rendered with: another minor version lays help out its own way.

The methods table (between its markers in docs/methods.md) has one row per registered method, in
:data:`kvcli.compressors.REGISTRY`'s order: what the class declares for it (``title``, ``acts``,
``positions``, ``disk_cache``, ``spec_note``; see :class:`kvcli.compressors.base.Compressor`) and
its spec with its knobs' defaults (``table_knobs``); ``tests/test_docs.py`` fails when it is out of date.
So it does when kvcli/methods.json, what ``kvcli compressors`` and the help read of each
method without importing the methods (nor PyTorch), is not what the classes say (:func:`catalog_data`).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

WIDTH = 80
PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
METHODS_PAGE = PAGE.with_name("methods.md")
METHODS_BEGIN = (
    "<!-- The methods table: written by `python -m kvcli.cli.reference` from each method's class\n"
    "     (kvcli/compressors/). Do not edit: change the class and run it. -->"
)
METHODS_END = "<!-- end of the methods table -->"
CATALOG = PAGE.parents[1] / "kvcli" / "methods.json"  # what help says of each method
COMMAND = "python -m kvcli.cli.reference"


def typer_version() -> str:
    from importlib.metadata import version

    return ".".join(version("typer").split(".")[:2])


def command_paths() -> list[tuple[str, ...]]:
    """Every command and group of the app, depth first, in the order ``--help`` lists them."""
    import typer.main
    from typer.core import TyperGroup

    from . import app

    paths: list[tuple[str, ...]] = []

    def walk(command, path: tuple[str, ...]) -> None:
        paths.append(path)
        if isinstance(command, TyperGroup):
            for name in command.list_commands(None):
                walk(command.get_command(None, name), (*path, name))

    walk(typer.main.get_command(app), ())
    return paths


def help_text(path: tuple[str, ...]) -> str:
    """What ``kvcli PATH --help`` prints at 80 columns (stdout and stderr; it must exit 0)."""
    from . import main

    out, argv, columns = io.StringIO(), sys.argv, os.environ.get("COLUMNS")
    sys.argv, os.environ["COLUMNS"] = ["kvcli", *path, "--help"], str(WIDTH)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code or 0
    finally:
        sys.argv = argv
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    if code != 0:
        raise RuntimeError(f"kvcli {' '.join(path)} --help exited {code}:\n{out.getvalue()}")
    return out.getvalue()


def render() -> str:
    """The page: a contents list, then each command's ``--help`` verbatim in a code block."""
    paths = command_paths()
    names = [" ".join(("kvcli", *path)) for path in paths]
    lines = [
        "# Command-line reference",
        "",
        f"<!-- Written by `{COMMAND}` from each command's --help (typer {typer_version()}). Do not edit:",
        f"     change the help text in kvcli/cli/ and run `{COMMAND}`. -->",
        "",
        "Every kvcli command's `--help`, as it prints at 80 columns. The [README](../README.md) is the",
        "guide; [usage.md](usage.md) has every `--json` field and error.",
        "",
    ]
    lines += [f"- [`{name}`](#{_anchor(name)})" for name in names]
    for name, path in zip(names, paths):
        lines += ["", f"## {name}", "", "```text", help_text(path).rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


def method_spec(cls) -> str:
    """A methods-table row's spec: the method's name and its ``table_knobs`` with their defaults, as
    ``kvcli compressors NAME`` shows them ("..." kept where the row elides the others)."""
    from ..compressors.base import knob_text

    defaults = {f.name: knob_text(f.default) for f in cls.knobs()}
    shown = list(defaults) if cls.table_knobs is None else cls.table_knobs
    unknown = [k for k in shown if k != "..." and k not in defaults]
    if unknown:
        raise ValueError(f"{cls.name}: table_knobs names no knob {unknown}; knobs: {', '.join(defaults)}")
    knobs = ",".join(k if k == "..." else f"{k}={defaults[k]}" for k in shown)
    return cls.name + (":" + knobs if knobs else "")


def methods_table() -> str:
    """The methods table of docs/methods.md, its markers included: one row per registered method."""
    from ..compressors import REGISTRY

    lines = [
        METHODS_BEGIN,
        "",
        "| method | spec | acts | positions of kept tokens | disk cache keeps |",
        "|---|---|---|---|---|",
    ]
    for cls in REGISTRY.values():
        missing = [a for a in ("title", "acts", "positions", "disk_cache") if a not in vars(cls)]
        if missing:
            raise TypeError(f"{cls.__name__} ({cls.name}) declares no {', '.join(missing)} for the methods table")
        spec = f"`{method_spec(cls)}`" + (f" {cls.spec_note}" if cls.spec_note else "")
        lines.append(f"| {cls.title} | {spec} | {cls.acts} | {cls.positions} | {cls.disk_cache} |")
    return "\n".join([*lines, "", METHODS_END])


def methods_page(current: str) -> str:
    """docs/methods.md ``current`` with the table between its markers written anew."""
    start, end = current.find(METHODS_BEGIN), current.find(METHODS_END)
    if start < 0 or end < start:
        raise ValueError(f"{METHODS_PAGE} has no methods-table markers ({METHODS_BEGIN!r} ... {METHODS_END!r})")
    return current[:start] + methods_table() + current[end + len(METHODS_END) :]


def catalog_data() -> str:
    """kvcli/methods.json written from the method classes: every registered method, in order."""
    from ..compressors import REGISTRY
    from ..method_catalog import as_data, describe

    return as_data({name: describe(cls) for name, cls in REGISTRY.items()})


def _anchor(heading: str) -> str:
    """The fragment GitHub gives a heading of words and spaces."""
    return heading.lower().replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--check"]):
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    pages = {
        PAGE: render(),
        METHODS_PAGE: methods_page(METHODS_PAGE.read_text(encoding="utf-8")),
        CATALOG: catalog_data(),
    }
    if args == ["--check"]:
        stale = [
            path for path, page in pages.items() if (path.read_text(encoding="utf-8") if path.exists() else "") != page
        ]
        for path in stale:
            print(f"{path} is out of date: run `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    for path, page in pages.items():
        path.write_text(page, encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
