"""The words of issue 41's item 8: each error says what happened to this input and what to do."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from kvcli.errors import ModelError
from kvcli.model import hub, load_model
from tests.helpers.cli_runner import assert_user_error


def test_a_missing_gguf_file_is_no_such_file(cli, tmp_path):
    doc = tmp_path / "a.txt"
    doc.write_text("The lamp is lit at dusk.")
    for spec in (str(tmp_path / "missing.gguf"), "missing.gguf", "./models/Missing.GGUF"):
        with pytest.raises(ModelError, match=f"^cannot load model '{spec}': no such file$"):
            load_model(spec)
    result = cli("ask", doc, "When?", "-m", tmp_path / "missing.gguf")
    assert "no such file" in assert_user_error(result, 1) and "directory" not in result[2]


def test_max_new_tokens_names_the_environment_variable_only_when_the_value_came_from_it(cli, tmp_path, monkeypatch):
    doc = tmp_path / "a.txt"
    doc.write_text("The lamp is lit at dusk.")
    line = assert_user_error(cli("ask", doc, "When?", "--max-new-tokens", "0"), 2, "'--max-new-tokens'")
    assert "KVCLI_MAX_NEW_TOKENS" not in line and "env var" not in line
    monkeypatch.setenv("KVCLI_MAX_NEW_TOKENS", "0")
    assert_user_error(cli("ask", doc, "When?"), 2, "'--max-new-tokens' (env var: 'KVCLI_MAX_NEW_TOKENS')")


def test_a_pdf_on_stdin_is_told_to_give_the_file(cli, monkeypatch):
    pdf = Path("tests/data/groff-pdfmark.pdf").read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(pdf), encoding="utf-8", errors="surrogateescape"))
    line = assert_user_error(
        cli("ask", "-", "What is it?"), 1, "stdin holds a PDF", "give the PDF file's path instead of -"
    )
    assert "kvcli reads PDF" not in line


@pytest.mark.parametrize("name", ["empty.pdf", "empty.txt", "empty.md", "empty.html"])
def test_a_0_byte_file_is_empty_whatever_its_type(cli, tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    line = assert_user_error(cli("ask", tmp_path / name, "What is it?"), 1)
    assert line == f"kvcli: error: '{tmp_path / name}' is empty"


def test_an_unknown_model_name_points_to_kvcli_models(cli, tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "_hub_reachable", lambda: False)
    doc = tmp_path / "a.txt"
    doc.write_text("The lamp is lit at dusk.")
    assert_user_error(cli("ask", doc, "When?", "-m", "smollm3-unknown"), 1, "'smollm3-unknown'", "`kvcli models` lists")

    def not_found(spec, **kw):
        if kw.get("local_files_only"):
            raise OSError("not cached")
        raise OSError(f"{spec} is not a local folder and is not a valid model identifier")

    monkeypatch.setattr(hub, "_hub_reachable", lambda: True)
    with pytest.raises(ModelError, match="is not a valid model identifier; `kvcli models` lists"):
        hub.hub_load(not_found, "smollm3-unknown", "the config")


def test_ask_help_lists_every_exit_code(cli):
    code, out, _ = cli("ask", "--help")
    assert code == 0
    text = " ".join(out.split())
    for words in ("0 all answered", "1 some failed", "2 usage error", "3 internal error", "130 interrupted"):
        assert words in text, words
