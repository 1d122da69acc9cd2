"""Answers shown as they are decoded (kvcli.answer.streaming, AnswerGuard.settled): the pieces written add
up to the final answer exactly, whether the guard cuts the answer or not, and settled text is
written while decoding goes on, not all at the end."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer.pipeline import Pipeline
from kvcli.answer.stopping import AnswerGuard
from kvcli.answer.streaming import AnswerStream
from kvcli.api import AskOptions, QuestionOptions, Session
from kvcli.documents import document_from_text
from kvcli.runtime.decode import DecodeStep
from kvcli.runtime.engine import Engine
from tests.helpers.tiny_models import _tokenizer

STOP = 0  # a token id the scripts below never produce, standing for the model's end of turn
TEMPLATE = "{document}\n\nAnswer the question using only the document above.\nQuestion: {question}\nAnswer:"


def ids(text: str) -> list[int]:
    return _tokenizer()(text, add_special_tokens=False)["input_ids"]


def decode_script(text: str, *, guard: bool, max_new_tokens: int | None = None, stop: bool = True):
    """Run the engine's own decoding loop on a model that "generates" ``text``'s tokens (then the
    stop token, with ``stop``), the stream attached as the CLI attaches it. Returns the final answer
    as ``pipeline.run`` makes it, the pieces written, and how many were written before decoding ended."""
    tokenizer = _tokenizer()
    script = ids(text) + ([STOP] if stop else [])
    limit = len(script) if max_new_tokens is None else max_new_tokens
    pieces: list[str] = []
    g = AnswerGuard(tokenizer, TEMPLATE) if guard else None
    stream = AnswerStream(tokenizer, g, pieces.append)

    def logits_for(i: int) -> torch.Tensor:
        out = torch.zeros(tokenizer.vocab_size if tokenizer.vocab_size > max(script) else max(script) + 1)
        out[script[i]] = 1.0
        return out

    step = lambda token, position, cache: logits_for(position + 1)  # noqa: E731  position i -> token i+1
    answer_ids = Engine.decode(
        None, logits_for(0), None, 0, limit, {STOP}, stream.on_token, step=DecodeStep(step), guard=g
    )
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
    during = len(pieces)
    stream.close(answer)
    return answer, pieces, during


CASES = {
    # (text, max_new_tokens: None = ends with the stop token, else the limit in tokens)
    "not cut": (" The keeper is Ann Lee. She lit the lamp at dusk every day.", None),
    "one sentence": ("Ann Lee keeps the light on the north rock", None),
    "trailing space": (" Ann keeps it.  \n ", None),
    "invented turn": ("The combination is 4-7-1-9.\nQuestion: What is the colour of the door?\nAnswer: Red.", None),
    "repeat": ("The keeper is Ann Lee. She is old. The keeper is Ann Lee. The keeper is Ann Lee.", None),
    "limit cuts the last sentence": ("The keeper is Ann Lee. She lit the lamp at dusk and then", 14),
    "limit keeps a list": ("The numbers are:\n* 1851551\n* 20441", 12),
    "multi-byte characters": ("Café ☕ costs 3€ — naïve 日本語 text. Ünïcödé again ☕☕ here", None),
    "a role word that is no turn": ("It says:\nQuestions are welcome. Users too.", None),
    "echoed template line": ("The secret word is PELICAN.\n\nAnswer the question using only the document above.", None),
    "dangling lead-in": ("Ada Byron\n\nThe answer is:", None),
    "run of items": ("The chapters are Chapter 10: Chapter 11: Chapter 12: Chapter 13: Chapter 14: Chapter 15:", None),
    "number repeated": ("1. " * 20 + "1.", None),
    "answer said twice": ("The answer is: 1\n\nThe answer is: 1", None),
    "said twice, restated": ("The answer is 1 The answer is 1\nAnswer: 1. The answer is 1.", None),
    "limit after a dangling word": ("Maxima's mode for Emacs, which is", 10),
    "limit after a list marker": (
        "1. Read.table and scan controls whether C-style escapes are interpreted.\n2. The",
        20,
    ),
}


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_pieces_add_up_to_the_answer(case, guard):
    text, limit = CASES[case]
    answer, pieces, during = decode_script(text, guard=guard, max_new_tokens=limit)
    assert "".join(pieces) == answer
    assert all(pieces)  # never an empty write
    if case == "not cut" or not guard:
        assert during >= 3, pieces  # token by token, not one write at the end


def test_the_guard_cases_do_cut():
    """The scripts above exercise each of the guard's cuts (else the equality proves little)."""
    cut = {case: decode_script(text, guard=True, max_new_tokens=limit)[0] for case, (text, limit) in CASES.items()}
    assert cut["invented turn"] == "The combination is 4-7-1-9."
    assert cut["repeat"] == "The keeper is Ann Lee. She is old."
    assert cut["limit cuts the last sentence"] == "The keeper is Ann Lee."
    assert cut["echoed template line"] == "The secret word is PELICAN."
    assert cut["dangling lead-in"] == "Ada Byron"
    assert cut["run of items"] == "The chapters are Chapter 10:"
    assert cut["number repeated"] == "1."
    assert cut["answer said twice"] == "The answer is: 1"
    assert cut["said twice, restated"] == "The answer is 1"
    assert cut["limit after a list marker"] == CASES["limit after a list marker"][0].split("\n")[0]
    assert cut["limit after a dangling word"] == "Maxima's mode for Emacs"
    text, limit = CASES["limit keeps a list"]
    assert (
        cut["limit keeps a list"] == _tokenizer().decode(ids(text)[:limit]).strip()
    )  # no whole sentence to end at: all of it
    assert cut["trailing space"] == "Ann keeps it."


def test_what_is_written_during_decoding_is_never_taken_back():
    """Each settled text extends the previous one (checked on every prefix of every script), and
    a first sentence streams as it is decoded."""
    tokenizer = _tokenizer()
    guard = AnswerGuard(tokenizer, TEMPLATE)
    for text, _ in CASES.values():
        script, before = ids(text), ""
        for j in range(1, len(script) + 1):
            now = guard.settled(script[:j])
            assert now.startswith(before), (text, before, now)
            before = now
    answer, pieces, during = decode_script("The keeper is Ann Lee and she lit the lamp. She", guard=True)
    assert pieces[0] == "The" and during >= 5


def test_held_back_text():
    guard = AnswerGuard(_tokenizer(), TEMPLATE)
    settled = lambda text: guard.settled(ids(text))  # noqa: E731
    assert settled("The keeper is Ann.\nQuest") == "The keeper is Ann."  # may become "Question:"
    assert settled("It says:\nQuest") == "It says:"
    assert settled("It says:\nQuestions are") == "It says:"  # no turn, but may end as a lead-in ("Questions are:")
    # too long for a lead-in: all but the last few characters, which may still begin a run of items
    assert settled("It says:\nQuestions are welcome to everyone who reads the long manual here").startswith(
        "It says:\nQuestions are welcome to everyone who reads the long manual"
    )
    assert settled("The keeper is Ann Lee. The keeper") == "The keeper is Ann Lee."  # may repeat
    assert settled("The keeper is Ann Lee. She lit") == "The keeper is Ann Lee."  # the limit would cut it
    assert settled("Yes. She lit the lamp") == "Yes."  # may still end as a lead-in ("She lit the lamp:")
    assert settled("She lit the lamp") == "She lit the lamp"  # a first sentence is no lead-in
    assert (
        settled("Ann Lee\nAnswer the question using only the document above. ") == "Ann Lee"
    )  # an echo, cut at the next token
    long_line = "Ann Lee\nAnswer: yes, she is the keeper of the lighthouse on the north rock"
    assert settled(long_line).startswith("Ann Lee\nAnswer: yes, she is the keeper of the")  # no echo
    assert settled("It is Chapter 10: Chapter 11: Chap") == "It is Chapter 10:"  # may become a run of items
    assert settled("The keeper is Ann Lee. She lit it. ") == "The keeper is Ann Lee. She lit it."


def test_session_streams_the_answer_of_a_real_model(tiny_dir):
    session = Session.open(
        AskOptions(model=str(tiny_dir("llama", num_hidden_layers=4)), use_cache=False, max_new_tokens=24)
    )
    doc = document_from_text(" ".join(f"Entry {i}: the keeper logged {i * 7 % 13} ships." for i in range(30)))
    pieces: list[str] = []
    prompts, progress = [], []
    result = session.ask(
        doc,
        "How many ships?",
        Pipeline.parse("auto"),
        QuestionOptions(
            on_text=pieces.append, on_prompt=lambda m, n: prompts.append((m, n)), on_progress=progress.append
        ),
    )
    assert "".join(pieces) == result.answer
    assert prompts == [("full attention", result.prompt.n_tokens)]
    assert progress and progress == sorted(progress) and progress[-1] == 1.0  # the whole prompt, every layer
    assert all(not layer._forward_pre_hooks for layer in session.engine.layers)  # hooks gone after the prompt
    plain = session.ask(doc, "How many ships?", Pipeline.parse("auto"))
    assert plain.answer_ids == result.answer_ids  # streaming changes nothing
