"""kvcli.runtime.measure's prompt-phase memory layout: which allocations get their own mapping, and that
neither layout changes a single number the model computes."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.caches import KVCache
from kvcli.errors import UsageError
from kvcli.runtime import measure
from kvcli.runtime.engine import Engine
from kvcli.runtime.measure import long_lived, reading_prompt
from tests.helpers.runs import prompt_for

BIG = torch.zeros(1, 3, 2048, 64)  # 1.5 MiB: over the 1 MiB mapping size
SMALL = torch.zeros(1, 3, 16, 64)


def _mapped(*tensors) -> bool:
    """Whether allocating a tensor of their total size is mapped (a KV concatenation's size)."""
    with long_lived(tensors[0].device, sum(t.numel() * t.element_size() for t in tensors)) as mapped:
        return mapped


def test_long_lived_maps_only_large_kv_while_a_prompt_is_read(monkeypatch):
    calls = []
    monkeypatch.setattr(measure, "_set_mmap_threshold", lambda n: calls.append(n) or True)
    assert not _mapped(BIG)  # outside a prompt phase: decoding's copies stay on the heap
    with reading_prompt("cpu"):
        assert _mapped(BIG)
        assert not _mapped(SMALL)
        assert _mapped(SMALL, BIG)  # the size of what is allocated: old KV + new together
    assert calls == [measure._MAPPED_MIN, measure._DYNAMIC_MAX] * 2  # lowered for the allocation, restored after
    calls.clear()
    with reading_prompt("cpu", low_memory=True):
        assert calls == [measure._MAPPED_MIN]  # every large allocation mapped for the whole phase
        assert not _mapped(BIG)  # ... so the KV needs nothing of its own
    assert calls == [measure._MAPPED_MIN, measure._DYNAMIC_MAX]
    with reading_prompt("meta"):  # not CPU (CUDA): nothing changes
        assert not _mapped(BIG)
    with reading_prompt("cpu"):  # a tensor on another device than the CPU: nothing either
        assert not _mapped(BIG.to("meta"))


def test_cache_update_keeps_a_copy_only_when_mapped(monkeypatch):
    monkeypatch.setattr(measure, "_set_mmap_threshold", lambda n: True)
    key, value = torch.randn(1, 3, 2048, 64), torch.randn(1, 3, 2048, 64)
    small_key, small_value = key[:, :, :1024].clone(), value[:, :, :1024].clone()
    with reading_prompt("cpu"):  # K and V of 768 KiB each: 1.5 MiB together, but neither would be mapped
        small = KVCache()
        small.update(small_key, small_value, 0)
    assert small.keys[0] is small_key and small.values[0] is small_value  # kept as the model made them: no useless copy
    outside = KVCache()
    outside.update(key, value, 0)
    assert outside.keys[0] is key  # no copy outside a prompt phase
    with reading_prompt("cpu"):
        inside = KVCache()
        k, v = inside.update(key, value, 0)
    assert k is not key and torch.equal(k, key) and torch.equal(v, value)


@pytest.mark.cpu_only("mapped allocations are glibc's: the host allocator, not the GPU's")
@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("spec", ["full", "snapkv:budget=0.5"])
def test_memory_layouts_change_no_number(tiny_lm, spec, low_memory, monkeypatch):
    monkeypatch.setattr(measure, "_MAPPED_MIN", 1024)  # the tiny model's tensors are small: map them too
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = prompt_for(lm)

    def answer(maps: bool, **kw):
        calls: list[int] = []
        real = measure._set_mmap_threshold
        with monkeypatch.context() as m:  # maps=False: glibc's threshold is never changed, nothing is mapped
            m.setattr(
                measure, "_set_mmap_threshold", (lambda n: calls.append(n) or real(n)) if maps else (lambda n: False)
            )
            pipeline = Pipeline.parse(spec)
            pipeline.configure(lm)
            result = run(engine, prompt, pipeline, max_new_tokens=6, stop_ids=set(), **kw)
        assert (measure._MAPPED_MIN in calls) == maps  # the layout under test did map allocations
        return result

    base, other = answer(False, low_memory=low_memory), answer(True, low_memory=low_memory)
    assert other.answer_ids == base.answer_ids
    for a, b in zip(base.cache.keys, other.cache.keys):
        assert torch.equal(a, b)


class _Libc:
    """glibc's mallopt, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


def test_freed_memory_is_kept_once_a_process_and_stays_kept(monkeypatch):
    libc = _Libc()
    monkeypatch.setattr(measure, "_libc", lambda: libc)
    monkeypatch.setattr(measure, "_KEEPING", False)
    monkeypatch.delenv("KVCLI_HEAP", raising=False)
    assert measure.keep_freed_memory()
    mmap, trim = measure._M_MMAP_THRESHOLD, measure._M_TRIM_THRESHOLD
    assert libc.calls == [(mmap, 32 * 2**20), (trim, 2**31 - 1)]
    assert measure.keep_freed_memory() and len(libc.calls) == 2  # once a process
    libc.calls.clear()
    with long_lived(torch.device("cpu"), 4 * 2**20, always=True) as mapped:  # a KV buffer of its own, then back
        assert mapped
    assert libc.calls == [(mmap, measure._MAPPED_MIN), (mmap, 32 * 2**20), (trim, 2**31 - 1)]  # still kept


def test_freed_memory_follows_glibc_with_kvcli_heap_system(monkeypatch):
    libc = _Libc()
    monkeypatch.setattr(measure, "_libc", lambda: libc)
    monkeypatch.setattr(measure, "_KEEPING", False)
    monkeypatch.setenv("KVCLI_HEAP", "system")
    assert not measure.keep_freed_memory() and libc.calls == []
    assert measure._set_mmap_threshold(measure._DYNAMIC_MAX)
    assert libc.calls[-1] == (measure._M_TRIM_THRESHOLD, 64 * 2**20)  # what glibc's own adjustment would set
    monkeypatch.setattr(measure, "_libc", lambda: None)  # not glibc: nothing to set
    monkeypatch.delenv("KVCLI_HEAP")
    assert not measure.keep_freed_memory()
    monkeypatch.setenv("KVCLI_HEAP", "fast")
    with pytest.raises(UsageError, match="KVCLI_HEAP must be keep or system, not 'fast'"):
        measure.keep_freed_memory()
