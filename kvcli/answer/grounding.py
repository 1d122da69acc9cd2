"""Whether an answer comes from the document: the answer's tokens with the document against without it.

A model asked about something no page states answers anyway, from what it learned (on four R
manuals' held-out questions that no page answers, the 1.5B Qwen declined none of 12). The answer's
own tokens say where they came from: each token's log-probability as it was chosen, the document
read (recorded while decoding, so any method's reading counts), against the same tokens after the
question alone in a closed-book prompt (:data:`CLOSED_BOOK`, one pass over ~50 tokens and the
answer: 0.5 s on the 0.5B Qwen, 1.1-1.4 s on the 1.5B, on 2 cores, after the answer is shown).
Their mean difference, nats per answer token, is the document's pointwise mutual information with the answer (:attr:`Grounding.score`): a token copied from a page
(a number, a name, an option) gains several nats; an answer the model gives as readily without the
pages gains about none. Under the model's threshold the answer gets a note, never a different answer.

The threshold is a model's measured fact (``check_threshold`` in kvcli/model/models.json), chosen on
tuning questions (docs/bench/cite/unanswerable-tuning.json and the tuning manuals' answerable ones)
and reported on the held-out set (docs/bench/qwen/README.md, "Answers no page gives"); a model
without one is not checked. A right answer the model knew already ("ODBC stands for Open Database
Connectivity") gains little from its page, so the note says "may": check the sources.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..runtime.decode import chosen_logprobs
from ..templates import rendered_ids

# the closed-book prompt: the question alone, rendered through the model's chat template
CLOSED_BOOK = "{document}Answer the question. Be brief.\nQuestion: {question}"


@dataclass(frozen=True)
class Grounding:
    """``score``: the mean over the answer's tokens of log p(token | document, question) - log
    p(token | question alone), in nats; ``threshold``: the model's, under which the answer may not
    come from the document; ``seconds``: the closed-book pass's time."""

    score: float
    threshold: float
    seconds: float

    @property
    def grounded(self) -> bool:
        return self.score >= self.threshold

    def note(self) -> str | None:
        """The line said when the answer may not come from the document (None: it does)."""
        if self.grounded:
            return None
        return (
            "the answer may not come from the document: the model gives it as readily without it "
            f"(it gains {self.score:.2f} nats a token from the document, under {self.threshold}); check its sources"
        )


def closed_book_ids(tokenizer, question: str) -> list[int]:
    """The closed-book prompt's token ids for ``question`` (tokenized whole)."""
    return rendered_ids(tokenizer, CLOSED_BOOK, "", question)


@torch.inference_mode()
def closed_book_logprobs(engine, tokenizer, question: str, answer_ids: list[int]) -> list[float]:
    """Each of ``answer_ids``' log-probabilities after the closed-book prompt, in one pass."""
    prompt = closed_book_ids(tokenizer, question)
    ids = torch.tensor(prompt + list(answer_ids))
    hidden = engine.forward(ids, torch.arange(ids.numel()), engine.new_cache())
    logits = engine.logits(hidden[:, len(prompt) - 1 : -1])  # the logits that chose each answer token
    return chosen_logprobs(logits, torch.tensor(answer_ids)).tolist()


def grounding(
    engine, tokenizer, question: str, answer_ids: list[int], logprobs: list[float], threshold: float
) -> Grounding | None:
    """The answer's :class:`Grounding` from its tokens' ``logprobs`` with the document (None for an
    empty answer). A model without a chat template gets the closed-book prompt as a completion
    ending on ``Answer:``, as its prompt with the document does (:func:`kvcli.templates.render_pieces`)."""
    if not answer_ids or len(logprobs) != len(answer_ids):
        return None
    start = time.perf_counter()
    without = closed_book_logprobs(engine, tokenizer, question, answer_ids)
    score = sum(a - b for a, b in zip(logprobs, without)) / len(answer_ids)
    return Grounding(round(score, 4), threshold, time.perf_counter() - start)
