"""One vocabulary (kvcli.cli.vocabulary): every environment variable kvcli reads is in the table and in
``kvcli --help``; a precision is spelled in bits everywhere (the old ``--quant 8bit`` still accepted
with a one-line note), a size cap is ``--cache-max`` (``cache prune --max-size`` too, with a note);
``inspect`` answers with the method ``ask`` does by default; a batch says a document's over-window
note once, not once per question."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcli.cli import vocabulary
from tests.helpers.cli_runner import assert_user_error, run_cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli(capsys, monkeypatch):
    return lambda *args: run_cli(args, capsys, monkeypatch)


@pytest.fixture(scope="module")
def model(tiny_dir) -> str:
    return str(tiny_dir("llama", num_hidden_layers=4, max_position_embeddings=256))


def test_every_environment_variable_read_is_in_the_table_and_the_help(cli):
    read = set()
    for path in (REPO / "kvcli").rglob("*.py"):
        read |= set(re.findall(r"\bKVCLI_[A-Z0-9_]+\b", path.read_text()))
    read -= {"KVCLI_DOCUMENT", "KVCLI_QUESTION"}  # the prompt template's placeholders, not variables
    assert read == set(vocabulary.ENVIRONMENT), read ^ set(vocabulary.ENVIRONMENT)
    code, out, _ = cli("--help")
    assert code == 0 and "Environment:" in out
    for name in vocabulary.ENVIRONMENT:
        assert name in out, name
    code, out, _ = cli("ask", "--help")
    assert "env var: KVCLI_THREADS" in out  # a declared option's variable, not parsed by hand
    with pytest.raises(KeyError):
        vocabulary.env("KVCLI_NOT_LISTED")


def test_threads_from_the_environment_is_checked_as_it_is_parsed(cli, tmp_path, monkeypatch):
    doc = tmp_path / "d.txt"
    doc.write_text("Hello there.")
    monkeypatch.setenv("KVCLI_THREADS", "lots")
    assert_user_error(cli("ask", doc, "What?"), 2, "KVCLI_THREADS must be auto or a whole number")
    assert_user_error(cli("ask", doc, "What?", "--threads", "x"), 2, "--threads must be")


def test_quant_is_spelled_in_bits_and_the_old_spelling_gets_a_note():
    assert vocabulary.quant_value("8") == "8" and vocabulary.quant_value("4") == "4"
    assert vocabulary.quant_value("none") == "none" and vocabulary.quant_value("auto") == "auto"


def test_the_library_spells_quant_as_the_cli_and_the_json_do(model, tmp_path):
    """AskOptions.quant takes what --quant takes and --json reports ("8"), not another name."""
    from kvcli import api
    from kvcli.errors import UsageError

    options = api.AskOptions(model=model, quant="8", dtype="bfloat16", use_cache=False, max_new_tokens=1)
    session = api.Session.open(options)
    assert session.lm.quant == "8bit"  # load_model's own name, inside
    with pytest.raises(UsageError, match="must be one of auto, none, 8, 4, not '8bit'"):
        api.Session.open(api.AskOptions(model=model, quant="8bit", use_cache=False))


@pytest.mark.parametrize("old, new", [("8bit", "8"), ("4bit", "4")])
def test_quant_old_spelling_note(cli, model, tmp_path, old, new):
    doc = tmp_path / "d.txt"
    doc.write_text("The keeper was Ada.")
    args = ("ask", doc, "Who?", "-m", model, "--max-new-tokens", "2", "--no-cache", "--json", "--dtype", "bfloat16")
    code, out, err = cli(*args, "--quant", old)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("kvcli: note:")]
    assert notes == [f"kvcli: note: --quant {old} is now --quant {new} (the old spelling goes in the next release)"]
    code, out, err = cli(*args, "--quant", old, "-q")  # --quiet: nothing on stderr but errors
    assert code == 0 and err == ""
    code, out2, err2 = cli(*args, "--quant", new, "-q")
    assert code == 0 and err2 == ""
    assert json.loads(out)["answer"] == json.loads(out2)["answer"] and json.loads(out2)["quant"] == new
    assert_user_error(cli(*args, "--quant", "16"), 2, "--quant", "must be one of auto, none, 8, 4", "--help")


def test_cache_prune_takes_cache_max_and_the_old_max_size_with_a_note(cli, tmp_path):
    code, out, err = cli("cache", "prune", "--cache-max", "1G", "--cache-dir", tmp_path)
    assert code == 0 and err == "" and out.startswith("removed 0 entries")
    code, out, err = cli("cache", "prune", "--max-size", "1G", "--cache-dir", tmp_path)
    assert code == 0 and out.startswith("removed 0 entries")
    assert err == "kvcli: note: --max-size is now --cache-max (the old spelling goes in the next release)\n"
    code, out, err = cli("cache", "prune", "--max-size", "1G", "--cache-dir", tmp_path, "--quiet")
    assert code == 0 and err == "" and out.startswith("removed 0 entries")
    assert_user_error(cli("cache", "prune", "--cache-dir", tmp_path), 2, "--cache-max")
    code, out, _ = cli("cache", "prune", "--help")
    assert "--cache-max" in out and "--max-size" not in out


def test_inspect_defaults_to_the_method_ask_does(cli, model, tmp_path, monkeypatch):
    doc = tmp_path / "long.txt"  # over the 256-token window: -c auto reads a page (pages), not gemfilter
    doc.write_text(" ".join(f"Entry {i}: the keeper logged {i * 7 % 13} ships." for i in range(60)))
    monkeypatch.delenv("KVCLI_COMPRESSOR", raising=False)
    common = ("-m", model, "--no-cache", "--json", "-q")
    code, out, err = cli("ask", doc, "How many ships?", *common, "--max-new-tokens", "2")
    assert code == 0, err
    asked = json.loads(out)["compressor"]
    assert json.loads(out)["policy"] == "auto"
    code, out, err = cli("inspect", doc, "How many ships?", *common)
    assert code == 0, err
    assert json.loads(out)["compressor"] == asked and asked.startswith("pages")
    assert json.loads(out)["policy"] == "auto"  # as ask --json says it
    code, out, err = cli("inspect", doc, "How many ships?", *common, "-c", asked)
    assert code == 0, err
    assert json.loads(out)["compressor"] == asked and json.loads(out)["policy"] is None  # an explicit -c


def test_a_batch_says_a_documents_over_window_note_once(cli, model, tmp_path):
    doc = tmp_path / "long.txt"
    doc.write_text(" ".join(f"Entry {i}: the keeper logged {i * 7 % 13} ships." for i in range(60)))
    questions = tmp_path / "q.txt"
    questions.write_text("How many ships?\nHow many ships were logged in all the entries?\nWho logged them?\n")
    code, out, err = cli("ask", doc, "--questions", questions, "-m", model, "--max-new-tokens", "2", "--no-cache")
    assert code == 0, err
    assert len(out.splitlines()) == 3
    notes = [line for line in err.splitlines() if "window" in line]
    assert len(notes) == 1 and notes[0].startswith("kvcli: warning: the prompt is "), err
