"""The answer guard end to end, through ``kvcli ask``: a model whose answer writes a repeated line
or an invented next question is cut there by default, not with ``--no-answer-guard``, and the cut
answer is the start of the uncut one (the guard decides only where to stop)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.tiny_models import make_parrot_model

DOC = "The keeper lit the lamp at dusk and put it out at dawn. " * 20


@pytest.mark.parametrize(
    "loop, cut",
    [
        ("The light is on.\n", "The light is on."),  # a repeated line
        # an invented next turn: the prompt ends in "\n", which leads to "Question" here, so the
        # answer is "Question:No\nQuestion:No\n..." (each line under the 12 characters a repeat
        # needs: only the turn can cut it)
        ("No\nQuestion:", "Question:No"),
    ],
)
def test_ask_cuts_the_answer_and_no_answer_guard_does_not(cli, tmp_path_factory, tmp_path, loop, cut):
    model = str(make_parrot_model(tmp_path_factory.mktemp("parrot"), loop))
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    common = [
        "ask",
        doc,
        "Is the light on?",
        "-m",
        model,
        "--max-new-tokens",
        "30",
        "-c",
        "full",
        "--json",
        "--no-cache",
    ]
    code, out, err = cli(*common)
    assert code == 0, err
    guarded = json.loads(out)["answer"]
    code, out, err = cli(*common, "--no-answer-guard")
    assert code == 0, err
    unguarded = json.loads(out)["answer"]
    assert guarded == cut
    assert unguarded.startswith(guarded) and len(unguarded) > len(guarded) + len(loop)
    assert unguarded.count(cut) >= 3  # it really went on: the loop, again and again
    # and the plain answer on stdout (a pipe: the answer alone) is the cut one
    code, out, err = cli(*common[:-2], "--no-cache")
    assert code == 0, err
    assert out.strip() == cut
