"""A document's passages (kvcli.documents.pagination): a PDF's pages, else runs of about a page cut
at paragraph, then line, then sentence ends whatever the blank lines. The expected cuts are written
out by hand on small sizes; the page size itself on the real manuals' text."""

from __future__ import annotations

import pytest

from kvcli.answer.prompt import build_prompt
from kvcli.compressors import parse_one
from kvcli.documents import Document, document_from_text
from kvcli.documents.pagination import PASSAGE_CHARS, passages
from kvcli.runtime.engine import Engine


def cut(text: str, size: int, starts=(0,)) -> list[str]:
    return [text[a:b] for a, b in passages(text, starts, size)]


def test_paragraphs_that_fit_are_joined_up_to_the_size():
    text = "One two.\n\nThree four.\n\nFive six seven.\n\nEight."
    assert cut(text, 30) == ["One two.\n\nThree four.", "Five six seven.\n\nEight."]
    assert cut(text, 1000) == [text]  # a short note: one passage
    assert cut(text, 15) == ["One two.", "Three four.", "Five six seven.", "Eight."]


def test_a_cut_prefers_a_paragraph_end_to_a_line_end():
    # the second paragraph (47 characters) is over 40: its lines are the pieces. The first paragraph
    # (23) and "line one" fit in 40 (33), "line two" not: the passage ends at the paragraph's end
    # (past half the size), not after "line one"
    text = "alpha beta gamma delta.\n\nline one\nline two\nline three\nline four\nline five"
    assert cut(text, 40) == ["alpha beta gamma delta.", "line one\nline two\nline three\nline four", "line five"]


def test_a_text_without_blank_lines_is_cut_at_line_ends():
    lines = [f"line {i:02d} of a text with no blank line" for i in range(10)]  # 34 characters each
    text = "\n".join(lines)
    got = cut(text, 100)  # two lines and the newline between them: 69; three: 104
    assert got == ["\n".join(lines[i : i + 2]) for i in range(0, 10, 2)]
    assert len(passages(text)) == 1  # 349 characters: under a page, one passage


def test_one_long_line_is_cut_at_sentence_ends():
    sentences = [f"Sentence {i} ends here." for i in range(6)]  # 22 characters each
    text = " ".join(sentences)
    assert cut(text, 50) == [" ".join(sentences[i : i + 2]) for i in range(0, 6, 2)]


def test_a_sentence_over_the_size_is_cut_between_words_and_a_word_inside():
    assert cut("alpha beta gamma delta", 11) == ["alpha beta", "gamma delta"]
    assert cut("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]


def test_pages_stay_the_passages_of_a_pdf():
    text = "page one.\n\n\fpage two, paragraph one.\n\nparagraph two.\n"
    assert passages(text, (0, 11)) == [(0, 9), (12, len(text) - 1)]  # a page is one passage, its blank lines too
    long_page = "word " * 1000  # a page over PASSAGE_CHARS is still one passage
    doc = Document("x.pdf", long_page + "\n\nnext", (0, len(long_page) + 2), "pdf", "0")
    assert len(doc.passages()) == 2


@pytest.mark.parametrize("size", [40, 200, PASSAGE_CHARS])
@pytest.mark.parametrize(
    "text",
    [
        "\n\n".join(f"Paragraph {i}. " + "Some words here. " * (i % 7 + 1) for i in range(60)),
        "\n".join(f"Line {i} with a few words on it" + ("." if i % 3 else "") for i in range(300)),
        " ".join(f"Sentence {i} is short." for i in range(400)),
    ],
    ids=["paragraphs", "no-blank-lines", "one-line"],
)
def test_every_passage_fits_and_together_they_hold_the_whole_text(text, size):
    spans = passages(text, (0,), size)
    assert all(0 < b - a <= size for a, b in spans)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))  # in order, apart
    # what lies outside the passages is whitespace
    rest = (
        text[: spans[0][0]] + "".join(text[b1:a2] for (_, b1), (a2, _) in zip(spans, spans[1:])) + text[spans[-1][1] :]
    )
    assert not rest.strip()
    # no passage is under half the size but where the next piece could not join it, or the last
    if len(text) > size:
        assert all(b - a >= size / 4 for a, b in spans[:-1])


def test_pages_reads_the_answers_part_of_a_text_without_blank_lines(tiny_lm):
    """The issue's case: a text without blank lines was one passage, so pages read its first
    tokens whatever the question. Now it reads the page-sized run that holds the answer."""
    lm = tiny_lm("llama")
    filler = [f"Row {i}: the harbour log notes calm water and a light breeze." for i in range(400)]
    filler[300] = "Row 300: the padlock combination of the oil store is 4417."
    doc = document_from_text("\n".join(filler))
    assert len(doc.passages()) > 5
    prompt = build_prompt(lm.tokenizer, doc.text, "What is the padlock combination?", page_starts=doc.page_starts)
    method = parse_one("pages:pages=1,skim=0")
    method.configure(lm)
    sel = method.select_tokens(Engine(lm), prompt.ids, protected=prompt.n_after_document, prompt=prompt)
    kept = [i for i in sel.kept.tolist() if prompt.doc_start <= i < prompt.doc_end]
    lo, hi = prompt.char_span(kept[0])[0], prompt.char_span(kept[-1])[1]
    assert lo <= doc.text.index("Row 300:") < hi and hi - lo <= PASSAGE_CHARS


def test_a_prompts_passages_know_the_line_they_begin_on(tiny_lm):
    """Each passage's first line (what a note names in a document without pages), against the
    newlines counted before it; its last line from its own text."""
    lines = [f"Line {i} of the harbour log, with a few words to fill it out." for i in range(400)]
    text = "\n".join(lines[:150]) + "\n\n\n" + "\n".join(lines[150:])
    prompt = build_prompt(tiny_lm("llama").tokenizer, text, "Which line?")
    assert len(prompt.passages) > 3
    for p in prompt.passages:
        assert p.line == text.count("\n", 0, p.char_start) + 1
        last = text.count("\n", 0, p.char_start + len(p.text.rstrip("\n"))) + 1
        assert p.where(paged=False) == (f"lines {p.line}-{last}" if last > p.line else f"line {p.line}")
