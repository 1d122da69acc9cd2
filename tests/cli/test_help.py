"""``--help`` of every kvcli command: docs/cli.md is what it prints, and it reads like a kept CLI.

docs/cli.md is written from the live help by ``python -m kvcli.cli.reference``; a change to a
command, an option or its help text makes the page out of date and the first test below says the
one command that rewrites it. The page records the Typer minor version it was rendered with;
another minor version lays help out its own way, so the comparison is skipped there (the checks
of the help itself still run).
"""

from __future__ import annotations

import difflib
import os
import re

import pytest
import typer.main
from typer.core import TyperArgument, TyperGroup, TyperOption

from kvcli.cli import app, reference
from tests.helpers.cli_runner import heavy_imports


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """``kvcli PATH --help`` of every command, by path ("" for the root, "cache rm", ...)."""
    return {" ".join(path): reference.help_text(path) for path in reference.command_paths()}


def test_docs_cli_md_is_the_live_help():
    page = reference.PAGE.read_text(encoding="utf-8") if reference.PAGE.exists() else ""
    made_with = re.search(r"\(typer (\d+\.\d+)\)", page)
    if made_with and made_with.group(1) != reference.typer_version():
        if os.environ.get("CI"):  # CI installs the test extra, which pins typer's minor version
            pytest.fail(
                f"docs/cli.md was rendered with typer {made_with.group(1)}, CI runs typer "
                f"{reference.typer_version()}: the test extra pins the minor version; fix the pin "
                f"or run `{reference.COMMAND}`"
            )
        pytest.skip(
            f"docs/cli.md was rendered with typer {made_with.group(1)}; typer "
            f"{reference.typer_version()} lays help out differently"
        )
    rendered = reference.render()
    if rendered != page:
        diff = "".join(
            difflib.unified_diff(page.splitlines(True), rendered.splitlines(True), "docs/cli.md", "kvcli --help now")
        )
        pytest.fail(f"docs/cli.md is out of date: run `{reference.COMMAND}` and commit it\n{diff}")


def test_the_reference_page_lists_every_command(helps):
    page = reference.PAGE.read_text(encoding="utf-8")
    for path in helps:
        assert f"\n## {' '.join(('kvcli', path)).strip()}\n" in page, path


def test_every_option_and_argument_has_help():
    def walk(command, path: str) -> None:
        for param in command.params:
            if isinstance(param, (TyperOption, TyperArgument)) and not param.hidden:
                assert (param.help or "").strip(), f"kvcli {path}: {param.name} has no help"
        if isinstance(command, TyperGroup):
            for name in command.list_commands(None):
                walk(command.get_command(None, name), f"{path} {name}".strip())
        else:
            assert (command.help or command.short_help or "").strip(), f"kvcli {path} has no help"

    walk(typer.main.get_command(app), "")


def test_help_reads_like_a_well_kept_cli(helps):
    assert set(helps) >= {"", "ask", "inspect", "cache", "cache rm", "bench", "bench speed"}
    everything = "".join(helps.values())
    assert "<bool>" not in everything  # no type placeholders
    assert "<str>" not in "".join(text for path, text in helps.items() if not path.startswith("bench"))
    usage = [line for text in helps.values() for line in text.splitlines() if line.startswith(("Usage:", "   or:"))]
    assert usage and "{" not in "".join(usage)
    for path, text in helps.items():  # at most 80 columns, but an example command is never broken
        for line in text.splitlines():
            assert len(line) <= reference.WIDTH or line.lstrip().startswith("kvcli "), (path, line)
    ask = helps["ask"]
    usage_lines = (
        "Usage: kvcli ask [OPTIONS] DOCUMENT... QUESTION\n   or: kvcli ask [OPTIONS] DOCUMENT... --questions FILE\n"
    )
    assert usage_lines in ask
    examples = [line for line in ask.splitlines() if line.strip().startswith(("kvcli ask", "cat notes.txt"))]
    assert len(examples) == 5 and len({len(line) - len(line.lstrip()) for line in examples}) == 1  # one indentation
    # paragraphs flow: no line of prose broken mid-sentence by the terminal width
    speed = helps["bench speed"]
    assert "generates exactly --new-tokens tokens" in " ".join(speed.split())
    assert re.search(r"^      kvcli bench speed --out bench/ .* --lengths 1024,2048,4096,8000$", speed, re.M)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["compressors"],
        ["compressors", "snapkv"],
        ["cache", "ls"],
    ],
    ids=" ".join,
)
def test_help_and_the_method_table_import_no_pytorch(args, tmp_path):
    """What only prints help, the methods or the cache's entries answers at once: ``python -X
    importtime`` names no module of PyTorch or transformers (the library is imported in the
    commands' bodies, the methods' facts come from kvcli/methods.json; a store with entries in it:
    tests/test_book_resume.py)."""
    done, heavy = heavy_imports(args, {"KVCLI_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert heavy == []
