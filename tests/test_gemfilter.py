"""GemFilter does what Algorithm 1 of the paper says, and keeping everything equals full attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcli.compressors import parse_one
from kvcli.compressors.gemfilter import default_filter_layer, top_k_positions
from kvcli.engine import Engine
from kvcli.errors import UsageError
from kvcli.pipeline import Pipeline, run
from kvcli.prompt import build_prompt, stop_token_ids
from reference import reference_qk
from tiny_models import FAMILIES

TOL = 1e-4
DOC = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} gulls." for i in range(12))


def prompt_for(lm, question="How many gulls?"):
    return build_prompt(lm.tokenizer, DOC, question)


@pytest.mark.parametrize("family", FAMILIES)
def test_keep_everything_reproduces_full_attention(tiny_lm, family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n = prompt.n_tokens
    gem = parse_one(f"gemfilter:k={n},layer=2")
    gem.configure(lm)
    selection = gem.select_tokens(engine, prompt.ids, protected=prompt.n_suffix)
    assert selection.kept.tolist() == list(range(n))  # k = n: the top-k is everything, in order
    _, full_logits = engine.prefill(prompt.ids)
    _, gem_logits = engine.prefill(prompt.ids[selection.kept])
    assert torch.allclose(gem_logits, full_logits, atol=TOL)

    # and through the whole pipeline: 5 greedy tokens, identical
    stop = stop_token_ids(lm.tokenizer)
    full = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=5, stop_ids=set())
    gem = run(engine, prompt, Pipeline.parse(f"gemfilter:k={n},layer=2"), max_new_tokens=5, stop_ids=set())
    assert gem.answer_ids == full.answer_ids and len(gem.answer_ids) == 5
    assert gem.n_kept_tokens == full.n_kept_tokens == n
    assert stop  # the tokenizer has stop ids


def reference_gemfilter_indices(lm, ids, r, k, kernel=5):
    """Appendix C.1 of the paper, literally: q and k of layer r recomputed the HF way (no
    output_attentions), repeat_kv, matmul of the last query row, sum over heads, avg_pool, topk, sort."""
    q, kk, _ = reference_qk(lm, ids)[r - 1]
    in_pro = torch.matmul(q[:, :, -1:, :], kk.transpose(-1, -2))
    in_pro = torch.sum(in_pro, dim=1, keepdim=True)
    in_pro = F.avg_pool1d(in_pro[0], kernel_size=kernel, padding=kernel // 2, stride=1)
    return torch.sort(torch.topk(in_pro[0, 0], k, dim=-1).indices).values


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_selection_matches_the_papers_reference_code(tiny_lm, family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    gem = parse_one("gemfilter:k=40,layer=3,keep_question=false")
    gem.configure(lm)
    selection = gem.select_tokens(engine, prompt.ids, protected=prompt.n_suffix)
    ref = reference_gemfilter_indices(lm, prompt.ids, r=3, k=40)
    assert selection.kept.tolist() == ref.tolist()


def test_filter_pass_stops_at_layer_r(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    entered, mlps = [], []
    hooks = [l.register_forward_pre_hook(lambda m, a, i=i: entered.append(i)) for i, l in enumerate(engine.layers)]
    hooks += [l.mlp.register_forward_pre_hook(lambda m, a, i=i: mlps.append(i)) for i, l in enumerate(engine.layers)]
    try:
        gem = parse_one("gemfilter:k=30,layer=2")
        gem.configure(lm)
        gem.select_tokens(engine, prompt.ids, protected=prompt.n_suffix)
    finally:
        for h in hooks:
            h.remove()
    assert entered == [0, 1]  # layers 3 and 4 never ran on the long prompt
    assert mlps == [0]  # layer r stops once its queries and keys are scored


def test_second_pass_reads_only_the_kept_tokens_and_keeps_the_question(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    result = run(engine, prompt, Pipeline.parse("gemfilter:k=32,layer=2"), max_new_tokens=3, stop_ids=set())
    kept = result.selection.kept.tolist()
    assert len(kept) == 32 and kept == sorted(kept)
    suffix = list(range(prompt.n_tokens - prompt.n_suffix, prompt.n_tokens))
    assert set(suffix) <= set(kept)
    assert result.extra["kv_cache_bytes"] < run(engine, prompt, Pipeline.parse("full"), max_new_tokens=3, stop_ids=set()).extra["kv_cache_bytes"]


def test_top_k_positions():
    scores = torch.tensor([0.0, 5.0, 1.0, 4.0, 3.0, 2.0, 9.0, 0.5])
    assert top_k_positions(scores, 3).tolist() == [1, 3, 6]
    assert top_k_positions(scores, 3, forced=torch.tensor([7])).tolist() == [1, 6, 7]
    # spans of 4: window 1 (indices 4-7, best 9.0) first, then window 0 (best 5.0)
    assert top_k_positions(scores, 6, span=4).tolist() == [0, 1, 4, 5, 6, 7]
    assert top_k_positions(scores, 8).tolist() == list(range(8))


def test_k_larger_than_the_prompt(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    explicit = parse_one("gemfilter:k=100000,layer=2")
    explicit.configure(lm)
    with pytest.raises(UsageError, match="larger than the prompt"):
        explicit.select_tokens(engine, prompt.ids, protected=prompt.n_suffix)
    default = parse_one("gemfilter:layer=2")  # default k=1024, short prompt: keep everything
    default.configure(lm)
    assert default.select_tokens(engine, prompt.ids).n_kept == prompt.n_tokens


def test_default_filter_layer_follows_the_paper_ratio(tiny_lm):
    assert default_filter_layer(32) == 13
    assert default_filter_layer(2) == 1
    gem = parse_one("gemfilter")
    gem.configure(tiny_lm("llama"))
    assert gem.layer == 2 and gem.k == 1024  # round(13/32 * 4), the paper's k
    with pytest.raises(UsageError, match="has 4 layers"):
        parse_one("gemfilter:layer=9").configure(tiny_lm("llama"))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gemfilter:kernel=4", "kernel must be odd"),
        ("gemfilter:k=0", "k must be at least 1"),
        ("gemfilter:k=abc", "expects int"),
        ("gemfilter:foo=1", "unknown knob 'foo'; knobs: layer"),
        ("gemfilter:k", "expected knob=value"),
        ("nosuch", "unknown compressor 'nosuch'; available: "),  # then the registered names
    ],
)
def test_bad_specs_are_usage_errors(spec, message):
    with pytest.raises(UsageError, match=message):
        Pipeline.parse(spec)


def test_spec_round_trip():
    p = Pipeline.parse("gemfilter:k=64,layer=3,keep_question=no")
    assert p.spec() == "gemfilter:layer=3,k=64,kernel=5,keep_question=false,span=1"
    assert Pipeline.parse(p.spec()).spec() == p.spec()
    assert Pipeline.parse("full").spec() == "full"
