"""--kv-offload cpu's prefill runs layer by layer (each layer on the accelerator during its chunks,
moved to host memory once) with the chunk-by-chunk arithmetic bit for bit; decoding gathers the
selected blocks into per-layer staging buffers (pinned where CUDA is). Forced on the CPU here."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.caches import blocks
from kvcli.compressors.base import Runtime
from kvcli.compressors.blocksparse import BlockSparse
from kvcli.runtime.engine import Engine
from tests.helpers.runs import prompt_for, random_ids
from tests.helpers.tiny_models import FAMILIES

SMALL = "block_size=8,initial=4,local_window=8,topk=2,chunk=8"


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_by_layer_is_the_chunked_prefill_bit_for_bit(tiny_lm, family):
    engine = Engine(tiny_lm(family))
    ids = random_ids(70, seed=10)
    prefix = engine.prefix_kv(ids[:20])
    ref = prefix.copy()
    for s in range(20, 70, 16):
        ref, ref_logits = engine.prefill(
            ids[s : min(70, s + 16)], positions=torch.arange(s, min(70, s + 16)), cache=ref
        )
    order = []
    cache, logits = engine.prefill_by_layer(
        ids[20:],
        torch.arange(20, 70),
        prefix.copy(),
        16,
        before_layer=lambda i: order.append(("start", i)),
        after_layer=lambda i: order.append(("end", i)),
    )
    assert torch.equal(logits, ref_logits)
    assert cache.positions.tolist() == ref.positions.tolist() == list(range(70))
    for l in range(engine.n_layers):
        assert torch.equal(cache.keys[l], ref.keys[l]) and torch.equal(cache.values[l], ref.values[l])
    assert order == [(e, i) for i in range(engine.n_layers) for e in ("start", "end")]


def test_offloaded_blocksparse_moves_each_layer_once_and_stages_its_gathers(tiny_lm, monkeypatch):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    plain = run(engine, prompt, Pipeline.parse(f"blocksparse:{SMALL}"), max_new_tokens=6, stop_ids=set())
    events = []
    real_update, real_offload = blocks.OffloadKVCache.update, blocks.OffloadKVCache.offload
    monkeypatch.setattr(
        blocks.OffloadKVCache,
        "update",
        lambda self, k, v, layer, *a, **kw: events.append(("update", layer)) or real_update(self, k, v, layer),
    )
    monkeypatch.setattr(
        blocks.OffloadKVCache,
        "offload",
        lambda self, layer: events.append(("offload", layer)) or real_offload(self, layer),
    )
    monkeypatch.setattr(BlockSparse, "offloaded", lambda self, engine: True)  # as on a CUDA model
    pipeline = Pipeline.parse(f"blocksparse:{SMALL}")
    pipeline.stages[0].runtime = Runtime(kv_offload="cpu")
    stages = []
    real_gather = blocks.BlockCache.gather

    def gather(self, layer, query):
        out = real_gather(self, layer, query)
        stages.append(self._stages[layer][0].data_ptr())
        return out

    monkeypatch.setattr(blocks.BlockCache, "gather", gather)
    offloaded = run(engine, prompt, pipeline, max_new_tokens=6, stop_ids=set())
    assert offloaded.answer_ids == plain.answer_ids
    assert offloaded.extra["method_stats"]["kv_offload"] == "cpu"
    # two passes, each layer by layer: the prefix (the document, read offloaded too: its KV is
    # never whole on the accelerator), then the question on top of it; in each, every chunk of
    # layer 0, then layer 0 goes to host memory once; then layer 1 ...
    first = events.index(("offload", 0))
    second = (first + 1) * lm.n_layers
    rest = events.index(("offload", 0), second) - second
    assert first == -(-prompt.prefix_len // 8) and rest > 1  # chunks of 8
    per_pass = lambda chunks: [e for l in range(lm.n_layers) for e in [("update", l)] * chunks + [("offload", l)]]
    assert events == per_pass(first) + per_pass(rest)
    per_layer = {}
    for i, ptr in enumerate(stages):
        per_layer.setdefault(i % lm.n_layers, set()).add(ptr)
    assert len(stages) == 5 * lm.n_layers and all(len(p) == 1 for p in per_layer.values())  # one buffer a layer, reused


def test_offloaded_prefix_comes_from_the_store_to_the_host_and_leaves_its_memo_intact(tiny_lm, tmp_path, monkeypatch):
    """--kv-offload cpu with the disk store: the stored prefix is handed to the method in host
    memory (not uploaded whole to the accelerator), as a copy, so the question's run (which cuts it
    back and extends it) leaves the store's memo as it was: every later question answers the same."""
    from kvcli.store import KVStore

    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)
    monkeypatch.setattr(BlockSparse, "offloaded", lambda self, engine: True)  # as on a CUDA model

    def pipeline():
        p = Pipeline.parse(f"blocksparse:{SMALL}")
        p.stages[0].runtime = Runtime(kv_offload="cpu")
        return p

    assert pipeline().stages[0].prefix_device(engine).type == "cpu"
    store = KVStore(tmp_path / "kv")
    cold = run(engine, prompt, pipeline(), max_new_tokens=6, stop_ids=set(), store=store)
    memo = store.memo.cache
    held = [(k.data_ptr(), k.shape) for k in memo.keys]
    warm = [run(engine, prompt, pipeline(), max_new_tokens=6, stop_ids=set(), store=store) for _ in range(2)]
    assert cold.extra["cache"]["status"] == "miss" and [w.extra["cache"]["status"] for w in warm] == ["hit", "hit"]
    assert [w.answer_ids for w in warm] == [cold.answer_ids] * 2
    assert store.memo.cache is memo and [(k.data_ptr(), k.shape) for k in memo.keys] == held


def test_an_offloaded_prefix_has_its_own_store_key(meta_engine, tiny_dir):
    """Read offloaded in blocksparse's chunks, the prefix KV is not -c full's pass bit for bit: its
    prefix state (hashed into the store key) differs on an accelerator; on the CPU (no offload)
    it is full attention's, shared."""
    from kvcli.compressors.full import FullAttention

    def state(lm, offload):
        method = Pipeline.parse(f"blocksparse:{SMALL}").stages[0]
        method.runtime = Runtime(kv_offload=offload)
        method.configure(lm)
        return method.prefix_state(lm)

    import dataclasses

    on_gpu = dataclasses.replace(meta_engine.lm, device=torch.device("meta"))  # any device but the CPU
    assert state(on_gpu, "cpu") != FullAttention().prefix_state(on_gpu) == state(on_gpu, "none")
    from kvcli.model import load_model

    cpu = load_model(
        str(tiny_dir("llama", num_hidden_layers=4)), device="cpu", dtype="float32"
    )  # on the CPU, whatever --device
    assert state(cpu, "cpu") == FullAttention().prefix_state(cpu)
