"""Where an answer ends: besides the model's end-of-turn token, the places a reader would stop.

Small instruction models rarely stop on their own after a short answer about a long document: they
repeat the same sentence, write an invented next turn (``Question: ...``), or run into the
``--max-new-tokens`` limit in the middle of a word. :class:`AnswerGuard` (``kvcli ask
--answer-guard``, on by default; ``--no-answer-guard`` turns it off) ends the answer

* before an invented next turn: a new line starting ``Question:``, ``Q:``, ``User:``, ``Human:`` or
  ``Document:`` (the roles of kvcli's prompt templates, never part of an answer);
* before a repeated sentence or line: one equal (case and spacing aside) to an earlier one of the
  same answer, at least ``MIN_REPEAT_CHARS`` long;
* at the token limit, after the last finished sentence (one ending in ``.``, ``!`` or ``?``), when
  the answer has one and the limit cut the next one off; an answer without one (a list after a
  colon, one unfinished sentence) is kept as it is.

Greedy decoding is unchanged up to the cut: the guard only decides where to stop, so an answer it
does not touch is token-identical to one without it. Its effect on accuracy is measured by
``kvcli bench ruler`` (README, "Accuracy").
"""

from __future__ import annotations

import re

MIN_REPEAT_CHARS = 12
_TURN = re.compile(r"\n[ \t]*(?:question|q|user|human|document)[ \t]*:", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*(?=\s)|\n")


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


class AnswerGuard:
    """``check(ids)`` after every generated token: None to go on, or how many tokens to keep (stop
    now); ``finish(ids)`` when the token limit is reached: how many tokens to keep."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _tokens_within(self, ids: list[int], n_chars: int) -> int:
        """The most leading tokens whose text is at most ``n_chars`` long."""
        keep = 0
        for j in range(1, len(ids) + 1):
            if len(self._text(ids[:j])) > n_chars:
                break
            keep = j
        return keep

    def cut(self, text: str) -> int | None:
        """Character offset where ``text`` should end, or None."""
        turn = _TURN.search(text)
        end = turn.start() if turn else len(text)
        seen: set[str] = set()
        start = 0
        for m in _SENTENCE_END.finditer(text, 0, end):
            piece = _norm(text[start : m.end()])
            if len(piece) >= MIN_REPEAT_CHARS:
                if piece in seen:
                    return start
                seen.add(piece)
            start = m.end()
        return turn.start() if turn else None

    def check(self, ids: list[int]) -> int | None:
        text = self._text(ids)
        if not text.strip():
            return None
        # judge only text followed by something: a sentence or turn marker is complete once the
        # next token has started (a "Question" that becomes "Questions are..." is not cut)
        at = self.cut(text.rstrip())
        if at is None or at >= len(text.rstrip()):
            return None
        return self._tokens_within(ids, len(text[:at].rstrip()))

    def finish(self, ids: list[int]) -> int:
        text = self._text(ids)
        at = self.cut(text)
        if at is not None:
            return self._tokens_within(ids, len(text[:at].rstrip()))
        body = text.rstrip()
        if not body or body[-1] in ".!?\"')]" or "\n" in body[-1:]:
            return len(ids)
        last = None
        for m in _SENTENCE_END.finditer(body):
            last = m.end()
        kept = body[:last].rstrip() if last is not None else ""
        if len(_norm(kept)) < MIN_REPEAT_CHARS or kept[-1] not in ".!?\"')]":
            # no whole sentence before the cut-off one (e.g. "The numbers are:\n* 1851551..."): keep it all
            return len(ids)
        return self._tokens_within(ids, len(kept))
