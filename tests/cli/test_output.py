"""What kvcli prints besides answers, issue 41's item 9: a method named by what the user set (the
whole spec in --json), a batch's summary naming every method that answered, the over-window note
said once per document, a legend for ⟦ ⟧, Gemma's sliding windows in the KV figures, and a
`kvcli compressors` a person reads."""

from __future__ import annotations

import json
import re

import pytest

from kvcli import notices
from kvcli.answer.labels import spec_label
from kvcli.answer.pipeline import Pipeline


def test_a_spec_is_shown_by_its_name_and_the_knobs_the_user_set():
    full = (
        "infllm:preset=auto,block_size=128,initial=128,local_window=1024,topk=8,answer_topk=50,repr_topk=4,"
        "chunk=512,kv_dtype=float16,retrieval=question,answer_scores=tokens,filter_layer=17,"
        "answer_positions=ordered"
    )
    assert len(full) > 200
    assert spec_label(full, Pipeline.parse("infllm:answer_topk=50")) == "infllm:answer_topk=50"
    assert spec_label(full, Pipeline.parse("infllm")) == "infllm"
    assert spec_label(full, Pipeline.parse("auto")) == "infllm"  # -c auto: the method it chose
    assert spec_label("full", Pipeline.parse("auto")) == "full"
    chain = "gemfilter:layer=13,k=1024,kernel=5,keep_question=true,span=1+snapkv:budget=64,window=32,kernel=7,pool=max"
    given = Pipeline.parse("gemfilter:k=1024+snapkv:budget=64")
    assert spec_label(chain, given) == "gemfilter:k=1024+snapkv:budget=64"


@pytest.fixture
def two_sizes(tmp_path, tiny_dir):
    """A folder with a short note and a document over the 2,048-token window of a tiny llama, on
    which -c auto reads the long one with pages (as on the embedded model past 8,192 tokens)."""
    model = str(tiny_dir("llama", num_hidden_layers=2, max_position_embeddings=2048))
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a-short.txt").write_text("The keeper counted 7 gulls.")
    long = " ".join(f"Line {i}: the keeper counted {i % 13} gulls near rock {i % 5}." for i in range(190))
    (folder / "b-long.txt").write_text(long)
    return model, folder


def test_a_batch_summary_names_each_method_with_its_count(cli, two_sizes):
    model, folder = two_sizes
    code, out, err = cli("ask", folder, "How many gulls?", "-m", model, "--max-new-tokens", "2", "--no-cache", "-q")
    assert code == 0 and err == "", err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["compressor"].split(":")[0] for r in records] == ["full", "pages"]
    assert (
        records[1]["compressor"] == "pages:pages=1,skim=2,skim_tokens=64,candidates=30,budget=1024,expand=0"
    )  # the JSON keeps every knob (half the window)
    code, out, err = cli("ask", folder, "How many gulls?", "-m", model, "--max-new-tokens", "2", "--no-cache")
    assert code == 0, err
    assert err.splitlines()[-1] == "2 answered, 0 failed · full ×1, pages ×1"


def test_the_over_window_note_is_said_once_per_document_and_short(cli, two_sizes, tmp_path):
    """A stored book (-c infllm) says it stores the book, then nothing on a cache hit."""
    model, folder = two_sizes
    args = (
        "ask",
        folder / "b-long.txt",
        "How many gulls?",
        "-c",
        "infllm",
        "-m",
        model,
        "--max-new-tokens",
        "2",
        "--cache-dir",
        tmp_path / "c",
    )
    code, out, err = cli(*args)
    assert code == 0, err
    assert "window" not in err and "storing the document's KV" in err  # the first read says it stores the book
    code, out, err = cli(*args)  # a cache hit: nothing to say
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("kvcli: warning")] == []
    stats = err.splitlines()[-1]
    assert re.match(r"infllm · KV kept [\d,]+/[\d,]+ tokens \(1\.0×\), \d+% of it read · ", stats), err
    notices.reset()  # a new process (the tests before said it in this one)
    code, out, err = cli(*args, "--no-cache")  # no store: every run reads it, and is told so
    warnings = [line for line in err.splitlines() if line.startswith("kvcli: warning")]
    assert code == 0 and len(warnings) == 1 and "window" in warnings[0], warnings
    assert len(warnings[0].replace(model, "smollm2-135m-instruct")) < 230, warnings  # was ~400 characters
    notices.reset()  # leave nothing said for the next test's JSON records


def test_gemma_sliding_windows_are_named_beside_the_ratio(cli, tiny_dir, tmp_path):
    model = str(tiny_dir("gemma3", num_hidden_layers=4))
    doc = tmp_path / "log.txt"
    doc.write_text(" ".join(f"Entry {i}: the keeper logged {i % 13} ships." for i in range(30)))
    code, out, err = cli(
        "ask", doc, "How many ships?", "-m", model, "-c", "full", "--max-new-tokens", "2", "--no-cache"
    )
    assert code == 0, err
    kept = re.search(r"KV kept ([\d,]+)/([\d,]+) tokens \(sliding windows; 1\.0× compression vs full attention\)", err)
    assert kept and int(kept[1].replace(",", "")) < int(kept[2].replace(",", "")), err


def test_piped_show_selected_has_a_legend_for_its_marks(cli, model, tmp_path):
    doc = tmp_path / "log.txt"
    doc.write_text(" ".join(f"Entry {i}: the keeper logged {i * 7 % 13} ships and {i % 5} storms." for i in range(40)))
    code, out, err = cli(
        "ask",
        doc,
        "How many ships?",
        "-m",
        model,
        "-c",
        "gemfilter:k=200",
        "--max-new-tokens",
        "2",
        "--no-cache",
        "--show-selected",
    )
    assert code == 0, err
    lines = out.splitlines()
    legend = [i for i, line in enumerate(lines) if line.startswith("⟦ ⟧ mark the kept text")]
    assert len(legend) == 1 and "⟦" in "\n".join(lines[legend[0] + 1 :])


def test_compressors_is_a_short_table_and_a_method_shows_its_knobs(cli):
    from kvcli.compressors import REGISTRY

    code, out, err = cli("compressors")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) <= 2 * len(REGISTRY) + 3 and max(map(len, lines)) <= 80
    assert "acts at" not in out and "build_prefix" not in out
    for name in REGISTRY:
        assert re.search(rf"^{name}\s", out, re.M), name
    assert re.search(r"^\s+k=auto|^\s+layer=auto, k=auto, kernel=5", out, re.M)
    code, out, err = cli("compressors", "GemFilter")
    assert code == 0, err
    assert out.startswith("gemfilter — GemFilter") and "paper: " in out
    for knob in ("layer", "k", "kernel"):
        assert re.search(rf"^\s*{knob}\s", out, re.M), knob
    code, out, err = cli("compressors", "gemfiltre")
    assert code == 2 and out == "" and err.startswith("kvcli: error: unknown compressor 'gemfiltre'; available: ")
