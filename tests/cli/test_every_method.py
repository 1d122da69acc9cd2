"""``kvcli ask`` with every registered method, sources on, on a small two-paragraph note: each answers
(exit 0, one JSON record, its sources inside what the note holds), and ``pages`` asked for more
passages than the note has reads it all (issue 49: it ended in an internal error, exit 3).

The methods come from :data:`kvcli.compressors.base.REGISTRY` (a method registered later is asked
without a new test), each with its compressing spec of the tests (:data:`tests.helpers.specs.COMPRESSING`)."""

from __future__ import annotations

import json

import pytest

from kvcli.compressors.base import REGISTRY
from tests.helpers.specs import COMPRESSING

NOTE = (
    "The harbour master keeps the blue lamp lit every night of the winter, from the first storm "
    "until the ice breaks on the river.\n"
    "He counts the gulls on the stone pier at dawn and writes their number in a red book.\n"
    "\n"
    "The passkey to the lamp room is 4172. The keeper's daughter carries it on a string around her "
    "neck, and she opens the door at six.\n"
    "Nobody else climbs the tower; the stairs are narrow and the rail is loose.\n"
)

# every registered method, and pages asked for more passages than the note has
SPECS = [COMPRESSING[name] for name in sorted(REGISTRY)] + ["pages:pages=5,skim=3"]


@pytest.fixture(scope="module")
def note(tmp_path_factory):
    path = tmp_path_factory.mktemp("note") / "note.md"
    path.write_text(NOTE, encoding="utf-8")
    return path


@pytest.mark.parametrize("spec", SPECS)
def test_every_method_answers_with_sources(cli, note, model, spec):
    code, out, err = cli(
        "ask", note, "What is the passkey?", "-m", model, "-c", spec, "--json", "--max-new-tokens", "4"
    )
    assert code == 0, err
    assert "internal error" not in err and "Traceback" not in err
    assert out.count("\n") == 1, out
    record = json.loads(out)
    assert record["compressor"].split(":")[0] == spec.split(":")[0]
    assert isinstance(record["sources"], list)  # sources on: found, or a note saying why none is clear
    assert record["sources"] or record["sources_note"]
    text = NOTE.strip("\n")
    for source in record["sources"]:
        assert 0 <= source["start"] < source["end"] <= len(text)
        assert text[source["start"] : source["end"]].strip() == source["text"].strip()


def test_pages_with_more_pages_than_the_note_has_reads_it_all(cli, note, model):
    code, out, err = cli("ask", note, "What is the passkey?", "-m", model, "-c", "pages:pages=5", "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["n_selected_tokens"] == record["n_context_tokens"]  # every passage read: the whole prompt
