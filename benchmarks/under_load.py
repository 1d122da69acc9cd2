"""kvcli on a shared machine: the same questions with 0, 1 and 2 other busy processes.

    python benchmarks/under_load.py                               # every load, configuration and run
    python benchmarks/under_load.py --loads 1 --configs auto,1    # one load, two configurations
    python benchmarks/under_load.py --loads 2 --resume            # add a load to the stored results
    python benchmarks/under_load.py --report-only                 # the table again from the JSON

Each load level starts ``N`` competing busy processes (``python -c "while True: pass"``: one core
each, forever) and keeps them running while every configuration is measured:

* ``kvcli --threads auto`` (the default), ``--threads 1`` and ``--threads 2`` (the default on two
  cores before :mod:`kvcli.runtime.threads`), each run a fresh ``python -m kvcli ask --json`` process:
  - **hit**: a question about a ~4.7k-token document (``--doc-tokens``) whose
    KV is in the disk cache (filled once before the grid, not timed): the time to its first token,
    and the decoding speed (``--max-new-tokens``, no answer guard; over the answer's tokens);
  - **book**: a text over the embedded model's 8k window (``--book-tokens``) read by the default
    path (``-c auto``: InfLLM), no disk cache: prompt tokens / time to the first token;
  - **cold** (only when ``--runs`` names it): the document read with full attention, no disk
    cache: the prompt's large products.
* ``llama.cpp`` (llama-cpp-python in ``.peers/llamacpp``, ``benchmarks/peers/setup.sh``; the
  peers' worker ``benchmarks/peers/worker_llamacpp.py``, on as many threads as the machine has
  cores, its own default): **hit** from its prompt cache (``llama_state_load_file``, saved once
  before the grid) and the same number of answer tokens decoded (forced); **cold**: the whole
  prompt. It reads no document over its window: no book. Left out when not built.

A run over ``--timeout`` seconds is stopped; its row says so and the table shows a bound. Each cell
is the median of its ``--reps`` runs (the configurations take turns). Writes OUT/under_load.json
(every run, the load average before each, the commands) and OUT/under_load.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from portable import portable, scrub  # noqa: E402  (no machine's paths in the JSON)

LLAMA_PYTHON = ROOT / ".peers" / "llamacpp" / "bin" / "python"
LLAMA_WORKER = ROOT / "benchmarks" / "peers" / "worker_llamacpp.py"
BUSY = "while True: pass"
QUESTION = "What is the pass key?"  # the question whose KV fills the cache (the document's prefix)
QUESTION_HIT = "Describe what the author says in this document, in detail."
BOOK_QUESTION = "What does the author say about startups?"
CONFIGS = ("auto", "1", "2", "llama.cpp")
RUNS = ("hit", "book", "cold")
LABELS = {
    "auto": "kvcli (auto, the default)",
    "1": "kvcli --threads 1",
    "2": "kvcli --threads 2 (the old default)",
    "llama.cpp": "llama.cpp",
}
SHOWN = ("load", "config", "run", "ttft_s", "decode_tokens_per_s", "n_context_tokens", "threads", "timed_out", "error")


def make_inputs(work: Path, args) -> dict:
    """The two texts (essays of the needle tests), and llama.cpp's cases: the hit question's
    prompt ids (with its prefix) and the cold one's."""
    sys.path.insert(0, str(ROOT))
    from kvcli.answer.prompt import build_prompt, load_template
    from kvcli.bench.needle import make_case
    from kvcli.model import load_model
    from kvcli.model.embedded import embedded_gguf_file
    from kvcli.templates import stop_token_ids

    lm = load_model(args.model)
    doc = make_case(lm.tokenizer, args.doc_tokens, 0.5, seed=3)
    book = make_case(lm.tokenizer, args.book_tokens, 0.5, seed=4)
    (work / "doc.txt").write_text(doc.text)
    (work / "book.txt").write_text(book.text)
    inputs = {"doc": work / "doc.txt", "book": work / "book.txt"}
    stop = sorted(stop_token_ids(lm.tokenizer, lm.model.generation_config))
    inputs["n_book"] = build_prompt(lm.tokenizer, book.text, BOOK_QUESTION, load_template()).n_tokens
    for run, question in (("hit", QUESTION_HIT), ("cold", QUESTION)):
        prompt = build_prompt(lm.tokenizer, doc.text, question, load_template())
        case = {
            "ids": prompt.ids.tolist(),
            "prefix_len": prompt.prefix_len,
            "new_tokens": args.new_tokens,
            "n_ctx": prompt.n_tokens + args.new_tokens + 8,
            "gguf": str(embedded_gguf_file()),
            "stop_ids": stop,
        }
        inputs[f"case_{run}"] = work / f"case_{run}.json"
        inputs[f"case_{run}"].write_text(json.dumps(case))
        inputs[f"n_{run}"] = prompt.n_tokens
    inputs["prompt_cache"] = work / "llama_prefix.bin"
    del lm  # the driver only waits from here on
    return inputs


def cache_dir(work: Path) -> Path:
    """A fresh disk KV cache whose ``models/`` is the user's (the embedded model converted once)."""
    from kvcli.model import default_cache_dir

    folder = work / "cache"
    folder.mkdir(exist_ok=True)
    models = default_cache_dir() / "models"
    if models.exists():
        (folder / "models").symlink_to(models)
    return folder


def timed(cmd: list, timeout: float, env: dict | None = None) -> tuple[dict | None, dict]:
    """Run ``cmd``; (its last JSON line, or None, and what went wrong or the wall time)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:
        return None, {"timed_out": True, "wall_s": round(time.perf_counter() - t0, 1)}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None, {"error": scrub((proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1])}
    return json.loads(lines[-1]), {"wall_s": round(time.perf_counter() - t0, 1)}


def kvcli(args: list, timeout: float, env: dict) -> dict:
    """``python -m kvcli ask ARGS --json`` in a fresh process: its JSON record, or why not."""
    record, how = timed([sys.executable, "-m", "kvcli", "ask", *map(str, args), "--json", "--quiet"], timeout, env)
    if record and isinstance(record.get("document"), str):
        record["document"] = portable(record["document"])  # a temporary file: <tmp>/doc.txt
    return {**(record or {}), **how}


def llamacpp(case: Path, timeout: float, *extra) -> dict:
    record, how = timed([str(LLAMA_PYTHON), str(LLAMA_WORKER), str(case), "full", *map(str, extra)], timeout)
    return {**(record or {}), **how}


def measure(config: str, run: str, inputs: dict, cache: Path, args, env: dict) -> dict | None:
    """One run of one configuration at the current load (None: llama.cpp reads no book)."""
    if config == "llama.cpp":
        if run == "book":
            return None
        if run == "hit":
            return {
                **llamacpp(inputs["case_hit"], args.timeout, "--load-prefix", inputs["prompt_cache"]),
                "n_context_tokens": inputs["n_hit"],
            }
        return {**llamacpp(inputs["case_cold"], args.timeout), "n_context_tokens": inputs["n_cold"]}
    common = ["--threads", config, "--max-new-tokens", args.new_tokens, "--no-answer-guard", "--cache-dir", cache]
    if args.model:
        common += ["-m", args.model]
    if run == "hit":
        row = kvcli([inputs["doc"], QUESTION_HIT, "-c", "full", *common], args.timeout, env)
    elif run == "book":
        row = kvcli([inputs["book"], BOOK_QUESTION, "--no-cache", *common], args.timeout, env)
    else:
        row = kvcli([inputs["doc"], QUESTION, "-c", "full", "--no-cache", *common], args.timeout, env)
    return {"n_context_tokens": inputs[f"n_{run}"], **row}  # a run stopped at --timeout: the prompt it had


def prepare(inputs: dict, cache: Path, configs: list[str], args, env: dict) -> None:
    """Untimed, before the grid: the document's KV into kvcli's disk cache, llama.cpp's prompt cache."""
    fill = [inputs["doc"], QUESTION, "-c", "full", "--cache-dir", cache, "--max-new-tokens", 2]
    warm = kvcli(fill + (["-m", args.model] if args.model else []), 900, env)
    if "error" in warm or warm.get("timed_out"):
        raise SystemExit(f"could not fill the disk cache: {warm}")
    if "llama.cpp" in configs:
        saved = llamacpp(inputs["case_hit"], 900, "--save-prefix", inputs["prompt_cache"])
        if "error" in saved or saved.get("timed_out"):
            raise SystemExit(f"llama.cpp could not save its prompt cache: {saved}")


def busy_processes(n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    time.sleep(1.0)  # let them settle on their cores
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


# --- the table --------------------------------------------------------------------------------------
def cell(rows: list[dict], load: int, config: str, run: str, what: str) -> str:
    """``what`` (ttft, decode, read, threads) of one table cell: the median over its runs (--reps)."""
    found = [r for r in rows if r["load"] == load and r["config"] == config and r["run"] == run]
    done = [r for r in found if not r.get("timed_out") and "error" not in r]
    if not found:
        return "—"
    if what == "threads":
        seen = [(r.get("threads") or {}) for r in done] or [{}]
        shown = dict.fromkeys(
            " / ".join(",".join(map(str, t.get(p, []))) or "—" for p in ("prefill", "decode")) for t in seen
        )
        return " or ".join(shown)
    if not done:
        r = found[-1]
        if not r.get("timed_out"):
            return "error"
        # stopped at its timeout: a bound (the prompt's length from the row or from the same run's others)
        n = r.get("n_context_tokens") or next(
            (x["n_context_tokens"] for x in rows if x["run"] == run and x.get("n_context_tokens")), None
        )
        return {"ttft": f"> {r['wall_s']:.0f}", "read": f"< {n / r['wall_s']:,.0f}" if n else "?"}.get(what, "?")
    if what == "ttft":
        return f"{statistics.median(r['ttft_s'] for r in done):.2f}"
    if what == "decode":
        rates = [r["decode_tokens_per_s"] for r in done if r.get("decode_tokens_per_s") is not None]
        return f"{statistics.median(rates):.1f}" if rates else "—"
    if what == "read":
        return f"{statistics.median(r['n_context_tokens'] / r['ttft_s'] for r in done):,.0f}"
    raise ValueError(what)


def table(data: dict) -> str:
    rows = data["rows"]
    loads = sorted({r["load"] for r in rows})
    configs = list(dict.fromkeys(r["config"] for r in rows))
    cold = any(r["run"] == "cold" for r in rows)
    head = ["busy processes", "configuration", "TTFT hit s", "decode tok/s", "book read tok/s"]
    head += ["TTFT cold s"] * cold + ["kvcli's threads, prefill / decode (hit; book)"]
    out = ["| " + " | ".join(head) + " |", "|---:|---|" + "---:|" * (3 + cold) + "---|"]
    for load in loads:
        for c in configs:
            values = [
                cell(rows, load, c, "hit", "ttft"),
                cell(rows, load, c, "hit", "decode"),
                cell(rows, load, c, "book", "read"),
            ]
            values += [cell(rows, load, c, "cold", "ttft")] * cold
            values.append(
                "—" if c == "llama.cpp" else "; ".join(cell(rows, load, c, run, "threads") for run in ("hit", "book"))
            )
            out.append(f"| {load} | {LABELS.get(c, 'kvcli --threads ' + c)} | {' | '.join(values)} |")
    return "\n".join(out) + "\n"


def write_report(out: Path, data: dict) -> str:
    md = table(data)
    meta = data["meta"]
    n_book = next(
        (r["n_context_tokens"] for r in data["rows"] if r["run"] == "book" and r.get("n_context_tokens")),
        meta["n_book"],
    )
    commands = "\n".join(f"    {c}" for c in meta["commands"])
    (out / "under_load.md").write_text(
        f"# kvcli under load\n\n`benchmarks/under_load.py` on {meta['machine']} ({meta['affinity']} CPUs); "
        f"a hit's document {meta['n_hit']:,} tokens, the book {n_book:,}, answers of up to "
        f"{meta['new_tokens']} tokens; each cell the median of its runs (under_load.json: every run). "
        f"Made by:\n\n{commands}\n\n{md}"
    )
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="0,1,2", help="numbers of competing busy processes")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="kvcli --threads values (auto, N) and llama.cpp")
    ap.add_argument("--runs", default="hit,book", help=f"which of {', '.join(RUNS)}")
    ap.add_argument("--doc-tokens", type=int, default=4700, help="the hit's (and cold's) document")
    ap.add_argument("--book-tokens", type=int, default=12000, help="the book's length (over the 8k window)")
    ap.add_argument("--new-tokens", type=int, default=48, help="--max-new-tokens of every answer")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds before a run is stopped")
    ap.add_argument("--reps", type=int, default=1, help="runs of each cell (the table: medians)")
    ap.add_argument("--model", default=None, help="kvcli's -m (default: the embedded model; llama.cpp runs its GGUF)")
    ap.add_argument(
        "--resume", action="store_true", help="keep OUT's rows of the loads, configurations and runs not measured"
    )
    ap.add_argument("--report-only", action="store_true", help="measure nothing: OUT/under_load.md from its JSON")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "under-load"))
    args = ap.parse_args()

    out = Path(args.out)
    if args.report_only:
        print(write_report(out, json.loads((out / "under_load.json").read_text())))
        return
    loads = [int(x) for x in args.loads.split(",")]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if set(runs) - set(RUNS):
        raise SystemExit(f"--runs: choose from {', '.join(RUNS)}")
    if "llama.cpp" in configs and (not LLAMA_PYTHON.exists() or args.model):
        print(
            "llama.cpp is not built (benchmarks/peers/setup.sh) or -m is not the embedded model: no llama.cpp rows",
            file=sys.stderr,
        )
        configs.remove("llama.cpp")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "under_load.json"
    data = json.loads(path.read_text()) if args.resume and path.exists() else {"meta": {}, "rows": []}
    measured = {(load, c, run) for load in loads for c in configs for run in runs}
    data["rows"] = [r for r in data["rows"] if (r["load"], r["config"], r["run"]) not in measured]
    data["meta"].setdefault("commands", []).append(
        scrub(" ".join(["python benchmarks/under_load.py", *map(shlex.quote, sys.argv[1:])]))
    )
    # every run as a user's: no thread count or kvcli setting inherited (heavy.sh's OMP_NUM_THREADS=1)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") and not k.startswith("KVCLI_")
    }
    env["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inputs = make_inputs(work, args)
        data["meta"].update(
            {
                "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "affinity": len(os.sched_getaffinity(0)),
                "n_hit": inputs["n_hit"],
                "n_book": inputs["n_book"],
                "new_tokens": args.new_tokens,
                "busy": BUSY,
                "model": args.model or "embedded",
            }
        )
        cache = cache_dir(work)
        prepare(inputs, cache, configs, args, env)
        for load in loads:
            procs = busy_processes(load)
            try:
                for rep in range(args.reps):  # the configurations in turn, so drift hits each alike
                    for config in configs:
                        for run in runs:
                            before = os.getloadavg()[0]
                            row = measure(config, run, inputs, cache, args, env)
                            if row is None:
                                continue
                            row.update(
                                load=load,
                                config=config,
                                run=run,
                                rep=rep,
                                loadavg_before=round(before, 2),
                                time=time.strftime("%H:%M:%S"),
                                timeout_s=args.timeout,
                            )
                            data["rows"].append(row)
                            print(json.dumps({k: row.get(k) for k in SHOWN}), flush=True)
                        path.write_text(json.dumps(data, indent=1))
            finally:
                stop(procs)
    order = {c: i for i, c in enumerate(CONFIGS)}
    data["rows"].sort(key=lambda r: (r["load"], order.get(r["config"], len(order)), r["config"]))
    path.write_text(json.dumps(data, indent=1))
    print(write_report(out, data))


if __name__ == "__main__":
    main()
