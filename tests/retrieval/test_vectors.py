"""kvcli.retrieval's passage vectors: the store (a second call reads the file; a damaged file or
another format's is a miss) and the real embedding model against sentence-transformers' own."""

from __future__ import annotations

import numpy as np
import pytest

from kvcli.errors import ModelError
from kvcli.retrieval import embed, rank_passages, vectors
from tests.helpers.embedders import Counting

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

    stored, steps = [], []
    document = {"document": "/docs/a.pdf", "document_sha256": "ab" * 32}
    model = Counting(progress_step=2)
    vectors.passage_vectors(
        model, PASSAGES, tmp_path, document=document, on_stored=stored.append, on_progress=lambda *s: steps.append(s)
    )
    (path,) = (tmp_path / "vectors").glob("*.safetensors")
    assert stored == [path] and steps == [(2, 7), (4, 7), (6, 7), (7, 7)]
    with safe_open(str(path), framework="numpy") as f:
        about = json.loads(f.metadata()["about"])
    assert about == {**document, "model": "/models/counting", "window_words": 100, "passages": 3, "embedded": 3}
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
    vectors.save(path, digest, want, np.array([0, 1, 1, 1, 1, 1, 2]), np.ones(3, bool), {})
    import torch

    from kvcli.files import save_safetensors_atomic

    save_safetensors_atomic(
        path,
        {
            "vectors": torch.from_numpy(want),
            "owner": torch.tensor([0, 1, 1, 1, 1, 1, 2], dtype=torch.int32),
            "done": torch.ones(3, dtype=torch.uint8),
        },
        {"key": digest, "format": str(vectors.FORMAT + 1)},
    )
    assert vectors.load(path, digest) is None
    _, _, how = vectors.passage_vectors(model, PASSAGES, tmp_path)
    assert how == "computed" and model.calls == 3


def test_only_the_wanted_passages_are_embedded_and_the_file_fills_in(tmp_path):
    """A call embeds the wanted passages missing from the file, returns exactly their windows (as
    a call over every passage computes them) and writes the union back; a later call for passages
    already there reads them."""
    model = Counting()
    everything, owner_all, _ = vectors.passage_vectors(Counting(), PASSAGES, None)
    got, owner, how = vectors.passage_vectors(model, PASSAGES, tmp_path, wanted=[2])
    assert how == "computed" and model.texts == [PASSAGES[2]] and owner.tolist() == [2]
    np.testing.assert_array_equal(got, everything[owner_all == 2])
    got, owner, how = vectors.passage_vectors(model, PASSAGES, tmp_path, wanted=[0, 2])
    assert how == "computed" and model.texts == [PASSAGES[0]] and owner.tolist() == [0, 2]  # 2 read back
    np.testing.assert_array_equal(got, everything[(owner_all == 0) | (owner_all == 2)])
    path = next((tmp_path / "vectors").glob("*.safetensors"))
    stored, stored_owner, done = vectors.load(path, path.stem)
    assert done.tolist() == [True, False, True] and stored_owner.tolist() == [0, 2]
    _, _, how = vectors.passage_vectors(model, PASSAGES, tmp_path, wanted=[2, 0])
    assert how == "hit" and model.calls == 2
    got, owner, how = vectors.passage_vectors(model, PASSAGES, tmp_path)
    assert how == "computed" and len(model.texts) == 5 and owner.tolist() == owner_all.tolist()
    np.testing.assert_array_equal(got, everything)
    assert vectors.load(path, path.stem)[2].all()


def test_candidates_are_bm25s_best_reranked_and_the_rest_follow(tmp_path):
    """With ``candidates=N`` the embedding re-ranks BM25's best N passages (scored as the ranking
    over every passage scores them) and only those are embedded; the others follow in BM25's
    order. A document of at most N passages ranks as over every passage; a question with no word
    in the document re-ranks the first N (BM25's ties: document order)."""
    passages = [f"alpha {' '.join(['beta'] * i)} gamma {'delta ' * (5 - i)}" for i in range(5)] + ["nothing here"]
    question = "beta delta"
    model = Counting()
    full = ranking_with(model, passages, question, tmp_path / "all", 0)
    assert model.wanted[-1] == list(range(6))
    part = ranking_with(model, passages, question, tmp_path / "part", 3)
    by_bm25 = sorted(range(6), key=lambda i: (-full.bm25[i], i))
    best3, rest = by_bm25[:3], by_bm25[3:]
    assert full.bm25[best3[-1]] > full.bm25[rest[0]] and model.wanted[-1] == sorted(best3)  # only those embedded
    np.testing.assert_allclose(part.scores[best3], full.scores[best3])
    assert part.order == sorted(best3, key=lambda i: (-full.scores[i], i)) + rest
    assert (part.semantic[rest] == -1).all() and np.allclose(part.semantic[best3], full.semantic[best3])
    assert ranking_with(model, passages, question, tmp_path / "small", 6).order == full.order
    none = ranking_with(model, passages, "zeta", tmp_path / "none", 2)
    assert model.wanted[-1] == [0, 1] and none.order[2:] == [2, 3, 4, 5]


def ranking_with(model, passages, question, cache, candidates, name="fake"):
    """rank_passages with ``model`` as the embedding, named ``name`` (its wanted passages recorded)."""
    from unittest import mock

    from kvcli.retrieval import ranking

    real = vectors.passage_vectors

    def spy(m, p, c, size=vectors.WINDOW_WORDS, **kw):
        model.wanted.append(list(kw.get("wanted") or range(len(p))))
        return real(m, p, c, size, **kw)

    with (
        mock.patch.object(ranking.embed, "setting", return_value=name),
        mock.patch.object(ranking.embed, "embedder", return_value=model),
        mock.patch.object(ranking.vectors, "passage_vectors", spy),
    ):
        return rank_passages(passages, question, cache, candidates=candidates)


def test_a_known_model_ranks_with_its_own_tuned_weight_and_threshold(tmp_path):
    """The fused score is BM25's share by the model's weight (kvcli/retrieval/embedders.json), and
    the no-match cosine the model's: EmbeddingGemma's, not all-MiniLM-L6-v2's; an unknown model the default's."""
    from kvcli.retrieval import embedders
    from kvcli.retrieval.ranking import weighted

    passages = [f"alpha {' '.join(['beta'] * i)} gamma {'delta ' * (5 - i)}" for i in range(5)] + ["nothing here"]
    for name in ("embeddinggemma-300m", "fake"):
        r = ranking_with(Counting(), passages, "beta delta", tmp_path / name, 0, name)
        tuned = embedders.tuned(name)
        np.testing.assert_allclose(r.scores, weighted(r.bm25, r.semantic, tuned.weight))
        assert r.no_match == tuned.no_match_cosine
    gemma, default = embedders.tuned("embeddinggemma-300m"), embedders.tuned("fake")
    assert gemma.weight != default.weight and default == embedders.tuned(embed.DEFAULT)


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
    normalisation; in bfloat16, as a CPU with native bfloat16 runs it, within its rounding), and
    the paraphrased question finds the set -e passage it shares no word with."""
    monkeypatch.delenv(embed.ENV, raising=False)
    model = embed.Embedder(embed.model_dir(embed.DEFAULT))
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(model.folder), device="cpu")
    texts = [*SHELL, "how do I make my script quit at the first error?"]
    expected = reference.encode(texts)
    np.testing.assert_allclose(model.encode(texts), expected, atol=2e-5)
    half = embed.Embedder(model.folder, "bfloat16").encode(texts)
    assert ((half * expected).sum(1) > 0.999).all()
    r = rank_passages(SHELL, "how do I make my script quit at the first error?", cache_dir=tmp_path)
    assert r.signal == f"bm25+{embed.DEFAULT}" and r.bm25.max() == 0 and r.order[0] == 1
    assert len(list((tmp_path / "vectors").glob("*.safetensors"))) == 1


def tiny_folder(tmp_path, pooling: str | None, prompts: dict | None = None, max_seq_length: int | None = None):
    """A 2-layer BERT with random weights and all-MiniLM-L6-v2's tokenizer, in sentence-transformers'
    layout with the given pooling, prompts and token limit (None: that file absent)."""
    import json
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    default = embed.model_dir(embed.DEFAULT)
    folder = tmp_path / f"tiny-{pooling}"
    folder.mkdir()
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default / name, folder / name)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    BertModel(config).eval().save_pretrained(folder)
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        modes = {f"pooling_mode_{m}": m == pooling for m in ("mean_tokens", "cls_token", "max_tokens")}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **modes}))
    if prompts is not None:
        (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return folder


def reference_vectors(folder, texts, pooling: str, max_tokens: int = 256) -> np.ndarray:
    """The pooled, normalised vectors computed here one text at a time (no padding), from the
    model's own forward pass: what sentence-transformers computes for these layouts."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
    rows = []
    for text in texts:
        batch = tok([text], truncation=True, max_length=max_tokens, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state[0]
        pooled = {"mean": hidden.mean(0), "cls": hidden[0], "max": hidden.max(0).values}[pooling]
        rows.append((pooled / pooled.norm()).numpy())
    return np.stack(rows)


@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
def test_the_folders_pooling_is_used(tmp_path, pooling):
    """A folder's 1_Pooling/config.json decides the pooling (texts of different lengths: the padded
    batch must pool as each text alone does)."""
    folder = tiny_folder(tmp_path, {"mean": "mean_tokens", "cls": "cls_token", "max": "max_tokens"}[pooling])
    model = embed.Embedder(folder)
    assert model.layout.pooling == pooling
    texts = [SHELL[1], "short one", SHELL[0]]
    np.testing.assert_allclose(model.encode(texts), reference_vectors(folder, texts, pooling), atol=1e-5)


def test_batches_hold_at_most_the_budget_shortest_first():
    """Every text once; a batch's rows times its longest within the budget (a longer text alone);
    shortest first, ties in input order."""
    lengths = [7, 3, 40, 3, 9, 12, 5, 100, 8, 8]
    got = embed.batches(lengths, 24)
    assert sorted(i for b in got for i in b) == list(range(len(lengths)))
    assert [i for b in got for i in b] == sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    assert all(len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 24 for b in got)
    assert got == [[1, 3, 6], [0, 8, 9], [4, 5], [2], [7]]  # worked out by hand
    assert embed.batches([], 24) == []


def test_texts_over_several_batches_come_back_in_their_order(tmp_path, monkeypatch):
    """Texts of many lengths over many small batches: each row is its own text's vector (as the
    text alone computes it)."""
    folder = tiny_folder(tmp_path, "mean_tokens")
    monkeypatch.setattr(embed, "BATCH_TOKENS", 40)
    texts = [" ".join(SHELL[i % 2].split()[: 3 + 5 * i]) for i in range(9)][::-1] + ["short one"]
    seen = []
    got = embed.Embedder(folder).encode(texts, on_progress=lambda done, total: seen.append((done, total)))
    np.testing.assert_allclose(got, reference_vectors(folder, texts, "mean"), atol=1e-5)
    assert seen[0] == (0, 10) and seen[-1] == (10, 10) and len(seen) > 3


def test_prompts_and_token_limit_and_the_vectors_key(tmp_path):
    """The query prompt goes before a question only, the passage prompt before a window; the token
    limit cuts; a folder without the files runs as all-MiniLM-L6-v2 (mean, 256, no prompt); the
    layout is part of the model's id (the vectors' key)."""
    plain = embed.Embedder(tiny_folder(tmp_path, None))
    assert plain.layout == embed.Layout()
    folder = tiny_folder(tmp_path, "cls_token", {"query": "query: ", "passage": "passage: "}, max_seq_length=8)
    model = embed.Embedder(folder)
    assert model.layout == embed.Layout("cls", 8, "query: ", "passage: ")
    q = "how do I make my script quit at the first error?"
    np.testing.assert_allclose(
        model.encode_query(q), reference_vectors(folder, ["query: " + q], "cls", 8)[0], atol=1e-5
    )
    np.testing.assert_allclose(
        model.encode([SHELL[1]]), reference_vectors(folder, ["passage: " + SHELL[1]], "cls", 8), atol=1e-5
    )
    assert not np.allclose(model.encode([q])[0], model.encode_query(q))
    before = model.id
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert embed.Embedder(folder).id != before


def test_in_bfloat16_near_float32_and_another_key(tmp_path):
    import torch

    """The encoder in bfloat16 (its token table, pooling, dense layers and norm in float32): vectors within
    bfloat16's rounding of the float32 reference, and another id (the vectors' key), while a
    float32 model keeps the id it had before dtypes were part of it."""
    folder = tiny_folder(tmp_path, "mean_tokens")
    texts = [SHELL[1], "short one", SHELL[0]]
    half, full = embed.Embedder(folder, "bfloat16"), embed.Embedder(folder)
    assert half.dtype == "bfloat16" and half.model.encoder.layer[0].output.dense.weight.dtype == torch.bfloat16
    assert half.model.get_input_embeddings().weight.dtype == torch.float32  # the table: looked up, then cast
    got, ref = half.encode(texts), reference_vectors(folder, texts, "mean")
    assert got.dtype == np.float32 and np.abs(got - ref).max() < 0.05 and not np.allclose(got, ref, atol=1e-6)
    assert ((got * ref).sum(1) > 0.999).all()
    assert half.id != full.id and "bfloat16" not in repr(full.layout)


def test_narrowed_hands_back_only_what_nothing_else_reads():
    """Weights tied by a shared storage are converted whole (handing the first one's pages back would
    zero the other's: anonymous memory reads back as zeros); the table stays float32, cast after."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(10, 2048)
            self.a, self.b, self.c = (torch.nn.Linear(2048, 2048, bias=False) for _ in range(3))
            self.b.weight = torch.nn.Parameter(self.a.weight.data)  # another Parameter on a's storage

        def get_input_embeddings(self):
            return self.table

    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    embed.narrowed(model, torch.bfloat16)
    for k, v in model.state_dict().items():
        assert v.dtype == (torch.float32 if k.startswith("table") else torch.bfloat16), k
        torch.testing.assert_close(v.float(), before[k], atol=0, rtol=2**-8)
    assert model.table(torch.tensor([1, 2])).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "fact,native,dtype", [(True, True, "bfloat16"), (True, False, "float32"), (False, True, "float32")]
)
def test_bfloat16_only_where_kvcli_measured_it_and_the_cpu_is_faster_in_it(tmp_path, monkeypatch, fact, native, dtype):
    from kvcli.retrieval import embedders
    from kvcli.runtime import native as native_mod

    folder = tiny_folder(tmp_path, "mean_tokens")
    monkeypatch.setattr(embed, "model_dir", lambda name: folder)
    monkeypatch.setattr(embedders, "bfloat16", lambda name: fact)
    monkeypatch.setattr(native_mod, "fast_gemm", lambda dt: native)
    embed.embedder.cache_clear()
    try:
        assert embed.embedder("some-model").dtype == dtype
    finally:
        embed.embedder.cache_clear()


def test_a_pooling_kvcli_cannot_run_is_one_error(tmp_path):
    folder = tiny_folder(tmp_path, "mean_tokens")
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_lasttoken": true}')
    with pytest.raises(ModelError, match="pools with pooling_mode_lasttoken"):
        embed.Embedder(folder)


def with_dense(folder, layers: list[tuple[int, int, bool, str]]):
    """``folder`` given sentence-transformers' modules.json with a Dense module per (in, out, bias,
    activation) after the pooling, then Normalize; random weights. Returns the folder."""
    import json

    import torch
    from safetensors.torch import save_file

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    torch.manual_seed(1)
    for i, (n_in, n_out, bias, act) in enumerate(layers, start=2):
        path = folder / f"{i}_Dense"
        path.mkdir()
        config = {"in_features": n_in, "out_features": n_out, "bias": bias, "activation_function": act}
        (path / "config.json").write_text(json.dumps(config))
        tensors = {"linear.weight": torch.randn(n_out, n_in) / n_in**0.5}
        if bias:
            tensors["linear.bias"] = torch.randn(n_out)
        save_file(tensors, path / "model.safetensors")
        modules.append({"idx": i, "name": str(i), "path": path.name, "type": "sentence_transformers.models.Dense"})
    modules.append(
        {"idx": len(modules), "name": "n", "path": "n_Normalize", "type": "sentence_transformers.models.Normalize"}
    )
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def test_dense_layers_after_the_pooling_as_sentence_transformers_runs_them(tmp_path):
    """EmbeddingGemma's layout: the pooled vector through Dense modules (modules.json) before the
    normalisation. Checked against sentence-transformers itself on a tiny folder with an identity
    and a tanh layer, one with a bias; their bytes are part of the model's id."""
    st = pytest.importorskip("sentence_transformers")
    folder = with_dense(
        tiny_folder(tmp_path, "mean_tokens", {"query": "q: ", "document": "d: "}),
        [(32, 48, False, "torch.nn.modules.linear.Identity"), (48, 24, True, "torch.nn.modules.activation.Tanh")],
    )
    model = embed.Embedder(folder)
    assert model.layout.dense == ("2_Dense", "3_Dense") and model.dim == 24
    reference = st.SentenceTransformer(str(folder), device="cpu")
    texts = [SHELL[1], "short one", SHELL[0]]
    np.testing.assert_allclose(model.encode(texts), reference.encode(["d: " + t for t in texts]), atol=1e-5)
    q = "how do I make my script quit at the first error?"
    np.testing.assert_allclose(model.encode_query(q), reference.encode(["q: " + q])[0], atol=1e-5)
    before = model.id
    save_file = pytest.importorskip("safetensors.torch").save_file
    import torch

    save_file({"linear.weight": torch.zeros(48, 32)}, folder / "2_Dense" / "model.safetensors")
    assert embed.Embedder(folder).id != before


def test_a_module_kvcli_cannot_run_is_one_error(tmp_path):
    folder = with_dense(tiny_folder(tmp_path, "mean_tokens"), [(32, 8, False, "torch.nn.modules.activation.ReLU")])
    with pytest.raises(ModelError, match="uses torch.nn.modules.activation.ReLU: kvcli runs identity or tanh"):
        embed.Embedder(folder)
    (folder / "modules.json").write_text('[{"path": "x", "type": "sentence_transformers.models.LayerNorm"}]')
    with pytest.raises(ModelError, match="has a LayerNorm module"):
        embed.Embedder(folder)


# --- an idle chat fills the file in (vectors.fill, Session.embed_rest) ----------------------------

FILL_PASSAGES = [f"page {i} holds " + "words " * (3 * i + 1) for i in range(7)]


def test_fill_embeds_every_passage_step_by_step_as_one_call_would(tmp_path):
    import threading

    model = Counting()
    assert vectors.fill(model, FILL_PASSAGES, tmp_path, threading.Event(), step=2)
    assert model.calls == 4  # 2 + 2 + 2 + 1 passages
    digest = vectors.key(Counting.id, FILL_PASSAGES)
    vecs, owner, done = vectors.load(vectors.path_for(tmp_path, digest), digest)
    ref, ref_owner, _ = vectors.passage_vectors(Counting(), FILL_PASSAGES, None)  # all at once, not kept
    assert done.all() and np.array_equal(owner, ref_owner) and np.allclose(vecs, ref)
    assert not vectors.fill(model, FILL_PASSAGES, tmp_path, threading.Event()) and model.calls == 4  # all there


def test_fill_stops_between_steps_and_where_the_file_cannot_be_written(tmp_path):
    import threading

    stop = threading.Event()

    class Stopping(Counting):
        def encode(self, texts, on_progress=None):
            stop.set()  # asked to stop while the first step runs: that step ends, no other starts
            return super().encode(texts, on_progress)

    assert vectors.fill(Stopping(), FILL_PASSAGES, tmp_path / "a", stop, step=2, order=[5, 2, 6])
    digest = vectors.key(Counting.id, FILL_PASSAGES)
    _, _, done = vectors.load(vectors.path_for(tmp_path / "a", digest), digest)
    assert np.flatnonzero(done).tolist() == [2, 5]  # the order's first two, then it stopped
    stop.clear()
    model = Counting()
    assert vectors.fill(model, FILL_PASSAGES, tmp_path / "a", stop, step=2, order=[5, 2, 6])
    assert [t.split()[1] for t in model.texts] == ["4"]  # 6, 0, 1, 3 before it: the order, then the rest
    _, _, done = vectors.load(vectors.path_for(tmp_path / "a", digest), digest)
    assert done.all()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "vectors").write_text("a file where the folder would be")
    model = Counting()
    assert not vectors.fill(model, FILL_PASSAGES, tmp_path / "b", threading.Event(), step=2) and model.calls == 1
