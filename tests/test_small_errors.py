"""The small ones of issue 27 (item 7): a template given by path, a method without knobs given
one, "1 document span", and a full disk while the embedded model is converted."""

from __future__ import annotations

import errno
from io import StringIO
from pathlib import Path

import pytest

from kvcli import notices
from kvcli.errors import ModelError, UsageError

# --- --template ------------------------------------------------------------------------------


def test_a_template_path_without_an_extension_is_read_as_a_file(tmp_path):
    from kvcli.answer.prompt import load_template

    other = tmp_path / "passwd"  # as /etc/passwd: exists, no extension, not a template
    other.write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(UsageError) as info:
        load_template(str(other))
    assert "needs one {document} followed by one {question}" in str(info.value) and "not found" not in str(info.value)
    good = tmp_path / "mine"
    good.write_text("{document}\nQ: {question}\n")
    assert load_template(str(good)) == "{document}\nQ: {question}\n"
    with pytest.raises(UsageError, match="prompt template file .*missing.* not found"):
        load_template(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="prompt template 'nosuch' not found; templates by name: qa, ruler"):
        load_template("nosuch")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\xfa\x00{document}")
    with pytest.raises(UsageError, match="is not UTF-8 text"):
        load_template(str(tmp_path / "bin.txt"))
    with pytest.raises(UsageError, match="cannot be read"):
        load_template(str(tmp_path))  # a folder
    assert load_template("qa").count("{document}") == 1


# --- full:x=1 --------------------------------------------------------------------------------


def test_a_knob_for_a_method_without_knobs_says_it_takes_none():
    from kvcli.compressors import parse_one

    with pytest.raises(UsageError) as info:
        parse_one("full:x=1")
    assert str(info.value) == "full takes no knobs, got 'x=1'; give it as 'full'"
    with pytest.raises(UsageError, match="unknown knob 'foo'; knobs: layer"):
        parse_one("gemfilter:foo=1")


# --- 1 document span -------------------------------------------------------------------------


@pytest.mark.parametrize("n, words", [(1, "1 document span"), (2, "2 document spans")])
def test_kept_spans_header_counts_in_the_right_number(n, words):
    from rich.console import Console

    from kvcli.compressors.selection import Span
    from kvcli.documents import document_from_text
    from kvcli.report import terminal as render

    doc = document_from_text("alpha beta gamma delta " * 40)
    pieces = [(0, 5), (400, 405)][:n]
    spans = [Span(a, b, doc.page_of(a), doc.page_of(b - 1), 1, None, doc.text[a:b]) for a, b in pieces]
    console = Console(file=StringIO(), width=100, color_system=None, highlight=False)
    render.selected_spans(console, spans, doc, n_kept=8, n_total=100)
    header = console.file.getvalue().splitlines()[0]
    assert header.rstrip(" ─").endswith(words), header


# --- a full disk while the embedded model is converted -----------------------------------------


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """The embedded model's conversion, with a fake GGUF, failing as ``fail(dest)`` says."""
    from kvcli.model import embedded

    gguf = tmp_path / "pkg" / embedded.EMBEDDED_GGUF
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake weights")
    monkeypatch.setattr(embedded, "embedded_gguf_file", lambda: gguf)
    failures = {}

    def convert(src, dest):
        error = failures.get("error")
        if error is not None and Path(dest).is_relative_to(tmp_path / "cache"):
            raise error
        (Path(dest) / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    said = []
    notices.reset()
    notices.set_sink(said.append)
    yield embedded, failures, said
    notices.reset()
    notices.set_sink(None)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        # safetensors' serialisation wraps the OSError of a full disk
        Exception(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
    ],
)
def test_a_full_disk_during_the_conversion_falls_back_to_a_temporary_one_with_one_warning(
    fake_conversion, tmp_path, error
):
    embedded, failures, said = fake_conversion
    failures["error"] = error
    folder, sha = embedded.ensure_converted(tmp_path / "cache")
    assert (folder / "config.json").is_file() and not folder.is_relative_to(tmp_path / "cache")
    folder2, _ = embedded.ensure_converted(tmp_path / "cache")  # again: converted again, said once
    assert folder2 != folder
    [line] = said
    assert f"cannot write to the cache directory {tmp_path / 'cache'}" in line and (
        "No space left" in line or "quota" in line
    )
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # nothing half-written left behind
    # the same as a cache directory that cannot be written at all
    failures.clear()
    target, _ = embedded.ensure_converted(tmp_path / "cache")
    assert target.is_relative_to(tmp_path / "cache")


def test_a_conversion_error_that_is_not_the_disk_stays_an_error(fake_conversion, tmp_path):
    embedded, failures, said = fake_conversion
    failures["error"] = ValueError("unknown GGUF architecture 'foo'")
    with pytest.raises(ModelError, match="cannot convert the embedded model .*unknown GGUF architecture"):
        embedded.ensure_converted(tmp_path / "cache")
    assert said == []
