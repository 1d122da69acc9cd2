"""`kvcli ask --ray`: 24 documents x 3 questions on the embedded model, 1 vs 2 Ray CPU workers.

    python benchmarks/ray_batch.py                              # the measurement (a quiet machine)
    python benchmarks/ray_batch.py --docs 2 --questions 1       # a smoke run: does it work
    python benchmarks/ray_batch.py --doc-seconds 0.35           # project with a per-document time measured on a GPU

Documents are filler text with a pass key (kvcli.bench.needle), 512 to 2,560 tokens, mixed so
that longest-first dispatch matters. Every configuration answers the same batch from a fresh
disk cache (the converted model is shared), through the library path `kvcli ask --ray local
--workers N` runs (`run_batch(RayExecutor(...))`), on one local Ray instance with 2 CPUs; an
in-process batch (`LocalExecutor`, torch's default threads) is the reference. Timed: the batch
(first record to last, workers already loaded) and, apart, the start (actors + model loads).

Then the arithmetic for D documents (default 10,000) on N GPU workers, stated as a projection:

    T(N) = start + ceil(D / N) x t_doc + t_tail,   and never less than D x t_driver

t_doc: one worker's time per document (measured here with 1 CPU worker, or --doc-seconds from a
GPU run of this script with --device cuda); t_tail: the longest document's time (longest first
leaves at most about one document of imbalance at the end); t_driver: the driver's own cost per
document (a Ray round trip, measured). Assumptions: documents like these, N workers that do not
share a device (GPU workers do not share cores as the two CPU workers here do), a shared
filesystem and disk cache that keep up, no worker failures.

Writes benchmarks/out/ray_batch.json and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

QUESTIONS = ["What is the pass key?", "What colour is the grass in the text?", "What is the text about?"]


def make_documents(folder: Path, n: int) -> list[Path]:
    from kvcli.bench.needle import make_case
    from kvcli.model import load_model

    tokenizer = load_model(None).tokenizer
    paths = []
    for i in range(n):
        tokens = 512 + (i * 7 % 5) * 512  # 512 .. 2,560, mixed
        case = make_case(tokenizer, tokens, depth=(i % 4 + 1) / 5, seed=i, haystack="filler")
        path = folder / f"doc{i:02d}.txt"
        path.write_text(case.text)
        paths.append(path)
    return paths


def fresh_cache(root: Path, name: str) -> Path:
    """An empty KV cache whose models/ is the user's (the embedded model converted once)."""
    from kvcli.model import default_cache_dir

    cache = root / name
    cache.mkdir()
    real = default_cache_dir() / "models"
    real.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(real, target_is_directory=True)
    return cache


def run(executor, docs: list[Path], questions: list[str], spec: str) -> tuple[list[dict], float]:
    from kvcli.api import parse_pipeline
    from kvcli.batch import expand_inputs
    from kvcli.executors import run_batch

    t0 = time.perf_counter()
    records = list(run_batch(executor, expand_inputs([str(d) for d in docs]), questions, parse_pipeline(spec)))
    return records, time.perf_counter() - t0


def round_trip_s(worker, n: int = 50) -> float:
    """The driver's cost per document, approximated by a Ray call round trip to a worker."""
    import ray

    ray.get(worker.handle.ready.remote())
    t0 = time.perf_counter()
    for _ in range(n):
        ray.get(worker.handle.ready.remote())
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--questions", type=int, default=3, choices=range(1, len(QUESTIONS) + 1))
    ap.add_argument("--workers", default="1,2", help="worker counts to compare (default 1,2)")
    ap.add_argument("--spec", default="auto", help="compressor spec (default auto)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (then one GPU per worker)")
    ap.add_argument("--no-local", action="store_true", help="skip the in-process reference batch")
    ap.add_argument("--project", type=int, default=10_000, help="documents in the projection (default 10,000)")
    ap.add_argument(
        "--doc-seconds",
        type=float,
        default=None,
        help="per-document time on one GPU worker for the projection (default: measured here)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "ray_batch.json"))
    args = ap.parse_args()

    import ray

    from kvcli.api import AskOptions, Session
    from kvcli.executors import LocalExecutor, RayExecutor

    counts = [int(w) for w in args.workers.split(",")]
    questions = QUESTIONS[: args.questions]
    rows, answers = [], {}
    with tempfile.TemporaryDirectory(prefix="kvcli-ray-bench-") as tmp:
        root = Path(tmp)
        (root / "docs").mkdir()
        docs = make_documents(root / "docs", args.docs)

        def options(cache: Path) -> AskOptions:
            return AskOptions(max_new_tokens=args.max_new_tokens, cache_dir=cache, device=args.device)

        if not args.no_local:
            t0 = time.perf_counter()
            session = Session.open(options(fresh_cache(root, "cache-local")))
            start_s = time.perf_counter() - t0
            records, batch_s = run(LocalExecutor(session), docs, questions, args.spec)
            answers["local"] = [r.get("answer") for r in records]
            rows.append(row("in-process (no Ray)", None, records, batch_s, start_s, args.docs))
            del session
        cpus = max(2, max(counts)) if args.device == "cpu" else None
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        rtt = None
        try:
            for n in counts:
                executor = RayExecutor(options(fresh_cache(root, f"cache-ray{n}")), "local", n)
                with executor:
                    t0 = time.perf_counter()
                    executor.start(args.docs)
                    start_s = time.perf_counter() - t0
                    records, batch_s = run(executor, docs, questions, args.spec)
                    if rtt is None:
                        rtt = round_trip_s(executor.workers[0])
                answers[f"ray{n}"] = [r.get("answer") for r in records]
                rows.append(
                    row(
                        f"Ray, {n} {args.device.upper()} worker{'s' if n > 1 else ''}",
                        n,
                        records,
                        batch_s,
                        start_s,
                        args.docs,
                    )
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            ray.shutdown()
    errors = sum(r["errors"] for r in rows)
    same = len({json.dumps(a) for a in answers.values()}) == 1
    one = next((r for r in rows if r["workers"] == counts[0]), None)
    ratios = {r["workers"]: round(one["batch_s"] / r["batch_s"], 3) for r in rows if r["workers"]}
    t_doc = args.doc_seconds if args.doc_seconds is not None else one["batch_s"] * counts[0] / args.docs
    t_tail = (
        max(one["doc_s"])
        if args.doc_seconds is None
        else args.doc_seconds * max(one["doc_s"]) / (sum(one["doc_s"]) / len(one["doc_s"]))
    )
    start = max(r["start_s"] for r in rows if r["workers"])
    projection = []
    for n in (1, 2, 4, 8, 16, 32, 64):
        total = start + math.ceil(args.project / n) * t_doc + t_tail
        floor = args.project * rtt
        projection.append(
            {
                "gpu_workers": n,
                "hours": round(max(total, floor) / 3600, 3),
                "docs_per_s": round(args.project / max(total, floor), 2),
                "driver_bound": floor > total,
            }
        )
    result = {
        "docs": args.docs,
        "questions": len(questions),
        "spec": args.spec,
        "device": args.device,
        "cpu_count": os.cpu_count(),
        "rows": rows,
        "throughput_ratio_vs_1_worker": ratios,
        "same_answers": same,
        "errors": errors,
        "round_trip_s": round(rtt, 5),
        "projection": {
            "documents": args.project,
            "t_doc_s": round(t_doc, 4),
            "t_doc_from": "--doc-seconds" if args.doc_seconds else f"measured, {counts[0]} {args.device} worker",
            "t_tail_s": round(t_tail, 3),
            "start_s": round(start, 2),
            "t_driver_s": round(rtt, 5),
            "rows": projection,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))

    print(
        f"{args.docs} documents x {len(questions)} questions, `-c {args.spec}`, {os.cpu_count()} CPU cores; same answers everywhere: {'yes' if same else 'NO'}; error records: {errors}\n"
    )
    print("| run | start (s) | batch (s) | documents/s | vs 1 worker |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        ratio = f"{ratios[r['workers']]:.2f}x" if r["workers"] else ""
        print(f"| {r['run']} | {r['start_s']:.1f} | {r['batch_s']:.1f} | {r['docs_per_s']:.2f} | {ratio} |")
    print(
        f"\nProjection for {args.project:,} documents: t_doc {t_doc:.3f} s ({result['projection']['t_doc_from']}), "
        f"tail {t_tail:.2f} s, start {start:.1f} s, driver {rtt * 1000:.2f} ms/document\n"
    )
    print(f"| workers at {t_doc:.2f} s/document | hours | documents/s |")
    print("|---:|---:|---:|")
    for p in projection:
        print(
            f"| {p['gpu_workers']} | {p['hours']:.2f} | {p['docs_per_s']:.1f}{' (driver-bound)' if p['driver_bound'] else ''} |"
        )


def row(name: str, workers: int | None, records: list[dict], batch_s: float, start_s: float, n_docs: int) -> dict:
    per_doc: dict[str, float] = {}
    for r in records:
        per_doc[r["document"]] = per_doc.get(r["document"], 0.0) + (r.get("total_s") or 0.0)
    return {
        "run": name,
        "workers": workers,
        "start_s": round(start_s, 2),
        "batch_s": round(batch_s, 2),
        "docs_per_s": round(n_docs / batch_s, 3),
        "errors": sum(1 for r in records if "error" in r),
        "doc_s": [round(v, 3) for v in per_doc.values()],  # the model's time per document (its questions' total_s)
        "cache": [r.get("cache") for r in records],
    }


if __name__ == "__main__":
    main()
