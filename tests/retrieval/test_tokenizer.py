"""The sentence-embedding model's tokenizer.json is run by the tokenizers library directly only
where it gives what transformers' AutoTokenizer gives (kvcli/retrieval/embed.py, JsonTokenizer):
checked once a folder, the verdict kept with the folder's files; a folder whose tokenizer.json
AutoTokenizer changes (its settings in tokenizer_config.json) keeps AutoTokenizer."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch

from kvcli.retrieval import embed

TEXTS = [
    "How do I tell R where my own add-on packages live?",
    "R_LIBS_USER names the user's library; .libPaths() lists them all. " * 60,  # longer than the cut
    "Déjà vu: naïve résumé, 日本語 and 3.14159 — §2",
]


def copied_tokenizer(tmp_path, **config):
    """all-MiniLM-L6-v2's tokenizer files in a folder, ``config`` written into its tokenizer_config.json."""
    default = embed.model_dir(embed.DEFAULT)
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default / name, folder / name)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, **config}))
    return folder


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("input_ids", "attention_mask"))


def test_the_default_models_tokenizer_json_gives_autotokenizers_batches():
    folder = embed.model_dir(embed.DEFAULT)
    settings = embed.json_tokenizer_settings(folder, embed.probes(embed.Layout.read(folder)))
    assert json.loads(settings) == {"pad_id": 0, "padding_side": "right"}
    ours = embed.JsonTokenizer(folder, **json.loads(settings))
    auto = embed.auto_tokenizer(folder)
    for cut in (8, 256):
        batch = ours.batch(TEXTS, cut)
        assert batch["input_ids"].shape == (3, cut)  # padded to the longest, that one cut
        assert same(batch, embed.hf_batch(auto, TEXTS, cut))


def test_a_tokenizer_json_that_autotokenizer_changes_is_not_used(tmp_path):
    """tokenizer.json lowercases; the folder's tokenizer_config.json says not to, which AutoTokenizer
    obeys: the two differ on the probes, so the folder keeps AutoTokenizer."""
    cased = copied_tokenizer(tmp_path, do_lower_case=False)
    layout = embed.Layout()
    assert embed.json_tokenizer_settings(cased, embed.probes(layout)) == ""
    auto = embed.auto_tokenizer(cased)
    ours = embed.JsonTokenizer(cased, pad_id=0)
    assert not same(ours.batch(TEXTS, 64), embed.hf_batch(auto, TEXTS, 64))  # what the check caught


def test_the_verdict_is_kept_with_the_folder_and_the_vectors_stay(tmp_path, monkeypatch):
    """The first Embedder of a folder checks its tokenizer.json (AutoTokenizer loaded once); a later
    one reads the verdict and never loads AutoTokenizer; both give the same vectors, those of
    AutoTokenizer's batches."""
    monkeypatch.setenv("KVCLI_CACHE_DIR", str(tmp_path / "cache"))
    folder = embed.model_dir(embed.DEFAULT)
    first = embed.Embedder(folder)
    assert isinstance(first.batch.__self__, embed.JsonTokenizer)

    def refuse(_folder):
        raise AssertionError("AutoTokenizer loaded again")

    monkeypatch.setattr(embed, "auto_tokenizer", refuse)
    later = embed.Embedder(folder)
    np.testing.assert_array_equal(first.encode(TEXTS), later.encode(TEXTS))
    monkeypatch.undo()
    auto = embed.Embedder(folder)
    auto.batch = lambda texts, cut: embed.hf_batch(embed.auto_tokenizer(folder), texts, cut)
    np.testing.assert_allclose(later.encode(TEXTS), auto.encode(TEXTS), atol=1e-6)
