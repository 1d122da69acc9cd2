"""What one question is asked with (:class:`QuestionOptions`): the settings that differ from
question to question and the callbacks that show it being answered. The session's own settings
(the model, the store, ...) are :class:`kvcli.api.AskOptions`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class QuestionOptions:
    """How :meth:`kvcli.api.Session.ask` answers one question.

    ``max_new_tokens``: default the session's; ``force_tokens``: ignore the stop tokens and
    generate exactly that many (benchmarks of decoding speed); ``use_store=False``: neither read
    nor write the disk store for this question (cold runs); ``answer_prefix``: text the answer
    starts with, after the generation prompt (benchmarks such as RULER). ``sources``: read the
    answer's attention while it is decoded and cite the document's sentences it read most
    (``Result.sources``, :mod:`kvcli.cite.sources`); False: nothing is read or cited; None: the
    session's option. ``check``: after the answer, whether it comes from the document
    (``Result.grounding``, :mod:`kvcli.answer.grounding`: a note when it may not); None: the session's option.

    While it runs: ``on_prompt(method, n_tokens)`` once the method is chosen (its name, e.g.
    "full attention", and the prompt's length; for a method that retrieves, ``pages``, once it
    chose what to read, and the tokens it reads), before the prompt is read; ``on_progress(f)``
    while the prompt is read, ``f`` in [0, 1] (:class:`kvcli.answer.progress.prompt_progress`;
    none once the document's KV came from the disk store); ``on_wait(text)`` while another kvcli
    process computes the same document's KV and this one waits for it ("another kvcli process (pid
    4242) reading book.pdf: 12,288/88,244 tokens (14%)"), ``on_wait(None)`` when the wait ends;
    ``on_resume(f)`` when a book read resumes where an interrupted one stopped, ``f`` of the
    prompt read already; ``on_embed(done, total)`` while a method that retrieves (``pages``)
    embeds the document's passages, the first time it reads that document (``done`` of ``total``
    windows; none once their vectors are kept in the cache folder); ``on_token(id)`` with each
    answer token; ``on_text(piece)`` with the answer as it is decoded, the pieces adding up to
    ``Result.answer`` (:class:`kvcli.answer.streaming.AnswerStream`); ``on_answer(text)`` with the
    answer whole once it is final, before the check after it and its sources are computed (what
    a pipe writes: the answer does not wait for them)."""

    max_new_tokens: int | None = None
    force_tokens: bool = False
    use_store: bool = True
    answer_prefix: str = ""
    sources: bool | None = None
    check: bool | None = None
    on_token: Callable[[int], None] | None = None
    on_text: Callable[[str], None] | None = None
    on_prompt: Callable[[str, int], None] | None = None
    on_progress: Callable[[float], None] | None = None
    on_wait: Callable[[str | None], None] | None = None
    on_resume: Callable[[float], None] | None = None
    on_embed: Callable[[int, int], None] | None = None
    on_answer: Callable[[str], None] | None = None
