"""Every method vs full attention on the embedded model, at one budget: needle, TTFT, memory, KV.

    python benchmarks/methods.py                                   # 2k/4k/8k x 3 depths, budget 256
    python benchmarks/methods.py --lengths 2048,4096 --budget 512
    python benchmarks/methods.py --lengths 1024,2048,4096,8000 --methods "full;gemfilter;gemfilter:span=16"

Methods (every one keeps ``--budget`` tokens: KV entries per layer for the eviction methods — on
average over layers for PyramidKV — and prompt tokens for GemFilter): full, snapkv, pyramidkv,
h2o, streamingllm, gemfilter. All run in one process on the same needle documents, with no disk
cache (every row is a cold run), so TTFT ratios are same-machine, same-run ratios. TTFT includes
the eviction (the scores are computed during the prefill); "KV MiB" is the cache after
compression (plus the answer's tokens). Writes benchmarks/out/methods.json (after every row)
and prints a Markdown table; ``--table`` prints the table of an earlier (or interrupted) run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from kvcli.api import AskOptions, Session
from kvcli.bench.runner import markdown_table, run_grid, summary

METHODS = ["full", "snapkv:budget={b}", "pyramidkv:budget={b}", "h2o:budget={b}", "streamingllm:budget={b}", "gemfilter:k={b}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,4096,8000")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--methods", default=";".join(METHODS), help="';'-separated specs; {b} is replaced by --budget")
    ap.add_argument("--haystack", default="filler", choices=["filler", "essays"])
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "methods.json"))
    ap.add_argument("--table", action="store_true", help="only print the table of --out")
    args = ap.parse_args()
    if args.table:
        print(markdown_table(summary(json.loads(Path(args.out).read_text())["rows"])))
        return
    specs = [s.strip().format(b=args.budget) for s in args.methods.split(";") if s.strip()]
    session = Session.open(AskOptions(max_new_tokens=args.max_new_tokens, use_cache=False))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "haystack": args.haystack,
        "budget": args.budget,
    }
    done: list[dict] = []

    def save(rows):  # after every row, so an interrupted run keeps what finished
        out.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary(rows)}, indent=2))

    def show(row):
        done.append(row)
        save(done)
        print(
            f"{row['length']:>5} depth {row['depth']:.1f} {row['method']:<26} {'OK ' if row['correct'] else 'no '}"
            f"TTFT {row['ttft_s']:6.2f}s peak {row['peak_mem_mb']:7.0f} MiB KV {row['kv_cache_mb']:6.1f} MiB "
            f"{row['answer'][:40]!r}",
            file=sys.stderr,
            flush=True,
        )

    rows = run_grid(
        session,
        specs,
        [int(x) for x in args.lengths.split(",")],
        [float(x) for x in args.depths.split(",")],
        haystack=args.haystack,
        on_row=show,
    )
    save(rows)
    print(markdown_table(summary(rows)))


if __name__ == "__main__":
    main()
