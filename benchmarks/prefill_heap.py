"""A prompt's prefill with freed memory kept in the heap (``KVCLI_HEAP=keep``, the default) and with
glibc's own settings (``system``), side by side: seconds, page faults, peak memory
(docs/cpu.md, "Freed memory kept").

    .venv/bin/python benchmarks/prefill_heap.py [-m qwen2.5-coder-1.5b] [--length 2000] [--rounds 2]

``--vary gemm``: instead, the products on weights made dense in bfloat16 (from ``dense_rows`` rows)
against float32 (from ``FLOAT_ROWS``), whatever ``native.fast_gemm`` says of this CPU (docs/cpu.md,
"AVX-512 with bfloat16 but no AMX"); the heap kept in both.

Each round runs both settings, each in a new process (the setting is the process's): the model
loaded as ``kvcli ask`` loads it, then five prefills of ``--length`` random tokens inside
``reading_prompt`` (what a question's reading runs in), timed one by one; the process's minor page
faults over the five and its peak resident memory (``VmHWM``) after them. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, os, resource, sys, time, torch
from kvcli.model import cpu_quant
if os.environ.get("BENCH_GEMM"):  # --vary gemm: the dense products' dtype forced
    cpu_quant.fast_gemm = lambda dtype: dtype == torch.float32 or os.environ["BENCH_GEMM"] == "bfloat16"
from kvcli.model.load import load_model
from kvcli.runtime.engine import Engine
from kvcli.runtime.measure import _read_hwm_mb, reading_prompt
engine = Engine(load_model(sys.argv[1]))
ids = torch.randint(100, 20000, (int(sys.argv[2]),), generator=torch.Generator().manual_seed(0))
faults, times = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
for _ in range(5):
    t = time.perf_counter()
    with reading_prompt("cpu"):
        engine.prefill(ids)
    times.append(round(time.perf_counter() - t, 3))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(json.dumps({"seconds": times, "minor_faults": faults, "peak_mb": round(_read_hwm_mb() or 0)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--length", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vary", choices=("heap", "gemm"), default="heap", help="what the two settings differ in")
    args = p.parse_args()
    root = Path(__file__).resolve().parent.parent
    names = ("system", "keep") if args.vary == "heap" else ("bfloat16", "float32")
    rows: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for setting, runs in rows.items():
            vary = {"KVCLI_HEAP": setting} if args.vary == "heap" else {"BENCH_GEMM": setting}
            env = {**os.environ, **vary, "PYTHONPATH": str(root)}
            done = subprocess.run(
                [sys.executable, "-c", CHILD, args.model, str(args.length)], env=env, capture_output=True, text=True
            )
            if done.returncode:
                raise SystemExit(done.stderr.strip()[-400:])
            runs.append(json.loads(done.stdout.splitlines()[-1]))
            print(setting, runs[-1], flush=True)
    for setting, runs in rows.items():
        seconds = [s for r in runs for s in r["seconds"]]
        print(
            f"{setting}: prefill of {args.length} tokens median {statistics.median(seconds):.2f} s "
            f"(range {min(seconds):.2f}-{max(seconds):.2f}), minor faults a run "
            f"{statistics.median(r['minor_faults'] for r in runs):,.0f}, peak {max(r['peak_mb'] for r in runs):,} MiB"
        )


if __name__ == "__main__":
    main()
