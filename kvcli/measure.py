"""Wall time and peak memory of a piece of work, measured the same way for every method.

Peak memory:
* CUDA: ``torch.cuda.max_memory_allocated`` after a reset — memory held by tensors.
* CPU (Linux): the process's resident-set high-water mark (``VmHWM``), reset before the work by
  writing ``5`` to ``/proc/self/clear_refs``; freed heap is first handed back with ``malloc_trim``
  so earlier work doesn't hide this work's allocations. Elsewhere: a 2 ms RSS sampling thread.
Both are reported in MiB as the absolute peak during the work (weights included), so numbers from
one run are directly comparable between methods.
"""

from __future__ import annotations

import ctypes
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch


@dataclass
class Measurement:
    seconds: float = 0.0
    peak_mem_mb: float = 0.0


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# glibc mallopt parameter, and its largest value on 64-bit (what its dynamic threshold grows up to)
_M_MMAP_THRESHOLD = -3
_DYNAMIC_MAX = 32 * 2**20


def _set_mmap_threshold(nbytes: int) -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):
        return False


@contextmanager
def large_allocations_mapped(device: torch.device | str = "cpu", threshold: int = 2**20):
    """While reading a prompt on CPU, give every allocation above ``threshold`` bytes its own
    ``mmap``, so a freed tensor goes back to the OS at once (glibc; elsewhere a no-op).

    By default glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB),
    after which a prefill's per-layer activations and the KV tensors it keeps come from the same
    heap: the long-lived KV pins that heap, and the freed activations between its tensors stay
    resident — 240-300 MiB of a 8k-token prompt's peak on the embedded model. Mapped, they are
    returned when freed. On exit the threshold is fixed at glibc's dynamic maximum, so decoding's
    per-step ``torch.cat`` of each layer's KV reuses heap blocks instead of faulting in fresh pages.
    Memory layout only: no computation changes."""
    if torch.device(device).type != "cpu" or not _set_mmap_threshold(threshold):
        yield
        return
    try:
        yield
    finally:
        _set_mmap_threshold(_DYNAMIC_MAX)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _read_hwm_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class _Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)


@contextmanager
def measure(device: torch.device | str = "cpu"):
    """``with measure(device) as m: ...`` fills ``m.seconds`` and ``m.peak_mem_mb``."""
    m = Measurement()
    device = torch.device(device)
    sampler = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _malloc_trim()
        if not _reset_hwm():
            sampler = _Sampler()
            sampler.start()
    start = time.perf_counter()
    try:
        yield m
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        m.seconds = time.perf_counter() - start
        if device.type == "cuda":
            m.peak_mem_mb = torch.cuda.max_memory_allocated(device) / 2**20
        elif sampler is not None:
            sampler.stop_event.set()
            sampler.join()
            m.peak_mem_mb = max(sampler.peak, psutil.Process().memory_info().rss) / 2**20
        else:
            m.peak_mem_mb = _read_hwm_mb() or psutil.Process().memory_info().rss / 2**20
