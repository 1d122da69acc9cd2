"""What a chat's idle time buys: later questions about a big book, one process, with and without
the pages embedded while the user reads and types (``kvcli chat``'s ``Idle``:
:meth:`kvcli.api.Session.embed_rest`).

    python benchmarks/chat_idle.py --model qwen2.5-coder-0.5b --idle 30 --out docs/bench/retrieval/chat-idle-0.5b.json

The book is R-exts.pdf and its three questions of benchmarks/first_question.py (236 pages; fetched
once from Debian). Each run is one :class:`kvcli.api.Session`, as ``kvcli chat`` holds, in a fresh
cache folder holding links to the converted models (``--models``, the user's cache by default):
``off`` asks the three questions one after the other; ``idle`` waits ``--idle`` seconds after each
answer while the rest of the book is embedded, as a chat does while its user types, then asks the
next. For each question: the time to its first token and to its end (kvcli's own clocks, as
``--json`` gives them), the pages it read, and how many of the book's passages were embedded before
it and after the wait. Time it alone on the machine: the embedding uses both cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from books import fetch_pdf  # noqa: E402
from first_question import QUESTIONS, R_EXTS  # noqa: E402
from portable import portable, scrub  # noqa: E402

from kvcli.api import AskOptions, QuestionOptions, Session, parse_pipeline, read_document  # noqa: E402
from kvcli.report.record import result_record  # noqa: E402
from kvcli.retrieval import embed, vectors  # noqa: E402


def embedded(cache: Path, result) -> int:
    """The book's passages whose windows the vectors file holds (0: no file)."""
    texts = [p.text for p in result.prompt.passages]
    digest = vectors.key(embed.embedder(embed.setting()).id, texts)
    found = vectors.load(vectors.path_for(cache, digest), digest)
    return 0 if found is None else int(found[2].sum())


def run(mode: str, book: Path, model: str, idle_s: float, models: Path, max_new_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        (cache / "models").symlink_to(models.resolve())
        session = Session.open(AskOptions(model=model, cache_dir=cache))
        document, pipeline = read_document(book), parse_pipeline("auto")
        rows = []
        for question in QUESTIONS:
            result = session.ask(document, question, pipeline, QuestionOptions(max_new_tokens=max_new_tokens))
            record = result_record(result, session, pipeline, document)
            row = {"question": question, "ttft_s": round(result.ttft_s, 2), "total_s": round(result.total_s, 2)}
            row.update({"compressor": record["compressor"], "read": record["read"], "answer": result.answer})
            row["embedded_after_question"] = embedded(cache, result)
            if mode == "idle":
                stop = threading.Event()
                timer = threading.Timer(idle_s, stop.set)
                timer.start()
                start = time.perf_counter()
                session.embed_rest(result, stop)
                row["idle_embedding_s"] = round(time.perf_counter() - start, 2)  # until done or stopped
                stop.wait()  # the user types for idle_s whether or not the book was done before
                row["embedded_after_idle"] = embedded(cache, result)
            row["passages"] = len(result.prompt.passages)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("ttft_s", "total_s", "embedded_after_question")}), flush=True)
        return {"mode": mode, "questions": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--idle", type=float, default=30.0, help="seconds the user takes between questions")
    p.add_argument("--models", type=Path, default=Path.home() / ".cache" / "kvcli" / "models")
    p.add_argument("--pdf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-books-pdfs")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--modes", default="off,idle")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if embed.setting() is None:
        raise SystemExit("no sentence-embedding model: kvcli models --install embeddinggemma-300m")
    book = fetch_pdf(R_EXTS, args.pdf_dir)
    runs = [run(m, book, args.model, args.idle, args.models, args.max_new_tokens) for m in args.modes.split(",")]
    out = {
        "command": scrub(" ".join(["python", *sys.argv])),
        "book": portable(book),
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
