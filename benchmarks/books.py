"""Books: real Debian manuals, factual questions from the first page to the last (issue 28).

    python benchmarks/books.py                         # every document and method (hours on 2 cores)
    python benchmarks/books.py --docs camlidl --methods oracle,infllm
    python benchmarks/books.py --memory 8000,20000,70000,150000   # infllm's peak memory by length
    python benchmarks/books.py --read-speed 8192 --infllm infllm:preset=cpu  # the reading pass alone

The questions, their pages and accepted answers: docs/bench/books/questions.json (each checked
with ``pdftotext`` on its page). The PDFs come from Debian packages (``apt-get download`` +
``dpkg -x`` into --pdf-dir, sha256 checked), never committed. Methods, on the embedded model:

* ``oracle`` — full attention on the text of the answer's page alone (the ceiling of any reading
  of the book with this model);
* ``full`` — full attention on the whole document, where it fits the model's window;
* ``finch`` — Finch (the question read with every chunk; nothing can be stored);
* ``infllm`` — the document read once into the disk store (a fresh one per document), then
  every question answered from it; the first question's time includes the reading, and one
  more question is asked in a new process (``python -m kvcli ask``, cold process, warm store).

An answer is right when it contains one of the accepted strings as a word of its own
more often than the question holds it (case-insensitive; ``par`` is not found in "parameters", an
echo of the question is no answer); ``--table-from`` rescores old logs so. Writes
docs/bench/books/results.json (every answer, times, peak memory, the machine's load) and prints
the Markdown table of docs/bench/books/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcli.answer.prompt import build_prompt  # noqa: E402
from kvcli.api import AskOptions, Session, parse_pipeline  # noqa: E402
from kvcli.documents import document_from_text, load_document  # noqa: E402
from kvcli.model import default_cache_dir  # noqa: E402
from kvcli.store import KVStore  # noqa: E402

QUESTIONS = ROOT / "docs" / "bench" / "books" / "questions.json"
METHODS = ("oracle", "full", "finch", "infllm")


def load() -> float:
    return os.getloadavg()[0]


def fetch_pdf(doc: dict, pdf_dir: Path) -> Path:
    """The document's PDF under ``pdf_dir`` (downloaded from Debian once), sha256 checked."""
    target = pdf_dir / Path(doc["path"]).name
    if not target.exists():
        pdf_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                ["apt-get", "download", f"{doc['package']}={doc['version']}"], cwd=tmp, check=True, capture_output=True
            )
            deb = next(Path(tmp).glob("*.deb"))
            subprocess.run(["dpkg", "-x", str(deb), str(Path(tmp) / "x")], check=True)
            (Path(tmp) / "x" / doc["path"]).resolve().replace(target)  # r-doc-pdf's paths are links within the package
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != doc["sha256"]:
        raise SystemExit(f"{target}: sha256 {digest}, expected {doc['sha256']}")
    return target


def page_text(document, page: int) -> str:
    starts = list(document.page_starts) + [len(document.text)]
    return document.text[starts[page - 1] : starts[page]]


def right(answer: str, accept: list[str], question: str = "") -> bool:
    """The answer holds an accepted string as a word of its own (a plural -s/-es allowed), more
    often than the question does: ``par`` counts in "use par()" but not in "parameters", ``-e``
    in "Rscript -e" but not in "re-enter", and an echo of the question ("write.table double
    quotes" for "which qmethod makes write.table double quotes?") is not an answer. A word's
    edge is asked for only where the accepted string has a letter or digit there: ``:::``
    counts in "bar:::foo" (before 2026-11-30 it did not, and 6 right answers were scored wrong)."""

    def count(text: str, a: str) -> int:
        a = a.lower()
        before = r"(?<![a-z0-9])" if a[:1].isalnum() else ""
        after = r"(?:s|es)?(?![a-z0-9])" if a[-1:].isalnum() else ""
        return len(re.findall(before + re.escape(a) + after, text.lower()))

    return any(count(answer, a) > count(question, a) for a in accept)


def rescored(rows: list[dict]) -> list[dict]:
    """``right`` recomputed with :func:`right` from each row's answer (logs of earlier runs)."""
    spec = json.loads(QUESTIONS.read_text())
    accept = {(d["name"], q["q"]): q["accept"] for d in spec["documents"] for q in d["questions"]}
    last = {d["name"]: d["questions"][-1]["q"] for d in spec["documents"]}
    out = []
    for r in rows:
        key = (
            r.get("document"),
            r.get("question") or (last.get(r.get("document")) if r.get("repeat_process") else None),
        )
        if key in accept and "answer" in r:
            r = {**r, "right": right(r.get("answer") or "", accept[key], key[1])}
        out.append(r)
    return out


def fresh_cache_dir() -> Path:
    """A cache folder with an empty disk store whose models/ is the user's (no reconversion)."""
    return store_dir(Path(tempfile.mkdtemp(prefix="kvcli-books-")))


def store_dir(root: Path) -> Path:
    """``root`` as a cache folder whose models/ is the user's: its disk store kept between runs."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "models").exists():
        (root / "models").symlink_to(default_cache_dir() / "models", target_is_directory=True)
    return root


def record(method, doc, q, result, extra=None) -> dict:
    return {
        "method": method,
        "document": doc["name"],
        "page": q["page"],
        "question": q["q"],
        "answer": result.answer,
        "right": right(result.answer, q["accept"], q["q"]),
        "n_tokens": result.prompt.n_tokens,
        "ttft_s": round(result.ttft_s, 2),
        "total_s": round(result.total_s, 2),
        "peak_mem_mb": round(result.peak_mem_mb, 1),
        "cache": result.extra["cache"]["status"],
        "compressor": result.extra.get("compressor"),
        "load": round(load(), 2),
        **(extra or {}),
    }


def run_documents(args) -> list[dict]:
    spec = json.loads(QUESTIONS.read_text())
    rows = []
    session = Session.open(AskOptions(use_cache=False, max_new_tokens=args.max_new_tokens))
    window = session.lm.max_context
    for doc in spec["documents"]:
        if args.docs and doc["name"] not in args.docs:
            continue
        pdf = fetch_pdf(doc, args.pdf_dir)
        document = load_document(pdf)
        n = build_prompt(session.lm.tokenizer, document.text, doc["questions"][0]["q"], session.template).n_tokens
        print(
            f"# {doc['name']}: {document.n_pages} pages, {n:,} tokens (load {load():.1f})", file=sys.stderr, flush=True
        )
        for method in args.methods:
            if method == "full" and n + args.max_new_tokens > window:
                rows.append(
                    {
                        "method": "full",
                        "document": doc["name"],
                        "skipped": f"{n:,} tokens: over the {window:,}-token window",
                    }
                )
                continue
            if method == "finch" and n > args.finch_max_tokens:
                rows.append(
                    {"method": "finch", "document": doc["name"], "skipped": f"{n:,} tokens: over --finch-max-tokens"}
                )
                continue
            if method == "infllm":
                rows += (
                    run_infllm_processes(args, doc, pdf)
                    if args.processes
                    else run_infllm(args, session, doc, pdf, document)
                )
                continue
            for q in doc["questions"]:
                if args.pages and q["page"] not in args.pages:
                    continue
                source = document_from_text(page_text(document, q["page"])) if method == "oracle" else document
                result = session.ask(source, q["q"], parse_pipeline("full" if method == "oracle" else method))
                rows.append(record(method, doc, q, result))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def cli_ask(args, pdf: Path, question: str, cache_dir: Path) -> tuple[dict, float, str | None]:
    """``python -m kvcli ask PDF QUESTION -c <infllm spec> --json`` in a new process: its JSON,
    its wall time (model load and PDF extraction included), its error."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcli",
            "ask",
            str(pdf),
            question,
            "-c",
            args.infllm[0],
            "--cache-dir",
            str(cache_dir),
            "--cache-max",
            "none",
            "--json",
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--kv-bits",
            str(args.kv_bits),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    wall = time.perf_counter() - t0
    return (
        (json.loads(out.stdout) if out.returncode == 0 else {}),
        wall,
        (None if out.returncode == 0 else out.stderr.strip()[-300:]),
    )


def run_infllm_processes(args, doc, pdf) -> list[dict]:
    """``--processes``: every question a new ``kvcli ask`` process on one fresh store, as a user
    would run them: the first reads the book (its wall time is the first answer's), every later
    one starts cold from the stored book."""
    cache_dir = fresh_cache_dir()
    rows = []
    for i, q in enumerate(doc["questions"]):
        rec, wall, error = cli_ask(args, pdf, q["q"], cache_dir)
        rows.append(
            {
                "method": "infllm",
                "document": doc["name"],
                "page": q["page"],
                "question": q["q"],
                "answer": rec.get("answer"),
                "right": right(rec.get("answer") or "", q["accept"], q["q"]),
                "n_tokens": rec.get("n_tokens"),
                "ttft_s": rec.get("ttft_s"),
                "total_s": rec.get("total_s"),
                "wall_s": round(wall, 2),
                "peak_mem_mb": rec.get("peak_mem_mb"),
                "cache": (rec.get("cache") or {}).get("status")
                if isinstance(rec.get("cache"), dict)
                else rec.get("cache"),
                "compressor": rec.get("compressor"),
                "first": i == 0,
                "process": True,
                "load": round(load(), 2),
                "error": error,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def answer_retrieved(result, document, q) -> dict:
    """Where the accepted answer stands on its page, in the stored book, and whether the question
    retrieved it: ``answer_blocks`` (the Memory blocks holding an occurrence; ``answer_in`` says
    "initial" or "local" when one lies there, always attended), ``retrieved`` (the share of the
    (layer, KV head) pairs whose question pass chose one of those blocks)."""
    book, prompt = result.cache, result.prompt
    if not hasattr(book, "question_blocks"):
        return {}
    lo = list(document.page_starts)[q["page"] - 1]
    text = page_text(document, q["page"]).lower()
    chars = [lo + m.start() for a in q["accept"] for m in re.finditer(r"(?<![a-z0-9])" + re.escape(a.lower()), text)]
    positions = {prompt.doc_start + next(i for i, (_, e) in enumerate(prompt.doc_offsets) if e > c) for c in chars}
    blocks = sorted({(p - book.initial) // book.block_size for p in positions if book.initial <= p < book.origin})
    parts = ["initial"] * any(p < book.initial for p in positions) + ["local"] * any(
        p >= book.origin for p in positions
    )
    chosen = book.question_blocks()
    share = None
    if blocks and chosen:
        want = torch.tensor(blocks)
        share = sum(float(torch.isin(c, want).any(dim=-1).float().mean()) for c in chosen.values()) / len(chosen)
    return {"answer_blocks": blocks, "answer_in": parts, "retrieved": None if share is None else round(share, 3)}


def run_infllm(args, base: Session, doc, pdf, document) -> list[dict]:
    """A store (``--store``, else a fresh one): the first question reads the book (timed), the rest
    answer from it, for each ``--infllm`` spec in turn (a spec that reads the same way reuses the
    stored book); one more question in a new process (cold process, warm store) unless
    ``--no-repeat``. The model is ``base``'s (loaded once)."""
    cache_dir = store_dir(args.store) if args.store else fresh_cache_dir()
    options = AskOptions(
        cache_dir=cache_dir, max_new_tokens=args.max_new_tokens, cache_max="none", kv_bits=args.kv_bits
    )
    session = Session(
        lm=base.lm, engine=base.engine, options=options, template=base.template, store=KVStore.open(cache_dir)
    )
    rows = []
    for spec in args.infllm:
        for i, q in enumerate(doc["questions"]):
            result = session.ask(document, q["q"], parse_pipeline(spec))
            rows.append(
                record(
                    "infllm",
                    doc,
                    q,
                    result,
                    {
                        "first": i == 0,
                        "entry_bytes": result.extra["cache"]["entry_bytes"],
                        "spec": spec,
                        **answer_retrieved(result, document, q),
                    },
                )
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.no_repeat:
        return rows
    q = doc["questions"][-1]
    rec, wall, error = cli_ask(args, pdf, q["q"], cache_dir)
    rows.append(
        {
            "method": "infllm",
            "document": doc["name"],
            "repeat_process": True,
            "wall_s": round(wall, 2),
            "total_s": rec.get("total_s"),
            "peak_mem_mb": rec.get("peak_mem_mb"),
            "cache": rec.get("cache"),
            "answer": rec.get("answer"),
            "right": right(rec.get("answer") or "", q["accept"], q["q"]),
            "load": round(load(), 2),
            "error": error,
        }
    )
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def run_memory(args) -> list[dict]:
    """infllm's first question (the whole read) on documents of the given token counts, made of
    R-intro's text repeated: peak memory and time by length."""
    spec = json.loads(QUESTIONS.read_text())
    doc = next(d for d in spec["documents"] if d["name"] == "R-intro")
    text = load_document(fetch_pdf(doc, args.pdf_dir)).text
    session = Session.open(AskOptions(cache_dir=fresh_cache_dir(), max_new_tokens=8, cache_max="none"))
    tok = session.lm.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rows = []
    for n in args.memory:
        piece = (ids * (n // len(ids) + 1))[:n]
        result = session.ask(
            document_from_text(tok.decode(piece)), "Which version of R is described?", parse_pipeline(args.infllm[0])
        )
        rows.append(
            {
                "method": "infllm",
                "memory_tokens": n,
                "n_tokens": result.prompt.n_tokens,
                "ttft_s": round(result.ttft_s, 2),
                "peak_mem_mb": round(result.peak_mem_mb, 1),
                "entry_bytes": result.extra["cache"]["entry_bytes"],
                "load": round(load(), 2),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def run_read_speed(args) -> list[dict]:
    """``--read-speed N``: the reading pass alone, ``N`` random token ids read into memory (no disk
    store, no question), tokens per second; run it alone on the machine to compare code."""
    from kvcli.compressors import parse_one

    session = Session.open(AskOptions(use_cache=False))
    method = parse_one(args.infllm[0])
    method.configure(session.lm)
    ids = torch.randint(100, 20000, (args.read_speed,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    method.read(session.engine, ids)
    dt = time.perf_counter() - t0
    row = {
        "method": args.infllm[0],
        "read_tokens": args.read_speed,
        "seconds": round(dt, 2),
        "tok_s": round(args.read_speed / dt, 1),
        "threads": torch.get_num_threads(),
        "load": round(load(), 2),
    }
    print(json.dumps(row), file=sys.stderr, flush=True)
    return [row]


def rows_from_log(path: Path) -> list[dict]:
    """The rows a run printed on stderr (one JSON object a line), for a run stopped before its end."""
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def table(rows: list[dict]) -> str:
    """Per document and method: accuracy, first-question time, repeat-question time, peak memory."""
    lines = [
        "| document | method | right | first question (s) | repeat question (s) | peak memory (MB) |",
        "|---|---|---|---|---|---|",
    ]
    docs = list(dict.fromkeys(r["document"] for r in rows if "document" in r))
    for d in docs:
        for m in METHODS:
            rs = [r for r in rows if r.get("document") == d and r.get("method") == m]
            if not rs:
                continue
            skipped = [r for r in rs if "skipped" in r]
            if skipped:
                lines.append(f"| {d} | {m} | — | — | — | {skipped[0]['skipped']} |")
                continue
            qs = [r for r in rs if not r.get("repeat_process")]
            rep = [r for r in rs if r.get("repeat_process")]
            first = qs[0]["total_s"]
            if m == "infllm" and qs[0].get("process"):  # every question a new process: wall times
                first = f"{qs[0]['wall_s']} wall ({qs[0]['ttft_s']} to the first token)"
                walls = [r["wall_s"] for r in qs[1:]]
                repeat = f"{sum(walls) / max(1, len(walls)):.1f} wall (mean of {len(walls)} new processes, max {max(walls, default=0)})"
            elif m == "infllm":
                repeat = f"{rep[0]['wall_s']} (new process; {rep[0]['total_s']} answering)" if rep else "—"
            elif m == "oracle":
                repeat = "—"
            else:
                repeat = f"{sum(r['total_s'] for r in qs[1:]) / max(1, len(qs) - 1):.1f} (mean)"
            lines.append(
                f"| {d} | {m} | {sum(r['right'] for r in qs)}/{len(qs)} | {first} | {repeat} | {max(r['peak_mem_mb'] or 0 for r in qs)} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=lambda s: s.split(","), default=None)
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    p.add_argument(
        "--pages",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="oracle/full/finch: only the questions on these pages (to split a long run)",
    )
    p.add_argument(
        "--infllm",
        nargs="+",
        default=["infllm"],
        help="the infllm spec(s) (knobs); several: each on every question, in turn",
    )
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="infllm: this cache folder's disk store, kept between runs (default: a fresh one)",
    )
    p.add_argument("--no-repeat", action="store_true", help="infllm: no extra question in a new process")
    p.add_argument(
        "--processes",
        action="store_true",
        help="infllm: every question a new `kvcli ask` process on one store (the first reads)",
    )
    p.add_argument(
        "--finch-max-tokens",
        type=int,
        default=40000,
        help="skip Finch on longer documents (it reads every token per question)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--kv-bits", type=int, default=16, choices=(16, 8, 4), help="infllm: the stored book's bits")
    p.add_argument("--pdf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-books-pdfs")
    p.add_argument("--memory", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument(
        "--read-speed", type=int, default=None, metavar="N", help="time infllm's reading pass alone on N random tokens"
    )
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "books" / "results.json")
    p.add_argument(
        "--table-from", type=Path, nargs="+", default=None, help="print the table of the rows in these stderr logs"
    )
    args = p.parse_args()
    if args.table_from:
        print(table(rescored([r for path in args.table_from for r in rows_from_log(path)])))
        return
    started = {"load": load(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rows = run_read_speed(args) if args.read_speed else run_memory(args) if args.memory else run_documents(args)
    out = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "started": started,
        "ended": {"load": load(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    if not args.memory and not args.read_speed:
        print(table(rows))


if __name__ == "__main__":
    main()
