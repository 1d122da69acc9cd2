"""Full attention vs GemFilter on the embedded model: TTFT, peak memory, passkey accuracy.

    python benchmarks/gemfilter_vs_full.py                       # 1k/2k/4k/8k x 3 depths
    python benchmarks/gemfilter_vs_full.py --lengths 1024,2048 --haystack essays

All methods run in one process on the same documents, so the TTFT ratios are same-machine,
same-run ratios. Writes benchmarks/out/gemfilter_vs_full.json and prints a Markdown table.
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

DEFAULT_SPECS = ["full", "gemfilter", "gemfilter:span=16"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,2048,4096,8000")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--methods", default=";".join(DEFAULT_SPECS), help="';'-separated compressor specs")
    ap.add_argument("--haystack", default="filler", choices=["filler", "essays"])
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "gemfilter_vs_full.json"))
    args = ap.parse_args()
    specs = [s for s in args.methods.split(";") if s.strip()]
    # no disk cache: every row is a cold run (see cache_second_question.py for the warm case)
    session = Session.open(AskOptions(max_new_tokens=args.max_new_tokens, use_cache=False))

    def show(row):
        print(
            f"{row['length']:>5} depth {row['depth']:.1f} {row['method']:<28} {'OK ' if row['correct'] else 'no '}"
            f"TTFT {row['ttft_s']:6.2f}s peak {row['peak_mem_mb']:7.0f} MiB  {row['answer'][:40]!r}",
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
    table = summary(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "haystack": args.haystack}
    out.write_text(json.dumps({"meta": meta, "rows": rows, "summary": table}, indent=2))
    print(markdown_table(table))


if __name__ == "__main__":
    main()
