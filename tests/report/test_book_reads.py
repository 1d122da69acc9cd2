"""What InfLLM's stored book *read* (issue 41, item 3): the book holds the whole document, and a
question reads Initial, the Memory blocks its retrievals chose and Local. The read set is checked
against InfLLM written out plainly (:func:`tests.compressors.test_infllm.infllm_reference`, which
picks each layer's blocks by q·K itself), counted per block whatever the number of decoding steps,
and shown by ``inspect`` (terminal, JSON, HTML) and ``ask --show-selected`` with its pages."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvcli.answer.prompt import build_prompt
from kvcli.caches.representatives import partition
from kvcli.runtime.engine import Engine
from tests.compressors.test_infllm import DOC, SPEC, _Prefix, infllm_reference, read_traced, stage
from tests.helpers.cli_runner import assert_user_error
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one intra-op thread in this module)
from tests.report.test_inspect import make_pdf


def expected_read(n_prompt: int, chosen: list, *, initial: int, block_size: int, origin: int) -> torch.Tensor:
    """(n_layers, n_kv, n_prompt): Initial, the chosen blocks of each layer and KV head, Local."""
    mask = torch.zeros(len(chosen), len(chosen[0]), n_prompt, dtype=torch.bool)
    mask[:, :, :initial] = True
    mask[:, :, origin:] = True
    for layer, heads in enumerate(chosen):
        for head, blocks in enumerate(heads):
            for b in blocks:
                mask[layer, head, initial + b * block_size : initial + (b + 1) * block_size] = True
    return mask


@pytest.mark.parametrize("scores", ["representatives", "tokens"])
def test_the_read_set_is_what_a_retrieval_by_q_k_picks(tiny_lm, scores):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls near rock 3?")
    ids, n_doc = prompt.ids, prompt.prefix_len
    s = stage(lm, SPEC + f",answer_scores={scores}")
    book, trace = read_traced(s, engine, ids[:n_doc])
    assert book.read_mask(n_doc) is None  # nothing answered yet: nothing read
    cache, _, _ = s.prefill(engine, ids, prefix=_Prefix(book, n_doc))
    # the reference scores every block itself; where two blocks tie within its tolerance it
    # checks kvcli's pick is one of its top-k and goes on with it
    follow = {(start, layer): blocks for start, layer, blocks in trace}
    _, chosen = infllm_reference(
        lm,
        ids[:n_doc],
        ids[n_doc:],
        initial=4,
        block_size=8,
        local=16,
        topk=3,
        repr_topk=2,
        chunk=12,
        follow=follow,
        token_scores=scores == "tokens",
    )
    n = ids.numel()
    want = expected_read(n, chosen, initial=4, block_size=8, origin=cache.origin)
    assert cache.origin < n_doc and book.n_blocks == partition(n_doc, 4, 16, 8)[1] > 3
    assert torch.equal(cache.read_mask(n), want)
    assert bool(cache.kept_mask(n).all())  # what it holds: everything
    assert cache.stats()["kv_read_frac"] == pytest.approx(float(want.float().mean()))
    assert 0 < cache.stats()["kv_read_frac"] < 1
    # each layer and KV head retrieved once, its 3 blocks
    reads = cache.block_reads()
    assert reads.shape == (lm.n_layers, lm.n_kv_heads, book.n_blocks) and bool((reads.sum(dim=-1) == 3).all())


def test_decoding_steps_add_their_blocks_as_counts(tiny_lm):
    """retrieval=step: every decoding step retrieves its own blocks; the read set is their union
    and the counts add up, in a tensor of one int per block whatever the number of steps."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls near rock 3?")
    ids, n_doc = prompt.ids, prompt.prefix_len
    s = stage(lm, SPEC + ",retrieval=step")
    book = s.read(engine, ids[:n_doc])
    cache, logits, position = s.prefill(engine, ids, prefix=_Prefix(book, n_doc))
    after_question = cache.read_mask(ids.numel()).clone()
    shape = cache.block_reads().shape
    trace = cache.trace = []
    steps = 6
    token = int(logits.argmax())
    for i in range(steps):
        token = int(s.decode_step(engine, token, position + i, cache).argmax())
    reads = cache.block_reads()
    assert reads.shape == shape  # bounded: counts per block, not per step
    assert bool((reads.sum(dim=-1) == 3 * (1 + steps)).all())
    mask = cache.read_mask(ids.numel())
    assert bool(mask[after_question].all())  # the question's blocks stay read
    nothing = [[[]] * lm.n_kv_heads] * lm.n_layers
    by_step = expected_read(ids.numel(), nothing, initial=4, block_size=8, origin=cache.origin)
    for _, layer, blocks in trace:  # and the steps' own retrievals are added
        for head, chosen in enumerate(blocks):
            for b in chosen:
                by_step[layer, head, 4 + 8 * b : 12 + 8 * b] = True
    assert torch.equal(mask, after_question | by_step)


# --- what the commands show ------------------------------------------------------------------------

PAGE = " ".join(f"Line {i}: the keeper counted {i * 7 % 13} gulls near rock {i % 5}." for i in range(14))
BOOK_SPEC = "infllm:block_size=16,initial=16,local_window=64,topk=2,chunk=64"


@pytest.fixture(scope="module")
def small_window(tiny_dir) -> str:
    """A tiny llama with a 512-token window: a few PDF pages are over it."""
    return str(tiny_dir("llama", num_hidden_layers=4, max_position_embeddings=512))


@pytest.fixture(scope="module")
def book_pdf(tmp_path_factory):
    pages = [f"Page {p}. " + PAGE.replace("Line", f"P{p} line") for p in range(1, 7)]
    return make_pdf(tmp_path_factory.mktemp("book") / "book.pdf", pages)


def test_inspect_shows_what_the_question_read_with_pages(cli, small_window, book_pdf, tmp_path):
    args = ("inspect", book_pdf, "How many gulls near rock 3?", "-m", small_window, "-c", BOOK_SPEC, "--no-cache")
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    record = json.loads(out)
    n = record["n_prompt_tokens"]
    assert n > 512 and record["view"] == "read" and record["score"] == "read"
    assert record["n_kept_tokens"] == n and record["compression_ratio"] == 1.0  # it holds everything
    assert 0 < record["kv_read_frac"] < 0.5
    assert record["n_read_tokens"] == pytest.approx(record["kv_read_frac"] * n, abs=n * 1e-4)
    assert record["n_read_any"] < n and record["n_kept_any"] == n
    assert record["spans"] and {s["page"] for s in record["spans"]} >= {1, 6}  # Initial (p.1), Local (the last page)
    # the tiny model retrieves per layer (no filter layer): layers read different blocks
    assert record["read_same_in_every_layer"] is False and len(record["read_layers"]) == 4
    union = set()
    for row in record["read_layers"]:
        assert row["n_read_tokens"] <= record["n_read_any"] and row["pages"]
        union |= {c for a, b in row["spans"] for c in range(a, b)}
    assert union == {c for s in record["spans"] for c in range(s["start"], s["end"])}  # the layers' reads add up
    assert record["method_stats"]["kv_read_frac"] == pytest.approx(record["kv_read_frac"], abs=1e-3)

    code, out, err = cli(*args)
    assert code == 0, err
    assert "everything kept" not in out
    assert f"holds all {n:,} prompt tokens" in out and f"({record['kv_read_frac']:.1%} of the KV)" in out
    table = out.split("read per layer", 1)[1]
    rows = [line.split()[0] for line in table.splitlines() if re.match(r"\s*\d+\s+[\d.]+\s+[\d.]+%", line)]
    assert rows == ["0", "1", "2", "3"]
    assert re.search(r"p\.1\b.*p\.6", table)
    assert "⟦ ⟧ mark the read text" in out and "⟦" in out  # a pipe: marks and their legend
    header = out.splitlines()[0]
    assert "infllm:block_size=16" in header and "answer_positions" not in header  # the knobs set (all in --json)

    page = tmp_path / "read.html"
    code, out, err = cli(*args, "--html", page)
    assert code == 0, err
    text = page.read_text()
    assert "What infllm:block_size=16" in text and " read of book.pdf" in text and "read by " in text
    assert "read per layer" in text and "<mark" in text


def test_ask_show_selected_and_the_stats_line_say_what_was_read(cli, small_window, book_pdf):
    args = (
        "ask",
        book_pdf,
        "How many gulls near rock 3?",
        "-m",
        small_window,
        "-c",
        BOOK_SPEC,
        "--no-cache",
        "--max-new-tokens",
        "4",
    )
    code, out, err = cli(*args, "--json", "--show-selected")
    assert code == 0, err
    record = json.loads(out)
    assert record["compression_ratio"] == 1.0 and 0 < record["kv_read_frac"] < 0.5
    n_doc_tokens = record["n_document_tokens"]
    assert 0 < sum(s["n_tokens"] for s in record["selected_spans"]) < n_doc_tokens  # what was read, not everything

    code, out, err = cli(*args, "--show-selected")
    assert code == 0, err
    assert "read " in out and "prompt tokens per layer and KV head" in out and "⟦ ⟧ mark the read text" in out
    assert re.search(r"\bp\.1\b", out) and re.search(r"\bp\.6\b", out)
    stats = err.splitlines()[-1]
    assert stats.startswith("infllm:block_size=16,initial=16,local_window=64,topk=2,chunk=64 · ")
    assert f"{record['kv_read_frac']:.0%} of it read" in stats


def test_inspect_over_the_window_names_a_method_that_reads_it(cli, small_window, book_pdf):
    """inspect's default is gemfilter: the refusal does not call -c auto the default."""
    line = assert_user_error(
        cli("inspect", book_pdf, "How many gulls?", "-c", "gemfilter", "-m", small_window, "--no-cache"), 1
    )
    assert "use -c auto" in line and "default" not in line
