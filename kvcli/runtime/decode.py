"""Decoding: one step of full attention over a cache, and the greedy loop that runs the steps.

The loop (:func:`greedy`) chooses each token by argmax, reads it back to the host (the step's one
synchronisation: the host needs the token to know when to stop) and runs the next step; a method
that owns its decoding steps (``Compressor.decode_step``: LazyLLM's dynamic pruning, block-sparse
retrieval) hands the loop a :class:`DecodeStep` of its own. The engine's ``step`` and ``decode``
methods call :func:`step` and :func:`greedy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import notices
from . import graphs, lookup, windows


@dataclass(frozen=True)
class DecodeStep:
    """One greedy decoding step: ``run(token, position, cache) -> logits (vocab,)`` after ``token``
    at ``position``. ``device_token``: ``run`` takes the token as the (1,) tensor the last argmax
    left on the model's device (no upload, no synchronisation); else as an id."""

    run: Callable[[int | torch.Tensor, int, object], torch.Tensor]
    device_token: bool = False
    # called once the loop is done (a captured step: the cache counts the rows it wrote)
    finish: Callable[[], None] | None = None

    @classmethod
    def full_attention(cls, engine, cache=None, start: int = 0, steps: int = 0) -> DecodeStep:
        """The engine's own step (:func:`step` through ``engine.step``), which takes the token where
        it is; given the ``cache`` and the loop's ``start`` and ``steps``, the same step captured
        as a CUDA graph where it can be (:mod:`kvcli.runtime.graphs`)."""
        if cache is not None and graphs.unavailable(engine, cache, steps) is None:
            try:
                static = graphs.StaticStep(engine, cache, start, steps, capture=True)
                return cls(static.run, device_token=True, finish=static.finish)
            except RuntimeError as e:  # a model whose step cannot be captured: step by step
                notices.warn(
                    f"decoding step by step: its step could not be captured as a CUDA graph ({e})", key="cuda-graphs"
                )
        return cls(engine.step, device_token=True)


@torch.inference_mode()
def step(engine, token: int | torch.Tensor, position: int, cache) -> torch.Tensor:
    """One decoding step of full attention: the logits (vocab,) after ``token`` at ``position``.
    ``token``: an id, or a (1,) tensor on the model's device (the argmax of the last step's
    logits, never read back to the host here): then the step makes no host -> device copy and
    no synchronisation. A hybrid's sliding layers are cut back to their window every
    :data:`~kvcli.runtime.windows.WINDOW_SLACK` steps."""
    logits = engine.rows(torch.tensor([token]) if isinstance(token, int) else token.view(1), position, cache)
    cache.trim_windows(engine.windows, slack=windows.WINDOW_SLACK)
    return logits[-1]


def chosen_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(q, vocab) logits and the (q,) ids chosen from them -> each id's log-probability, float32,
    where the logits are."""
    logits = logits.float()
    return logits.gather(1, ids.view(-1, 1).to(logits.device))[:, 0] - torch.logsumexp(logits, -1)


@torch.inference_mode()
def greedy(
    engine,
    first_logits: torch.Tensor,
    cache,
    next_position: int,
    max_new_tokens: int,
    stop_ids: set[int],
    on_token: Callable[[int], None] | None = None,
    step: DecodeStep | None = None,
    guard=None,
    logprobs: list[torch.Tensor] | None = None,
    drafts: lookup.PromptLookup | None = None,
) -> list[int]:
    """Greedy decoding from ``first_logits``; returns the generated ids (without the stop token).

    ``step``: what runs one decoding step (default :meth:`DecodeStep.full_attention`); methods that
    own decoding (``Compressor.decode_step``) pass theirs. ``guard``: a
    :class:`kvcli.answer.stopping.AnswerGuard` that may end the answer earlier (an invented next question,
    a repeated sentence) and trims it at the token limit; it may also rule out first tokens
    (``guard.opening``: an answer that would open a new line after a completion's ``Answer:``).
    ``logprobs``: each chosen token's log-probability under the model's logits (before the guard's
    opening rule) is appended to it, one per generated id, as a 0-d tensor where the logits are (no
    synchronisation more; :mod:`kvcli.answer.grounding` reads them). ``drafts``: tokens drafted
    from the text read, checked a pass at a time (:mod:`kvcli.runtime.lookup`), where full attention
    decodes step by step on a cache that can take rows back (:func:`lookup.usable`); elsewhere unused.
    """
    own = step is not None
    step = DecodeStep.full_attention(engine, cache, next_position, max_new_tokens - 1) if step is None else step

    def advance(chosen: torch.Tensor, token: int, out: list[int]) -> torch.Tensor:
        """The logits after ``token``, the answer's last (``out[-1]``): the step, which takes the
        token where it takes it (on the device, no upload; or the id)."""
        return step.run(chosen if step.device_token else token, next_position + len(out) - 1, cache)

    if drafts is not None and not own and step.finish is None and lookup.usable(engine, cache) is None:
        advance = drafts.advancing(engine, cache, next_position, max_new_tokens, advance)
    try:
        return _greedy(first_logits, max_new_tokens, stop_ids, on_token, advance, guard, logprobs)
    finally:
        if drafts is not None:
            drafts.close(cache)
        if step.finish is not None:
            step.finish()


def _greedy(first_logits, max_new_tokens, stop_ids, on_token, advance, guard, logprobs) -> list[int]:
    out: list[int] = []
    raw = first_logits
    logits = first_logits if guard is None else guard.opening(first_logits)
    for i in range(max_new_tokens):
        chosen = torch.argmax(logits).view(1)
        token = int(chosen)  # the step's one synchronisation: the host needs the token
        if token in stop_ids:  # the guard may still drop a dangling end ("The answer is:")
            return out if guard is None else out[: guard.finish(out, at_limit=False)]
        out.append(token)
        if logprobs is not None:
            logprobs.append(chosen_logprobs(raw.view(1, -1), chosen)[0])
        if guard is not None:
            keep = guard.check(out)
            if keep is not None:
                return out[:keep]
        if on_token is not None:
            on_token(token)
        if i + 1 == max_new_tokens:
            break
        logits = raw = advance(chosen, token, out)
    return out if guard is None else out[: guard.finish(out)]
