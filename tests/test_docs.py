"""Facts the code also states (the default method, the --json fields) say the same in the docs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvcli import policy
from kvcli.batch import error_record
from kvcli.selection import Span
from tests.helpers.documented import json_fields

ROOT = Path(__file__).resolve().parent.parent


def test_methods_md_states_the_default_policy_as_the_help_does():
    """`kvcli ask --help` shows policy.DESCRIPTION for -c auto; docs/methods.md says the same words."""
    methods = " ".join((ROOT / "docs" / "methods.md").read_text(encoding="utf-8").split())
    assert policy.DESCRIPTION in methods


def test_the_other_records_fields_are_documented():
    """The fields some records add (docs/usage.md's second table): an error record's, a kept span's."""
    every, some = json_fields()
    record = error_record("a.pdf", "Who?", ValueError("x"))
    assert set(record) <= set(every) | set(some), set(record) - set(every) - set(some)
    spans = some["selected_spans"]
    for field in dataclasses.fields(Span):
        assert f"`{field.name}`" in spans, field.name
    assert {"peak_mem_reserved_mb", "question", "worker"} <= set(some)
