"""``--help`` of every kvcli command, compared with the checked-in ``tests/cli/help_snapshot.txt``.

The help is part of the interface: a change to a command, an option or its help text shows up
here as a diff to review. After changing help on purpose, regenerate the snapshot and commit it
with the change:

    KVCLI_UPDATE_HELP=1 python -m pytest tests/cli/test_help.py     # or: python tests/cli/test_help.py

Every command is found by walking the Typer app (a new sub-command is picked up by itself), and
rendered at 80 columns, as in a pipe. The snapshot records the Typer version it was made with;
another Typer minor version renders help its own way, so the comparison is skipped there (the
structural checks below still run).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import sys
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).with_name("help_snapshot.txt")
UPDATE_ENV = "KVCLI_UPDATE_HELP"
WIDTH = 80


def typer_version() -> str:
    import typer

    return ".".join(typer.__version__.split(".")[:2])


def command_paths() -> list[tuple[str, ...]]:
    """Every command and group of the app, depth first, in the order ``--help`` lists them."""
    import typer.main

    from kvcli.cli import app

    paths: list[tuple[str, ...]] = []

    def walk(command, path: tuple[str, ...]) -> None:
        paths.append(path)
        if hasattr(command, "list_commands"):
            for name in command.list_commands(None):
                walk(command.get_command(None, name), (*path, name))

    walk(typer.main.get_command(app), ())
    return paths


def help_text(path: tuple[str, ...]) -> str:
    """What ``kvcli PATH --help`` prints at 80 columns (stdout and stderr; it must exit 0)."""
    from kvcli.cli import main

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
    assert code == 0, (path, out.getvalue())
    return out.getvalue()


def render_all() -> str:
    parts = [f"# kvcli --help of every command (typer {typer_version()}); regenerate: {UPDATE_ENV}=1 python -m pytest tests/cli/test_help.py\n"]
    for path in command_paths():
        parts.append(f"\n$ kvcli {' '.join([*path, '--help'])}\n{help_text(path)}")
    return "".join(parts)


def write_snapshot() -> None:
    SNAPSHOT.write_text(render_all(), encoding="utf-8")


@pytest.fixture(scope="module")
def rendered() -> str:
    return render_all()


def test_help_matches_the_snapshot(rendered):
    if os.environ.get(UPDATE_ENV):
        SNAPSHOT.write_text(rendered, encoding="utf-8")
        return
    assert SNAPSHOT.exists(), f"no {SNAPSHOT.name}: create it with {UPDATE_ENV}=1 python -m pytest tests/cli/test_help.py"
    expected = SNAPSHOT.read_text(encoding="utf-8")
    made_with = re.search(r"\(typer (\d+\.\d+)\)", expected.splitlines()[0])
    if made_with and made_with.group(1) != typer_version():
        if os.environ.get("CI"):  # CI installs the test extra, which pins typer's minor version
            pytest.fail(f"{SNAPSHOT.name} was made with typer {made_with.group(1)}, CI runs typer {typer_version()}: "
                        "the test extra pins the minor version the snapshot was made with; regenerate it or fix the pin")
        pytest.skip(f"{SNAPSHOT.name} was made with typer {made_with.group(1)}; typer {typer_version()} renders help differently")
    if rendered != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), rendered.splitlines(True), SNAPSHOT.name, "kvcli --help now"))
        pytest.fail(f"--help changed; if that is intended, run {UPDATE_ENV}=1 python -m pytest tests/cli/test_help.py and commit the snapshot\n{diff}")


def test_help_reads_like_a_well_kept_cli(rendered):
    sections = rendered.split("\n$ kvcli ")[1:]
    assert {s.split("--help", 1)[0].strip() for s in sections} >= {"", "ask", "inspect", "cache", "cache rm", "bench", "bench speed"}
    assert "<bool>" not in rendered and "<str>" not in rendered.split("$ kvcli bench")[0]  # no type placeholders (bench's own help aside)
    assert "{" not in "".join(line for line in rendered.splitlines() if line.startswith(("Usage:", "   or:")))
    for line in rendered.splitlines()[1:]:  # at most 80 columns, but an example command is never broken
        assert len(line) <= WIDTH or line.lstrip().startswith("kvcli "), line
    ask = next(s for s in sections if s.startswith("ask --help"))
    assert "Usage: kvcli ask [OPTIONS] DOCUMENT... QUESTION\n   or: kvcli ask [OPTIONS] DOCUMENT... --questions FILE\n" in ask
    examples = [line for line in ask.splitlines() if line.strip().startswith(("kvcli ask", "cat notes.txt"))]
    assert len(examples) == 5 and len({len(line) - len(line.lstrip()) for line in examples}) == 1  # one indentation
    # paragraphs flow: no line of prose broken mid-sentence by the terminal width
    speed = next(s for s in sections if s.startswith("bench speed --help"))
    assert "generates exactly --new-tokens tokens" in " ".join(speed.split())
    assert re.search(r"^      kvcli bench speed --out bench/ .* --lengths 1024,2048,4096,8000$", speed, re.M)


if __name__ == "__main__":
    write_snapshot()
    print(f"wrote {SNAPSHOT}")
