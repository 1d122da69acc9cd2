"""Every method vs full attention on the embedded model, at one budget: needle, TTFT, memory, KV.

A thin wrapper over ``kvcli bench needle`` (same grid runner, same JSON, same heatmaps) that keeps
this script's defaults and its ``{b}`` budget placeholder, and prints the detailed per-length table
of the README after the CLI's accuracy table:

    PYTHONPATH=. python benchmarks/methods.py                      # 2k/4k/8k x 3 depths, budget 256
    PYTHONPATH=. python benchmarks/methods.py --lengths 2048,4096 --budget 512 --resume
    PYTHONPATH=. python benchmarks/methods.py --lengths 1024,2048,4096,8000 --methods "full;gemfilter;gemfilter:span=16"

Methods (every one keeps ``--budget`` tokens: KV entries per layer for the eviction methods — on
average over layers for PyramidKV — and prompt tokens for GemFilter): full, snapkv, pyramidkv,
h2o, streamingllm, gemfilter. All run in one process on the same needle documents, with no disk
cache (every row is a cold run), so TTFT ratios are same-machine, same-run ratios. TTFT includes
the eviction (the scores are computed during the prefill); "KV MiB" is the cache after
compression (plus the answer's tokens). Writes ``--out``/needle.json (after every row; default
benchmarks/out/methods/) and the heatmaps; ``--table`` prints the tables of an earlier (or
interrupted) run; ``--resume`` finishes an interrupted one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcli.bench.runner import markdown_table, summary
from kvcli.cli import main as kvcli_main

METHODS = [
    "full",
    "snapkv:budget={b}",
    "pyramidkv:budget={b}",
    "h2o:budget={b}",
    "streamingllm:budget={b}",
    "gemfilter:k={b}",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,4096,8000")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--methods", default=";".join(METHODS), help="';'-separated specs; {b} is replaced by --budget")
    ap.add_argument("--haystack", default="filler", choices=["filler", "essays"])
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "out" / "methods"), help="folder of needle.json and the PNGs"
    )
    ap.add_argument("--resume", action="store_true", help="run only the cells missing from --out")
    ap.add_argument("--table", action="store_true", help="only print the tables of --out (and redraw its heatmaps)")
    args, rest = ap.parse_known_args()  # anything else (--model, --device, --quiet...) goes to kvcli
    specs = ";".join(s.strip().replace("{b}", str(args.budget)) for s in args.methods.split(";") if s.strip())
    argv = [
        "kvcli",
        "bench",
        "needle",
        "--methods",
        specs,
        "--lengths",
        args.lengths,
        "--depths",
        args.depths,
        "--out",
        args.out,
    ]
    if args.table:
        argv.append("--plot-only")
    else:
        argv += ["--haystack", args.haystack, "--max-new-tokens", str(args.max_new_tokens)]
        argv += ["--resume"] if args.resume else []
    sys.argv = argv + rest
    try:
        kvcli_main()
    except SystemExit as e:
        if e.code:
            raise
    rows = json.loads((Path(args.out) / "needle.json").read_text())["rows"]
    wanted = set(specs.split(";"))
    print()
    print(markdown_table(summary([r for r in rows if r["method"] in wanted])))


if __name__ == "__main__":
    main()
