"""What every peer worker shares, with no dependency beyond the standard library: it runs in kvcli's
venv and in each peer's (.peers/kvpress, .peers/llamacpp), which do not have kvcli installed.

A worker is one fresh process per measurement: ``python worker_X.py CASE_JSON SPEC`` reads the case
(prompt token ids made by kvcli's prompt builder, so every peer sees the same ids), loads its model,
warms up on a short prompt, then measures one run and prints one JSON line on stdout.

Peak memory is measured the same way for every peer: the process's resident-set high-water mark
(``VmHWM``) after freed heap is handed back (``malloc_trim``) and the mark is reset
(``/proc/self/clear_refs``), i.e. the absolute peak during the run, weights included.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time


def reset_peak() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def read_case() -> tuple[dict, str, list[str]]:
    """(case, spec, extra args) from the command line."""
    with open(sys.argv[1]) as f:
        case = json.load(f)
    return case, sys.argv[2], sys.argv[3:]


class Clock:
    """Wall times of one generation: ``first()`` at the first answer token, ``done()`` at the end.
    A worker whose call returns after more than the tokens (kvcli: the answer's sources) marks each
    streamed token with ``token()`` instead of ``first()``: decoding then ends at the last token,
    not at ``done()``, as it does for a peer whose call ends with its last token."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ttft = None
        self.last = None
        self.total = None

    def first(self) -> None:
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.start

    def token(self) -> None:
        self.first()
        self.last = time.perf_counter() - self.start

    def done(self) -> None:
        self.total = time.perf_counter() - self.start


def answer_ids(ids: list[int], stop_ids: list[int]) -> list[int]:
    """The answer: the generated ids up to the first stop token (generation is forced past it)."""
    out = []
    for t in ids:
        if t in stop_ids:
            break
        out.append(int(t))
    return out


def emit(case: dict, clock: Clock, generated: list[int], **extra) -> None:
    n = len(generated)
    decode = (clock.last if clock.last is not None else clock.total) - clock.ttft
    record = {
        "ttft_s": round(clock.ttft, 4),
        "total_s": round(clock.total, 4),
        "decode_tokens_per_s": round((n - 1) / decode, 3) if n > 1 and decode > 0 else None,
        "n_generated": n,
        "peak_mib": round(peak_mib(), 1),
        "answer_ids": answer_ids(generated, case["stop_ids"]),
        **extra,
    }
    print(json.dumps(record), flush=True)
