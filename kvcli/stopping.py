"""Where an answer ends: besides the model's end-of-turn token, the places a reader would stop.

Small instruction models rarely stop on their own after a short answer about a long document: they
repeat the same sentence, write an invented next turn (``Question: ...``), or run into the
``--max-new-tokens`` limit in the middle of a word. :class:`AnswerGuard` (``kvcli ask
--answer-guard``, on by default; ``--no-answer-guard`` turns it off) ends the answer

* before an invented next turn: a new line starting ``Question:``, ``Q:``, ``User:``, ``Human:`` or
  ``Document:`` (the roles of kvcli's prompt templates, never part of an answer);
* before a repeated sentence or line: one equal (case and spacing aside) to an earlier one of the
  same answer, at least ``MIN_REPEAT_CHARS`` long;
* before a line that echoes the prompt template's own instructions ("Answer the question using
  only the document above."), once some answer precedes it;
* after the first item of a run of ``MIN_RUN_ITEMS`` near-identical items, numbers aside
  ("Chapter 10: Chapter 11: Chapter 12: ..."; a list of numbers alone is never such a run);
* before a dangling lead-in at the very end, a last line or sentence ending in a colon after an
  answer ("Ada Byron\n\nThe answer is:");
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
MIN_ECHO_CHARS = 16  # a template sentence this long, at the start of an answer's line, is an echo
MIN_RUN_ITEMS = 4  # this many near-identical items in a row are a loop, not a list
MAX_LEAD_IN_CHARS = 60
_TURN = re.compile(r"\n[ \t]*(?:question|q|user|human|document)[ \t]*:", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*(?=\s)|\n")
_SKELETON = re.compile(r"\d+|.", re.DOTALL)  # digit runs are one "#": items differing only in numbers match
_PLACEHOLDER = re.compile(r"\{(?:document|question)\}")


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def template_sentences(template: str | None) -> tuple[str, ...]:
    """The prompt template's own sentences (placeholders dropped), normalised, that are long
    enough to tell an echo of them: the instructions a small model may copy after its answer."""
    if not template:
        return ()
    out = []
    for line in template.splitlines():
        line = _PLACEHOLDER.sub("", line)
        start = 0
        for m in [*_SENTENCE_END.finditer(line + " "), None]:
            end = len(line) if m is None else m.end()
            piece = _norm(line[start:end])
            if len(piece) >= MIN_ECHO_CHARS:
                out.append(piece)
            if m is None:
                break
            start = end
    return tuple(dict.fromkeys(out))


class AnswerGuard:
    """``check(ids)`` after every generated token: None to go on, or how many tokens to keep (stop
    now); ``finish(ids)`` when decoding ends (at the token limit, or ``at_limit=False`` at a stop
    token): how many tokens to keep. ``template``: the prompt template, whose lines are cut when
    the answer echoes them."""

    def __init__(self, tokenizer, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.echoes = template_sentences(template)

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
        """Character offset where ``text`` should end, or None: the earliest of an invented next
        turn, a repeated sentence, an echoed template line and a run of near-identical items."""
        turn = _TURN.search(text)
        end = turn.start() if turn else len(text)
        cuts = [] if turn is None else [turn.start()]
        seen: set[str] = set()
        start = 0
        for m in _SENTENCE_END.finditer(text, 0, end):
            piece = _norm(text[start : m.end()])
            if len(piece) >= MIN_REPEAT_CHARS:
                if piece in seen:
                    cuts.append(start)
                    break
                seen.add(piece)
            start = m.end()
        for at in (self._echo(text), _run_of_items(text)):
            if at is not None:
                cuts.append(at)
        return min(cuts) if cuts else None

    def _echo(self, text: str) -> int | None:
        """Start of the first line, after some answer, that begins with one of the template's
        sentences, whole: "Answer the question using only the document above." """
        if not self.echoes:
            return None
        offset = 0
        for line in text.splitlines(keepends=True):
            if text[:offset].strip():
                norm = _norm(line)
                if any(norm.startswith(t) for t in self.echoes):
                    return offset
            offset += len(line)
        return None

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

    def finish(self, ids: list[int], at_limit: bool = True) -> int:
        text = self._text(ids)
        at = self.cut(text)
        if at is not None:
            text = text[:at]
        lead_in = _trailing_lead_in(text)
        if lead_in is not None:
            return self._tokens_within(ids, len(text[:lead_in].rstrip()))
        if at is not None:
            return self._tokens_within(ids, len(text.rstrip()))
        body = text.rstrip()
        if not at_limit or not body or body[-1] in ".!?\"')]" or "\n" in body[-1:]:
            return len(ids)
        last = None
        for m in _SENTENCE_END.finditer(body):
            last = m.end()
        kept = body[:last].rstrip() if last is not None else ""
        if len(_norm(kept)) < MIN_REPEAT_CHARS or kept[-1] not in ".!?\"')]":
            # no whole sentence before the cut-off one (e.g. "The numbers are:\n* 1851551..."): keep it all
            return len(ids)
        return self._tokens_within(ids, len(kept))


def _trailing_lead_in(text: str) -> int | None:
    """Where a dangling lead-in at the very end starts ("Ada Byron\n\nThe answer is:"): a last line,
    or a last sentence, ending in a colon with nothing after it and an answer before it."""
    body = text.rstrip()
    if not body.endswith(":"):
        return None
    start = 0
    for m in _SENTENCE_END.finditer(body):
        start = m.end()
    if len(body) - start > MAX_LEAD_IN_CHARS or not body[:start].strip():
        return None
    return start


def _run_of_items(text: str) -> int | None:
    """The end of the first item of a run of at least ``MIN_RUN_ITEMS`` near-identical items at
    the end of ``text`` ("Chapter 10: Chapter 11: Chapter 12: ..."): a piece with letters that
    repeats, numbers aside, back to back. None when there is none. A list of numbers alone is
    never a run (RULER's answers are such lists)."""
    pieces = _SKELETON.findall(text)
    skeleton = "".join("#" if p[0].isdigit() else p for p in pieces)
    ends = []  # end offset in ``text`` of each skeleton character
    offset = 0
    for p in pieces:
        offset += len(p)
        ends.append(offset)
    n = len(skeleton)
    for period in range(3, n // MIN_RUN_ITEMS + 1):
        unit = skeleton[n - period :]
        if skeleton[n - MIN_RUN_ITEMS * period :] != unit * MIN_RUN_ITEMS:
            continue
        if sum(c.isalpha() for c in unit) < 3:
            continue
        start = n - MIN_RUN_ITEMS * period
        while start > 0 and skeleton[start - 1] == skeleton[start - 1 + period]:
            start -= 1
        while not (skeleton[start].isalnum() or skeleton[start] == "#"):
            start += 1  # an item starts with its first word or number ("Chapter", not ": Chapter")
        return ends[start + period - 1]
    return None
