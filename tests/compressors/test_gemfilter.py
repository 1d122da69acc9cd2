"""GemFilter does what Algorithm 1 of the paper says, and keeping everything equals full attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcli.answer.pipeline import Pipeline, run
from kvcli.answer.prefix import Prefix
from kvcli.answer.prompt import build_prompt
from kvcli.compressors import parse_one
from kvcli.compressors.gemfilter import default_filter_layer, top_k_positions
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from kvcli.templates import stop_token_ids
from tests.helpers.tiny_models import FAMILIES

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
    gem = parse_one(f"gemfilter:k={n},layer=1")
    gem.configure(lm)
    selection = gem.select_tokens(engine, prompt.ids, protected=prompt.n_after_document)
    assert selection.kept.tolist() == list(range(n))  # k = n: the top-k is everything, in order
    _, full_logits = engine.prefill(prompt.ids)
    _, gem_logits = engine.prefill(prompt.ids[selection.kept])
    assert torch.allclose(gem_logits, full_logits, atol=TOL)

    # and through the whole pipeline: 5 greedy tokens, identical
    stop = stop_token_ids(lm.tokenizer)
    full = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=5, stop_ids=set())
    gem = run(engine, prompt, Pipeline.parse(f"gemfilter:k={n},layer=1"), max_new_tokens=5, stop_ids=set())
    assert gem.answer_ids == full.answer_ids and len(gem.answer_ids) == 5
    assert gem.n_kept_tokens == full.n_kept_tokens
    # a hybrid's sliding layers: their window
    assert full.n_kept_tokens == n or lm.windows.full_layers != list(range(lm.n_layers))
    assert stop  # the tokenizer has stop ids


def official_filter_qk(lm, ids, select_layer_idx):
    """q and k of the filter layer, indexed the way the official code does
    (SalesforceAIResearch/GemFilter, my_utils/my_generation.py): ``reduce_layer`` keeps
    ``model.model.layers[:select_layer_idx + 1]``, the truncated HF model runs the prompt, and
    ``find_context`` scores in the attention of ``layers[select_layer_idx]``. Its input (the normed
    hidden states and RoPE's cos/sin, as HF hands them) is captured by a pre-hook; q and k are
    recomputed from it, independently of kvcli's engine. -> (q, repeat_kv(k)), each (1, H, n, d)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    model = lm.model
    original_layers = model.model.layers
    attn = original_layers[select_layer_idx].self_attn
    seen = {}

    def capture(module, args, kwargs):
        seen["h"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen["cos_sin"] = kwargs["position_embeddings"]

    hook = attn.register_forward_pre_hook(capture, with_kwargs=True)
    model.model.layers = original_layers[: select_layer_idx + 1]  # reduce_layer
    try:
        with torch.inference_mode():
            model(ids.view(1, -1).to(lm.device))
    finally:
        model.model.layers = original_layers  # recover_layer
        hook.remove()
    h = seen["h"]
    n = h.shape[1]
    q = attn.q_proj(h).view(1, n, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(h).view(1, n, -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary_pos_emb(q, k, *seen["cos_sin"])
    return q, repeat_kv(k, attn.num_key_value_groups)


def reference_gemfilter_indices(lm, ids, select_layer_idx, k, kernel=5):
    """Appendix C.1 / ``standard_dis_index`` of the official code, literally, on the official
    filter layer: matmul of the last query row, sum over heads, avg_pool, topk, sort."""
    q, kk = official_filter_qk(lm, ids, select_layer_idx)
    in_pro = torch.matmul(q[:, :, -1:, :], kk.transpose(-1, -2))[:, :, 0, :]
    in_pro = torch.sum(in_pro, dim=1, keepdim=True)
    in_pro = F.avg_pool1d(in_pro, kernel_size=kernel, padding=kernel // 2, stride=1)
    return torch.sort(torch.topk(in_pro[0, 0], k, dim=-1).indices).values


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("layer", [1, 2])
def test_selection_matches_the_papers_reference_code(tiny_lm, family, layer):
    """``layer=r`` is the official ``select_layer_idx``: 0-based, layers 0..r run, layer r scores."""
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    gem = parse_one(f"gemfilter:k=40,layer={layer},keep_question=false")
    gem.configure(lm)
    selection = gem.select_tokens(engine, prompt.ids, protected=prompt.n_after_document)
    ref = reference_gemfilter_indices(lm, prompt.ids, select_layer_idx=layer, k=40)
    assert selection.kept.tolist() == ref.tolist()
    # the comparison has teeth: the 1-based reading (scores of layers[r - 1]) selects other tokens
    assert reference_gemfilter_indices(lm, prompt.ids, select_layer_idx=layer - 1, k=40).tolist() != ref.tolist()


def test_filter_pass_stops_at_layer_r(tiny_lm):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    entered, mlps = [], []
    hooks = [l.register_forward_pre_hook(lambda m, a, i=i: entered.append(i)) for i, l in enumerate(engine.layers)]
    hooks += [l.mlp.register_forward_pre_hook(lambda m, a, i=i: mlps.append(i)) for i, l in enumerate(engine.layers)]
    try:
        gem = parse_one("gemfilter:k=30,layer=1")
        gem.configure(lm)
        gem.select_tokens(engine, prompt.ids, protected=prompt.n_after_document)
    finally:
        for h in hooks:
            h.remove()
    assert entered == [0, 1]  # layers 0..r = 0..1 ran; layers 2 and 3 never ran on the long prompt
    assert mlps == [0]  # layer r stops once its queries and keys are scored


def test_prefix_state_is_the_kv_of_the_r_plus_1_layers_run(tiny_lm):
    """The disk store keeps layers 0..r (r + 1 of them); a selection on top of that prefix state
    equals one pass over the whole prompt."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    gem = parse_one("gemfilter:k=30,layer=2")
    gem.configure(lm)
    assert gem.prefix_state(lm) == {"kind": "kv", "layers": 3}
    prefix = Prefix.of(engine, prompt, gem, None, {})
    assert prefix.copy().n_layers == 3
    with_prefix = gem.select_tokens(engine, prompt.ids, protected=prompt.n_after_document, prefix=prefix)
    one_pass = gem.select_tokens(engine, prompt.ids, protected=prompt.n_after_document)
    assert with_prefix.kept.tolist() == one_pass.kept.tolist()
    torch.testing.assert_close(with_prefix.scores, one_pass.scores, atol=1e-4, rtol=1e-4)


def test_keep_question_keeps_every_token_after_the_document(tiny_lm):
    """The instructions between the document and the question (the template's middle), the
    question and the generation prompt are all kept, whatever the scores."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    after = list(range(prompt.doc_end, prompt.n_tokens))
    assert prompt.n_after_document == len(after) > prompt.n_suffix  # the template's middle is not empty
    middle = lm.tokenizer.decode(prompt.ids[prompt.doc_end : prompt.prefix_len])
    assert "question" in middle.lower()  # "... using only the document above ... Question:"
    gem = parse_one(f"gemfilter:k={len(after) + 5},layer=1")
    gem.configure(lm)
    kept = gem.select_tokens(engine, prompt.ids, protected=prompt.n_after_document).kept.tolist()
    assert set(after) <= set(kept) and len(kept) == len(after) + 5


def test_second_pass_reads_only_the_kept_tokens_and_keeps_the_question(tiny_lm):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    result = run(engine, prompt, Pipeline.parse("gemfilter:k=32,layer=2"), max_new_tokens=3, stop_ids=set())
    kept = result.selection.kept.tolist()
    assert len(kept) == 32 and kept == sorted(kept)
    suffix = list(range(prompt.n_tokens - prompt.n_suffix, prompt.n_tokens))
    assert set(suffix) <= set(kept)
    assert (
        result.extra["kv_cache_bytes"]
        < run(engine, prompt, Pipeline.parse("full"), max_new_tokens=3, stop_ids=set()).extra["kv_cache_bytes"]
    )


def test_pipeline_protects_every_token_after_the_document(tiny_lm, monkeypatch):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    pipeline = Pipeline.parse("gemfilter:k=32,layer=1")
    gem = pipeline.stages[0]
    seen = []
    real = gem.select_tokens
    monkeypatch.setattr(
        gem,
        "select_tokens",
        lambda engine, ids, protected=0, prefix=None, prompt=None: (
            seen.append((protected, prompt)) or real(engine, ids, protected, prefix, prompt)
        ),
    )
    run(engine, prompt, pipeline, max_new_tokens=1, stop_ids=set())
    assert seen == [(prompt.n_after_document, prompt)]  # every selector is called the same way


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
        explicit.select_tokens(engine, prompt.ids, protected=prompt.n_after_document)
    default = parse_one("gemfilter:layer=2")  # default k=1024, short prompt: keep everything
    default.configure(lm)
    assert default.select_tokens(engine, prompt.ids).n_kept == prompt.n_tokens


def test_default_filter_layers_are_the_official_codes():
    # select_layer_idx of the official code (0-based), per model family and depth
    assert default_filter_layer(32, "meta-llama/Llama-3.1-8B-Instruct", "llama") == 13  # "13, 14 out of 32"
    assert default_filter_layer(40, "mistralai/Mistral-Nemo-Instruct-2407", "mistral") == 19  # "19 out of 40"
    assert default_filter_layer(32, "microsoft/Phi-3.5-mini-instruct", "phi3") == 19  # "19 out of 32"
    # the embedded model's measured layer: the 16th of 30 (it was "layer=16" when the knob was 1-based)
    assert default_filter_layer(30, "smollm2-135m-instruct", "llama") == 15
    # otherwise ~13/32 of the depth, as an index in 0..n-1
    assert default_filter_layer(32) == 13
    assert default_filter_layer(28, "", "qwen2") == 11
    assert default_filter_layer(2) == 1 and default_filter_layer(1) == 0


def test_layer_knob_is_a_0_based_index(tiny_lm):
    gem = parse_one("gemfilter")
    gem.configure(tiny_lm("llama"))
    assert gem.layer == 2 and gem.k == 1024  # round(13/32 * 4) = index 2, the paper's k
    last = parse_one("gemfilter:layer=3")
    last.configure(tiny_lm("llama"))  # the last of 4 layers: fine
    with pytest.raises(UsageError, match="has 4 layers"):
        parse_one("gemfilter:layer=4").configure(tiny_lm("llama"))
    with pytest.raises(UsageError, match="0-based"):
        parse_one("gemfilter:layer=-1")
    parse_one("gemfilter:layer=0").configure(tiny_lm("llama"))  # the first layer alone


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
