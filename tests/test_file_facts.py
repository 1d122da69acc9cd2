"""Facts about large files are computed once and kept while the files stay as they were
(kvcli/file_facts.py): a GGUF's sha256, an embedding model's id; a file rewritten, added or touched
computes the fact again, and a fact of another name is computed apart and kept beside it."""

from __future__ import annotations

import os

from kvcli.file_facts import SIDECAR, file_fact, folder_fact


class Counting:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self, *args):
        self.calls += 1
        return self.value


def test_a_files_fact_is_computed_once_while_it_keeps_its_size_and_mtime(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x" * 10)
    fact = Counting("abc")
    assert file_fact(f, tmp_path, "sha256", str, fact) == "abc" == file_fact(f, tmp_path, "sha256", str, fact)
    assert fact.calls == 1 and (tmp_path / SIDECAR).is_file()
    other = Counting(["Q4_K"])
    assert file_fact(f, tmp_path, "linear_types", list, other) == ["Q4_K"] and other.calls == 1
    assert file_fact(f, tmp_path, "sha256", str, fact) == "abc" and fact.calls == 1  # both kept
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched: read again
    assert file_fact(f, tmp_path, "sha256", str, fact) == "abc" and fact.calls == 2


def test_a_folders_fact_is_computed_again_when_a_file_changes_or_comes(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"w" * 100)
    files = lambda: sorted(folder.iterdir())  # noqa: E731
    fact = Counting("id-1")
    cache = tmp_path / "cache"
    assert folder_fact(folder, files(), cache, "id", fact) == "id-1"
    assert folder_fact(folder, files(), cache, "id", fact) == "id-1" and fact.calls == 1
    assert folder_fact(folder, files(), cache, "id of another layout", fact) == "id-1" and fact.calls == 2
    assert folder_fact(folder, files(), cache, "id", fact) == "id-1" and fact.calls == 2  # both kept
    (folder / "config.json").write_text('{"a": 1}')
    folder_fact(folder, files(), cache, "id", fact)
    assert fact.calls == 3
    (folder / "tokenizer.json").write_text("{}")
    folder_fact(folder, files(), cache, "id", fact)
    assert fact.calls == 4
    os.utime(folder / "model.safetensors")  # the weights touched: computed again
    folder_fact(folder, files(), cache, "id", fact)
    assert fact.calls == 5
