"""Two runs of ``kvcli bench ruler`` compared answer for answer: did a change (a commit, a setting
such as ``--kv-bits``) move any answer? Prints, per method spec, the cells both runs hold, how many
answers are the same text, both runs' mean scores, and every answer that differs.

    # the same slice at two commits (each checkout's kvcli on PYTHONPATH), or at two settings
    T=niah_single_1,niah_multikey_2,niah_multivalue,vt,cwe,qa_2
    kvcli bench ruler --methods "full;snapkv;streamingllm" --ratios 4 --lengths 1024 --tasks $T \\
        --samples 2 --seed 0 --kv-bits 16 --out /tmp/ruler-16
    ...                                                           --kv-bits 8 --out /tmp/ruler-8
    python benchmarks/ruler_same_answers.py /tmp/ruler-16/ruler.json /tmp/ruler-8/ruler.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def cells(path: Path) -> dict:
    rows = json.loads(path.read_text())["rows"]
    return {(r["task"], r["length"], r["index"], r["spec"]): r for r in rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    args = p.parse_args()
    a, b = cells(args.before), cells(args.after)
    common = sorted(set(a) & set(b))
    print("| method | cells | same answer | score before | score after |")
    print("|---|---:|---:|---:|---:|")
    for spec in sorted({k[3] for k in common}):
        keys = [k for k in common if k[3] == spec]
        same = sum(a[k]["answer"] == b[k]["answer"] for k in keys)
        before = statistics.mean(a[k]["score"] for k in keys)
        after = statistics.mean(b[k]["score"] for k in keys)
        print(f"| `{spec}` | {len(keys)} | {same}/{len(keys)} | {before:.1f} | {after:.1f} |")
    for k in common:
        if a[k]["answer"] != b[k]["answer"]:
            print(
                f"{k}: score {a[k]['score']:.0f} -> {b[k]['score']:.0f}: {a[k]['answer'][:70]!r} -> {b[k]['answer'][:70]!r}"
            )


if __name__ == "__main__":
    main()
