"""kvcli.retrieval's passage vectors: the store (a second call reads the file; a damaged file or
another format's is a miss) and the real embedding model against sentence-transformers' own."""

from __future__ import annotations

import numpy as np
import pytest

from kvcli.errors import ModelError
from kvcli.retrieval import embed, rank_passages, vectors


class Counting:
    """An embedder whose vectors are known: a text's word count and length, normalised."""

    id = "counting-1"
    folder = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, texts):
        self.calls += 1
        v = np.array([[len(t.split()), len(t) + 1.0] for t in texts], dtype=np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


PASSAGES = ["one two three", " ".join(f"w{i}" for i in range(450)), "four"]


def test_windows_of_100_words():
    cut = vectors.windows(PASSAGES[1])
    assert [len(w.split()) for w in cut] == [100, 100, 100, 100, 50]
    assert cut[1].split()[0] == "w100" and vectors.windows("   ") == [""]
    assert [len(w.split()) for w in vectors.windows(PASSAGES[1], 200)] == [200, 200, 50]


def test_second_call_reads_the_file(tmp_path):
    model = Counting()
    first, owner, how = vectors.passage_vectors(model, PASSAGES, tmp_path)
    assert how == "computed" and model.calls == 1 and owner.tolist() == [0, 1, 1, 1, 1, 1, 2]
    files = list((tmp_path / "vectors").glob("*.safetensors"))
    assert len(files) == 1 and not list((tmp_path / "vectors").glob(".*"))  # no temporary file left
    again, owner2, how = vectors.passage_vectors(model, PASSAGES, tmp_path)
    assert how == "hit" and model.calls == 1
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(owner2, owner)
    # another passage layout (or document) is another key
    _, _, how = vectors.passage_vectors(model, PASSAGES[:2], tmp_path)
    assert how == "computed" and model.calls == 2


def test_the_file_names_its_document_and_a_hit_marks_it_used(tmp_path):
    """What ``kvcli cache ls`` shows of a vectors file: the document it came from, in its header's
    ``about``; a hit sets its mtime (the cap removes the least recently used first); ``on_stored``
    hears of the file written, ``on_progress`` of the windows embedded."""
    import json
    import os

    from safetensors import safe_open

    class Batched(Counting):
        def encode(self, texts, on_progress=None):
            for done in range(2, len(texts), 2):
                on_progress(done, len(texts))
            on_progress(len(texts), len(texts))
            return super().encode(texts)

    stored, steps = [], []
    document = {"document": "/docs/a.pdf", "document_sha256": "ab" * 32}
    model = Batched()
    vectors.passage_vectors(
        model, PASSAGES, tmp_path, document=document, on_stored=stored.append, on_progress=lambda *s: steps.append(s)
    )
    (path,) = (tmp_path / "vectors").glob("*.safetensors")
    assert stored == [path] and steps == [(2, 7), (4, 7), (6, 7), (7, 7)]
    with safe_open(str(path), framework="numpy") as f:
        about = json.loads(f.metadata()["about"])
    assert about == {**document, "model": "counting", "window_words": 100, "passages": 3}
    os.utime(path, (1_000_000, 1_000_000))
    stored.clear()
    _, _, how = vectors.passage_vectors(model, PASSAGES, tmp_path, on_stored=stored.append)
    assert how == "hit" and stored == [] and path.stat().st_mtime > 1_000_000


def test_damaged_or_other_format_file_is_a_miss(tmp_path):
    model = Counting()
    want, _, _ = vectors.passage_vectors(model, PASSAGES, tmp_path)
    path = next((tmp_path / "vectors").glob("*.safetensors"))
    digest = path.stem
    path.write_bytes(path.read_bytes()[:40])  # cut short
    got, _, how = vectors.passage_vectors(model, PASSAGES, tmp_path)
    assert how == "computed" and model.calls == 2
    np.testing.assert_array_equal(got, want)
    assert vectors.load(path, digest) is not None  # written again
    # a file of another format under the same name
    vectors.save(path, digest, want, np.array([0, 1, 1, 1, 1, 1, 2]), {})
    import torch

    from kvcli.files import save_safetensors_atomic

    save_safetensors_atomic(
        path,
        {"vectors": torch.from_numpy(want), "owner": torch.tensor([0, 1, 1, 1, 1, 1, 2], dtype=torch.int32)},
        {"key": digest, "format": str(vectors.FORMAT + 1)},
    )
    assert vectors.load(path, digest) is None
    _, _, how = vectors.passage_vectors(model, PASSAGES, tmp_path)
    assert how == "computed" and model.calls == 3


def test_missing_model_is_one_line(monkeypatch):
    monkeypatch.setenv(embed.ENV, "no-such-embedding-package")
    with pytest.raises(ModelError, match="sentence-embedding model 'no-such-embedding-package' is missing"):
        rank_passages(["a page"], "a question")
    monkeypatch.setenv(embed.ENV, "none")
    assert rank_passages(["a page", "cats"], "page").signal == "bm25"


SHELL = [
    "Cats sleep for most of the day and purr when they are content.",
    "With set -e the shell exits immediately when a pipeline returns a non-zero status.",
    "The printer driver supports duplex printing on A4 and letter paper.",
]


@pytest.mark.slow
def test_real_model_against_sentence_transformers(monkeypatch, tmp_path):
    """The default model's vectors as sentence-transformers computes them (its own pooling and
    normalisation), and the paraphrased question finds the set -e passage it shares no word with."""
    monkeypatch.delenv(embed.ENV, raising=False)
    model = embed.embedder(embed.DEFAULT)
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(model.folder), device="cpu")
    texts = [*SHELL, "how do I make my script quit at the first error?"]
    np.testing.assert_allclose(model.encode(texts), reference.encode(texts), atol=2e-5)
    r = rank_passages(SHELL, "how do I make my script quit at the first error?", cache_dir=tmp_path)
    assert r.signal == "bm25+embedding" and r.bm25.max() == 0 and r.order[0] == 1
    assert len(list((tmp_path / "vectors").glob("*.safetensors"))) == 1
