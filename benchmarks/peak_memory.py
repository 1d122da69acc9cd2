"""Peak memory of every method vs full attention, each (method, length) cell in a fresh process.

    PYTHONPATH=. python benchmarks/peak_memory.py --lengths 4096,8000
    PYTHONPATH=. python benchmarks/peak_memory.py --lengths 4096 --methods "full;snapkv:budget=0.25" --trace

Every cell answers the passkey question about the same needle document (depth 0.5, the essays
haystack, ``--new-tokens`` generated, stop tokens ignored) with no disk cache, and reports
``peak_mem_mb`` exactly as ``kvcli ask --json`` does (:mod:`kvcli.runtime.measure`: the process's VmHWM
after a reset, weights included). A fresh process per cell keeps one cell's freed-but-kept heap
from hiding or inflating the next one's. ``--trace`` also samples VmRSS every millisecond and
prints, for the top moments, what the main thread was running (file:line of kvcli code) — where
a peak comes from. ``--json FILE`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DEFAULT_METHODS = [
    "full",
    "snapkv:budget=0.25",
    "streamingllm:budget=0.25",
    "pyramidkv:budget=0.25",
    "finch:target=0.25",
    "gemfilter:k=1024",
    "tova:budget=0.25",
    "keydiff:budget=0.25",
    "knorm:budget=0.25",
    "adakv:budget=0.25",
]


def _cell(spec: str, length: int, new_tokens: int, trace: bool) -> dict:
    """Run one cell in this process (the child)."""
    import threading
    import time
    import traceback

    from kvcli.answer.pipeline import Pipeline
    from kvcli.api import AskOptions, QuestionOptions, Session
    from kvcli.bench.needle import make_case
    from kvcli.bench.runner import PROMPT_OVERHEAD
    from kvcli.documents import document_from_text

    session = Session.open(AskOptions(use_cache=False))
    case = make_case(session.lm.tokenizer, length - PROMPT_OVERHEAD, 0.5, seed=0, haystack="essays")
    document = document_from_text(case.text, source=f"peak-{length}")
    samples: list[tuple[float, str]] = []
    stop = threading.Event()
    main = threading.main_thread().ident

    def sample() -> None:
        here = str(Path(__file__).resolve().parents[1] / "kvcli")
        while not stop.wait(0.001):
            with open("/proc/self/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
            frame = sys._current_frames().get(main)
            where = [
                f"{Path(fs.filename).name}:{fs.lineno}:{fs.name}"
                for fs in traceback.extract_stack(frame)
                if fs.filename.startswith(here)
            ]
            samples.append((rss, " < ".join(reversed(where[-4:]))))

    sampler = threading.Thread(target=sample, daemon=True)
    if trace:
        sampler.start()
    with open("/proc/self/status") as f:
        base = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    t0 = time.perf_counter()
    result = session.ask(
        document,
        case.question,
        Pipeline.parse(spec),
        QuestionOptions(max_new_tokens=new_tokens, force_tokens=True, use_store=False),
    )
    stop.set()
    if trace:
        sampler.join()  # before the interpreter exits (a daemon thread reading frames can abort it)
    row = {
        "method": spec,
        "length": length,
        "n_context_tokens": result.prompt.n_tokens,
        "peak_mem_mb": round(result.peak_mem_mb, 1),
        "before_mb": round(base, 1),  # the process before the question: weights, runtime, tokenizer
        "ttft_s": round(result.ttft_s, 2),
        "kv_cache_mb": round(result.extra.get("kv_cache_bytes", 0) / 2**20, 1)
        if result.extra.get("kv_cache_bytes")
        else None,
        "answer_ids": result.answer_ids,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if trace:
        best: dict[str, float] = {}
        for rss, where in samples:
            best[where] = max(best.get(where, 0.0), rss)
        row["trace"] = sorted(best.items(), key=lambda kv: -kv[1])[:12]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,8000")
    ap.add_argument("--methods", default=";".join(DEFAULT_METHODS), help="';'-separated specs")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--trace", action="store_true", help="sample VmRSS and print where the peak happened")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "LENGTH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_cell(args.child[0], int(args.child[1]), args.new_tokens, args.trace)))
        return
    rows = []
    specs = [s.strip() for s in args.methods.split(";") if s.strip()]
    for length in [int(x) for x in args.lengths.split(",")]:
        for spec in specs:
            cmd = [sys.executable, __file__, "--child", spec, str(length), "--new-tokens", str(args.new_tokens)]
            cmd += ["--trace"] if args.trace else []
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                print(f"{spec} @ {length}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(
                f"{length:>6} {spec:<28} peak {row['peak_mem_mb']:>8.1f} MiB (before {row['before_mb']:.0f})  ttft {row['ttft_s']:>6.2f} s  KV {row['kv_cache_mb']} MiB",
                flush=True,
            )
            for where, rss in row.get("trace", []):
                print(f"         {rss:8.1f}  {where}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
