"""LazyLLM: keep=1 is full attention; revived tokens get the KV of the Aux Cache path (checked
against an independent recomputation); every (token, layer) is computed at most once; the prefix
state (disk store) does the same arithmetic as one pass; knobs and pipelines."""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.answer.prefix import Prefix
from kvcli.answer.prompt import build_prompt
from kvcli.caches import LazyCache
from kvcli.compressors import parse_one
from kvcli.compressors.lazyllm import default_keep, default_layers, last_token_attention, n_keep
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from kvcli.store import KVStore

TOL = 1e-4
DOC = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} gulls." for i in range(12))


def lazy(lm, spec: str):
    c = parse_one(spec)
    c.configure(lm)
    return c


def setup(tiny_lm, family="llama"):
    lm = tiny_lm(family)
    engine = Engine(lm)
    return lm, engine, build_prompt(lm.tokenizer, DOC, "How many gulls?")


def greedy(step, first_logits, n_prompt, steps=5):
    """Greedy decode with ``step(token, position)``; every step's logits."""
    out, logits = [first_logits], first_logits
    for i in range(steps):
        logits = step(int(torch.argmax(logits)), n_prompt + i)
        out.append(logits)
    return out


# --- keep = 1 everywhere is full attention ---------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-window"])
def test_keep_one_reproduces_full_attention(tiny_lm, family):
    if family == "mistral-window":  # a sliding window shorter than the prompt: masks count positions
        lm = tiny_lm("mistral", sliding_window=48, num_hidden_layers=4)
        engine, prompt = Engine(lm), build_prompt(lm.tokenizer, DOC, "How many gulls?")
    else:
        lm, engine, prompt = setup(tiny_lm, family)
    n = prompt.n_tokens
    full_cache, full_first = engine.prefill(prompt.ids)
    full = greedy(lambda t, p: engine.step(t, p, full_cache), full_first, n)
    method = lazy(lm, "lazyllm:layers=1/2/3,keep=1/1/1")
    cache, first, next_position = method.prefill(engine, prompt.ids, protected=prompt.n_suffix)
    assert next_position == n
    ours = greedy(lambda t, p: method.decode_step(engine, t, p, cache), first, n)
    for a, b in zip(ours, full):
        assert torch.allclose(a, b, atol=TOL)
    stats = cache.stats()
    assert stats["prompt_tokens_computed_frac"] == 1.0 and stats["revived"] == 0
    # through the pipeline (prefix state + question on top): the same 5 greedy tokens
    ref = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=5, stop_ids=set())
    got = run(engine, prompt, Pipeline.parse("lazyllm:keep=1/1/1"), max_new_tokens=5, stop_ids=set())
    assert got.answer_ids == ref.answer_ids and len(got.answer_ids) == 5


# --- the scores are equation 1 ----------------------------------------------------------------------


def test_last_token_attention_is_head_mean_of_softmax():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 7, 16)
    visible = torch.tensor([True, False, True, True, True, False, True])
    got = last_token_attention(q, k, visible)
    kk = k.repeat_interleave(2, dim=1)  # GQA, expanded only in the reference
    logits = (q[0, :, -1:, :] @ kk[0].transpose(-1, -2))[:, 0] / math.sqrt(16)  # (4, 7)
    logits[:, ~visible] = float("-inf")
    assert torch.allclose(got, logits.softmax(-1).mean(0), atol=1e-6)
    assert got[~visible].eq(0).all()


def test_prefill_prunes_by_the_last_tokens_attention(tiny_lm):
    """The tokens kept at the pruning layer are the top ceil(keep·n) of equation 1 computed from an
    independent HF forward (layers before it see every token); the last token is always kept."""
    from tests.helpers.reference import reference_qk

    lm, engine, prompt = setup(tiny_lm)
    n = prompt.n_tokens
    method = lazy(lm, "lazyllm:layers=2,keep=0.4")
    cache, _, _ = method.prefill(engine, prompt.ids)
    q, k, _ = reference_qk(lm, prompt.ids)[1]  # layer 1 = the layer before the pruning layer
    scores = (q[0, :, -1:, :] @ k[0].transpose(-1, -2))[:, 0].div(math.sqrt(q.shape[-1])).softmax(-1).mean(0)
    scores[-1] = float("inf")
    expected = torch.topk(scores, n_keep(0.4, n)).indices.sort().values
    assert cache.slot_pos[2].tolist() == expected.tolist() == cache.slot_pos[3].tolist()
    assert cache.stats()["per_layer_prefill_tokens"] == [n, n, n_keep(0.4, n), n_keep(0.4, n)]
    mask = cache.kept_mask(n)
    assert mask.shape == (4, 2, n) and mask[:2].all() and mask[2:, :, expected.to(mask.device)].all()
    assert int(mask[2, 0].sum()) == n_keep(0.4, n)


# --- revival from the Aux Cache == recomputation -----------------------------------------------------


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def _kv(layer, h, pos, lm):
    """Reference key/value (1, n_kv, q, d) of layer ``layer`` for inputs h (1, q, hidden) at ``pos``."""
    attn, rot = layer.self_attn, lm.model.model.rotary_emb
    x = layer.input_layernorm(h)
    k = attn.k_proj(x).view(1, h.shape[1], -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(1, h.shape[1], -1, attn.head_dim).transpose(1, 2)
    cos, sin = rot(h, pos.to(h.device).view(1, -1))
    return _rope(k, cos.unsqueeze(1), sin.unsqueeze(1)), v


def _layer_out(layer, h, pos, keys, values, key_pos, lm):
    """Reference decoder layer (eager, written out) for one token h (1, 1, hidden) at ``pos``
    attending to ``keys``/``values`` (1, n_kv, m, d) at ``key_pos`` (those <= pos)."""
    attn, rot = layer.self_attn, lm.model.model.rotary_emb
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
    cos, sin = rot(h, torch.tensor([[pos]], device=h.device))
    q = _rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
    groups = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    w = (q @ k.transpose(-1, -2)) * attn.scaling
    w = w.masked_fill(~(key_pos.to(w.device) <= pos).view(1, 1, 1, -1), float("-inf")).softmax(-1)
    o = attn.o_proj((w @ v).transpose(1, 2).reshape(1, 1, -1))
    h = h + o
    return h + layer.mlp(layer.post_attention_layernorm(h))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_revived_token_gets_the_kv_of_the_aux_cache_path(tiny_lm, family):
    """Prune at layer 2 in the prefill, decode one step: tokens the new token selects again are
    revived from the Aux Cache of layer 2. Their KV at layer 2 must equal the KV recomputed from
    an independent HF forward (their hidden state entering layer 2 — layers 0-1 saw every token),
    and their KV at layer 3 that of a hand-written layer 2 attending to that step's set S_2."""
    lm, engine, prompt = setup(tiny_lm, family)
    n = prompt.n_tokens
    method = lazy(lm, "lazyllm:layers=2,keep=0.5")
    cache, first, _ = method.prefill(engine, prompt.ids)
    pruned = cache.frontier[:n] == 2
    assert int(pruned.sum()) == n - n_keep(0.5, n)
    cache.trace = []
    token = int(torch.argmax(first))
    method.decode_step(engine, token, n, cache)
    ((layer, selected),) = cache.trace[0]
    assert layer == 2
    revived = torch.nonzero(pruned & selected[:n]).flatten()
    assert revived.numel() > 0 and cache.revived[revived].all() and cache.stats()["revived"] == revived.numel()
    assert (cache.frontier[revived] == 4).all()

    with torch.inference_mode():
        model = lm.model
        seq = torch.cat([prompt.ids, torch.tensor([token])]).view(1, -1).to(lm.device)
        hs = model(seq, output_hidden_states=True).hidden_states  # layers 0-1: full attention, all tokens
        layers = model.model.layers
        all_pos = torch.arange(n + 1, device=lm.device)
        k2, v2 = _kv(layers[2], hs[2], all_pos, lm)  # every token's layer-2 KV, recomputed
        members = torch.nonzero(selected).flatten()  # S_2 of the decoding step (the new token included)
        for j in revived.tolist():
            slot = int(torch.nonzero(cache.slot_pos[2] == j))
            assert torch.allclose(cache.keys[2][:, :, slot], k2[:, :, j], atol=TOL)
            assert torch.allclose(cache.values[2][:, :, slot], v2[:, :, j], atol=TOL)
            out = _layer_out(layers[2], hs[2][:, j : j + 1], j, k2[:, :, members], v2[:, :, members], members, lm)
            k3, v3 = _kv(layers[3], out, torch.tensor([j]), lm)
            slot = int(torch.nonzero(cache.slot_pos[3] == j))
            assert torch.allclose(cache.keys[3][:, :, slot], k3[:, :, 0], atol=TOL)
            assert torch.allclose(cache.values[3][:, :, slot], v3[:, :, 0], atol=TOL)
        # tokens pruned again stay in the Aux Cache of layer 2 with their prefill hidden state
        pos, hidden = cache.aux[2]
        assert set(pos.tolist()) == set(torch.nonzero(pruned & ~selected[:n]).flatten().tolist())
        assert torch.allclose(hidden[0], hs[2][0, pos], atol=TOL)


# --- each token computed at most once per layer -------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_token_is_computed_at_most_once_per_layer(tiny_lm, family):
    lm, engine, prompt = setup(tiny_lm, family)
    n = prompt.n_tokens
    result = run(
        engine, prompt, Pipeline.parse("lazyllm:layers=1/2/3,keep=0.6/0.4/0.2"), max_new_tokens=12, stop_ids=set()
    )
    cache, stats = result.cache, result.extra["method_stats"]
    assert isinstance(cache, LazyCache) and len(result.answer_ids) == 12
    total = n + 11  # prompt + the decoded tokens that ran as queries
    assert cache.computed.shape == (4, total)
    assert int(cache.computed.max()) == 1 == stats["max_computations_per_layer"]
    assert stats["revived"] > 0  # tokens did come back, and were still computed only once
    # what each layer holds is exactly what was computed there, once
    for layer in range(4):
        slots = cache.slot_pos[layer]
        assert slots.unique().numel() == slots.numel() == cache.get_seq_length(layer)
        assert sorted(slots.tolist()) == torch.nonzero(cache.computed[layer]).flatten().tolist()
        assert (cache.frontier[slots] > layer).all()
    # decoded tokens run through every layer; the Aux Cache holds exactly the unfinished tokens
    assert (cache.computed[:, n:] == 1).all()
    in_aux = sorted(p for pos, _ in cache.aux.values() for p in pos.tolist())
    assert in_aux == torch.nonzero(cache.frontier < 4).flatten().tolist()
    # the paper's "% of prompt tokens computed", never more than full attention's work
    assert stats["prompt_tokens_computed_frac"] == pytest.approx(float(cache.computed[:, :n].sum()) / (4 * n))
    assert stats["prefill_tokens_computed_frac"] < stats["prompt_tokens_computed_frac"] <= 1.0
    assert stats["per_layer_prefill_tokens"] == [n, n_keep(0.6, n), n_keep(0.4, n), n_keep(0.2, n)]
    # inspect's view: per layer, the prompt tokens that hold KV
    mask = result.kept_mask()
    assert mask.shape == (4, 2, n)
    assert mask[:, 0].sum(dim=1).tolist() == stats["per_layer_kv_tokens"]


# --- the prefix state (disk store) ---------------------------------------------------------------------


def test_prefix_state_gives_the_one_pass_result(tiny_lm, tmp_path):
    lm, engine, prompt = setup(tiny_lm)
    method = lazy(lm, "lazyllm:layers=2/3,keep=0.5/0.25")
    assert method.prefix_state(lm) == {"kind": "lazyllm", "layers": 2}
    one_cache, one_first, _ = method.prefill(engine, prompt.ids)
    prefix = Prefix.of(engine, prompt, method, None, {})
    two_cache, two_first, _ = method.prefill(engine, prompt.ids, prefix=prefix)
    assert torch.allclose(one_first, two_first, atol=TOL)
    assert torch.equal(one_cache.kept_mask(prompt.n_tokens), two_cache.kept_mask(prompt.n_tokens))
    # the stored form round-trips
    state = method.build_prefix(engine, prompt.ids[: prompt.prefix_len])
    tensors, facts = state.to_tensors()
    back = LazyCache.from_tensors(tensors, facts)
    assert torch.equal(back.frontier, state.frontier) and back.aux.keys() == state.aux.keys() == {2}
    with pytest.raises(ValueError):
        LazyCache.from_tensors({k: v for k, v in tensors.items() if k != "aux_pos.2"}, facts)
    # cold and warm runs through the store answer the same
    store = KVStore.open(tmp_path)
    spec = Pipeline.parse("lazyllm:layers=2/3,keep=0.5/0.25")
    cold = run(engine, prompt, spec, max_new_tokens=6, stop_ids=set(), store=store)
    warm = run(engine, prompt, spec, max_new_tokens=6, stop_ids=set(), store=store)
    assert cold.extra["cache"]["status"] == "miss" and warm.extra["cache"]["status"] == "hit"
    assert warm.answer_ids == cold.answer_ids
    assert warm.extra["method_stats"] == cold.extra["method_stats"]


# --- knobs ---------------------------------------------------------------------------------------------


def test_default_schedule():
    assert default_layers(30) == [8, 15, 22] and default_layers(32) == [8, 16, 24] and default_layers(4) == [1, 2, 3]
    assert default_layers(2) == [1]
    assert default_keep(3) == [0.7, 0.5, 0.3] and default_keep(1) == [0.5]
    assert n_keep(0.3, 10) == 3 and n_keep(0.01, 10) == 1 and n_keep(1.0, 7) == 7


def test_knobs_resolve_against_the_model(tiny_lm):
    lm = tiny_lm("llama")
    assert lazy(lm, "lazyllm").spec() == "lazyllm:layers=1/2/3,keep=0.7/0.5/0.3,reselect=1"
    assert lazy(lm, "lazyllm:layers=2").spec() == "lazyllm:layers=2,keep=0.5,reselect=1"
    assert lazy(lm, "lazyllm:keep=0.6/0.2").schedule() == [(1, 0.6), (3, 0.2)]


@pytest.mark.parametrize(
    "spec",
    [
        "lazyllm:layers=0/2",  # layer 0 has no layer before it to score with
        "lazyllm:layers=4",  # the tiny model has layers 0..3
        "lazyllm:layers=2/1",
        "lazyllm:layers=2/2",
        "lazyllm:layers=a/b",
        "lazyllm:keep=1.5",
        "lazyllm:keep=0",
        "lazyllm:keep=0.3/0.5",
        "lazyllm:keep=x",
        "lazyllm:layers=1/2,keep=0.5",
        "lazyllm:keep=0.9/0.8/0.7/0.6",  # 4 ratios, only 3 layers to prune at
        "lazyllm:reselect=-1",
        "lazyllm:reselect=two",
    ],
)
def test_bad_knobs_are_usage_errors(tiny_lm, spec):
    with pytest.raises(UsageError, match="lazyllm"):
        pipeline = Pipeline.parse(spec)
        pipeline.configure(tiny_lm("llama"))


# --- the cache's buffers: appends in place, copies never share a writer --------------------------------


def test_cache_appends_in_place_and_copies_write_their_own_buffers():
    torch.manual_seed(0)
    cache = LazyCache(1)
    rows = [torch.randn(1, 2, n, 4) for n in (5, 1, 3, 1)]
    cache.update(rows[0], rows[0] + 1, 0)
    k, _ = cache.update(rows[1], rows[1] + 1, 0)
    assert torch.equal(k, torch.cat(rows[:2], dim=2))
    twin = cache.copy()
    cache.update(rows[2], rows[2] + 1, 0)  # in place, beyond the twin's rows
    k2, v2 = twin.update(rows[3], rows[3] + 1, 0)  # the twin allocates a buffer of its own
    assert torch.equal(k2, torch.cat([*rows[:2], rows[3]], dim=2)) and torch.equal(v2, k2 + 1)
    assert torch.equal(cache.keys[0], torch.cat(rows[:3], dim=2))
    assert cache.keys[0].data_ptr() != twin.keys[0].data_ptr()
    # `gather` reads just the given slots (after the append)
    cache.gather = torch.tensor([0, 4, 9])
    k, v = cache.update(rows[3], rows[3] + 1, 0)
    assert torch.equal(k, torch.cat([*rows[:3], rows[3]], dim=2)[:, :, [0, 4, 9]]) and torch.equal(v, k + 1)
    assert cache.get_seq_length(0) == 10


# --- reading S_l: gathering its rows or masking the others gives the same step ------------------------


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_gathering_and_masking_give_the_same_logits(tiny_lm, family, monkeypatch):
    import kvcli.compressors.lazyllm as lazymod

    if family == "mistral-window":
        lm = tiny_lm("mistral", sliding_window=48, num_hidden_layers=4)
        engine, prompt = Engine(lm), build_prompt(lm.tokenizer, DOC, "How many gulls?")
    else:
        lm, engine, prompt = setup(tiny_lm, family)
    runs = []
    for gather_below in (0.0, 1.01):  # never gather / gather whenever several rows query a subset
        monkeypatch.setattr(lazymod, "GATHER_BELOW", gather_below)
        method = lazy(lm, "lazyllm:layers=1/2/3,keep=0.6/0.4/0.2")
        cache, first, n = method.prefill(engine, prompt.ids)
        runs.append((greedy(lambda t, p: method.decode_step(engine, t, p, cache), first, n, steps=8), cache))
    (a, cache_a), (b, cache_b) = runs
    assert cache_a.revivals > 0 and cache_a.revivals == cache_b.revivals
    assert torch.equal(cache_a.computed, cache_b.computed)
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=TOL)


# --- reselect: a documented departure from the paper (selection every N decoding steps) -------------


def test_reselect_reuses_the_last_selection_between_selecting_steps(tiny_lm):
    lm, engine, prompt = setup(tiny_lm)
    method = lazy(lm, "lazyllm:layers=1/2/3,keep=0.6/0.4/0.2,reselect=3")
    cache, logits, n = method.prefill(engine, prompt.ids)
    cache.trace, revivals = [], []
    for i in range(7):  # decoding steps 1..7: steps 3 and 6 select again
        before = cache.revivals
        logits = method.decode_step(engine, int(torch.argmax(logits)), n + i, cache)
        revivals.append(cache.revivals - before)
    stats = cache.stats()
    assert stats["decode_steps"] == 7 and stats["selecting_decode_steps"] == 2
    assert stats["schedule"]["reselect"] == 3 and int(cache.computed.max()) == 1
    assert revivals[2] > 0 and all(revivals[i] == 0 for i in (0, 1, 3, 4, 6))
    for step in (2, 4, 5, 7):  # a step between selections: the step before's S_l plus the new token
        now, prev = dict(cache.trace[step - 1]), dict(cache.trace[step - 2])
        for layer, selected in now.items():
            assert selected.numel() == n + step and selected[-1]
            assert torch.equal(selected[:-1], prev[layer])
    # reselect=0: the prefill's selection for good, nothing revived, nothing computed beyond it
    frozen = lazy(lm, "lazyllm:layers=1/2/3,keep=0.6/0.4/0.2,reselect=0")
    cache0, first0, _ = frozen.prefill(engine, prompt.ids)
    greedy(lambda t, p: frozen.decode_step(engine, t, p, cache0), first0, n, steps=7)
    stats0 = cache0.stats()
    assert cache0.revivals == 0 and stats0["selecting_decode_steps"] == 0
    assert stats0["prompt_tokens_computed_frac"] == stats0["prefill_tokens_computed_frac"]


def test_reselect_one_is_the_paper_and_keep_one_is_still_full_attention(tiny_lm):
    lm, engine, prompt = setup(tiny_lm)
    a = run(engine, prompt, Pipeline.parse("lazyllm:keep=0.6/0.4/0.2"), max_new_tokens=6, stop_ids=set())
    b = run(engine, prompt, Pipeline.parse("lazyllm:keep=0.6/0.4/0.2,reselect=1"), max_new_tokens=6, stop_ids=set())
    assert a.answer_ids == b.answer_ids and a.extra["method_stats"] == b.extra["method_stats"]
    ref = run(engine, prompt, Pipeline.parse("full"), max_new_tokens=6, stop_ids=set())
    for spec in ("lazyllm:keep=1/1/1,reselect=4", "lazyllm:keep=1/1/1,reselect=0"):
        assert run(engine, prompt, Pipeline.parse(spec), max_new_tokens=6, stop_ids=set()).answer_ids == ref.answer_ids
