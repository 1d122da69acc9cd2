"""What docs/usage.md documents of ``kvcli ask --json``, read from its two tables: the fields every
record of an answer has, and the fields some records add (and when)."""

from __future__ import annotations

import re
from pathlib import Path

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def _table_after(text: str, marker: str) -> dict[str, str]:
    """The first Markdown table after ``marker``: its first column's `field` -> the rest of its row."""
    rows = {}
    after = text.split(marker, 1)[1]
    table = after[after.index("\n|") + 1 :].split("\n\n", 1)[0]
    for line in table.splitlines():
        match = re.match(r"\| `([a-z0-9_]+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    assert rows, f"docs/usage.md: no table after {marker!r}"
    return rows


def json_fields() -> tuple[dict[str, str], dict[str, str]]:
    """(every record's fields -> their row: type, meaning; the fields some records add -> their row: when, meaning)."""
    section = USAGE.read_text(encoding="utf-8").split("## `kvcli ask --json`", 1)[1].split("\n## ", 1)[0]
    every = _table_after(section, "Every record of an answer has these fields")
    return every, _table_after(section, "Some records have more:")
