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
``kvcli bench ruler`` (docs/methods.md, "Where an answer ends").
"""

from __future__ import annotations

import re

MIN_REPEAT_CHARS = 12
MIN_ECHO_CHARS = 16  # a template sentence this long, at the start of an answer's line, is an echo
MIN_RUN_ITEMS = 4  # this many near-identical items in a row are a loop, not a list
MAX_LEAD_IN_CHARS = 60
_ROLES = ("question", "q", "user", "human", "document")
_TURN = re.compile(r"\n[ \t]*(?:" + "|".join(_ROLES) + r")[ \t]*:", re.IGNORECASE)
_FINISHED = ".!?\"')]"  # what a whole sentence ends with (``finish``)
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*(?=\s)|\n")
_SKELETON = re.compile(r"\d+|.", re.DOTALL)  # digit runs are one "#": items differing only in numbers match
_PLACEHOLDER = re.compile(r"\{(?:document|question)\}")


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _is_whole_sentence(kept: str) -> bool:
    """Whether ``finish`` may end the answer after ``kept`` (cutting off what follows it)."""
    return len(_norm(kept)) >= MIN_REPEAT_CHARS and kept[-1] in _FINISHED


def _may_become_turn(tail: str) -> bool:
    """Whether ``tail`` (starting at a new line) may still grow into an invented next turn."""
    rest = tail[1:].lstrip(" \t").lower()
    return any(role.startswith(rest) or (rest.startswith(role) and re.fullmatch(r"[ \t]*:?", rest[len(role):])) for role in _ROLES)


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
        if not at_limit or not body or body[-1] in _FINISHED or "\n" in body[-1:]:
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
        line that may still become an invented turn (``\\nQuest``) or an echo of the template's
        instructions; the unfinished sentence when it may still repeat an earlier one, when
        ``finish`` would cut it off at the token limit (an earlier whole sentence exists: from the
        second sentence on, a sentence is settled once the next one starts) or when it may still
        end as a dangling lead-in ("The answer is:"); and the end of the text from where it may
        still grow into a run of near-identical items (the text repeating itself, numbers aside,
        at some period: usually a few characters)."""
        text = self._text(ids).rstrip("\ufffd")  # bytes of a character still to come decode as U+FFFD
        end = len(text)
        for m in re.finditer(r"\n", text):
            if _may_become_turn(text[m.start() :]) or _TURN.match(text, m.start()):
                end = m.start()
                break
        seen: set[str] = set()
        start = 0
        starts = [0]  # where each sentence before ``end`` starts
        for m in _SENTENCE_END.finditer(text, 0, end):
            piece = _norm(text[start : m.end()])
            if len(piece) >= MIN_REPEAT_CHARS:
                if piece in seen:  # ``check`` cuts here once the next token is read
                    return text[:start].strip()
                seen.add(piece)
            start = m.end()
            starts.append(start)
        tail = _norm(text[start:end])
        if any(earlier.startswith(tail) for earlier in seen):
            end = start  # the unfinished sentence may still become a repeat
        elif start and _is_whole_sentence(text[:start].rstrip()):
            end = start  # at the token limit ``finish`` would end the answer before it
        end = min(end, self._echo_may_start(text, end), _lead_in_may_start(text, end, starts), _run_may_start(text[:end]))
        return text[:end].strip()

    def _echo_may_start(self, text: str, end: int) -> int:
        """Start of the last line before ``end`` when, after some answer, it may still become (or
        is) an echo of one of the template's sentences; else ``end``."""
        line_start = text.rfind("\n", 0, end) + 1
        if not self.echoes or not text[:line_start].strip():
            return end
        norm = _norm(text[line_start:end])
        if any(t.startswith(norm) or norm.startswith(t) for t in self.echoes):
            return line_start
        return end


def _lead_in_may_start(text: str, end: int, starts: list[int]) -> int:
    """Where the answer's end may still be dropped as a dangling lead-in (``finish``): the last
    sentences before ``end``, after some answer, that are short enough and end in a colon or may
    still do so (the unfinished last one). Else ``end``."""
    i = len(starts) - 1
    while i > 0:
        start = starts[i]
        piece = text[start:end].rstrip()
        unfinished = i == len(starts) - 1
        if not text[:start].strip() or len(piece) > MAX_LEAD_IN_CHARS or not (unfinished or piece.endswith(":")):
            break
        end = start
        i -= 1
    return end


def _skeleton(text: str) -> tuple[str, list[int]]:
    """``text`` with every digit run as one ``#`` (items differing only in numbers look alike),
    and the end offset in ``text`` of each skeleton character."""
    pieces = _SKELETON.findall(text)
    ends = []
    offset = 0
    for p in pieces:
        offset += len(p)
        ends.append(offset)
    return "".join("#" if p[0].isdigit() else p for p in pieces), ends


def _item_start(skeleton: str, start: int) -> int:
    """An item starts with its first word or number ("Chapter", not ": Chapter")."""
    while start < len(skeleton) and not (skeleton[start].isalnum() or skeleton[start] == "#"):
        start += 1
    return start


def _run_may_start(text: str) -> int:
    """The earliest offset from which ``_run_of_items`` could cut ``text`` once more text follows:
    for every period whose item has letters, the end of the first item of the periodic stretch at
    the end of ``text``, when at least one character of a next item follows it."""
    skeleton, ends = _skeleton(text)
    n = len(skeleton)
    alpha = [0]
    for c in skeleton:
        alpha.append(alpha[-1] + c.isalpha())
    hold = len(text)
    for period in range(3, n):
        if alpha[n] - alpha[n - period] < 3 or skeleton[n - 1] != skeleton[n - 1 - period]:
            continue  # a periodic stretch's last ``period`` characters are a rotation of its item
        lo, hi = 1, n - period  # the longest L with skeleton[n-L:] == skeleton[n-period-L:n-period]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if skeleton[n - mid :] == skeleton[n - period - mid : n - period]:
                lo = mid
            else:
                hi = mid - 1
        first = _item_start(skeleton, n - period - lo) + period - 1
        if first < n - 1:
            hold = min(hold, ends[first])
    return hold


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
    skeleton, ends = _skeleton(text)
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
        return ends[_item_start(skeleton, start) + period - 1]
    return None
