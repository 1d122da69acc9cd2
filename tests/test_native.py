"""Whether this CPU multiplies 16-bit matrices natively (kvcli.runtime.native.native_gemm) and faster
than float32 (fast_gemm): on x86 the CPU's flags decide, not a timing that a busy neighbour can
upset; elsewhere the timing, where one slow try does not decide."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from kvcli.runtime import native


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for name in native.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    native.native_gemm.cache_clear()
    native.fast_gemm.cache_clear()
    yield
    native.native_gemm.cache_clear()
    native.fast_gemm.cache_clear()


@pytest.mark.parametrize(
    "flags,bf16,fp16,fast",
    [
        ({"avx2", "fma"}, False, False, set()),  # an AVX2-only CPU: both emulated
        ({"avx2", "avx512f", "avx512_bf16"}, True, False, set()),  # Zen 4, Cooper Lake: native, slower than float32
        ({"avx512f", "avx512_bf16", "avx512_fp16"}, True, True, set()),  # Sapphire Rapids with its AMX hidden
        ({"avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}, True, True, {"bf16"}),  # Sapphire Rapids
        ({"amx_bf16", "amx_fp16"}, True, True, {"bf16", "fp16"}),
    ],
)
def test_the_cpu_flags_decide_and_nothing_is_timed(flags, bf16, fp16, fast, monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(native, "_timed_native", lambda dtype: pytest.fail("timed where the flags say"))
    assert native.native_gemm(torch.bfloat16) is bf16
    assert native.native_gemm(torch.float16) is fp16
    assert native.native_gemm(torch.float32) is True
    assert native.fast_gemm(torch.bfloat16) is ("bf16" in fast)  # faster than float32: AMX only
    assert native.fast_gemm(torch.float16) is ("fp16" in fast)
    assert native.fast_gemm(torch.float32) is True


def test_a_type_the_flags_do_not_speak_of_is_timed_as_before(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(native, "_timed_native", lambda dtype: dtype == torch.float64)
    assert native.native_gemm(torch.float64) is True  # not "emulated" for want of a 16-bit flag


@pytest.mark.parametrize("cap,timed", [("AVX2", True), ("avx512_core", True), ("ALL", False), ("", False)])
def test_onednn_capped_below_the_cpu_is_timed(cap, timed, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    monkeypatch.setattr(native, "_timed_native", lambda dtype: False)  # the capped oneDNN emulates
    assert native.native_gemm(torch.bfloat16) is not timed
    assert native.fast_gemm(torch.bfloat16) is not timed  # capped: the timing's answer, else the AMX flag


@pytest.mark.parametrize("emulated", [False, True])
def test_without_flags_faster_is_what_native_says(emulated, monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: None)
    monkeypatch.setattr(native, "_timed_native", lambda dtype: not emulated)
    assert native.fast_gemm(torch.bfloat16) is (not emulated)
    assert native.fast_gemm(torch.float32) is True


@pytest.mark.parametrize(
    "flags,amx,kv16,kv32",
    [
        ({"avx2"}, False, True, False),  # AVX2 only: the bfloat16 KV fused, float32 KV through SDPA
        ({"avx512f", "avx512_bf16"}, False, True, False),  # AVX512-BF16 without AMX
        ({"avx512f", "avx512_bf16", "amx_bf16"}, True, True, True),  # with AMX
    ],
)
def test_decoding_fuses_a_bfloat16_kv_on_every_cpu_measured(flags, amx, kv16, kv32, monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(native, "amx", lambda: amx)
    assert native.fused_decoding(torch.bfloat16) is kv16
    assert native.fused_decoding(torch.float32) is kv32
    assert native.fused_decoding(torch.float16) is False  # no float16 flag: emulated, grouped's float32 products


def test_without_flags_one_slow_try_does_not_decide(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: None)
    tries = iter([False, True, False])
    monkeypatch.setattr(native, "_timed_native", lambda dtype: next(tries))
    assert native.native_gemm(torch.bfloat16) is True  # the second try: native
    native.native_gemm.cache_clear()
    monkeypatch.setattr(native, "_timed_native", lambda dtype: False)
    assert native.native_gemm(torch.bfloat16) is False  # every try emulated


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or not os.path.exists("/proc/cpuinfo"), reason="x86 Linux"
)
def test_this_x86_cpus_flags_are_read():
    native.cpu_flags.cache_clear()
    flags = native.cpu_flags()
    assert flags is not None and "sse2" in flags  # every x86-64 CPU has SSE2
    assert native.native_gemm(torch.bfloat16) is bool(flags & {"avx512_bf16", "amx_bf16"})
    assert native.fast_gemm(torch.bfloat16) is ("amx_bf16" in flags)


@pytest.mark.parametrize("cap,tiles", [("AVX512_CORE_BF16", False), ("AVX512_CORE_AMX", True), ("", True)])
def test_onednn_capped_below_amx_leaves_the_tiles(cap, tiles, monkeypatch):
    native.amx.cache_clear()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    try:
        assert native.amx() is tiles
    finally:
        native.amx.cache_clear()


@pytest.mark.parametrize(
    "flags,cap,wide",
    [
        ({"avx2", "fma"}, "", False),  # AVX2 only
        ({"avx2", "avx512f", "avx512_bf16"}, "", True),  # a Xeon without AMX, Zen 4
        ({"avx512f", "amx_bf16"}, "AVX2", False),  # oneDNN capped below the CPU
        ({"avx512f", "amx_bf16"}, "AVX512_CORE_BF16", True),
        ({"avx512f", "amx_bf16"}, "AVX512_CORE_AMX", True),
    ],
)
def test_the_float32_gemm_is_wide_where_the_flags_and_onednn_say(flags, cap, wide, monkeypatch):
    """avx512: what cpu_quant.FLOAT_ROWS follows (the float32 GEMM overtakes the int8 kernel sooner)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    native.avx512.cache_clear()
    try:
        assert native.avx512() is wide
        monkeypatch.setattr(native, "cpu_flags", lambda: None)  # not x86 Linux: the narrower choice
        native.avx512.cache_clear()
        assert native.avx512() is False
    finally:
        native.avx512.cache_clear()
