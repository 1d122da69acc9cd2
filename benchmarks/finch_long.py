"""Finch on a document ~3x longer than the embedded model's window: passkey accuracy over depths.

    python benchmarks/finch_long.py                                  # 24k tokens x 5 depths
    python benchmarks/finch_long.py --tokens 24000 --depths 0.1,0.5 --method finch:target=512

The embedded SmolLM2-135M-Instruct has an 8,192-token window: full attention refuses these
documents (the benchmark checks that it does), Finch reads them chunk by chunk. The haystack is the
passkey filler (Mohtashami & Jaggi, 2023). Per depth: correct?, TTFT (selection + prefill),
peak memory, final KV cache size, and how many layers kept at least one token of the needle
sentence. Writes benchmarks/out/finch_long.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from kvcli.answer.pipeline import Pipeline, check_window
from kvcli.answer.prompt import build_prompt
from kvcli.api import AskOptions, Session
from kvcli.bench.needle import make_case
from kvcli.documents import document_from_text
from kvcli.errors import DocumentError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=24000, help="document tokens")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--method", default="finch")
    ap.add_argument("--haystack", default="filler", choices=["filler", "essays"])
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "finch_long.json"))
    args = ap.parse_args()
    session = Session.open(AskOptions(max_new_tokens=args.max_new_tokens, use_cache=False))
    lm = session.lm
    rows = []
    for i, depth in enumerate(float(x) for x in args.depths.split(",")):
        case = make_case(lm.tokenizer, args.tokens, depth, seed=i, haystack=args.haystack)
        document = document_from_text(case.text, source=f"needle-{args.tokens}-{depth}")
        prompt = build_prompt(lm.tokenizer, case.text, case.question, session.template)
        try:  # full attention cannot read it
            check_window(prompt, lm, args.max_new_tokens, Pipeline.parse("full"))
            refused = False
        except DocumentError:
            refused = True
        pipeline = Pipeline.parse(args.method)
        finch = pipeline.owner("prefill")
        kept_layers = None
        if finch is not None:  # spy on the compressed cache to see whether the needle survived
            original = finch.prefill

            def spy(engine, ids, prefix=None, protected=0, _orig=original):
                nonlocal kept_layers
                cache, logits, pos = _orig(engine, ids, prefix=prefix, protected=protected)
                span = [
                    j
                    for j in range(prompt.doc_start, prompt.doc_end)
                    if (s := prompt.char_span(j)) and s[1] > case.needle_start and s[0] < case.needle_end
                ]
                lo, hi = min(span), max(span)
                kept_layers = sum(bool(((k >= lo) & (k <= hi)).any()) for k in getattr(cache, "kept_positions", []))
                return cache, logits, pos

            finch.prefill = spy
        t0 = time.perf_counter()
        result = session.ask(document, case.question, pipeline)
        row = {
            "depth": depth,
            "method": pipeline.spec(),
            "n_context_tokens": result.prompt.n_tokens,
            "window": lm.max_context,
            "full_refused": refused,
            "correct": case.is_correct(result.answer),
            "key": case.key,
            "answer": result.answer,
            "ttft_s": result.ttft_s,
            "total_s": result.total_s,
            "wall_s": time.perf_counter() - t0,
            "peak_mem_mb": result.peak_mem_mb,
            "kv_cache_mb": result.extra["kv_cache_bytes"] / 2**20,
            "needle_kept_layers": kept_layers,
            "n_layers": lm.n_layers,
        }
        rows.append(row)
        print(
            f"depth {depth:.1f} {'OK ' if row['correct'] else 'no '} TTFT {row['ttft_s']:6.1f}s peak {row['peak_mem_mb']:6.0f} MiB "
            f"KV {row['kv_cache_mb']:5.1f} MiB needle kept in {kept_layers}/{lm.n_layers} layers  {row['answer'][:40]!r}",
            file=sys.stderr,
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "haystack": args.haystack,
        "model": lm.name,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print("| depth | correct | answer | TTFT s | peak MiB | KV MiB | needle kept (layers) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['depth']:.1f} | {'yes' if r['correct'] else 'no'} | {r['answer'][:30]!r} | {r['ttft_s']:.1f} | "
            f"{r['peak_mem_mb']:.0f} | {r['kv_cache_mb']:.1f} | {r['needle_kept_layers']}/{r['n_layers']} |"
        )
    print(
        f"\naccuracy {sum(r['correct'] for r in rows)}/{len(rows)}, {rows[0]['n_context_tokens']:,}-token prompts, "
        f"window {lm.max_context:,}, full attention refused: {all(r['full_refused'] for r in rows)}"
    )


if __name__ == "__main__":
    main()
