"""kvcli.runtime.measure on CUDA (its calls stood in for on a machine without one): times read after the
device has finished, and the allocator's reserved peak beside the allocated one."""

from __future__ import annotations

import torch

from kvcli.runtime import measure


def test_cuda_times_follow_a_synchronize_and_report_the_reserved_peak(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: events.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 * 2**20)
    real = measure.time.perf_counter
    monkeypatch.setattr(measure.time, "perf_counter", lambda: events.append("clock") or real())
    with measure.measure("cuda") as m:
        events.clear()
        ttft = m.elapsed()
        assert events == ["sync", "clock"] and ttft >= 0  # the clock is read after the device is done
        events.clear()
    assert events[:2] == ["sync", "clock"]
    assert (m.peak_mem_mb, m.peak_mem_reserved_mb) == (3.0, 5.0)


def test_cpu_has_no_reserved_peak_and_no_synchronize(monkeypatch):
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device=None: (_ for _ in ()).throw(AssertionError("synchronize on the CPU"))
    )
    with measure.measure("cpu") as m:
        assert m.elapsed() >= 0
    assert m.peak_mem_reserved_mb is None and m.peak_mem_mb > 0
