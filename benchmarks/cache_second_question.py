"""The disk KV cache on the embedded model: TTFT of a second, different question vs the first.

    python benchmarks/cache_second_question.py                  # ~4k-token document, full + GemFilter
    python benchmarks/cache_second_question.py --lengths 1024,4096,8000

Per method, in one process: a fresh store; question 1 (cold: computes and saves the prefix state),
question 2, different, on the same document (warm: loads it), and question 2 again without the
store (what it would cost without the cache). Target: TTFT(q2 warm) / TTFT(q1) <= 0.1.
Writes benchmarks/out/cache_second_question.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

from kvcli.api import AskOptions, Session, parse_pipeline
from kvcli.bench.needle import make_case
from kvcli.documents import document_from_text
from kvcli.store import KVStore

SECOND_QUESTION = "Which number does the text give as the pass key? Reply with the number."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--methods", default="full;gemfilter")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "cache_second_question.json"))
    args = ap.parse_args()
    base = Session.open(AskOptions(max_new_tokens=args.max_new_tokens, use_cache=False))
    tok = base.lm.tokenizer
    # warm-up: first calls pay one-time costs that are not the method's
    base.ask(
        document_from_text(make_case(tok, 200, 0.5, seed=1, haystack="filler").text), "Hi?", parse_pipeline("full")
    )
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        case = make_case(tok, length, 0.5, seed=3, haystack="filler")
        doc = document_from_text(case.text)
        for spec in [s for s in args.methods.split(";") if s.strip()]:
            with tempfile.TemporaryDirectory(prefix="kvcli-bench-") as tmp:
                q1 = dataclasses.replace(base, store=KVStore.open(Path(tmp))).ask(
                    doc, case.question, parse_pipeline(spec)
                )
                # a new store object: the entry comes from disk, as in a second kvcli process
                q2 = dataclasses.replace(base, store=KVStore.open(Path(tmp))).ask(
                    doc, SECOND_QUESTION, parse_pipeline(spec)
                )
                q2_off = base.ask(doc, SECOND_QUESTION, parse_pipeline(spec))
            assert (q1.extra["cache"]["status"], q2.extra["cache"]["status"]) == ("miss", "hit")
            assert q2.answer_ids == q2_off.answer_ids, "warm and uncached answers differ"
            row = {
                "length": q1.prompt.n_tokens,
                "method": spec,
                "ttft_q1_s": round(q1.ttft_s, 3),
                "ttft_q2_warm_s": round(q2.ttft_s, 3),
                "ttft_q2_nocache_s": round(q2_off.ttft_s, 3),
                "ratio_q2_warm_over_q1": round(q2.ttft_s / q1.ttft_s, 4),
                "store_load_s": q2.extra["cache"]["seconds"],
                "saved_s": q2.extra["cache"]["saved_s"],
                "entry_bytes": q1.extra["cache"]["entry_bytes"],
                "peak_mem_q1_mb": round(q1.peak_mem_mb, 1),
                "peak_mem_q2_mb": round(q2.peak_mem_mb, 1),
                "q1_correct": case.is_correct(q1.answer),
                "q2_correct": case.is_correct(q2.answer),
                "answers": [q1.answer, q2.answer],
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(
        "| prompt tokens | method | TTFT q1 (s) | TTFT q2 warm (s) | q2 warm / q1 | q2 without cache (s) | load (s) | entry size | peak RSS q1 / q2 (MiB) | passkey q1 / q2 |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['length']:,} | `{r['method']}` | {r['ttft_q1_s']:.2f} | {r['ttft_q2_warm_s']:.3f} | "
            f"**{r['ratio_q2_warm_over_q1']:.3f}** | {r['ttft_q2_nocache_s']:.2f} | {r['store_load_s']:.3f} | "
            f"{r['entry_bytes'] / 2**20:,.1f} MiB | {r['peak_mem_q1_mb']:,.0f} / {r['peak_mem_q2_mb']:,.0f} | "
            f"{'yes' if r['q1_correct'] else 'no'} / {'yes' if r['q2_correct'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
