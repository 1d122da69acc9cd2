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

A model may also ask itself (``check_asked``: a yes/no question and the log-odds of "yes" under
which the answer gets the note, where the tuning questions found one that catches more answers no
page gives without noting more right ones; the 1.5B Qwen's): the question is put to it as the
user's next turn right after its answer, on the answer's own KV (a few dozen tokens,
:func:`asked_log_odds`), and its log-odds of "yes" against "no" read from the one next token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..runtime.decode import chosen_logprobs
from ..templates import follow_up_ids, rendered_ids

# the closed-book prompt: the question alone, rendered through the model's chat template
CLOSED_BOOK = "{document}Answer the question. Be brief.\nQuestion: {question}"


@dataclass(frozen=True)
class Grounding:
    """``score``: the mean over the answer's tokens of log p(token | document, question) - log
    p(token | question alone), in nats; ``threshold``: the model's, under which the answer may not
    come from the document; ``seconds``: the check's time (both passes); ``asked``: the model's
    log-odds of "yes" to its own yes/no question (None: not asked), ``asked_under`` its threshold."""

    score: float
    threshold: float
    seconds: float
    asked: float | None = None
    asked_under: float | None = None

    @property
    def grounded(self) -> bool:
        doubted = self.asked is not None and self.asked_under is not None and self.asked < self.asked_under
        return self.score >= self.threshold and not doubted

    def note(self) -> str | None:
        """The line said when the answer may not come from the document (None: it does)."""
        if self.grounded:
            return None
        if self.score < self.threshold:
            return (
                "the answer may not come from the document: the model gives it as readily without it "
                f"(it gains {self.score:.2f} nats a token from the document, under {self.threshold}); check its sources"
            )
        return (
            "the answer may not come from the document: asked whether the document supports it, the model "
            f"is unsure (log-odds of yes {self.asked:.2f}, under {self.asked_under}); check its sources"
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


YES_NO = (("Yes", "yes"), ("No", "no"))  # the words whose first tokens answer the yes/no question


@torch.inference_mode()
def asked_log_odds(engine, tokenizer, cache, answer_ids: list[int], n_kept: int, question: str) -> float | None:
    """The log-odds of "yes" against "no" (each the log-sum of its words' first tokens,
    :data:`YES_NO`) as the model's next token when, right after its answer, the user asks
    ``question`` (:func:`kvcli.templates.follow_up_ids`): one pass over the answer's tokens decoding
    did not feed and the turn, on ``cache``, the answer's own KV (``n_kept`` prompt tokens, then the
    answer), which is cut back to the prompt and the answer afterwards. None where that cache cannot
    be cut back (its layout, a sliding layer's window) or the model has no chat template."""
    turn = follow_up_ids(tokenizer, question)
    fed = None if cache is None else cache.n_tokens - n_kept
    if turn is None or fed is None or fed < 0 or not cache.truncatable:
        return None
    fed = min(fed, len(answer_ids))  # a guard that cut the answer: tokens past it are not its KV
    end = n_kept + fed
    if not engine.windows.can_resume(cache, end):
        return None
    cache.truncate(end)
    _, logits = engine.prefill(torch.tensor(list(answer_ids[fed:]) + turn), cache=cache)
    cache.truncate(end)
    lp = torch.log_softmax(logits.float().flatten(), -1)
    first = [[tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words] for words in YES_NO]
    return round(float(torch.logsumexp(lp[first[0]], 0) - torch.logsumexp(lp[first[1]], 0)), 4)


def grounding(
    engine,
    tokenizer,
    question: str,
    answer_ids: list[int],
    logprobs: list[float],
    threshold: float,
    asked: tuple[str, float] | None = None,
    cache=None,
    n_kept: int = 0,
) -> Grounding | None:
    """The answer's :class:`Grounding` from its tokens' ``logprobs`` with the document (None for an
    empty answer). A model without a chat template gets the closed-book prompt as a completion
    ending on ``Answer:``, as its prompt with the document does (:func:`kvcli.templates.render_pieces`).
    ``asked``: the model's yes/no question and the log-odds under which the answer gets the note,
    asked on ``cache`` (:func:`asked_log_odds`) where the gain did not note it already; None: not asked."""
    if not answer_ids or len(logprobs) != len(answer_ids):
        return None
    start = time.perf_counter()
    without = closed_book_logprobs(engine, tokenizer, question, answer_ids)
    score = sum(a - b for a, b in zip(logprobs, without)) / len(answer_ids)
    noted = score < threshold  # the note is said already: nothing to ask
    odds = None if asked is None or noted else asked_log_odds(engine, tokenizer, cache, answer_ids, n_kept, asked[0])
    under = None if odds is None else asked[1]
    return Grounding(round(score, 4), threshold, time.perf_counter() - start, odds, under)
