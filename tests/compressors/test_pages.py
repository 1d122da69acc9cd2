"""``pages``: the question's best passages by BM25, read whole. The kept tokens are checked against
the tokenizer's own offsets (which characters each token covers) and the passages cut by hand."""

from __future__ import annotations

import json

import pytest
import torch

from kvcli.answer.pipeline import Pipeline
from kvcli.answer.prompt import build_prompt
from kvcli.compressors import parse_one
from kvcli.documents import Document, passages
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine

PARAS = [
    "The keeper's log begins with flour, lamp oil and two crates of tinned herring.",
    "The padlock combination of the oil store is 4417; the spare padlock key hangs behind the door.",
    "The gale arrived from the south west and the fog signal stuck on cold mornings.",
    "The inspector praised the brass; the oil store was painted in March.",
]
DOC = "\n\n".join(PARAS)
QUESTION = "What is the padlock combination of the oil store?"


def kept_characters(prompt, kept: torch.Tensor) -> str:
    """The document text the kept tokens cover, from the tokenizer's offsets, in order."""
    doc = [i for i in kept.tolist() if prompt.doc_start <= i < prompt.doc_end]
    return "".join(DOC[slice(*prompt.doc_offsets[i - prompt.doc_start])] for i in doc)


def select(lm, spec: str, text: str = DOC, page_starts=(0,)):
    prompt = build_prompt(lm.tokenizer, text, QUESTION, page_starts=page_starts)
    method = parse_one(spec)
    method.configure(lm)
    sel = method.select_tokens(Engine(lm), prompt.ids, protected=prompt.n_after_document, prompt=prompt)
    return prompt, sel


def test_passages_are_pages_else_paragraphs():
    assert [DOC[a:b] for a, b in passages(DOC)] == PARAS
    text = "page one.\n\n\fpage two, paragraph one.\n\nparagraph two.\n"
    assert passages(text, (0, 11)) == [(0, 9), (12, len(text) - 1)]  # a page is one passage, its blank lines too


def test_the_best_passage_is_read_whole_with_everything_around_the_document(tiny_lm):
    lm = tiny_lm("llama")
    prompt, sel = select(lm, "pages:pages=1")
    kept = sel.kept
    outside = [i for i in range(prompt.n_tokens) if not prompt.doc_start <= i < prompt.doc_end]
    assert set(outside) <= set(kept.tolist())
    # paragraph 2 holds "padlock" twice and "combination": BM25's best; it and the blank line after it
    assert kept_characters(prompt, kept).strip() == PARAS[1]
    # every token of a kept passage is kept (none cut), and its score is the passage's BM25 score
    doc_scores = sel.scores[prompt.doc_start : prompt.doc_end]
    assert torch.isnan(sel.scores[: prompt.doc_start]).all() and not torch.isnan(doc_scores).any()
    assert doc_scores.max() == sel.scores[kept[prompt.doc_start]]


def test_pages_and_budget(tiny_lm):
    lm = tiny_lm("llama")
    # two passages: the padlock paragraph, then the one that says "oil store" too, in document order
    prompt, sel = select(lm, "pages:pages=2")
    assert kept_characters(prompt, sel.kept).split("\n\n") == [PARAS[1], PARAS[3]]
    # a budget with room for the head and one passage only: the second best is left out
    n_best = len(lm.tokenizer(PARAS[1] + "\n\n", add_special_tokens=False)["input_ids"])
    prompt, sel = select(lm, f"pages:pages=2,budget={prompt.doc_start + n_best + 2}")
    assert kept_characters(prompt, sel.kept).strip() == PARAS[1]
    # the best passage alone over the budget: its first tokens, as many as fit
    prompt, sel = select(lm, f"pages:pages=2,budget={prompt.doc_start + 5}")
    doc_kept = [i for i in sel.kept.tolist() if prompt.doc_start <= i < prompt.doc_end]
    assert len(doc_kept) == 5 and PARAS[1].startswith(kept_characters(prompt, sel.kept).lstrip())


def test_a_pdfs_pages_are_the_passages(tiny_lm):
    lm = tiny_lm("llama")
    pages = ["Page one: the log and the herring.", "Page two: the padlock combination is 4417.", "Page three."]
    text = "\n".join(pages)
    starts = (0, len(pages[0]) + 1, len(pages[0]) + len(pages[1]) + 2)
    doc = Document("log.pdf", text, starts, "pdf", "0" * 64)
    assert [text[a:b] for a, b in doc.passages()] == pages
    prompt, sel = select(lm, "pages:pages=1", text, starts)
    doc_kept = [i for i in sel.kept.tolist() if prompt.doc_start <= i < prompt.doc_end]
    got = "".join(text[slice(*prompt.doc_offsets[i - prompt.doc_start])] for i in doc_kept)
    assert got.strip() == pages[1]


def test_keeping_every_passage_keeps_the_whole_prompt(tiny_lm):
    lm = tiny_lm("llama")
    prompt, sel = select(lm, "pages:pages=4,budget=100000")
    assert sel.kept.tolist() == list(range(prompt.n_tokens))


def test_usage_errors_are_one_line():
    for spec in ("pages:pages=0", "pages:budget=0"):
        with pytest.raises(UsageError):
            parse_one(spec)
    with pytest.raises(UsageError, match="must come first"):
        Pipeline.parse("gemfilter+pages")


def test_ask_cites_within_the_pages_it_read(cli, tiny_dir, tmp_path):
    src = tmp_path / "log.md"
    src.write_text(DOC, encoding="utf-8")
    code, out, err = cli(
        "ask",
        src,
        QUESTION,
        "-c",
        "pages:pages=1",
        "--model",
        str(tiny_dir("llama")),
        "--json",
        "--no-cache",
        "--max-new-tokens",
        "4",
    )
    assert code == 0, err
    record = json.loads(out)
    lo = DOC.index(PARAS[1])
    assert record["compressor"].startswith("pages:pages=1")
    assert record["sources"] and all(lo <= s["start"] and s["end"] <= lo + len(PARAS[1]) for s in record["sources"])


def test_its_sources_come_one_a_passage_in_the_passages_order(cli, tiny_dir, tmp_path):
    """Two paragraphs read: the first source in the best one (BM25's), the second in the other,
    whatever the tiny random model's attention says (kvcli.cite.sources.rank's groups)."""
    src = tmp_path / "log.md"
    src.write_text(DOC, encoding="utf-8")
    model = str(tiny_dir("llama"))
    code, out, err = cli(
        "ask", src, QUESTION, "-c", "pages:pages=2", "--model", model, "--json", "--no-cache", "--max-new-tokens", "4"
    )
    assert code == 0, err
    got = [(s["start"], s["end"]) for s in json.loads(out)["sources"]]
    within = [next(i for i, p in enumerate(PARAS) if DOC.index(p) <= a and b <= DOC.index(p) + len(p)) for a, b in got]
    assert within == [1, 3]
