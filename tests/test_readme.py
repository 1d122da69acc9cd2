"""The README's set-up commands are what CI runs, and the docs name what exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_ci_runs_both_readme_setup_commands_verbatim():
    commands = readme_commands()
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    for command in commands:
        assert command.strip() in ci
    assert "pytest" in commands[1] and "kvcli ask examples/" in commands[0]


def test_readme_example_files_exist():
    for name in re.findall(r"examples/[\w./-]+\.\w+", (ROOT / "README.md").read_text()):
        assert (ROOT / name.rstrip(".")).exists(), name


def test_readme_is_a_short_guide_whose_links_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for needle in (
        "8,192 tokens",
        "15-17-page PDF",
        "not cached",
        "kvcli chat",
        "## Choosing a method",
        "## Errors and exit codes",
        "## More",
    ):
        assert needle in text, needle
    links = re.findall(r"\]\(((?:docs|examples)/[^)#]+)", text)
    assert "docs/methods.md" in links and "docs/benchmarks.md" in links
    for link in links:
        assert (ROOT / link).exists(), link


def test_every_benchmark_script_says_what_it_answers():
    """Each script in benchmarks/ has its line in docs/benchmarks.md, and each line names a script that exists."""
    table = (ROOT / "docs" / "benchmarks.md").read_text().split("## The scripts", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([\w/.]+)`", table, flags=re.M))
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} | {"peers/"}
    assert named == scripts
