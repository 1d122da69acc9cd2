"""docs/cli.md, the command-line reference, written from the live ``--help`` of every command.

    python -m kvcli.cli.reference             # rewrites docs/cli.md (run from a source checkout)
    python -m kvcli.cli.reference --check     # exit 1 when docs/cli.md is not what --help prints

Every command and group is found by walking the Typer app (a new sub-command is picked up by
itself) and rendered at 80 columns, as in a pipe. ``tests/cli/test_help.py`` fails when the page
is out of date and names the command above. The page records the Typer minor version it was
rendered with: another minor version lays help out its own way.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

WIDTH = 80
PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
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


def _anchor(heading: str) -> str:
    """The fragment GitHub gives a heading of words and spaces."""
    return heading.lower().replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--check"]):
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    page = render()
    if args == ["--check"]:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
