"""Turn (document, question) into prompt token ids with a known layout.

The rendered prompt is cut into five pieces, tokenized separately so their boundaries are exact:

    [head][document][middle] | [question][tail]
    └──── question-agnostic prefix ────┘ └─ suffix ─┘

``head``/``middle``/``tail`` come from the template (``prompts/*.txt``, :mod:`kvcli.templates`) rendered through the
model's chat template; ``tail`` ends with the generation prompt (e.g. ``<|im_start|>assistant\\n``).
Document tokens carry their character span in ``Document.text`` so any kept token maps back to
text and page.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..documents import passages
from ..errors import DocumentError
from ..templates import load_template, render_pieces


@dataclass(frozen=True)
class Passage:
    """A passage of the document (a page, or a page-sized run of an unpaged one) in the prompt: tokens
    ``[start, end)`` (prompt indices), its text, which begins at ``char_start`` of the document."""

    start: int
    end: int
    char_start: int
    text: str
    page: int = 1  # the document's page (1-based) it begins on: what a note about it names
    line: int = 1  # the document's line (1-based) it begins on: what a note names in a document without pages

    def where(self, paged: bool) -> str:
        """``page 12``, or ``lines 40-71`` in a document without pages."""
        if paged:
            return f"page {self.page}"
        last = self.line + self.text.rstrip("\n").count("\n")
        return f"line {self.line}" if last == self.line else f"lines {self.line}-{last}"


@dataclass
class Prompt:
    ids: torch.Tensor  # (n,) int64: the whole prompt
    doc_start: int  # document tokens are ids[doc_start:doc_end]
    doc_end: int
    prefix_len: int  # ids[:prefix_len] do not depend on the question
    doc_offsets: list[tuple[int, int]]  # (start, end) character span in the document of each document token
    question: str = ""  # the question as asked (stripped)
    # the document's passages (pages, else page-sized runs: kvcli.documents.pagination), each as the prompt
    # tokens it covers: what a method that ranks passages by the question reads (``pages``)
    passages: tuple[Passage, ...] = ()

    @property
    def n_tokens(self) -> int:
        return self.ids.numel()

    @property
    def n_document_tokens(self) -> int:
        return self.doc_end - self.doc_start

    @property
    def n_suffix(self) -> int:
        """Tokens after the prefix: the question and the generation prompt."""
        return self.n_tokens - self.prefix_len

    @property
    def n_after_document(self) -> int:
        """Tokens after the document: the template's ``middle`` (the instructions between the
        document and the question), the question and the ``tail`` (generation prompt). What
        question-guided methods (GemFilter's ``keep_question``, Finch) never compress — unlike
        :attr:`n_suffix`, which is the question-dependent part (the disk store's prefix split)."""
        return self.n_tokens - self.doc_end

    def char_span(self, token_index: int) -> tuple[int, int] | None:
        """Document character span of prompt token ``token_index``; None outside the document."""
        if self.doc_start <= token_index < self.doc_end:
            return self.doc_offsets[token_index - self.doc_start]
        return None


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def build_prompt(
    tokenizer,
    document_text: str,
    question: str,
    template: str | None = None,
    answer_prefix: str = "",
    page_starts: tuple[int, ...] = (0,),
) -> Prompt:
    """``answer_prefix``: text that starts the model's answer, after the generation prompt (RULER's
    "The special magic number for ... is"); it is part of the suffix, never of the answer.
    ``page_starts``: the document's (:class:`kvcli.documents.Document`), for its passages."""
    head, middle, tail = render_pieces(tokenizer, template or load_template())
    enc = tokenizer(document_text, add_special_tokens=False, return_offsets_mapping=True)
    doc_ids = enc["input_ids"]
    if not doc_ids:
        raise DocumentError("the document has no tokens")
    head_ids, middle_ids = _encode(tokenizer, head), _encode(tokenizer, middle)
    question_ids = _encode(tokenizer, question.strip()) + _encode(tokenizer, tail) + _encode(tokenizer, answer_prefix)
    ids = head_ids + doc_ids + middle_ids + question_ids
    return Prompt(
        ids=torch.tensor(ids, dtype=torch.long),
        doc_start=len(head_ids),
        doc_end=len(head_ids) + len(doc_ids),
        prefix_len=len(head_ids) + len(doc_ids) + len(middle_ids),
        doc_offsets=[tuple(o) for o in enc["offset_mapping"]],
        question=question.strip(),
        passages=_passages(document_text, page_starts, enc["offset_mapping"], len(head_ids)),
    )


def _passages(text: str, page_starts, offsets, first: int) -> tuple[Passage, ...]:
    """The document's passages as prompt tokens: a token belongs to the passage its first
    character is in (tokens between passages, whitespace, to none); ``first``: the document's first
    prompt index."""
    starts = [int(o[0]) for o in offsets]
    out = []
    line, counted = 1, 0  # the line at character ``counted``
    for lo, hi in passages(text, page_starts):
        line, counted = line + text.count("\n", counted, lo), lo
        a, b = bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)
        if b > a:
            out.append(Passage(first + a, first + b, lo, text[lo:hi], bisect.bisect_right(page_starts, lo), line))
    return tuple(out)
