"""A new method is one file (issue 53): a class defined here alone, with a name and ``keep_all``,
registers itself, goes through the contract's checks (specs, keeping everything, the disk store)
and is listed by ``kvcli compressors``; it is unregistered afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from kvcli.cli import app, reference
from kvcli.compressors import parse_one
from kvcli.compressors.base import REGISTRY, Compressor, knob
from tests.compressors.test_contract import full_logits, kept_all, profiles, stored  # noqa: F401  (fixtures)
from tests.compressors.test_contract import test_keeping_everything_reproduces_full_attention as keeps_everything
from tests.compressors.test_contract import test_specs_round_trip_through_the_parser as round_trips
from tests.compressors.test_contract import test_warm_cold_and_no_store_give_the_same_answer as store_agrees
from tests.helpers.specs import COMPRESSING, HOLDS_EVERYTHING

NAME = "test-own-steps"


@pytest.fixture(scope="module")
def method():
    @dataclass
    class OwnSteps(Compressor):
        """Full attention through a decoding step of its own (a method in a test file)."""

        name: ClassVar[str] = NAME
        paper: ClassVar[str] = "none: a test's method"
        keep_all: ClassVar[str] = ""
        short_document_spec: ClassVar[str] = f"{NAME}:steps=2"  # it keeps everything whatever its knob
        title: ClassVar[str] = "own steps"
        acts: ClassVar[str] = "owns each decoding step (full attention)"
        positions: ClassVar[str] = "original"
        disk_cache: ClassVar[str] = "prefix KV (shared with full)"

        steps: int = knob(1, "decoding steps of its own per token (a knob the tables spell out)")

        def decode_step(self, engine, token, position, cache):
            return engine.step(token, position, cache)

    try:
        assert REGISTRY[NAME] is OwnSteps  # registered by being defined, nothing else
        yield OwnSteps
    finally:
        REGISTRY.pop(NAME)


def test_it_keeps_the_contract(method, tiny_lm, profiles, kept_all, full_logits, stored):  # noqa: F811
    round_trips(NAME, tiny_lm, profiles)
    keeps_everything(NAME, "llama", kept_all, full_logits, tiny_lm)
    store_agrees(NAME, stored, tiny_lm, profiles)


def test_kvcli_compressors_lists_it(method):
    listed = CliRunner().invoke(app, ["compressors"], terminal_width=200)
    assert listed.exit_code == 0, listed.output
    assert NAME in listed.output
    detail = CliRunner().invoke(app, ["compressors", NAME], terminal_width=200)
    assert detail.exit_code == 0 and "a test's method" in detail.output, detail.output
    assert "steps" in detail.output and "decoding steps of its own per token" in detail.output  # its knob, found


def test_the_tables_derive_its_row(method):
    # the tests' spec, parsed into the class with its knob set; the canonical spec written back
    parsed = parse_one(COMPRESSING[NAME])
    assert type(parsed) is method and parsed.steps == 2 and parsed.spec() == f"{NAME}:steps=2"
    assert NAME not in HOLDS_EVERYTHING  # the base class's default, not declared
    # the table's spec column is made from the knob's default (no spec was written for it)
    row = (
        "| own steps | `test-own-steps:steps=1` | owns each decoding step (full attention) | original "
        "| prefix KV (shared with full) |"
    )
    assert row in reference.methods_table().splitlines()
