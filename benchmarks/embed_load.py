"""How long does a new process take to load the sentence-embedding model (kvcli's Embedder), with
its tokenizer through transformers' AutoTokenizer and through kvcli's JsonTokenizer (its
tokenizer.json read by the tokenizers library, kvcli/retrieval/embed.py)? Each load in a fresh
Python process (kvcli, transformers and tokenizers imported before the clock), the median of
--repeat, after one load that stores the tokenizer check's verdict; run it alone.

    python benchmarks/embed_load.py --model embeddinggemma-300m --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

LOADS = {
    # the same load with the tokenizer.json check's way shut: AutoTokenizer, as before JsonTokenizer
    "Embedder, AutoTokenizer": "embed.JsonTokenizer.FILE = 'no-such-file.json'\nembed.Embedder(folder)",
    "Embedder, JsonTokenizer": "embed.Embedder(folder)",
}
TIMED = """
import time
from kvcli.retrieval import embed
folder = embed.model_dir({model!r})
start = time.perf_counter()
{load}
print(time.perf_counter() - start)
"""


def seconds(model: str, load: str) -> float:
    """One fresh process's time to run ``load`` (kvcli and transformers imported before the clock)."""
    code = "import transformers, tokenizers\n" + TIMED.format(model=model, load=load)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embeddinggemma-300m")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    seconds(args.model, "embed.Embedder(folder)")  # the verdict stored, the files in the page cache
    rows = {}
    for name, load in LOADS.items():
        runs = [seconds(args.model, load) for _ in range(args.repeat)]
        rows[name] = {"median_s": round(statistics.median(runs), 3), "runs_s": [round(r, 3) for r in runs]}
        print(f"{name}: {rows[name]['median_s']} s (runs {rows[name]['runs_s']})", file=sys.stderr)
    print(json.dumps({"model": args.model, "loads": rows}, indent=1))


if __name__ == "__main__":
    main()
