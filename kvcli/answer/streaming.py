"""Answers shown as they are decoded (``kvcli ask`` and ``kvcli chat`` on a terminal).

:class:`AnswerStream` takes each generated token (the engine's ``on_token``) and writes the part
of the answer that is *settled*: text no later token can take back. With the answer guard on, that
is :meth:`kvcli.answer.stopping.AnswerGuard.settled` (the guard may still cut an invented next turn, a
repeated sentence, or an unfinished last sentence at the token limit); without it, everything
decoded but trailing whitespace and an incomplete character. :meth:`AnswerStream.close` then
writes the rest of the final answer, so the pieces written always add up to ``Result.answer``
exactly: printed text is never taken back.
"""

from __future__ import annotations

from collections.abc import Callable


def decoded(tokenizer, ids: list[int]) -> str:
    """The answer so far as the final answer is made (decoded, stripped), less a character whose
    bytes are still to come (decoded as U+FFFD)."""
    return tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd").strip()


class AnswerStream:
    """``on_token(id)`` after every kept token; ``close(answer)`` with ``Result.answer``.
    ``write(piece)`` receives the pieces; ``shown`` is what was written."""

    def __init__(self, tokenizer, guard, write: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.guard = guard
        self.write = write
        self.ids: list[int] = []
        self.shown = ""
        self._stalled = False  # settled text stopped extending what was shown: wait for close()

    def on_token(self, token: int) -> None:
        self.ids.append(token)
        if self._stalled:
            return
        text = self.guard.settled(self.ids) if self.guard is not None else decoded(self.tokenizer, self.ids)
        if not text.startswith(self.shown):  # a tokenizer whose decoding of a prefix is no prefix
            self._stalled = True
        elif len(text) > len(self.shown):
            self.write(text[len(self.shown) :])
            self.shown = text

    def close(self, answer: str) -> None:
        """Write what is left of ``answer`` (the final one)."""
        if answer.startswith(self.shown):
            rest = answer[len(self.shown) :]
        else:  # cannot happen with kvcli's guard (tested); never lose the answer if it does
            rest = "\n" + answer
        if rest:
            self.write(rest)
        self.shown = answer
