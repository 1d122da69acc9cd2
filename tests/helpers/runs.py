"""Running a method on a tiny model the way the pipeline does (random prompts, configured
pipelines), and full attention's reference (the logits of the prefill and of each greedy decoding
step)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvcli.answer.pipeline import Pipeline, default_prefill
from kvcli.answer.prompt import build_prompt
from kvcli.caches import KVCache
from kvcli.compressors.base import Runtime
from kvcli.runtime.decode import DecodeStep
from kvcli.runtime.engine import Engine

DOC = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} gulls." for i in range(12))


def prompt_for(lm, question="How many gulls?"):
    return build_prompt(lm.tokenizer, DOC, question)


def prefill_and_compress(engine, ids, spec):
    """The pipeline's prefill + compress for ``spec`` (a single eviction method)."""
    pipeline = Pipeline.parse(spec)
    pipeline.configure(engine.lm)
    cache, logits = default_prefill(engine, ids, None, pipeline.compressors())
    for stage in pipeline.compressors():
        cache = stage.compress(engine, cache)
    return cache, logits


def decode_logits(engine, cache, first_logits, n_prompt, steps=5):
    """Greedy decode ``steps`` tokens and return every step's logits."""
    out, logits = [first_logits], first_logits
    for step in range(steps):
        token = int(torch.argmax(logits))
        hidden = engine.forward(torch.tensor([token]), torch.tensor([n_prompt + step]), cache)
        logits = engine.logits(hidden)[-1]
        out.append(logits)
    return out


def assert_top_k(kept, scores, k, tail, tol=1e-5):
    """``kept`` (sorted positions) = the ``tail`` + k entries of ``scores`` (over the positions
    before the tail) that are a top-k (ties, e.g. max-pool plateaus, may break either way)."""
    kept = kept.tolist()
    assert kept == sorted(kept) and kept[-len(tail) :] == list(tail) and len(kept) == k + len(tail)
    chosen = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    chosen[kept[:k]] = True
    assert scores[chosen].min() >= scores[~chosen].max() - tol


def greedy_logits(engine, cache, ids, steps: int) -> list[torch.Tensor]:
    """Prefill ``ids`` on top of ``cache``, then ``steps`` greedy tokens; the logits of each step."""
    cache, logits = engine.prefill(ids, cache=cache)
    out = [logits]
    pos = int(cache.positions[-1]) + 1
    for step in range(steps):
        token = torch.tensor([int(torch.argmax(out[-1]))])
        hidden = engine.forward(token, torch.tensor([pos + step]), cache)
        out.append(engine.logits(hidden)[-1])
    return out


def full_reference(engine, prompt, steps: int) -> list[torch.Tensor]:
    return greedy_logits(engine, KVCache(), prompt.ids, steps)


def full_references(load, steps: int):
    """``get(key)`` -> :func:`full_reference` of the model ``load(key)`` on :func:`prompt_for`'s
    prompt, computed once per key (the plain way: one prefill, then greedy steps)."""

    @functools.cache
    def get(key):
        lm = load(key)
        return full_reference(Engine(lm), prompt_for(lm), steps=steps)

    return get


class RecordingEngine(Engine):
    """The engine of one pipeline run that keeps the logits every answer token was chosen from: the
    prefill's last position, then each decoding step (the method's own ``decode_step``, if any):
    step by step, so ``drafts`` go unchecked (kvcli.runtime.lookup)."""

    def decode(
        self,
        first_logits,
        cache,
        next_position,
        max_new_tokens,
        stop_ids,
        on_token=None,
        step=None,
        guard=None,
        logprobs=None,
        drafts=None,
    ):
        inner = DecodeStep.full_attention(self) if step is None else step
        self.seen = [first_logits]

        def recording(token, position, c):
            logits = inner.run(token, position, c)
            self.seen.append(logits)
            return logits

        recording_step = DecodeStep(recording, device_token=inner.device_token)
        return super().decode(
            first_logits,
            cache,
            next_position,
            max_new_tokens,
            stop_ids,
            on_token,
            step=recording_step,
            guard=guard,
            logprobs=logprobs,
        )


def random_ids(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` token ids drawn from the vocabulary every tiny model has, the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 40000, (n,), generator=g)


def configured(spec: str, lm, profiles: Path) -> Pipeline:
    """The pipeline of ``spec`` configured on ``lm``, its per-model head profiles under ``profiles``."""
    pipeline = Pipeline.parse(spec)
    pipeline.configure(
        lm, Runtime(cache_dir=profiles)
    )  # per-model head profiles (razor, duo): computed once per session
    return pipeline
