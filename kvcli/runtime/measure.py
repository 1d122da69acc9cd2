"""Wall time and peak memory of a piece of work, measured the same way for every method.

Peak memory:
* CUDA: ``torch.cuda.max_memory_allocated`` after a reset — memory held by tensors; beside it
  ``max_memory_reserved`` (``peak_mem_reserved_mb``), what the caching allocator took from the GPU.
  Times on CUDA are read after ``torch.cuda.synchronize`` (:meth:`Measurement.elapsed`).
* CPU (Linux): the process's resident-set high-water mark (``VmHWM``), reset before the work by
  writing ``5`` to ``/proc/self/clear_refs``; freed heap is first handed back with ``malloc_trim``
  so earlier work doesn't hide this work's allocations. Elsewhere: a 2 ms RSS sampling thread.
Both are reported in MiB as the absolute peak during the work (weights included), so numbers from
one run are directly comparable between methods.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch

from .heap_setting import heap_kept


@dataclass
class Measurement:
    seconds: float = 0.0
    peak_mem_mb: float = 0.0
    # CUDA: the caching allocator's peak reservation (what the process really took from the GPU:
    # allocations plus the cache's slack and fragmentation); None elsewhere
    peak_mem_reserved_mb: float | None = None
    _start: float = 0.0
    _device: torch.device | None = None

    def elapsed(self, since: float | None = None) -> float:
        """Seconds since the measurement started (or ``since``, a ``time.perf_counter()``), once
        the device has finished the work queued so far (CUDA runs asynchronously: without the
        synchronisation a time-to-first-token would be the time to *queue* the prompt's kernels)."""
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter() - (self._start if since is None else since)


@functools.cache
def _libc():
    """glibc, loaded once (None elsewhere): the prompt phase calls it for every layer's KV."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def malloc_trim() -> None:
    """Give glibc's freed heap pages back to the system (elsewhere: nothing)."""
    try:
        _libc().malloc_trim(0)
    except AttributeError:
        pass


# glibc mallopt parameters, and the mmap threshold's largest value on 64-bit (what its dynamic
# adjustment grows it up to)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_DYNAMIC_MAX = 32 * 2**20
# the largest block the heap gives where keep_freed_memory ran (from this size on, a fresh mapping)
HEAP_BLOCK_MAX = _DYNAMIC_MAX
_MAPPED_MIN = 2**20  # allocations from this size on get their own mapping while a prompt is read
# "" outside a prompt phase; "kv": the kept KV gets its own mappings; "all": every large allocation does
_READING: contextvars.ContextVar[str] = contextvars.ContextVar("kvcli_reading_prompt", default="")


def _set_mmap_threshold(nbytes: int) -> bool:
    """Set glibc's mmap threshold. Setting it turns glibc's dynamic adjustment off, which also
    leaves the trim threshold at its 128 KiB start: back at the dynamic maximum, the trim
    threshold is set where the adjustment would have put it (twice the mmap threshold), or every
    freed top-of-heap block of a decoding step would be handed back and faulted in again; where
    :func:`keep_freed_memory` ran, at its :data:`_TRIM_KEPT`."""
    libc = _libc()
    try:
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
        if ok and nbytes >= _DYNAMIC_MAX:
            libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_KEPT if _KEEPING else 2 * int(nbytes))
        return ok
    except (OSError, AttributeError):
        return False


_TRIM_KEPT = 2**31 - 1  # mallopt's int at its largest: up to 2 GiB free at the heap's top stays
_KEEPING = False  # whether keep_freed_memory set the process's heap so


def keep_freed_memory() -> bool:
    """Keep freed heap for the next allocation, for the rest of the process (``KVCLI_HEAP=system``:
    glibc's own settings). A prefill on the CPU allocates and frees buffers of megabytes layer
    after layer (a layer's weights made dense, the MLP's outputs); glibc's mmap threshold starts at
    128 KiB and its trim threshold follows it, so such a buffer is a fresh mapping, or heap handed
    back, whose every 4 KiB page faults in and is zeroed again: 1.7 million page faults in a later
    question of the 1.5B Qwen about a book. Here blocks up to 32 MiB come from the heap from the
    start and its top is trimmed only past :data:`_TRIM_KEPT` (or where :func:`malloc_trim` is
    called: a prompt's end, a measurement's start). Measured in docs/cpu.md, "Freed memory kept".
    Whether it is on (glibc only)."""
    global _KEEPING
    if heap_kept() and not _KEEPING:
        _KEEPING = True  # read by _set_mmap_threshold, which sets the trim threshold with it
        _KEEPING = _set_mmap_threshold(_DYNAMIC_MAX)
    return _KEEPING


@contextmanager
def reading_prompt(device: torch.device | str = "cpu", low_memory: bool = False):
    """The prompt phase (selection, prefill, compression) on CPU, where a prefill allocates and
    frees each layer's activations (tens of MiB at 8k tokens) while the KV it keeps accumulates.
    From glibc's heap, the long-lived KV tensors sit between freed activation blocks and keep
    them resident. Two remedies (glibc only; on CUDA, and elsewhere, nothing changes):

    * default: the KV tensors a pass keeps get their own ``mmap`` (:func:`long_lived`), out of
      the heap, which reuses its activation blocks layer after layer. Costs nothing measurable;
      saves ~30 MiB at 4k tokens on the embedded model.
    * ``low_memory`` (``kvcli ask --low-memory``): *every* allocation of 1 MiB or more gets its
      own mapping, so a freed activation goes back to the OS at once: up to ~200 MiB less at 8k
      (full attention; 0-90 MiB for methods that evict during the prefill, whose KV no longer
      dominates), but each activation faults in fresh pages — +15-30% TTFT on this
      CPU (measured: benchmarks/peers, docs/bench/peers).

    On leaving, the freed heap is handed back (``malloc_trim``), so decoding's allocations (a
    layer's new KV buffer when its room runs out, the step's activations) do not land on resident
    activation blocks. Decoding itself runs with glibc's largest dynamic threshold: its per-step
    activations reuse heap blocks."""
    if torch.device(device).type != "cpu":
        yield
        return
    whole = low_memory and _set_mmap_threshold(_MAPPED_MIN)
    token = _READING.set("all" if whole else "kv")
    try:
        yield
    finally:
        _READING.reset(token)
        if whole:
            _set_mmap_threshold(_DYNAMIC_MAX)
        malloc_trim()


@contextmanager
def long_lived(device: torch.device, nbytes: int, always: bool = False):
    """Allocations of ``nbytes`` each made inside ``with long_lived(device, nbytes) as mapped:``
    get their own mapping when ``mapped`` is True: inside :func:`reading_prompt` (default mode;
    with ``low_memory`` every large allocation is mapped already) or ``always``, on CPU, and
    ``nbytes`` of 1 MiB or more — smaller ones stay on the heap whatever the threshold, so there is
    nothing to do (the KV a prefill keeps: the caller allocates it there — a copy of a tensor the
    model made, the buffer a layer's appends go into, or the entries an eviction keeps).
    ``always``: a layer's new buffer while decoding, which replaces one of the same size: from
    the heap, the one it replaces would stay resident as a hole (measured: +84 MiB at 4k tokens
    when the layers' room ran out together after ~126 steps); mapped, it goes back at once."""
    on = (always or _READING.get() == "kv") and device.type == "cpu" and nbytes >= _MAPPED_MIN
    if not on or not _set_mmap_threshold(_MAPPED_MIN):
        yield False
        return
    try:
        yield True
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
    """``with measure(device) as m: ...`` fills ``m.seconds`` and ``m.peak_mem_mb`` (and on CUDA
    ``m.peak_mem_reserved_mb``); ``m.elapsed()`` inside reads the time so far (TTFT)."""
    m = Measurement()
    device = torch.device(device)
    sampler = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        malloc_trim()
        if not _reset_hwm():
            sampler = _Sampler()
            sampler.start()
    m._start, m._device = time.perf_counter(), device
    try:
        yield m
    finally:
        m.seconds = m.elapsed()
        if device.type == "cuda":
            m.peak_mem_mb = torch.cuda.max_memory_allocated(device) / 2**20
            m.peak_mem_reserved_mb = torch.cuda.max_memory_reserved(device) / 2**20
        elif sampler is not None:
            sampler.stop_event.set()
            sampler.join()
            m.peak_mem_mb = max(sampler.peak, psutil.Process().memory_info().rss) / 2**20
        else:
            m.peak_mem_mb = _read_hwm_mb() or psutil.Process().memory_info().rss / 2**20
