"""``-c auto`` on gemma3-270m: Finch at 4x from 16,000 prompt tokens, full attention below (the
measurement in docs/hybrid.md "Decision"); SmolLM2 and every other model keep the default policy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcli.pipeline import Pipeline
from kvcli.policy import BEYOND_WINDOW, FALLBACK, AutoPolicy, policy_for


def resolved(model: str, window: int, n_prompt: int, max_new_tokens: int = 128) -> Pipeline:
    lm = SimpleNamespace(name=model, max_context=window)
    prompt = SimpleNamespace(n_tokens=n_prompt, n_after_document=20)
    return Pipeline.parse("auto").resolve(prompt, lm, max_new_tokens)


@pytest.mark.parametrize("n_prompt, want", [
    (4_000, "full"),
    (8_064, "full"),  # RULER's 8k point (8,192 with the answer): full attention
    (15_999, "full"),
    (16_000, "finch:target=0.25"),
    (16_256, "finch:target=0.25"),  # RULER's 16k point
    (32_768 - 128, "finch:target=0.25"),  # the last prompt the window holds with the answer
])
def test_gemma3_270m_auto_is_finch_from_16000_tokens(n_prompt, want):
    chosen = resolved("gemma3-270m", 32_768, n_prompt)
    assert chosen.chosen_by == "auto"
    if want == "full":
        assert chosen.spec() == "full" and [s.name for s in chosen.stages] == ["full"]
    else:
        assert [s.name for s in chosen.stages] == ["finch"] and chosen.stages[0].target == 0.25


def test_gemma3_270m_beyond_its_window_still_falls_back_to_finch():
    policy = policy_for("gemma3-270m")
    # InfLLM cannot read a hybrid: Finch (at its own default target) beyond the window, as before
    assert policy.choose(40_000, 32_768, 128, reads=lambda spec: False) == FALLBACK == "finch"
    assert policy_for("Gemma3-270M") == policy  # the name as typed


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-360M-Instruct", "some/model.gguf"])
def test_every_other_model_keeps_the_default_policy(model):
    assert policy_for(model) == AutoPolicy() and AutoPolicy().compress_from is None
    assert resolved(model, 8192, 8192 - 128).spec() == "full"  # full attention up to the window
    assert resolved(model, 32_768, 16_256).spec() == "full"  # even where gemma3-270m compresses
    assert AutoPolicy().choose(8192 - 127, 8192, 128) == BEYOND_WINDOW  # InfLLM beyond the window


def test_an_explicit_policy_is_not_replaced_by_the_measured_one():
    mine = AutoPolicy(compress_from=1000, long="snapkv:budget=0.5")
    assert mine.for_model("gemma3-270m") is mine
