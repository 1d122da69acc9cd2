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
* after the first of items repeated back to back word for word, numbers included: two copies of
  an item longer than ``MIN_REPEAT_CHARS`` with letters ("The answer is: 1\n\nThe answer is: 1"),
  ``MIN_RUN_ITEMS`` of a shorter one ("1. 1. 1. 1. ..."): a copy says nothing the first did not;
* before a dangling lead-in at the very end, a last line or sentence ending in a colon after an
  answer ("Ada Byron\n\nThe answer is:");
* at the token limit, after the last finished sentence (one ending in ``.``, ``!`` or ``?``), when
  the answer has one and the limit cut the next one off; without one, before the words an
  unfinished sentence cannot end on ("..., which is": :data:`DANGLING`), unless its last clause
  holds a number (a list of values cut off: "1234567, 7654321 and" is kept as it is).

When decoding ends (a stop token, the limit) the last sentence counts as finished: a repeat of an
earlier one is cut there too.

It also starts the answer on its line. A model without a chat template gets a completion prompt
ending ``\nAnswer:`` (:func:`kvcli.templates.render_pieces`), and a pretrained model there often
opens a new line instead (``\nAnswer:`` again, ``\nQuestion: ...``): an empty answer once cut.
So after that line (and no ``answer_prefix``) the first token is the likeliest one that does not
open a new line (:meth:`AnswerGuard.opening`); a chat model's answer is never touched there.

Otherwise greedy decoding is unchanged up to the cut: the guard only decides where to stop, so an
answer it does not touch is token-identical to one without it. Its effect on accuracy is measured by
``kvcli bench ruler`` (docs/methods.md, "Where an answer ends").
"""

from __future__ import annotations

import re

import torch

from ..templates import is_completion

MIN_REPEAT_CHARS = 12
MIN_ECHO_CHARS = 16  # a template sentence this long, at the start of an answer's line, is an echo
MIN_RUN_ITEMS = 4  # this many near-identical items in a row are a loop, not a list
MAX_LEAD_IN_CHARS = 60
OPENING_CANDIDATES = 64  # the first token is the likeliest of these that does not open a new line
_ROLES = ("question", "q", "user", "human", "document")
_TURN = re.compile(r"\n[ \t]*(?:" + "|".join(_ROLES) + r")[ \t]*:", re.IGNORECASE)
_FINISHED = ".!?\"')]"  # what a whole sentence ends with (``finish``)
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*(?=\s)|\n")
_LIST_MARKER = re.compile(r"(?:^|\s)\d{1,3}[.)]\s*$")  # "2." or "2)" ending a "sentence"
_SPACES_OR_CHAR = re.compile(r"\s+|.", re.DOTALL)
_TRAILING_WORD = re.compile(r"\w*$")  # letters or digits the next token may still extend
_SKELETON = re.compile(r"\d+|.", re.DOTALL)  # digit runs are one "#": items differing only in numbers match
_PLACEHOLDER = re.compile(r"\{(?:document|question)\}")
# words an unfinished sentence does not end on: at the token limit they are dropped from its end
DANGLING = frozenset(
    {  # not the words a sentence may end on ("turn it on", "the book is his", "I think so")
        "a",
        "an",
        "the",
        "of",
        "to",
        "at",
        "by",
        "for",
        "with",
        "from",
        "into",
        "onto",
        "as",
        "and",
        "or",
        "but",
        "nor",
        "than",
        "that",
        "which",
        "who",
        "whom",
        "whose",
        "where",
        "when",
        "while",
        "if",
        "because",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "has",
        "have",
        "had",
        "do",
        "does",
        "did",
        "will",
        "would",
        "can",
        "could",
        "shall",
        "should",
        "may",
        "might",
        "must",
        "its",
        "their",
        "our",
        "your",
        "my",
        "this",
        "these",
        "those",
        "such",
        "not",
        "also",
        "very",
    }
)
_DANGLING_END = re.compile(r"(?:[\s,;:\u2013\u2014-]+|\b[A-Za-z]+$)$")
_CLAUSE_END = re.compile(r"[,;:\n]|(?<=[.!?])\s")


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _is_whole_sentence(kept: str) -> bool:
    """Whether ``finish`` may end the answer after ``kept`` (cutting off what follows it)."""
    return len(_norm(kept)) >= MIN_REPEAT_CHARS and kept[-1] in _FINISHED


def _sentence_to_end_on(text: str, ends: list[int]) -> int | None:
    """Where the token limit ends an answer whose sentences end at ``ends``: after the last one,
    passing over list markers and numbers ("...are interpreted.\n2." ends after "interpreted.",
    "1. apples 2. pears" nowhere), when it is a whole sentence (:func:`_is_whole_sentence`); else
    None."""
    for i in range(len(ends) - 1, -1, -1):
        piece = text[ends[i - 1] if i else 0 : ends[i]]
        if _LIST_MARKER.search(text, 0, ends[i]) or not any(c.isalpha() for c in piece):
            continue
        return ends[i] if _is_whole_sentence(text[: ends[i]].rstrip()) else None
    return None


def _may_become_turn(tail: str) -> bool:
    """Whether ``tail`` (starting at a new line) may still grow into an invented next turn."""
    rest = tail[1:].lstrip(" \t").lower()
    return any(
        role.startswith(rest) or (rest.startswith(role) and re.fullmatch(r"[ \t]*:?", rest[len(role) :]))
        for role in _ROLES
    )


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
    the answer echoes them. ``answer_prefix``: text the prompt already starts the answer with
    (RULER's), after which the first token is the model's own."""

    def __init__(self, tokenizer, template: str | None = None, answer_prefix: str = "") -> None:
        self.tokenizer = tokenizer
        self.echoes = template_sentences(template)
        # the prompt ends on the answer's own line (a completion's "Answer:"): the answer starts there
        self.same_line = is_completion(tokenizer) and not answer_prefix

    def opening(self, logits: torch.Tensor) -> torch.Tensor:
        """The first token's ``logits`` (vocab,), with every token likelier than the likeliest one
        that does not open a new line set to -inf, when the prompt ends on the answer's line
        (:attr:`same_line`); else (or when none of the :data:`OPENING_CANDIDATES` likeliest qualifies)
        ``logits`` as they are."""
        if not self.same_line:
            return logits
        order = torch.topk(logits, min(OPENING_CANDIDATES, logits.numel())).indices.tolist()
        for rank, token in enumerate(order):
            if not self._text([token]).lstrip(" \t").startswith("\n"):
                if rank == 0:
                    return logits
                logits = logits.clone()
                logits[order[:rank]] = float("-inf")
                return logits
        return logits

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

    def cut(self, text: str, ended: bool = False) -> int | None:
        """Character offset where ``text`` should end, or None: the earliest of an invented next
        turn, a repeated sentence, an echoed template line, a run of near-identical items and
        items repeated word for word. ``ended``: decoding is over, so the text's last sentence is
        finished (and may be a repeat) and so is its last item."""
        turn = _TURN.search(text)
        end = turn.start() if turn else len(text)
        cuts = [] if turn is None else [turn.start()]
        seen: set[str] = set()
        start = 0
        ends = [m.end() for m in _SENTENCE_END.finditer(text, 0, end)]
        if ended and text[start if not ends else ends[-1] : end].strip():
            ends.append(end)  # the last sentence, finished by the end of the answer
        for stop in ends:
            piece = _norm(text[start:stop])
            if len(piece) >= MIN_REPEAT_CHARS:
                if piece in seen:
                    cuts.append(start)
                    break
                seen.add(piece)
            start = stop
        # an item is whole once a character other than a letter or digit follows it
        whole = text if ended else text[: len(text) - len(_TRAILING_WORD.search(text).group())]
        for at in (self._echo(text), _run_of_items(text), _repeated_items(whole)):
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
        at = self.cut(text, ended=True)
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
        last = _sentence_to_end_on(body, [m.end() for m in _SENTENCE_END.finditer(body)])
        kept = body[:last].rstrip() if last is not None else ""
        if last is None:
            # no whole sentence before the cut-off one: at most the words it cannot end on go
            # ("..., which is"); a list of values (e.g. "The numbers are:\n* 1851551...") is kept
            kept = _without_dangling_end(body)
            tail = body[max([0] + [m.end() for m in _CLAUSE_END.finditer(body)]) :]
            if kept is None or any(c.isdigit() for c in tail):
                return len(ids)
        return self._tokens_within(ids, len(kept))

    def settled(self, ids: list[int]) -> str:
        """The start of the answer no later token can take back, whatever tokens follow ``ids``
        (the tokens generated so far): what an answer shown as it is decoded may print
        (:class:`kvcli.answer.streaming.AnswerStream`). The final answer (``check``'s cut, ``finish``'s, or
        all of it at the stop token, then stripped) always starts with it.

        Held back: trailing whitespace (stripped at the end) and an incomplete character; a new
        line that may still become an invented turn (``\\nQuest``) or an echo of the template's
        instructions; the unfinished sentence when it may still repeat an earlier one, when
        ``finish`` would cut it off at the token limit (an earlier whole sentence exists: from the
        second sentence on, a sentence is settled once the next one starts) or when it may still
        end as a dangling lead-in ("The answer is:"); the words at its end it cannot end on
        (:data:`DANGLING`, which ``finish`` may drop at the token limit); and the end of the text
        from where it may still grow into a run of near-identical items or of items repeated word
        for word (the text repeating itself at some period: usually a few characters)."""
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
        elif (last := _sentence_to_end_on(text, starts[1:])) is not None:
            end = last  # at the token limit ``finish`` would end the answer there
        dangling = _without_dangling_end(text[:end])  # at the token limit ``finish`` may drop them
        end = min(
            end,
            self._echo_may_start(text, end),
            _lead_in_may_start(text, end, starts),
            _run_may_start(text[:end]),
            _repeat_may_start(text[:end]),
            end if dangling is None else len(dangling),
        )
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


def _without_dangling_end(text: str) -> str | None:
    """``text`` less the words at its end an unfinished sentence cannot end on (:data:`DANGLING`)
    and the punctuation before them: "Maxima's mode for Emacs" from "Maxima's mode for Emacs,
    which is". None when there are none, or too little would be left."""
    kept = text.rstrip()
    while True:
        m = _DANGLING_END.search(kept)
        if m is None or not m.group() or (m.group()[0].isalpha() and m.group().lower() not in DANGLING):
            break
        kept = kept[: m.start()]
    if len(kept) == len(text.rstrip()) or len(_norm(kept)) < MIN_REPEAT_CHARS:
        return None
    return kept


def _suffix_matches(text: str) -> list[int]:
    """``z[p]``: the longest ``L`` with ``text[n-L:] == text[n-p-L:n-p]`` (the end of ``text`` repeats
    with period ``p`` over ``L + p`` characters); the Z-function of the reversed text, O(n)."""
    r = text[::-1]
    n = len(r)
    z = [0] * (n + 1)
    left = right = 0
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and r[z[i]] == r[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    return z


def _flat(text: str) -> tuple[str, list[int]]:
    """``text`` lower-cased with every run of spaces and line breaks as one space (items repeated
    "case and spacing aside" read alike), and the end offset in ``text`` of each character."""
    pieces = _SPACES_OR_CHAR.findall(text)
    ends, offset = [], 0
    for p in pieces:
        offset += len(p)
        ends.append(offset)
    return "".join(" " if p[0].isspace() else p if len(p.lower()) != 1 else p.lower() for p in pieces), ends


def _repeat_items(text: str):
    """(period, first item's start, item's length without its trailing separator, copies needed)
    of every stretch at the end of ``text`` (:func:`_flat`: offsets in the flattened text) that
    repeats word for word back to back."""
    n = len(text)
    z = _suffix_matches(text)
    alnum, alpha, space = [0], [0], [0]
    for c in text:
        alnum.append(alnum[-1] + c.isalnum())
        alpha.append(alpha[-1] + c.isalpha())
        space.append(space[-1] + c.isspace())
    word_start = [n] * (n + 1)  # the first word start at or after i
    for i in range(n - 1, -1, -1):
        word_start[i] = i if text[i].isalnum() and (i == 0 or not text[i - 1].isalnum()) else word_start[i + 1]
    for period in range(2, n):
        if not z[period]:
            continue
        a = word_start[n - z[period] - period]
        if a + period > n:
            continue
        letters = alpha[a + period] - alpha[a]
        long = period > MIN_REPEAT_CHARS and letters >= 3
        if not long and not (alnum[a + period] > alnum[a] and space[a + period] > space[a]):
            continue  # a short item is a word or number and a space at least ("1. "; never "1000")
        core = period
        while not text[a + core - 1].isalnum():
            core -= 1
        yield period, a, core, 2 if long else MIN_RUN_ITEMS


def _repeated_items(text: str) -> int | None:
    """The end of the first item of items repeated word for word (case and spacing aside) at the
    end of ``text``, each whole: two of an item longer than ``MIN_REPEAT_CHARS`` with letters,
    ``MIN_RUN_ITEMS`` of a shorter one ("1. 1. 1. 1."). None when there are none."""
    flat, ends = _flat(text)
    cuts = [
        a + period for period, a, core, copies in _repeat_items(flat) if len(flat) - a >= (copies - 1) * period + core
    ]
    return ends[min(cuts) - 1] if cuts else None


def _repeat_may_start(text: str) -> int:
    """Where ``_repeated_items`` may still cut ``text`` once more text follows: the end of the
    first item of every stretch at its end that repeats word for word, when some of a next item
    follows it. Else ``len(text)``."""
    flat, ends = _flat(text)
    holds = [a + period for period, a, _, _ in _repeat_items(flat) if a + period < len(flat)]
    return ends[min(holds) - 1] if holds else len(text)


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
