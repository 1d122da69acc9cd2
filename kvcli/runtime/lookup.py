"""Drafts from the text the model read, checked in one pass: greedy decoding's answer, in fewer steps.

An answer about a document quotes it: a name, a command, a sentence of the manual. Where the
answer's last tokens also occur in the prompt, the tokens that followed them there are a cheap
guess at what comes next. One pass of the model over the answer's last token and that guess
(``[t, d1, ..., dk]``) gives the logits after each of them; greedy decoding takes its own argmax
after ``t``, and while that equals the guessed token it goes on with the logits the same pass
computed after it. At the first difference the model's own token is taken and the drafts past it
are taken back from the cache (:meth:`~kvcli.caches.base.CacheBase.rewind`). The tokens are the
model's argmax at every position, as step by step: the method changes how many passes decoding
runs, not what it chooses (up to the rounding of a pass of k + 1 rows against k + 1 passes of
one, which can flip a near tie).

This is reference-based copying, "Inference with Reference: Lossless Acceleration of Large
Language Models" (Yang et al., 2023, arXiv:2304.04487; LLMA), as popularised for question answering
by prompt lookup decoding (Saxena, 2023): the draft follows the latest earlier occurrence of the
answer's last :data:`NGRAMS` tokens (the longest that occurs), in the prompt or the answer so far,
at most ``max_draft`` tokens. A pass of k + 1 rows costs a CPU a little more than a step of one
(the weights are read once; docs/cpu.md), so a draft the model takes in part is still a gain, and
one it refuses costs that little.

Where it runs (:func:`usable`): greedy decoding of full attention step by step over a cache that
can take rows back (``rewindable``: the plain layout), a model without sliding layers; not where
a method owns its decoding steps, nor where the step runs as a captured CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # PyTorch where it runs: the CLI reads MAX_DRAFT, its --lookup default, without it
    import torch

NGRAMS = (3, 2)  # the lengths of the answer's tail looked up in the text, longest first
MAX_DRAFT = 3  # tokens drafted for one pass at most (the CLI's --lookup default): four rows, docs/cpu.md


def usable(engine, cache) -> str | None:
    """None where drafts can be checked on ``cache`` (module docstring), else why not (a phrase)."""
    if cache is None or not type(cache).rewindable:
        return f"{type(cache).__name__} cannot take rows back"
    if engine.windows.sliding_layers:
        return "the model has sliding layers"
    return None


@dataclass
class PromptLookup:
    """Drafts for one answer from ``source`` (the ids the model read: the prompt's, or the tokens a
    method kept) and the answer so far; ``max_draft`` tokens a pass at most."""

    source: torch.Tensor
    max_draft: int = MAX_DRAFT

    def __post_init__(self) -> None:
        import torch

        self.source = torch.as_tensor(self.source, dtype=torch.long).flatten().cpu()
        self.ahead: list[tuple[int, torch.Tensor]] = []  # drafted tokens fed, each with the logits after it
        self.passes = 0  # passes that checked a draft
        self.drafted = 0  # tokens drafted
        self.taken = 0  # drafted tokens the model chose

    def propose(self, answer: Sequence[int], room: int) -> list[int]:
        """At most ``min(room, max_draft)`` tokens that followed the latest earlier occurrence of the
        answer's last n tokens (n in :data:`NGRAMS`, longest first) in the source followed by the
        answer; [] where none occurs."""
        import torch

        room = min(room, self.max_draft)
        if room <= 0 or not answer:
            return []
        seq = torch.cat([self.source, torch.tensor(list(answer), dtype=torch.long)])
        for n in NGRAMS:
            if seq.numel() <= n:
                continue
            tail = seq[-n:]
            # windows starting at 0 .. len - n - 1: every occurrence but the tail itself
            hit = seq[: seq.numel() - n] == tail[0]
            for k in range(1, n):
                hit &= seq[k : seq.numel() - n + k] == tail[k]
            found = torch.nonzero(hit).flatten()
            if found.numel():
                start = int(found[-1]) + n
                return seq[start : start + room].tolist()
        return []

    def check(self, engine, cache, tokens: list[int], position: int) -> torch.Tensor:
        """One pass over ``tokens`` (the answer's last token, then the draft) at ``position`` on:
        their KV appended to ``cache``; the logits after each, (len(tokens), vocab)."""
        import torch

        from . import attention

        self.passes += 1
        self.drafted += len(tokens) - 1
        with attention.draft_pass():  # the answer's citations count each query as a step
            return engine.rows(torch.tensor(tokens), position, cache)

    def advancing(self, engine, cache, next_position: int, max_new_tokens: int, step):
        """Greedy decoding's ``advance(chosen, token, answer) -> the logits after token`` (the
        answer's last) with drafts: the logits a pass computed already where ``token`` was drafted;
        else, the rest of the draft taken back, a pass over ``token`` and a new draft, or the plain
        ``step`` where there is none. Drafts end before ``max_new_tokens``."""

        def advance(chosen, token: int, answer: list[int]):
            if self.ahead and self.ahead[0][0] == token:  # the model chose the drafted token
                self.taken += 1
                return self.ahead.pop(0)[1]
            self.close(cache)  # the model chose otherwise: the rest of the draft goes
            draft = self.propose(answer, max_new_tokens - len(answer) - 1)
            if not draft:
                return step(chosen, token, answer)
            rows = self.check(engine, cache, [token, *draft], next_position + len(answer) - 1)
            self.ahead = list(zip(draft, rows[1:]))
            return rows[0]

        return advance

    def close(self, cache) -> None:
        """Take the drafted rows no token was chosen for back from ``cache`` (at a refusal, and at
        the answer's end: the cache then holds the prompt and the answer's fed tokens only)."""
        if self.ahead:
            cache.rewind(len(self.ahead))
            self.ahead = []

    def stats(self) -> dict:
        """What drafting did, JSON-able: passes that checked a draft, tokens drafted and taken."""
        return {"lookup_passes": self.passes, "lookup_drafted": self.drafted, "lookup_taken": self.taken}
