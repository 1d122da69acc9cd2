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
