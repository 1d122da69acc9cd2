"""Integration: the embedded SmolLM2-135M-Instruct answers real questions through each method."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcli.api import parse_pipeline, read_document
from kvcli.bench.needle import make_case
from kvcli.documents import document_from_text

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def passkey_case(embedded_session):
    # ~1k tokens of the passkey-retrieval filler, needle at 90% depth
    return make_case(embedded_session.lm.tokenizer, 1000, 0.9, seed=7, haystack="filler")


@pytest.mark.parametrize("spec", ["full", "gemfilter", "gemfilter:k=256,span=16"])
def test_passkey_over_1k_tokens(embedded_session, passkey_case, spec):
    doc = document_from_text(passkey_case.text)
    result = embedded_session.ask(doc, passkey_case.question, parse_pipeline(spec))
    assert 950 < result.prompt.n_tokens < 1100
    assert passkey_case.is_correct(result.answer), result.answer
    if spec.startswith("gemfilter:k=256"):
        assert result.n_kept_tokens == 256
        # the kept spans contain the needle sentence's key, and map back into the document
        spans = result.selection.spans(result.prompt, doc)
        assert any(passkey_case.key in s.text for s in spans)


def test_demo_question_on_the_example_pdf(embedded_session):
    doc = read_document(EXAMPLES / "lighthouse.pdf")
    result = embedded_session.ask(doc, "What is the combination for the oil store padlock?", parse_pipeline("full"))
    assert "4-7-1-9" in result.answer


@pytest.mark.parametrize("spec", ["full", "gemfilter"])
def test_disk_cache_warm_equals_cold_on_the_real_model(embedded_session, passkey_case, tmp_path, spec):
    import dataclasses

    from kvcli.store import KVStore

    doc = document_from_text(passkey_case.text)
    cached = dataclasses.replace(embedded_session, store=KVStore.open(tmp_path))
    uncached = dataclasses.replace(embedded_session, store=None)
    cold = cached.ask(doc, passkey_case.question, parse_pipeline(spec))
    warm = cached.ask(doc, passkey_case.question, parse_pipeline(spec))
    off = uncached.ask(doc, passkey_case.question, parse_pipeline(spec))
    assert [r.extra["cache"]["status"] for r in (cold, warm, off)] == ["miss", "hit", "off"]
    assert cold.answer_ids == warm.answer_ids == off.answer_ids
    assert passkey_case.is_correct(warm.answer)
    # a different question on the same document reuses the entry
    other = cached.ask(doc, "What is the text about?", parse_pipeline(spec))
    assert other.extra["cache"]["status"] == "hit"
    assert other.answer_ids == uncached.ask(doc, "What is the text about?", parse_pipeline(spec)).answer_ids
