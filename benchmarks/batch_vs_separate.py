"""5 questions about one ~4k-token document: one batch process vs 5 separate invocations.

    python benchmarks/batch_vs_separate.py                    # -c full and -c gemfilter
    python benchmarks/batch_vs_separate.py --methods full --tokens 4096

Separate invocations run with --no-cache (each loads the model and reads the whole document);
the batch is `kvcli ask DOC --questions FILE` with a fresh disk cache (the model loads once, the
document's prefix state is computed once and reused by the 4 later questions). Wall-clock times
of whole processes, measured one after the other on this machine. Writes
benchmarks/out/batch_vs_separate.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTIONS = [
    "What is the pass key?",
    "Which number does the text give as the pass key?",
    "What colour is the grass in the text?",
    "Where is the sun in the text?",
    "What is the text about?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--methods", default="full;gemfilter")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "batch_vs_separate.json"))
    args = ap.parse_args()
    from kvcli.bench.needle import make_case
    from kvcli.model import load_model

    tok = load_model(None).tokenizer
    case = make_case(tok, args.tokens, 0.5, seed=3, haystack="filler")
    kvcli = [sys.executable, "-m", "kvcli", "ask"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcli-batch-bench-") as tmp:
        doc = Path(tmp) / "doc.txt"
        doc.write_text(case.text)
        qfile = Path(tmp) / "questions.txt"
        qfile.write_text("\n".join(QUESTIONS) + "\n")
        env = {**os.environ, "KVCLI_MAX_NEW_TOKENS": "12"}
        for spec in [m for m in args.methods.split(";") if m.strip()]:
            t0 = time.perf_counter()
            separate = [
                json.loads(subprocess.run([*kvcli, str(doc), q, "-c", spec, "--json", "-q", "--no-cache"], env=env,
                                          capture_output=True, text=True, check=True).stdout)
                for q in QUESTIONS
            ]
            t_separate = time.perf_counter() - t0
            cache = Path(tmp) / f"cache-{spec.replace(':', '_')}"
            t0 = time.perf_counter()
            out = subprocess.run([*kvcli, str(doc), "--questions", str(qfile), "-c", spec, "-q", "--cache-dir", str(cache)],
                                 env={**env, "KVCLI_CACHE_DIR": str(cache)}, capture_output=True, text=True, check=True).stdout
            t_batch = time.perf_counter() - t0
            batch = [json.loads(line) for line in out.splitlines()]
            same = [a["answer"] for a in separate] == [b["answer"] for b in batch]
            row = {
                "method": spec,
                "n_context_tokens": batch[0]["n_context_tokens"],
                "separate_s": round(t_separate, 2),
                "batch_s": round(t_batch, 2),
                "ratio_batch_over_separate": round(t_batch / t_separate, 3),
                "batch_cache": [b["cache"] for b in batch],
                "batch_ttft_s": [b["ttft_s"] for b in batch],
                "separate_ttft_s": [a["ttft_s"] for a in separate],
                "same_answers": same,
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"rows": rows}, indent=2))
    print("| method | prompt tokens | 5 separate, no cache (s) | 1 batch (s) | batch / separate | batch cache | same answers |")
    print("|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(f"| `{r['method']}` | {r['n_context_tokens']:,} | {r['separate_s']:.1f} | {r['batch_s']:.1f} | "
              f"**{r['ratio_batch_over_separate']:.2f}** | {' '.join(r['batch_cache'])} | {'yes' if r['same_answers'] else 'no'} |")


if __name__ == "__main__":
    main()
