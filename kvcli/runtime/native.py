"""Whether this CPU multiplies 16-bit matrices natively: the one question behind every product kvcli
runs in float32 although its operands are bfloat16 (a quantised model's prefill on weights made
dense, :mod:`kvcli.model.cpu_quant`; a decoding step's attention over a bfloat16 cache,
:func:`kvcli.runtime.kernels.grouped`).

oneDNN's bfloat16 GEMM is native with AVX512-BF16 or AMX; on an AVX2-only CPU (most laptops, AMD
before Zen 4) it is emulated: an AMD EPYC with AVX2 ran a 512 × 576 × 1536 product at 1.3 GFLOP/s
in bfloat16 against 71 in float32 on one core (2026-11-28), and one decoding query's attention over
4,700 bfloat16 keys (two KV heads of 64, seven query heads each) in 8.9 ms against 0.8 ms with the
keys and values made float32 first (2026-11-29, two threads; docs/cpu.md). On x86 Linux the CPU's
flags answer (:func:`native_gemm`); elsewhere, or where oneDNN was told to use less of the CPU than
it has (``ONEDNN_MAX_CPU_ISA``), a timing.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path

import torch

# The x86 CPU flags under which oneDNN multiplies each 16-bit dtype natively (/proc/cpuinfo's names).
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
# oneDNN's cap on the instructions it uses (its names; the older DNNL_ one too): set to anything but
# all of them, the flags no longer say what its products run on
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


@functools.cache
def native_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices about as fast as float32 ones (within 2x). On
    x86 Linux the CPU's flags say (:data:`NATIVE_FLAGS`); elsewhere it is timed once a process on a
    small product (under 20 ms a try). Timing alone misjudged a Xeon with AMX beside one busy
    process in 16 of 300 tries, and a process so misjudged read its prompt twice as slowly and
    decoded from float32 copies of the KV (the 0.5B at 4.7k tokens: peaks of 1.8-2.2 GB, not 1.2).
    Where oneDNN is capped below the CPU (``ONEDNN_MAX_CPU_ISA=AVX2`` on a Xeon with AMX), timed:
    the flags would promise products it no longer runs natively."""
    if dtype == torch.float32:
        return True
    flagged = _flagged(dtype, NATIVE_FLAGS)
    if flagged is not None:
        return flagged
    return any(_timed_native(dtype) for _ in range(3))  # noise only ever slows a try down


def _flagged(dtype: torch.dtype, table: dict[torch.dtype, tuple[str, ...]]) -> bool | None:
    """Whether this CPU's flags name one of ``table``'s for ``dtype``; None where they cannot say
    (not x86 Linux, oneDNN capped below the CPU: :func:`_cap`, or a dtype the table does not
    speak of: the flags speak of the 16-bit types only)."""
    flags = None if _cap() else cpu_flags()
    if flags is None or dtype not in table:
        return None
    return any(flag in flags for flag in table[dtype])


def _cap() -> str | None:
    """The instructions oneDNN was capped to (:data:`ISA_CAPS`, upper case), None where it may use
    all of this CPU's."""
    caps = [os.environ.get(name, "").strip().upper() for name in ISA_CAPS]
    return next((cap for cap in caps if cap not in ("", "ALL", "DEFAULT")), None)


def _timed_native(dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 256, generator=gen), torch.randn(256, 256, generator=gen)

    def best(x: torch.Tensor, y: torch.Tensor) -> float:
        torch.mm(x, y)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - t)
        return min(times)

    return best(a.to(dtype), b.to(dtype)) <= 2 * best(a, b)


# The x86 CPU flags under which oneDNN's 16-bit GEMM outruns its float32 one (:func:`fast_gemm`).
FAST_FLAGS = {torch.bfloat16: ("amx_bf16",), torch.float16: ("amx_fp16",)}


@functools.cache
def fast_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices faster than float32 ones, so that many rows
    (a prefill on weights made dense, :mod:`kvcli.model.cpu_quant`; a ranking model's encoder,
    :func:`kvcli.retrieval.embed.embedder`) should run in it: with AMX tiles (:data:`FAST_FLAGS`).
    Native without them is slower: a Xeon with AVX512-BF16 and no AMX, 2 threads, read the 1.5B
    Qwen's 2,000-token prompt on bfloat16 dense weights in 48 s against 28.5 on float32 ones and ran
    EmbeddingGemma at 3.6 windows a second against 5.4 (2026-12-03, docs/cpu.md). Where the flags
    cannot say (not x86 Linux, oneDNN capped): :func:`native_gemm`'s answer."""
    if dtype == torch.float32:
        return True
    flagged = _flagged(dtype, FAST_FLAGS)
    return native_gemm(dtype) if flagged is None else flagged


@functools.cache
def avx512() -> bool:
    """Whether oneDNN's float32 GEMM runs 16-wide (AVX-512) here: the CPU's flags name ``avx512f``
    and oneDNN is not capped below it (:data:`ISA_CAPS`). Where the flags cannot say: False (the
    narrower CPU's choices hold there)."""
    cap = _cap()
    if cap is not None and not any(wide in cap for wide in ("AVX512", "AVX10", "AMX")):
        return False
    flags = cpu_flags()
    return flags is not None and "avx512f" in flags


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The x86 CPU's feature flags (``/proc/cpuinfo``), None where there are none to read (not
    Linux, not x86: an ARM cpuinfo names its ``Features``, not these)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return None
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def fused_decoding(dtype: torch.dtype) -> bool:
    """Whether a decoding step's attention over a ``dtype`` KV runs PyTorch's fused CPU kernel
    (:func:`kvcli.runtime.kernels.group_rows`) where it was measured faster: a bfloat16 KV on each
    CPU it was timed on (one query over the 1.5B Qwen's 4,700 keys a layer, 2 threads: with AMX 20.9
    against 50.1 ms; AVX2 only, against the KV made float32, 30-31 against 87-97; AVX512-BF16
    without AMX 22.1 against 40.0, docs/cpu.md), another dtype with AMX."""
    return dtype == torch.bfloat16 or (native_gemm(dtype) and amx())


@functools.cache
def amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon since Sapphire Rapids), where PyTorch's fused CPU
    attention runs a decoding step's bfloat16 attention 2-2.4x faster than kvcli's own matrix
    products (:func:`kvcli.runtime.kernels.group_rows`; used for a bfloat16 KV on the CPUs without
    AMX measured too: :func:`fused_decoding`). The tiles are also where a 16-bit GEMM outruns
    float32's; :func:`fast_gemm` reads that from the CPU's flags, per dtype."""
    cap = _cap()
    if cap is not None and "AMX" not in cap:
        return False  # oneDNN told to leave the tiles unused (:data:`ISA_CAPS`)
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private in PyTorch 2.13
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:  # pragma: no cover - a build without the probe's backend
        return False
