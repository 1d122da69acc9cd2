"""Tests run in a cache folder of their own: the user's converted models are reused read only."""

from __future__ import annotations

from pathlib import Path

from kvcli.files import atomic_write
from kvcli.model import default_cache_dir
from kvcli.model.embedded import _SOURCE_MARKER
from tests.helpers.cache_dir import link_converted_models


def test_the_session_cache_is_a_temporary_folder(isolated_cache_dir, tmp_path_factory):
    assert default_cache_dir() == isolated_cache_dir
    assert isolated_cache_dir.is_relative_to(tmp_path_factory.getbasetemp())
    assert not (isolated_cache_dir / "models").is_symlink()


def test_linked_models_are_read_and_never_written_through(tmp_path):
    source = tmp_path / "user" / "models"
    done = source / "smollm2-abc"
    (done / "sub").mkdir(parents=True)
    for name, text in ((_SOURCE_MARKER, "{}"), ("config.json", "{}"), ("sub/tokenizer.json", "t")):
        (done / name).write_text(text)
    (source / ".smollm2-abc.tmp-1").mkdir()  # a conversion killed half-way
    (source / "half").mkdir()  # no marker: not a conversion
    dest = tmp_path / "session" / "models"
    link_converted_models(source, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["smollm2-abc"]
    assert (dest / "smollm2-abc" / "sub" / "tokenizer.json").read_text() == "t"
    assert all(p.is_symlink() for p in (dest / "smollm2-abc").rglob("*") if p.is_file())
    changed = dest / "smollm2-abc" / "config.json"
    atomic_write(changed, lambda tmp: Path(tmp).write_text('{"changed": 1}'))  # as kvcli writes a file
    assert (dest / "smollm2-abc" / "config.json").read_text() == '{"changed": 1}'
    assert (done / "config.json").read_text() == "{}"
