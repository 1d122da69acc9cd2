"""A book's first question and a later one, each in a new process, timed from the shell's side
(issue 49 item 2's targets: the first question on a 200-page PDF under 60 s on 2 cores, a later one
under 10 s in a new process).

    python benchmarks/first_question.py --out docs/bench/cite/first-question-r-exts.json

The document is R-exts.pdf, "Writing R Extensions", from Debian's r-doc-pdf 4.2.2 (236 pages,
fetched once with ``apt-get download`` and sha256 checked, as benchmarks/books.py does). Each run
is ``kvcli ask BOOK QUESTION --json`` in a new process with a fresh cache folder for the first
question, in which a question about a one-line note has converted the model first (untimed: what a
user's first ever kvcli run does once; the book's text, its page vectors and every KV entry are
made by the timed run) and the same folder for the later ones (a different question each: its
vectors are read back, its prefill is the question's own). The wall time is the process's, start to
exit (loading PyTorch and the model included); the JSON's own fields (``ttft_s``, ``total_s``,
``sources_s``) say where it went. Time it alone on the machine: the load before and after is kept.

``--set FILE --document NAME``: another document of a question file (its spec, its first three
answerable questions in the manual's words) instead of R-exts and the three questions below.

For a model that takes minutes to convert (``-- -m qwen2.5-coder-1.5b``), ``--models
~/.cache/kvcli/models`` links the converted models into the fresh folder; everything else in it
(the book's text, its page vectors, the KV) is still made by the timed runs.

``--keep``: ``kvcli cache add BOOK`` first, timed as a row of its own (every page embedded ahead):
then no question embeds a page, the first one included.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from books import fetch_pdf  # noqa: E402
from portable import portable  # noqa: E402

R_EXTS = {
    "name": "R-exts",
    "package": "r-doc-pdf",
    "version": "4.2.2.20221110-2",
    "path": "usr/share/doc/r-doc-pdf/manual/R-exts.pdf",
    "sha256": "792220b273d40e8629664d5dd0d6ae4151419d14f613a949aebe85b8c2a1f85c",
}
QUESTIONS = [
    "Which file of a package gives its name, version, license and dependencies?",
    "Which function registers a package's native routines with R?",
    "How do I make my C code check for user interrupts during a long loop?",
]
FIELDS = (
    "ttft_s",
    "total_s",
    "sources_s",
    "check_s",
    "n_pages",
    "n_document_tokens",
    "compressor",
    "read",
    "cache",
    "threads",
)


def timed(*args: str) -> tuple[dict, float]:
    """``kvcli ARGS --json`` in a new process: its JSON record and its wall time, start to exit."""
    cmd = [sys.executable, "-m", "kvcli", *args, "--json"]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"kvcli {args[0]} failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout), wall


def run(book: Path, question: str, cache: Path, extra: list[str]) -> dict:
    record, wall = timed("ask", str(book), question, "--cache-dir", str(cache), *extra)
    after = (record["total_s"] - record["ttft_s"]) + (record.get("sources_s") or 0) + (record.get("check_s") or 0)
    return {
        "question": question,
        "wall_s": round(wall, 2),
        # the first token's time from the process's start, at most: what ran after it (decoding, the
        # sources, the answer's check) taken off; the process's exit is left in
        "first_token_from_start_s": round(wall - after, 2),
        "answer": record["answer"],
        **{k: record.get(k) for k in FIELDS},
    }


def keep(book: Path, cache: Path) -> dict:
    """``kvcli cache add BOOK``, timed from the shell's side."""
    load = os.getloadavg()[0]
    record, wall = timed("cache", "add", str(book), "--cache-dir", str(cache))
    return {
        "run": "cache add",
        "load_before": round(load, 2),
        "wall_s": round(wall, 2),
        **{k: v for k, v in record.items() if k not in ("document", "vectors")},
    }


def chosen(question_file: Path | None, name: str | None) -> tuple[dict, list[str]]:
    """The document's spec and the questions asked: R-exts and :data:`QUESTIONS`, or ``name``'s
    in ``question_file`` and its first three answerable ones (the manual's words)."""
    if question_file is None:
        if name is not None:
            raise SystemExit("--document names a document of --set: give both")
        return R_EXTS, QUESTIONS
    for spec in json.loads(question_file.read_text())["documents"]:
        if spec["name"] == name:
            return spec, [q["q"] for q in spec["questions"] if not q.get("unanswerable")][:3]
    raise SystemExit(f"{question_file} has no document named {name!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pdf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-books-pdfs")
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--models",
        type=Path,
        default=None,
        help="a cache folder's models/ (converted models, their kept weights) to link into the fresh cache "
        "folder: the untimed first run then neither converts nor quantises (a 1.5B model's minutes)",
    )
    p.add_argument("--set", type=Path, help="a question file (docs/bench/cite/heldout-questions.json's form)")
    p.add_argument("--document", help="its document to ask about (with --set)")
    p.add_argument("--keep", action="store_true", help="run `kvcli cache add BOOK` (timed) before the questions")
    p.add_argument("extra", nargs="*", help="more kvcli ask options, after --")
    args = p.parse_args()
    spec, questions = chosen(args.set, args.document)
    book = fetch_pdf(spec, args.pdf_dir)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        if args.models is not None:
            cache.mkdir()
            (cache / "models").symlink_to(args.models.expanduser().resolve(), target_is_directory=True)
        note = Path(tmp) / "note.txt"
        note.write_text("The oil store padlock opens with 4-7-1-9.\n")
        run(note, "What opens the padlock?", cache, args.extra)  # the model converted into the folder, untimed
        if args.keep:
            rows.append(keep(book, cache))
            print(json.dumps({k: rows[-1][k] for k in ("run", "wall_s", "embedded")}), flush=True)
        for i, question in enumerate(questions):
            load = os.getloadavg()[0]
            row = {
                "run": "first" if i == 0 else "later",
                "load_before": round(load, 2),
                **run(book, question, cache, args.extra),
            }
            rows.append(row)
            shown = ("run", "wall_s", "first_token_from_start_s", "ttft_s", "load_before")
            print(json.dumps({k: row[k] for k in shown}), flush=True)
    out = {
        "command": " ".join(["python", "benchmarks/first_question.py", *sys.argv[1:]]),
        "document": {**{k: v for k, v in spec.items() if k != "questions"}, "file": portable(book)},
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
