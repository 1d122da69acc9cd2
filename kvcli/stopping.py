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
``kvcli bench ruler`` (docs/methods.md, "Where an answer ends").
"""

from __future__ import annotations

import re

MIN_REPEAT_CHARS = 12
_ROLES = ("question", "q", "user", "human", "document")
_TURN = re.compile(r"\n[ \t]*(?:" + "|".join(_ROLES) + r")[ \t]*:", re.IGNORECASE)
_FINISHED = ".!?\"')]"  # what a whole sentence ends with (``finish``)
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*(?=\s)|\n")


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _is_whole_sentence(kept: str) -> bool:
    """Whether ``finish`` may end the answer after ``kept`` (cutting off what follows it)."""
    return len(_norm(kept)) >= MIN_REPEAT_CHARS and kept[-1] in _FINISHED


def _may_become_turn(tail: str) -> bool:
    """Whether ``tail`` (starting at a new line) may still grow into an invented next turn."""
    rest = tail[1:].lstrip(" \t").lower()
    return any(role.startswith(rest) or (rest.startswith(role) and re.fullmatch(r"[ \t]*:?", rest[len(role):])) for role in _ROLES)


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
        if not body or body[-1] in _FINISHED or "\n" in body[-1:]:
            return len(ids)
        last = None
        for m in _SENTENCE_END.finditer(body):
            last = m.end()
        kept = body[:last].rstrip() if last is not None else ""
        if not _is_whole_sentence(kept):
            # no whole sentence before the cut-off one (e.g. "The numbers are:\n* 1851551..."): keep it all
            return len(ids)
        return self._tokens_within(ids, len(kept))

    def settled(self, ids: list[int]) -> str:
        """The start of the answer no later token can take back, whatever tokens follow ``ids``
        (the tokens generated so far): what an answer shown as it is decoded may print
        (:class:`kvcli.streaming.AnswerStream`). The final answer (``check``'s cut, ``finish``'s, or
        all of it at the stop token, then stripped) always starts with it.

        Held back: trailing whitespace (stripped at the end) and an incomplete character; a new
        line that may still become an invented turn (``\\nQuest``); the unfinished sentence when
        it may still repeat an earlier one, or when ``finish`` would cut it off at the token limit
        (an earlier whole sentence exists: from the second sentence on, a sentence is settled once
        the next one starts)."""
        text = self._text(ids).rstrip("\ufffd")  # bytes of a character still to come decode as U+FFFD
        end = len(text)
        for m in re.finditer(r"\n", text):
            if _may_become_turn(text[m.start() :]) or _TURN.match(text, m.start()):
                end = m.start()
                break
        seen: set[str] = set()
        start = 0
        for m in _SENTENCE_END.finditer(text, 0, end):
            piece = _norm(text[start : m.end()])
            if len(piece) >= MIN_REPEAT_CHARS:
                if piece in seen:  # ``check`` cuts here once the next token is read
                    return text[:start].strip()
                seen.add(piece)
            start = m.end()
        tail = _norm(text[start:end])
        if any(earlier.startswith(tail) for earlier in seen):
            end = start  # the unfinished sentence may still become a repeat
        elif start and _is_whole_sentence(text[:start].rstrip()):
            end = start  # at the token limit ``finish`` would end the answer before it
        return text[:end].strip()
