"""RazorAttention: the grouped cache reproduces full attention when it keeps everything (in the
paper's order and in the question-agnostic prefix order), the paper's order gives full
attention's first answer token and compresses the whole prompt, the compensation token is
equation 5, the echo / induction scores pick hand-made echo and induction heads and equal a naive
reference computed from token identity, head profiles are deterministic and reused, the memory
saving is real, and the compressed cache survives the disk store's round trip."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from kvcli import notices
from kvcli.answer.pipeline import Pipeline, default_prefill, run
from kvcli.answer.prefix import Prefix
from kvcli.answer.prompt import build_prompt
from kvcli.caches import KVCache, LayerView, RazorCache
from kvcli.compressors import parse_one
from kvcli.compressors.base import Runtime
from kvcli.compressors.full import FullAttention
from kvcli.compressors.razor import Razor, default_window
from kvcli.compressors.razor_heads import (
    HeadProfile,
    compute_profile,
    echo_induction_scores,
    load_or_compute,
    probe_ids,
    top_fraction,
)
from kvcli.errors import UsageError
from kvcli.runtime.attention import AttentionContext, attention_context, kvcli_attention
from kvcli.runtime.engine import Engine
from kvcli.store import make_key
from tests.helpers.reference import assert_same_logits, causal_softmax, reference_qk
from tests.helpers.runs import full_reference, greedy_logits

TOL = 1e-4
DOC = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} gulls." for i in range(12))
ORDERS = ["paper", "prefix"]


def razor_for(lm, tmp_path, spec: str = "razor:tokens=8") -> Razor:
    razor = parse_one(spec)
    razor.runtime = Runtime(cache_dir=tmp_path)
    razor.configure(lm)
    return razor


def decode_from(engine, cache, first_logits, position: int, steps: int) -> list[torch.Tensor]:
    out = [first_logits]
    for step in range(steps):
        out.append(engine.step(int(torch.argmax(out[-1])), position + step, cache))
    return out


def pipeline_logits(engine, stage, prompt, steps: int):
    """What :func:`kvcli.answer.pipeline.run` does with one stage: its prefix state (computed, no store),
    the prompt's remaining tokens on top, ``compress``, then greedy steps. -> (logits, cache)."""
    prefix = Prefix.of(engine, prompt, stage, None, {})
    compressors = [stage] if "compress" in type(stage).__dict__ else []
    cache, logits = default_prefill(engine, prompt.ids, prefix, compressors)
    for c in compressors:
        cache = c.compress(engine, cache)
    return decode_from(engine, cache, logits, prompt.n_tokens, steps), cache


# --------------------------------------------------------------------------- equal to full attention


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_all_heads_protected_reproduces_full_attention(tiny_lm, tmp_path, family, order):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    # a window far shorter than the document: without protection tokens would be dropped
    razor = razor_for(lm, tmp_path, f"razor:order={order},tokens=8,induction=1,window=8,ratio=100")
    assert bool(razor.protected.all())
    got, cache = pipeline_logits(engine, razor, prompt, steps=5)
    assert isinstance(cache, RazorCache) and cache.n_dropped > 0 and cache.order == order
    assert all(ck.shape[1] == 0 for ck in cache.ck)  # no head in the compressed group
    assert_same_logits(got, full_reference(engine, prompt, steps=5))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family, attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen2", "eager")])
def test_split_heads_without_dropping_reproduce_full_attention(tiny_lm, tmp_path, family, attn, order):
    """Half the KV heads in each group, a window covering the prompt: the per-group attention and
    the reassembly of the head outputs (GQA: 2 query heads per KV head) must give full attention."""
    lm = tiny_lm(family, attn=attn)
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    razor = razor_for(lm, tmp_path, f"razor:order={order},tokens=8,window=100000")
    razor._protected = torch.tensor([[True, False], [False, True], [False, False], [True, True]])
    got, cache = pipeline_logits(engine, razor, prompt, steps=5)
    assert cache.n_dropped == 0 and not cache.compensated
    assert [ck.shape[1] for ck in cache.ck] == [1, 1, 2, 0]
    assert_same_logits(got, full_reference(engine, prompt, steps=5))


def test_prefix_order_compression_changes_the_first_token(tiny_lm, tmp_path):
    """Sanity: with few protected heads and a short window, compressing the document before the
    question changes even the first answer token's logits."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    razor = razor_for(lm, tmp_path, "razor:order=prefix,tokens=8,window=8,ratio=100,sinks=4")
    got, cache = pipeline_logits(engine, razor, prompt, steps=0)
    assert cache.n_dropped == prompt.prefix_len - 12 and cache.compensated
    assert not torch.allclose(got[0], full_reference(engine, prompt, steps=0)[0], atol=TOL)


def test_paper_order_first_token_is_full_attentions_then_compression_acts(tiny_lm, tmp_path):
    """Algorithm 1: the whole prompt is prefilled with full attention (from full attention's prefix
    state), so the first answer token's logits are exactly full attention's; the KV is compressed
    before decoding, so the next steps differ."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    razor = razor_for(lm, tmp_path, "razor:tokens=8,window=8,ratio=100,sinks=4")
    assert razor.order == "paper"
    got, cache = pipeline_logits(engine, razor, prompt, steps=3)
    want, _ = pipeline_logits(engine, FullAttention(), prompt, steps=3)
    assert torch.equal(got[0], want[0])  # the same arithmetic, bit for bit
    assert not torch.allclose(got[1], want[1], atol=TOL)
    # N is the whole prompt: the window of the non-retrieval heads ends with the question
    n = prompt.n_tokens
    assert (cache.n_compressed, cache.n_dropped, cache.window, cache.compensated) == (n, n - 4 - 8, 8, True)
    assert cache.order == "paper" and cache.stats()["order"] == "paper"


def test_paper_order_shares_full_attentions_prefix_state(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    razor = razor_for(lm, tmp_path)
    assert razor.prefix_state(lm) == FullAttention().prefix_state(lm)
    ids = prompt.ids[: prompt.prefix_len]
    assert make_key(lm, ids, razor.prefix_state(lm)) == make_key(lm, ids, FullAttention().prefix_state(lm))
    state = razor.build_prefix(engine, ids)
    assert type(state) is KVCache and state.n_tokens == prompt.prefix_len
    prefix_order = razor_for(lm, tmp_path, "razor:order=prefix,tokens=8")
    assert prefix_order.prefix_state(lm)["kind"] == "razor"
    assert isinstance(prefix_order.build_prefix(engine, ids), RazorCache)


@pytest.mark.parametrize("order", ORDERS)
def test_kept_mask_and_stats_say_what_each_head_holds(tiny_lm, tmp_path, order):
    """Through the pipeline: retrieval heads hold every prompt entry, the others the sinks and the
    last ``window`` tokens of what was compressed — the whole prompt (paper: the question is
    inside the window) or the prefix (prefix: the question's tokens were appended after it)."""
    lm = tiny_lm("qwen2")
    pipeline = Pipeline.parse(f"razor:order={order},tokens=8,window=16,ratio=100,sinks=4")
    razor = pipeline.stages[0]
    razor.runtime = Runtime(cache_dir=tmp_path)
    razor.configure(lm)
    protected = torch.tensor([[True, False], [False, False], [False, True], [True, True]])
    razor._protected = protected
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    result = run(Engine(lm), prompt, pipeline, max_new_tokens=3, stop_ids=set())
    n, prefix = prompt.n_tokens, prompt.prefix_len
    others = torch.zeros(n, dtype=torch.bool)
    others[:4] = True
    if order == "paper":
        others[n - 16 :] = True
    else:
        others[prefix - 16 :] = True
    mask = result.kept_mask()
    for layer in range(lm.n_layers):
        for head in range(2):
            want = torch.ones(n, dtype=torch.bool) if protected[layer, head] else others
            assert (mask[layer, head] == want).all(), (layer, head)
    stats = json.loads(json.dumps(result.extra["method_stats"]))
    compressed = n if order == "paper" else prefix
    assert stats["order"] == order and stats["compressed_tokens"] == compressed
    assert stats["dropped_tokens"] == compressed - 20 and stats["protected_kv_heads"] == 4 and stats["kv_heads"] == 8
    assert stats["kv_bytes"] == result.extra["kv_cache_bytes"] < stats["kv_bytes_full"]


def test_razor_after_an_eviction_method_is_refused(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    pipeline = Pipeline.parse("snapkv:budget=40,window=8+razor:tokens=8")
    pipeline.configure(lm, Runtime(cache_dir=tmp_path))
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    with pytest.raises(UsageError, match="whole KV"):
        run(Engine(lm), prompt, pipeline, max_new_tokens=2, stop_ids=set())


# --------------------------------------------------------------------------- equation 5 by hand


def _eq5_by_hand(q, keys, values, dropped, scaling):
    """Equation 5 in float64: (N_d e^{s q k̂} v̂ + Σ_{n∉D} e^{s q k_n} v_n) / (N_d e^{s q k̂} + Σ_{n∉D} e^{s q k_n})."""
    q, keys, values = q.double(), keys.double(), values.double()
    n = keys.shape[0]
    kept = [i for i in range(n) if i not in set(dropped)]
    k_hat, v_hat = keys[dropped].mean(0), values[dropped].mean(0)
    n_d = len(dropped)
    num = n_d * torch.exp(scaling * q @ k_hat) * v_hat
    den = n_d * torch.exp(scaling * q @ k_hat)
    for i in kept:
        w = torch.exp(scaling * q @ keys[i])
        num = num + w * values[i]
        den = den + w
    return num / den


def _plain_by_hand(q, keys, values, scaling):
    w = torch.softmax(scaling * keys.double() @ q.double(), dim=0)
    return w @ values.double()


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_compensation_token_is_equation_5(kernel):
    torch.manual_seed(0)
    n, d, n_heads, sinks, window = 20, 8, 4, 2, 5
    keys, values = torch.randn(1, 2, n, d), torch.randn(1, 2, n, d)
    kv = KVCache()
    kv.update(keys, values, 0)
    kv.record_positions(torch.arange(n))
    protected = torch.tensor([[True, False]])  # KV head 0 keeps everything, KV head 1 is compressed
    cache = RazorCache.compress(kv, protected, n_heads, sinks, window)
    dropped = list(range(sinks, n - window))
    assert cache.n_dropped == len(dropped) == 13 and cache.compensated
    assert cache.ck[0].shape == (1, 1, 1 + sinks + window, d)  # [k̂, sinks, window]
    torch.testing.assert_close(cache.ck[0][0, 0, 0], keys[0, 1, dropped].mean(0))
    torch.testing.assert_close(cache.cv[0][0, 0, 0], values[0, 1, dropped].mean(0))

    # two new tokens (causal between them), 4 query heads: heads 0-1 read KV head 0, 2-3 KV head 1
    new_k, new_v = torch.randn(1, 2, 2, d), torch.randn(1, 2, 2, d)
    view, same = cache.update(new_k, new_v, 0)
    assert view is same and isinstance(view, LayerView)
    query = torch.randn(1, n_heads, 2, d)
    scaling = 1 / math.sqrt(d)
    module = types.SimpleNamespace(layer_idx=0)
    with attention_context(AttentionContext(kernel=kernel)):
        out, _ = kvcli_attention(module, query, view, view, None, scaling=scaling)
    assert out.shape == (1, 2, n_heads, d)

    all_k, all_v = torch.cat([keys, new_k], dim=2), torch.cat([values, new_v], dim=2)
    for row in range(2):
        visible = n + row + 1
        for h in range(n_heads):
            g = h // 2
            ks, vs = all_k[0, g, :visible], all_v[0, g, :visible]
            if g == 0:
                want = _plain_by_hand(query[0, h, row], ks, vs, scaling)
            else:
                want = _eq5_by_hand(query[0, h, row], ks, vs, dropped, scaling)
            torch.testing.assert_close(out[0, row, h].double(), want, atol=1e-5, rtol=0)


def test_without_compensation_the_dropped_tokens_are_gone():
    torch.manual_seed(1)
    n, d = 12, 4
    keys, values = torch.randn(1, 1, n, d), torch.randn(1, 1, n, d)
    kv = KVCache()
    kv.update(keys, values, 0)
    kv.record_positions(torch.arange(n))
    cache = RazorCache.compress(kv, torch.tensor([[False]]), 1, sinks=1, window=3, compensate=False)
    assert not cache.compensated and cache.ck[0].shape[2] == 4
    view, _ = cache.update(torch.randn(1, 1, 1, d), torch.randn(1, 1, 1, d), 0)
    q = torch.randn(1, 1, 1, d)
    out, _ = kvcli_attention(types.SimpleNamespace(layer_idx=0), q, view, view, None, scaling=0.5)
    ks = torch.cat([keys[0, 0, [0, 9, 10, 11]], cache.ck[0][0, 0, -1:]])  # the new token: the last compressed row
    vs = torch.cat([values[0, 0, [0, 9, 10, 11]], cache.cv[0][0, 0, -1:]])
    torch.testing.assert_close(out[0, 0, 0].double(), _plain_by_hand(q[0, 0, 0], ks, vs, 0.5), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- head profiles


def test_head_profile_is_deterministic_and_reloaded_from_disk(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    assert torch.equal(probe_ids(lm, 16, 0), probe_ids(lm, 16, 0))
    ids = probe_ids(lm, 16, 0)
    assert ids.numel() == 64 and torch.equal(ids[:16], ids[48:]) and ids[:16].unique().numel() == 16

    first = load_or_compute(engine, tokens=16, seed=0, cache_dir=tmp_path)
    assert not first.loaded and first.path.is_file() and first.path.parent == tmp_path / "heads"
    assert lm.fingerprint in first.path.name
    again = compute_profile(engine, tokens=16, seed=0)
    assert torch.equal(again.echo, first.echo) and torch.equal(again.induction, first.induction)
    other_seed = compute_profile(engine, tokens=16, seed=1)
    assert not torch.equal(other_seed.induction, first.induction)

    reloaded = load_or_compute(engine, tokens=16, seed=0, cache_dir=tmp_path)
    assert reloaded.loaded and reloaded.path == first.path
    assert torch.equal(reloaded.echo, first.echo) and torch.equal(reloaded.induction, first.induction)
    assert reloaded.identity() == first.identity()
    assert list(tmp_path.joinpath("heads").iterdir()) == [first.path]  # no temp files left

    # a damaged file is a warning and is recomputed (and rewritten)
    notices.reset()
    first.path.write_bytes(b"garbage")
    fixed = load_or_compute(engine, tokens=16, seed=0, cache_dir=tmp_path)
    assert not fixed.loaded and torch.equal(fixed.induction, first.induction)
    assert any("damaged" in w for w in notices.collected())
    assert HeadProfile.load(first.path, lm).loaded
    with pytest.raises(ValueError, match="another model"):
        HeadProfile.load(first.path, tiny_lm("qwen2"))


def test_protection_fractions_and_the_gqa_rule():
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3], [0.0, 0.8, 0.05, 0.04]])  # 2 layers x 4 query heads
    echo = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.7]])
    profile = HeadProfile("f", "m", n_kv_heads=2, tokens=4, seed=0, echo=echo, induction=scores)
    by_ind, by_echo = profile.protected_query_heads(0.25, 0.1)  # ceil(2) induction, ceil(0.8)=1 echo
    assert torch.nonzero(by_ind).tolist() == [[0, 0], [1, 1]]
    assert torch.nonzero(by_echo).tolist() == [[1, 3]]
    # query heads 0-1 read KV head 0, heads 2-3 KV head 1: protected if any of its query heads is
    assert profile.protected_kv_heads(0.25, 0.1).tolist() == [[True, False], [True, True]]
    assert profile.protected_kv_heads(0.0, 0.0).tolist() == [[False, False], [False, False]]
    assert top_fraction(scores, 1.0).all()


# --------------------------------------------------------------------------- echo and induction scores


def reference_scores(attn: torch.Tensor, ids: torch.Tensor, first_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's definitions (§3.3, Figure 3b) read off a full attention matrix ``attn`` (H, n, n)
    by token identity, not by period arithmetic: for query row i, the *echo tokens* are the earlier
    positions m < i holding the same token id as i, the *induction tokens* the positions m + 1 right
    after them. Each score sums the row's attention on those positions; rows ``first_row..n-1`` are
    averaged (the probe: repeats 2-4)."""
    n = ids.numel()
    echo = torch.zeros(attn.shape[0], dtype=torch.float64, device=attn.device)
    induction = torch.zeros(attn.shape[0], dtype=torch.float64, device=attn.device)
    for i in range(first_row, n):
        earlier = [m for m in range(i) if int(ids[m]) == int(ids[i])]
        echo += attn[:, i, earlier].double().sum(-1)
        induction += attn[:, i, [m + 1 for m in earlier]].double().sum(-1)
    rows = n - first_row
    return echo / rows, induction / rows


def handmade_heads(period: int, strength: float = 20.0):
    """Queries and keys of 4 query heads over 2 KV heads (GQA) for a sequence of ``period``
    distinct tokens repeated 4 times: KV head 0 keys are one-hot in the token's place in the
    period; query head 0 looks for the *next* token's key (an induction head), query head 1 for
    the same token's key (an echo head); KV head 1 has zero keys, so heads 2-3 attend uniformly."""
    n = 4 * period
    place = torch.arange(n) % period
    eye = torch.eye(period)
    key = torch.zeros(1, 2, n, period)
    key[0, 0] = eye[place]
    query = torch.zeros(1, 4, n, period)
    query[0, 0] = strength * eye[(place + 1) % period]
    query[0, 1] = strength * eye[place]
    query[0, 2:] = torch.randn(2, n, period)
    return query, key


def test_scores_rank_a_handmade_induction_head_and_echo_head_first():
    """Where each head looks is known by construction, so are the scores. An off-by-one in the
    ``i - j*K (+1)`` columns swaps or zeroes them. 100 tokens repeated 4 times: 300 scored rows,
    i.e. two row chunks of the scorer."""
    torch.manual_seed(0)
    K = 100
    query, key = handmade_heads(K)
    echo, induction = echo_induction_scores(query, key, K, scaling=1.0)
    assert induction.argmax() == 0 and echo.argmax() == 1
    assert torch.argsort(induction, descending=True)[0] == 0 and torch.argsort(echo, descending=True)[0] == 1
    # row i of repeat r (r = 1, 2, 3 previous occurrences): the induction head's mass is on the r
    # tokens that followed them — except for the last token of a period, whose "next" token also
    # occurs at position 0, which followed nothing (r / (r+1)); the echo head splits its mass
    # between the r earlier occurrences and the current token itself (r / (r+1))
    split = sum(r / (r + 1) for r in (1, 2, 3))
    torch.testing.assert_close(
        induction[0].double(), torch.tensor(((K - 1) * 3 + split) / (3 * K), dtype=torch.float64), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(echo[1].double(), torch.tensor(split / 3, dtype=torch.float64), atol=1e-5, rtol=0)
    assert echo[0] < 1e-5 and induction[1] < 1e-5  # each looks at the other's tokens not at all
    # uniform heads: row i puts 1/(i+1) on each of its r earlier occurrences, and on each follower
    uniform = sum((i // K) / (i + 1) for i in range(K, 4 * K)) / (3 * K)
    for h in (2, 3):
        assert echo[h].item() == pytest.approx(uniform, abs=1e-6) and induction[h].item() == pytest.approx(
            uniform, abs=1e-6
        )
    # the protection rule picks exactly those heads (one layer of 4 query heads, 2 KV heads)
    profile = HeadProfile(
        "f", "m", n_kv_heads=2, tokens=K, seed=0, echo=echo.view(1, 4), induction=induction.view(1, 4)
    )
    by_ind, by_echo = profile.protected_query_heads(0.25, 0.25)
    assert by_ind.tolist() == [[True, False, False, False]] and by_echo.tolist() == [[False, True, False, False]]
    assert profile.protected_kv_heads(0.25, 0.25).tolist() == [[True, False]]
    # and they equal the definition computed naively from the attention matrix by token identity
    ids = torch.arange(4 * K) % K
    attn = causal_softmax(query, key.repeat_interleave(2, dim=1), 1.0)[0]
    want_echo, want_induction = reference_scores(attn, ids, K)
    torch.testing.assert_close(echo.double(), want_echo, atol=1e-6, rtol=0)
    torch.testing.assert_close(induction.double(), want_induction, atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 150])
def test_scores_equal_the_naive_definition_on_random_heads(window):
    torch.manual_seed(1)
    K, d = 90, 8
    n = 4 * K
    query, key = torch.randn(1, 6, n, d), torch.randn(1, 2, n, d)  # 3 query heads per KV head
    echo, induction = echo_induction_scores(query, key, K, scaling=0.7, sliding_window=window)
    logits = torch.matmul(query, key.repeat_interleave(3, dim=1).transpose(-1, -2))[0] * 0.7
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = cols <= rows
    if window is not None:
        allowed &= cols > rows - window
    attn = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    want_echo, want_induction = reference_scores(attn, torch.arange(n) % K, K)
    torch.testing.assert_close(echo.double(), want_echo, atol=1e-6, rtol=0)
    torch.testing.assert_close(induction.double(), want_induction, atol=1e-6, rtol=0)


def test_profile_of_a_model_equals_the_definition_on_its_own_attention(tiny_lm):
    """The whole probe through kvcli's engine (observers, RoPE, GQA, scaling, the period of the
    repeats) against the definition applied to attention recomputed the Hugging Face way."""
    lm = tiny_lm("qwen2")
    K = 100
    profile = compute_profile(Engine(lm), tokens=K, seed=0)
    ids = probe_ids(lm, K, 0)
    for layer, (q, k, attn) in enumerate(reference_qk(lm, ids)):
        weights = causal_softmax(q, k, attn.scaling)[0]
        want_echo, want_induction = reference_scores(weights, ids, K)
        got_echo, got_induction = (s[layer].double().to(want_echo.device) for s in (profile.echo, profile.induction))
        torch.testing.assert_close(got_echo, want_echo, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_induction, want_induction, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- memory and the store


def _partial_cache(tiny_lm, tmp_path, spec="razor:order=prefix,tokens=8,window=16,ratio=100"):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, "How many gulls?")
    razor = razor_for(lm, tmp_path, spec)
    razor._protected = torch.tensor([[True, False], [False, False], [False, True], [True, True]])
    prefix = prompt.ids[: prompt.prefix_len]
    return lm, engine, prompt, razor, razor.build_prefix(engine, prefix), engine.prefix_kv(prefix)


def test_memory_saving_is_real(tiny_lm, tmp_path):
    lm, engine, prompt, razor, cache, full = _partial_cache(tiny_lm, tmp_path)
    n, d, el = prompt.prefix_len, lm.head_dim, 4
    kept = razor.sinks + 16 + 1  # sinks + window + compensation token
    n_protected = [1, 0, 1, 2]
    expected = sum(2 * d * el * (p * n + (2 - p) * kept) for p in n_protected)
    assert cache.nbytes() == expected
    assert cache.full_nbytes() == full.nbytes()
    report = cache.kv_bytes()
    assert (
        report["before"] == full.nbytes()
        and report["after"] == expected
        and report["ratio"] == full.nbytes() / expected > 1.5
    )
    # the tensors really are that small: no full-length tensor for compressed heads, no GQA expansion
    for layer, p in enumerate(n_protected):
        assert cache.pk[layer].shape == (1, p, n, d) and cache.ck[layer].shape == (1, 2 - p, kept, d)
    # the question and each decoded token add one entry per KV head, in both groups
    before = cache.nbytes()
    grown = cache.copy()
    engine.prefill(prompt.ids[prompt.prefix_len :], cache=grown)
    assert grown.nbytes() - before == prompt.n_suffix * lm.n_layers * 2 * 2 * d * el
    assert cache.nbytes() == before  # the copy left the original alone
    assert grown.n_tokens == prompt.n_tokens and grown.get_seq_length(0) == prompt.n_tokens


def test_to_tensors_round_trip(tiny_lm, tmp_path):
    from safetensors.torch import load_file, save_file

    lm, engine, prompt, razor, cache, _ = _partial_cache(tiny_lm, tmp_path)
    tensors, facts = cache.to_tensors()
    json.dumps(facts)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors.values())
    save_file(tensors, str(tmp_path / "entry.safetensors"))
    back = RazorCache.from_tensors(
        load_file(str(tmp_path / "entry.safetensors")), json.loads(json.dumps(facts)), device=cache.pk[0].device
    )
    assert back.kind == "razor" and back.n_tokens == cache.n_tokens and back.n_dropped == cache.n_dropped
    assert back.order == cache.order == "prefix"
    assert torch.equal(back.protected, cache.protected)
    for a, b in zip((*back.pk, *back.pv, *back.ck, *back.cv), (*cache.pk, *cache.pv, *cache.ck, *cache.cv)):
        assert torch.equal(a, b)
    question = prompt.ids[prompt.prefix_len :]
    assert_same_logits(greedy_logits(engine, back, question, 2), greedy_logits(engine, cache.copy(), question, 2))

    bad = dict(tensors)
    del bad["ck.1"]
    with pytest.raises(ValueError, match="tensor names"):
        RazorCache.from_tensors(bad, facts)
    bad = dict(tensors, **{"ck.1": tensors["ck.1"][:, :, :-1]})
    with pytest.raises(ValueError, match="ck.1 has shape"):
        RazorCache.from_tensors(bad, facts)
    with pytest.raises(ValueError):
        RazorCache.from_tensors(tensors, dict(facts, n_dropped=facts["n_dropped"] + 1))
    with pytest.raises(ValueError, match="positions"):
        RazorCache.from_tensors(tensors, dict(facts, n_tokens=facts["n_tokens"] + 1))
    with pytest.raises(ValueError, match="incomplete"):
        RazorCache.from_tensors(tensors, {"n_layers": 4})


def test_prefix_state_names_what_the_cache_depends_on(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    spec = "razor:order=prefix,tokens=8"
    a = razor_for(lm, tmp_path, spec).prefix_state(lm)
    assert a["kind"] == "razor" and a["profile"]["tokens"] == 8 and "question" not in json.dumps(a)
    assert a == razor_for(lm, tmp_path, spec).prefix_state(lm)
    assert razor_for(lm, tmp_path, spec + ",window=64").prefix_state(lm) != a
    assert razor_for(lm, tmp_path, spec + ",seed=3").prefix_state(lm)["profile"] != a["profile"]


# --------------------------------------------------------------------------- knobs and the CLI


def test_knobs_defaults_and_errors(tiny_lm, tmp_path):
    razor = razor_for(tiny_lm("llama"), tmp_path, "razor")
    assert (
        razor.spec()
        == "razor:order=paper,induction=0.14,echo=0.01,sinks=4,window=500,ratio=5.0,compensate=true,tokens=512,seed=0"
    )
    assert razor.window_for(100) == 500 and razor.window_for(10_000) == 2000  # max(S_0, N/C)
    assert default_window(8192) == 1000 and default_window(131072) == 4000
    for spec, message in [
        ("razor:induction=1.5", "between 0 and 1"),
        ("razor:ratio=0.5", "at least 1"),
        ("razor:window=0", "window must be at least 1"),
        ("razor:tokens=1", "tokens must be at least 2"),
        ("razor:order=late", "order must be paper or prefix"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_one(spec)
    with pytest.raises(UsageError, match="sliding-window"):
        razor_for(tiny_lm("mistral", sliding_window=32), tmp_path)


def test_heads_command_computes_once_then_shows(tiny_dir, tmp_path, capsys, monkeypatch):
    from tests.helpers.cli_runner import assert_user_error, run_cli

    model = str(tiny_dir("llama", num_hidden_layers=4))
    args = ["heads", model, "--tokens", "8", "--cache-dir", tmp_path, "--json"]
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    first = json.loads(out)
    assert not first["loaded"] and first["n_layers"] == 4 and len(first["induction"]) == 4
    assert first["n_by_induction"] == 3 and first["n_by_echo"] == 1  # ceil(14% of 16), ceil(1% of 16)
    assert 3 <= first["n_protected_query_heads"] <= 4
    code, out, err = run_cli(args, capsys, monkeypatch)
    second = json.loads(out)
    assert second["loaded"] and second["induction"] == first["induction"]
    code, out, err = run_cli(["heads", model, "--tokens", "8", "--cache-dir", tmp_path], capsys, monkeypatch)
    assert code == 0 and "layer" in out and "loaded from" in out
    assert_user_error(
        run_cli(["heads", str(tmp_path / "nope"), "--cache-dir", tmp_path], capsys, monkeypatch), 1, "no such directory"
    )
    assert_user_error(
        run_cli(["heads", model, "--score", "x", "--cache-dir", tmp_path], capsys, monkeypatch), 2, "--score"
    )


def test_a_selector_before_razor_is_refused():
    from kvcli.answer.pipeline import Pipeline
    from kvcli.errors import UsageError

    with pytest.raises(UsageError, match="selects tokens before razor"):
        Pipeline.parse("gemfilter+razor")


def test_decoding_appends_in_place_and_never_over_a_copy():
    """A decoding step appends its row into each group's buffer (no copy of the layer's groups);
    a copy of the cache gets buffers of its own on its first append, so the original's entries
    (and the views it handed out) stay as they were."""
    from kvcli.caches import KVCache
    from kvcli.caches.razor import RazorCache

    g = torch.Generator().manual_seed(1)
    kv = KVCache()
    for layer in range(2):
        kv.update(torch.randn(1, 2, 30, 4, generator=g), torch.randn(1, 2, 30, 4, generator=g), layer)
    kv.positions = torch.arange(30)
    cache = RazorCache.compress(kv, torch.tensor([[True, False], [False, True]]), 4, sinks=2, window=5)
    rows = [(torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g)) for _ in range(4)]
    cache.update(*rows[0], 0)
    ptrs = (cache.pk[0].data_ptr(), cache.ck[0].data_ptr())
    before = cache.copy()
    held = [t.clone() for t in (cache.pk[0], cache.pv[0], cache.ck[0], cache.cv[0])]
    for k, v in rows[1:3]:
        cache.update(k, v, 0)
    assert (cache.pk[0].data_ptr(), cache.ck[0].data_ptr()) == ptrs  # in place
    assert cache.pk[0].shape[-2] == 33 and cache.ck[0].shape[-2] == 2 + 5 + 1 + 3
    assert torch.equal(cache.pk[0][:, :, 31:], torch.cat([k[:, :1] for k, _ in rows[1:3]], dim=2))
    assert torch.equal(cache.cv[0][:, :, -2:], torch.cat([v[:, 1:] for _, v in rows[1:3]], dim=2))
    before.update(*rows[3], 0)  # the copy writes elsewhere
    assert before.pk[0].data_ptr() != ptrs[0]
    assert all(
        torch.equal(a[:, :, : b.shape[2]], b)
        for a, b in zip((cache.pk[0], cache.pv[0], cache.ck[0], cache.cv[0]), held)
    )
    assert torch.equal(before.pk[0][:, :, -1:], rows[3][0][:, :1])
