"""Before the long work starts: a prompt over the window is said with its token count, and a
question too long for any method is named as the problem (issue 27, items 3 and 4)."""

from __future__ import annotations

import pytest

from kvcli import notices
from kvcli.answer.pipeline import Pipeline, check_window
from kvcli.answer.prompt import build_prompt
from kvcli.errors import DocumentError


@pytest.fixture(scope="module")
def lm(tiny_lm):
    return tiny_lm("llama", max_position_embeddings=1024)


def configured(lm, spec: str, prompt, n_new: int = 4):
    """``spec`` resolved (auto: by the policy, for this prompt) and configured, as Session.ask does."""
    pipeline = Pipeline.parse(spec).resolve(prompt, lm, n_new)
    pipeline.configure(lm)
    return pipeline


@pytest.mark.parametrize("spec", ["auto", "full", "finch"])
def test_a_question_too_long_for_the_window_is_named_with_by_how_much(lm, spec):
    question = "Why " * 3000  # ~3,000 tokens, a 1,024-token window, a 3-word document
    prompt = build_prompt(lm.tokenizer, "A short note.", question)
    fixed = prompt.n_tokens - prompt.n_document_tokens + 4
    assert fixed > lm.max_context
    with pytest.raises(DocumentError) as info:
        check_window(prompt, lm, 4, configured(lm, spec, prompt))
    msg = str(info.value)
    assert msg.startswith("the question is too long") and f"by {fixed - lm.max_context:,} tokens" in msg, msg
    assert "shorten the question" in msg and "-c finch" not in msg and "shorten the document" not in msg


def test_too_many_tokens_to_generate_is_named_as_the_problem(lm):
    prompt = build_prompt(lm.tokenizer, "A short note.", "Why?")
    with pytest.raises(DocumentError) as info:
        check_window(prompt, lm, 2000, configured(lm, "auto", prompt, 2000))
    msg = str(info.value)
    assert msg.startswith("--max-new-tokens 2,000 does not fit") and "lower --max-new-tokens" in msg, msg
    assert "question is too long" not in msg


def test_a_long_document_gets_the_document_advice_not_the_question_one(lm):
    prompt = build_prompt(lm.tokenizer, "word " * 3000, "Which word?")
    with pytest.raises(DocumentError) as info:
        check_window(prompt, lm, 4, configured(lm, "full", prompt))
    assert "-c finch" in str(info.value) and "question is too long" not in str(info.value)


def test_a_prompt_over_the_window_is_announced_with_its_token_count_before_pages_reads_it(lm):
    said: list[str] = []
    notices.reset()
    notices.set_sink(said.append)
    try:
        prompt = build_prompt(lm.tokenizer, "word " * 5000, "Which word?")
        check_window(
            prompt, lm, 4, configured(lm, "auto", prompt)
        )  # pages reads a page-sized passage of it (at most 512 tokens): no error
        [line] = said
        assert f"the prompt is {prompt.n_tokens:,} tokens ({prompt.n_document_tokens:,} of document)" in line
        assert "1,024-token window" in line and "pages reads the page (or passage)" in line and "512 tokens" in line
        # within the window: nothing said
        said.clear()
        notices.reset()
        short = build_prompt(lm.tokenizer, "word " * 100, "Which word?")
        check_window(short, lm, 4, configured(lm, "auto", short))
        assert said == []
    finally:
        notices.reset()
        notices.set_sink(None)
