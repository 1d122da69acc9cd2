"""DuoAttention: keeping everything equals full attention; the head scores are kvpress's on-the-fly
estimate, recomputed naively from the Hugging Face model's projections; streaming heads hold sinks
+ recent, retrieval heads everything; the profile is stored per model; the compressed prefix is
reused from the disk store for any question."""

from __future__ import annotations

import math

import pytest
import torch

from kvcli import notices
from kvcli.caches import RazorCache
from kvcli.compressors import parse_one
from kvcli.compressors.base import Runtime
from kvcli.compressors.duo import DuoProfile, calibration_ids
from kvcli.errors import UsageError
from kvcli.runtime.engine import Engine
from tests.helpers.reference import assert_same_logits
from tests.helpers.runs import full_reference, greedy_logits, prompt_for

SMALL = "tokens=64,length=40"


def duo_for(lm, tmp_path, spec):
    duo = parse_one(spec)
    duo.runtime = Runtime(cache_dir=tmp_path)
    duo.configure(lm)
    return duo


def test_spec_round_trip_and_errors(tiny_lm, tmp_path):
    assert parse_one("duo").spec() == "duo:streaming=0.5,sinks=128,recent=256,tokens=auto,length=500"
    assert (
        duo_for(tiny_lm("llama"), tmp_path, "duo").spec()
        == "duo:streaming=0.5,sinks=128,recent=256,tokens=2048,length=500"
    )
    for spec, message in [
        ("duo:streaming=1.5", "between 0 and 1"),
        ("duo:sinks=-1", "sinks must be at least 0"),
        ("duo:recent=-4", "recent must be at least 0"),
        ("duo:tokens=1", "tokens must be at least 2"),
        ("duo:length=1", "length must be at least 2"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_one(spec)
    with pytest.raises(UsageError, match="sliding-window"):
        duo_for(tiny_lm("mistral", sliding_window=32), tmp_path, "duo")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("knobs", ["streaming=0,sinks=2,recent=4", "streaming=1,sinks=100,recent=1000"])
def test_keep_everything_reproduces_full_attention(tiny_lm, tmp_path, family, knobs):
    lm = tiny_lm(family)
    engine = Engine(lm)
    prompt = prompt_for(lm)
    duo = duo_for(lm, tmp_path, f"duo:{knobs},{SMALL}")
    cache = duo.build_prefix(engine, prompt.ids[: prompt.prefix_len])
    assert isinstance(cache, RazorCache)
    got = greedy_logits(engine, cache, prompt.ids[prompt.prefix_len :], steps=5)
    assert_same_logits(got, full_reference(engine, prompt, steps=5))


# --- the head estimate, naively -------------------------------------------------------------------------


def naive_scores(lm, tokens, length):
    """kvpress's duo_attention_on_the_fly on the calibration ids, with HF's projections, explicit
    per-position rotation matrices and loops: (n_layers, n_kv)."""
    model, d = lm.model, lm.head_dim
    dev = lm.device  # every tensor of the reference where the model runs
    ids = calibration_ids(lm, tokens).to(dev)
    group = lm.n_heads // lm.n_kv_heads
    half = d // 2
    P = torch.zeros(d, d, dtype=torch.float64, device=dev)
    eye = torch.eye(half, dtype=torch.float64, device=dev)
    P[:half, half:], P[half:, :half] = -eye, eye
    out = torch.zeros(lm.n_layers, lm.n_kv_heads, dtype=torch.float64, device=dev)
    with torch.inference_mode():
        hs = model(ids.view(1, -1), output_hidden_states=True).hidden_states
        cos, sin = model.model.rotary_emb(hs[0], torch.arange(length, device=dev).view(1, -1))
        rot = [torch.diag(cos[0, p].double()) + torch.diag(sin[0, p].double()) @ P for p in range(length)]
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(hs[i])[0]
            mq = attn.q_proj(h).view(ids.numel(), -1, d).double().mean(dim=0)  # (n_heads, d), before RoPE
            mk = attn.k_proj(h).view(ids.numel(), -1, d).double().mean(dim=0)  # (n_kv, d)
            for head in range(lm.n_heads):
                g = head // group
                q = rot[length - 1] @ mq[head]
                logits = torch.stack([q @ (rot[p] @ mk[g]) for p in range(length)]) / math.sqrt(d)
                out[i, g] += torch.cumsum(torch.softmax(logits, dim=0), dim=0).mean() / group
    return out.float()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_head_scores_are_kvpress_estimate(tiny_lm, tmp_path, family):
    lm = tiny_lm(family)
    engine = Engine(lm)
    duo = duo_for(lm, tmp_path, f"duo:{SMALL}")
    profile = duo.profile(engine)
    want = naive_scores(lm, 64, 40).to(profile.scores.device)  # where the profile keeps its scores
    torch.testing.assert_close(profile.scores, want, rtol=1e-4, atol=1e-6)
    # streaming heads: the lowest half of all KV heads
    streaming = profile.streaming_heads(0.5)
    assert int(streaming.sum()) == lm.n_layers * lm.n_kv_heads // 2
    assert profile.scores[streaming].max() <= profile.scores[~streaming].min()


def test_streaming_heads_keep_sinks_and_recent(tiny_lm, tmp_path):
    lm = tiny_lm("qwen2")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    n = prompt.prefix_len
    duo = duo_for(lm, tmp_path, f"duo:streaming=0.5,sinks=4,recent=16,{SMALL}")
    cache = duo.build_prefix(engine, prompt.ids[:n])
    retrieval = duo.retrieval_heads(engine)
    full = engine.prefix_kv(prompt.ids[:n])
    mask = cache.kept_mask(n)
    window = list(range(4)) + list(range(n - 16, n))
    for l in range(lm.n_layers):
        for h in range(lm.n_kv_heads):
            assert mask[l, h].tolist() == ([True] * n if retrieval[l, h] else [i in window for i in range(n)])
        streaming = torch.nonzero(~retrieval[l]).flatten()
        assert torch.equal(cache.ck[l], full.keys[l][:, streaming][:, :, window])  # no compensation token
    assert cache.nbytes() < full.nbytes()


def test_profile_is_stored_and_reloaded(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    first = duo_for(lm, tmp_path, f"duo:{SMALL}").profile(engine)
    assert not first.loaded and first.path.parent == tmp_path / "heads" and lm.fingerprint in first.path.name
    again = duo_for(lm, tmp_path, f"duo:{SMALL}").profile(engine)
    assert again.loaded and torch.equal(again.scores, first.scores)
    notices.reset()
    first.path.write_bytes(b"garbage")
    fixed = duo_for(lm, tmp_path, f"duo:{SMALL}").profile(engine)
    assert not fixed.loaded and torch.equal(fixed.scores, first.scores)
    assert any("damaged" in w for w in notices.collected())
    with pytest.raises(ValueError, match="another model"):
        DuoProfile.load(first.path, tiny_lm("qwen2"))


def test_compressed_prefix_is_reused_for_any_question(tiny_lm, tmp_path):
    from tests.helpers.stores import Q1, Q2, ask, entry_files, session_for

    lm = tiny_lm("qwen2")
    spec = f"duo:streaming=0.5,sinks=4,recent=16,{SMALL}"
    cold = ask(session_for(lm, tmp_path), spec, Q1)
    warm = ask(session_for(lm, tmp_path), spec, Q1)
    other = ask(session_for(lm, tmp_path), spec, Q2)
    off = ask(session_for(lm, None, use_cache=False), spec, Q1)
    assert cold.extra["cache"]["status"] == "miss"
    assert warm.extra["cache"]["status"] == other.extra["cache"]["status"] == "hit"
    assert cold.answer_ids == warm.answer_ids == off.answer_ids and len(cold.answer_ids) == 8
    assert len(entry_files(tmp_path)) == 1 and isinstance(warm.cache, RazorCache)
    assert cold.extra["kv_cache_bytes"] < ask(session_for(lm, tmp_path), "full", Q1).extra["kv_cache_bytes"]
