"""The question expanded by a passage the model writes first (Query2doc: Wang, Yang & Wei 2023,
"Query2doc: Query Expansion with Large Language Models", arXiv:2303.07678).

A user asks in their own words ("How do I put an apostrophe inside a quoted text constant?"); the
page says it in the manual's ("a single quote ... must be coded twice"). Before the pages are
ranked, the language model that will answer writes, closed-book, a short passage of the manual that
would answer the question (:data:`PROMPT`, given the document's first :data:`HEAD_WORDS` words so
that it knows which manual); that passage, right or wrong, is in the manual's vocabulary. As the
paper does, the lexical query is the question repeated :data:`REPEAT` times then the passage
(BM25 weighs the question's own words above the passage's), and the dense query the question, a
space and the passage (:func:`queries`). The passage only ranks the pages: the answer is still
read from them (``--json`` shows the passage as ``read.expansion``, never as an answer).

It costs one short generation before the ranking, and it is an option (``pages:expand=48``), not
a default: on the tuning questions the 1.5B Qwen's passages put the answer's page first for 20 of
30 questions in a user's words where the question alone did for 16 (among three: 25 and 23), but
the answers did not follow (docs/bench/qwen/README.md, "The question expanded by the model's own
passage"). The 0.5B's passages found no more pages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..runtime.decode import greedy
from ..templates import rendered_ids

# what the model is asked; {document} stands for the document's first words, after HEAD
PROMPT = "{document}Write a short passage of this manual that answers the question.\nQuestion: {question}"
HEAD = "A manual begins:\n{words}\n\n"
HEAD_WORDS = 40  # the document's first words the model is shown: enough to name the manual and its subject
REPEAT = 5  # the question's copies before the passage in the lexical query (the paper's n = 5)


@dataclass(frozen=True)
class Expansion:
    """The passage the model wrote (``text``, its ``n_tokens``) and how long it took (``seconds``)."""

    text: str
    n_tokens: int
    seconds: float


def head_words(texts: list[str], n: int = HEAD_WORDS) -> str:
    """The first ``n`` words of the document whose passages are ``texts``, joined by spaces."""
    words: list[str] = []
    for text in texts:
        words += text.split()
        if len(words) >= n:
            break
    return " ".join(words[:n])


def prompt_ids(tokenizer, question: str, head: str) -> list[int]:
    """:data:`PROMPT`'s token ids through the model's chat template, ``head`` (the document's
    first words, :func:`head_words`) in it."""
    return rendered_ids(tokenizer, PROMPT, HEAD.format(words=head), question)


@torch.inference_mode()
def write_passage(engine, tokenizer, stop_ids: set[int], question: str, head: str, tokens: int) -> Expansion:
    """The passage the model writes for ``question`` (greedy, at most ``tokens`` tokens, ended by a
    stop token), on a cache of its own; ``head``: the document's first words (:func:`head_words`)."""
    start = time.perf_counter()
    ids = prompt_ids(tokenizer, question, head)
    cache, logits = engine.prefill(torch.tensor(ids))
    out = greedy(engine, logits, cache, len(ids), tokens, stop_ids)
    text = tokenizer.decode(out, skip_special_tokens=True).strip()
    return Expansion(text, len(out), time.perf_counter() - start)


def queries(question: str, passage: str) -> tuple[str, str]:
    """(the lexical query, the dense query) of ``question`` expanded by ``passage`` (module doc);
    an empty passage leaves the question as it is."""
    if not passage.strip():
        return question, question
    return " ".join([question] * REPEAT + [passage]), f"{question} {passage}"
